"""Where the host time of an eager engine step goes: cProfile of `engine.step()` on a Llama-3-8B-shaped model with
``--layers`` layers (the host cost per layer does not depend on how many there are), a burst of requests over
distinct LoRA r=16 adapters, CUDA graphs off. Prints the functions with the most own time, for three decode steps and
a prefill step, the GPU time per kernel of the next prefill step, and the eager decode step's wall time. Run: ``PYTHONPATH=. python3 bench/profile_step.py``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_engine as B  # noqa: E402


def profiled(fn, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def kernel_table(fn, top: int) -> str:
    """GPU time per kernel name of `fn` (torch profiler), largest first, with the total."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    times = defaultdict(float)
    for e in prof.key_averages():
        if e.device_time_total > 0:
            times[e.key[:60]] += e.device_time_total
    rows = sorted(times.items(), key=lambda kv: -kv[1])
    lines = [f"  {us / 1e3:9.2f} ms  {name}" for name, us in rows[:top]]
    return "\n".join([f"  {sum(times.values()) / 1e3:9.2f} ms  (all kernels)"] + lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--adapters", type=int, default=64)
    p.add_argument("--top", type=int, default=35)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--root", default="/tmp/scute-profile-step")
    B.add_launch_option(p)  # e.g. fold_min_tokens=1000000000: a prefill step keeps the epilogue pass
    args = p.parse_args()
    B.apply_launch(args.launch)
    from transformers import LlamaConfig, LlamaForCausalLM

    from scute import Engine, SamplingParams

    cfg = LlamaConfig(**{**B.LLAMA3_8B, "num_hidden_layers": args.layers})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16).eval()
    paths = B.make_adapters(model, "lora", args.adapters, args.root) if args.adapters else []
    engine = Engine(model, device="cuda", dtype="bfloat16", max_adapters=max(1, args.adapters),
                    max_num_seqs=args.batch, max_model_len=512, enforce_eager=True,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    kv_cache_memory_bytes=2 << 30)
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)

    def burst(tag: str) -> None:
        for i in range(args.batch):
            prompt = torch.randint(0, cfg.vocab_size, (128,), generator=g).tolist()
            engine.add_request(f"{tag}-{i}", prompt, sp, paths[i % len(paths)] if paths else None)

    burst("warm")
    while engine.has_unfinished_requests():
        engine.step()
    burst("run")
    prefill = profiled(engine.step, args.top)  # the first step prefills (up to the token budget)
    wall = time.perf_counter()
    prefill_gpu = kernel_table(engine.step, 15)  # the second prefill step, on the GPU
    wall = 1e3 * (time.perf_counter() - wall)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    engine.step()
    torch.cuda.synchronize()
    t, n = time.perf_counter(), 10
    for _ in range(n):
        engine.step()
    torch.cuda.synchronize()
    step_ms = 1e3 * (time.perf_counter() - t) / n
    decode = profiled(lambda: [engine.step() for _ in range(3)], args.top)
    calls = 4 * args.layers  # qkv, o, gate/up, down
    print(f"eager decode step, {args.layers} layers, {args.batch} requests, {args.adapters} LoRAs: {step_ms:.2f} ms "
          f"({1e3 * step_ms / args.layers:.0f} us per decoder layer, {calls} linear-group calls)")
    print("== decode, 3 steps, by own time\n" + decode)
    print("== prefill step, by own time\n" + prefill)
    print(f"== the next prefill step on the GPU (wall {wall:.1f} ms under the profiler)\n" + prefill_gpu)


if __name__ == "__main__":
    main()
