"""Where the GPU time of a graph-replayed decode step goes: each kernel's time per step, the GPU's busy time and
its idle gaps, for a few cases of `bench_engine.py` (base and LoRA at 1 request, LoRA and the five-method mix at
64) on a Llama-3-8B-shaped model with ``--layers`` layers (the LM head and sampling once per step, the rest per
layer). Gaps are the GPU idle between kernels of one step: the launch latency a graph still pays per kernel, and
waits between dependent kernels on different streams.

Run: ``PYTHONPATH=. python3 bench/profile_decode.py [--layers 4] [--out decode_profile.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_engine as B  # noqa: E402

CASES = (("base", 1), ("lora", 1), ("lora", 64), ("mix", 64))


def kernel_events(fn, steps: int) -> list:
    """(name, start µs, end µs) of every GPU kernel and copy `fn` runs (`steps` decode steps)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == DeviceType.CUDA), key=lambda e: e[1])


def summarize(events: list, steps: int) -> dict:
    """Per step: the kernels' summed time by name, the GPU's busy time (union of kernel intervals) and its span."""
    by_name, count = defaultdict(float), defaultdict(int)
    for name, start, end in events:
        by_name[name[:70]] += (end - start) / steps
        count[name[:70]] += 1
    busy, cur_start, cur_end = 0.0, None, None
    for _, start, end in events:
        if cur_end is None or start > cur_end:
            busy += 0 if cur_end is None else cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += 0 if cur_end is None else cur_end - cur_start
    span = max(e[2] for e in events) - events[0][1] if events else 0.0
    return dict(kernels=len(events) / steps, busy_us=busy / steps, kernel_us=sum(by_name.values()),
                span_us=span / steps, by_name=dict(sorted(by_name.items(), key=lambda kv: -kv[1])),
                count={k: v / steps for k, v in count.items()})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--root", default="/tmp/scute-profile-decode")
    B.add_launch_option(p)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    B.apply_launch(args.launch)
    from scute.ops import launch

    from transformers import LlamaConfig, LlamaForCausalLM

    from scute import Engine, SamplingParams

    cfg = LlamaConfig(**{**B.LLAMA3_8B, "num_hidden_layers": args.layers})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16).eval()
    paths = {m: B.make_adapters(model, m, 64 if m == "lora" else 13, args.root) for m in B.MIX}
    engine = Engine(model, device="cuda", dtype="bfloat16", max_adapters=64, max_num_seqs=64, max_model_len=512,
                    max_adapter_rank=256, max_cpu_adapters=128, kv_cache_memory_bytes=2 << 30)
    g = torch.Generator().manual_seed(0)
    result = dict(command="PYTHONPATH=. python3 " + " ".join(sys.argv), torch=torch.__version__,
                  layers=args.layers, launch=vars(launch.CONFIG), cases=[])
    for case, batch in CASES:
        specs = B.case_specs(case, batch, paths, 64)
        for tag in ("warm", "run"):
            sp = SamplingParams(temperature=0, max_tokens=48 if tag == "warm" else 32, ignore_eos=True)
            for i in range(batch):
                prompt = torch.randint(0, cfg.vocab_size, (128,), generator=g).tolist()
                engine.add_request(f"{case}{batch}-{tag}-{i}", prompt, sp, specs[i])
            if tag == "warm":
                while engine.has_unfinished_requests():
                    engine.step()
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or \
                engine.scheduler.waiting:
            engine.step()
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        wall_us = 1e6 * (time.perf_counter() - t) / args.steps
        s = summarize(kernel_events(lambda: [engine.step() for _ in range(args.steps)], args.steps), args.steps)
        s.update(case=case, batch=batch, wall_us=wall_us)
        result["cases"].append(s)
        while engine.has_unfinished_requests():
            engine.step()
        print(f"== {case}, {batch} requests, {args.layers} layers: step {wall_us:.0f} us wall; GPU busy "
              f"{s['busy_us']:.0f} us of a {s['span_us']:.0f} us span ({s['kernels']:.0f} kernels, summed "
              f"{s['kernel_us']:.0f} us)")
        for name, us in list(s["by_name"].items())[:args.top]:
            print(f"  {us:8.1f} us  {s['count'][name]:5.1f}x  {name}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
