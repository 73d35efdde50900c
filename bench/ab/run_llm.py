"""One side of the Scute-vs-vLLM comparison (docs/vllm_ab.md): a plain vLLM offline script, run unchanged by vLLM
or by Scute's shim.

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python bench/ab/run_llm.py --backend vllm WORKLOAD.json OUT.json
    .venv/bin/python bench/ab/run_llm.py --backend scute WORKLOAD.json OUT.json

Only the import differs. The workload (written by bench/ab_vllm.py) names the model folder, the prompts as
token ids, one adapter folder per request (or none) and the engine options. It times `LLM.generate` over the
whole workload `repeats` times after one warm-up call, and writes every request's tokens and the timings.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["vllm", "scute"], required=True)
    ap.add_argument("workload")
    ap.add_argument("out")
    args = ap.parse_args()
    if args.backend == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest
    else:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
        from scute.compat.vllm import LLM, LoRARequest, SamplingParams

    with open(args.workload) as f:
        wl = json.load(f)
    side = wl[args.backend]
    t0 = time.perf_counter()
    llm = LLM(model=wl["model"], **wl["llm_options"], **side.get("llm_options", {}))
    load_s = time.perf_counter() - t0

    sp = SamplingParams(**wl["sampling"])
    ids = {name: i + 1 for i, name in enumerate(sorted(side["adapters"]))}
    loras = [None if a is None else LoRARequest(a, ids[a], side["adapters"][a]) for a in wl["request_adapters"]]
    prompts = [{"prompt_token_ids": p} for p in wl["prompts"]]

    warm = wl.get("warmup", 4)  # a short call: loads the adapters, compiles what needs compiling
    llm.generate(prompts[:warm], SamplingParams(**{**wl["sampling"], "max_tokens": 4, "min_tokens": 4}),
                 lora_request=loras[:warm], use_tqdm=False)
    times, tokens = [], None
    for _ in range(wl.get("repeats", 1)):
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, lora_request=loras, use_tqdm=False)
        times.append(time.perf_counter() - t)
        run = [list(o.outputs[0].token_ids) for o in outs]
        if tokens is not None and run != tokens:
            print(f"{args.backend}: tokens changed between repeats", file=sys.stderr)
        tokens = tokens or run
    result = {
        "backend": args.backend, "load_s": load_s, "generate_s": times, "tokens": tokens,
        "output_tokens": sum(len(t) for t in tokens), "prompt_tokens": sum(len(p) for p in wl["prompts"]),
        "maxrss_self_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(f"{args.backend}: load {load_s:.1f} s, generate {min(times):.2f} s (best of {len(times)})")


if __name__ == "__main__":
    main()
