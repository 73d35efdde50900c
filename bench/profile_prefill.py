"""Where a 64-request prefill step's time goes, through `Engine` on the Llama-3-8B shape (32 layers, graphs on).

Prints, for the base model and for 64 distinct LoRA r=16 adapters (one per request, every slot filled): the wall
time of the prefill step (8192 tokens at the default token budget; three runs after a warm-up) with the caching
allocator's retries, device allocations and frees over them (a retry frees cached memory and syncs). Then, for
the LoRA batch at each tile height of a long step (``--tile-tokens``, `LaunchConfig.long_tile_tokens`): four
more prefill steps and a torch profile of one, its top ops by own CPU time and by own GPU time (the adapter
kernels' rows: ``shrink_kernel``, ``delta_tiles_kernel``; the base GEMMs' cuBLAS kernels, with ``badd`` where
the fold adds the deltas). ``--trace-dir`` also writes each profile's Chrome trace (gzipped).

Run on a GPU: ``PYTHONPATH=. python3 bench/profile_prefill.py > profile_prefill.log``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_engine as B  # noqa: E402

STATS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--tile-tokens", default="16,64", help="long_tile_tokens values profiled in turn")
    p.add_argument("--root", default="/tmp/scute-profile-prefill")
    p.add_argument("--trace-dir", default=None)
    args = p.parse_args()
    from scute import SamplingParams
    from scute.ops import launch

    engine, paths, clock, prompts = B.lora_burst_engine(args.layers, args.root)

    def prefill_times(specs, runs: int):
        before = torch.cuda.memory_stats()
        times = [clock.run(prompts(len(specs)), specs, 2)["prefill_steps_ms"] for _ in range(runs)]
        after = torch.cuda.memory_stats()
        return times, {k: after.get(k, 0) - before.get(k, 0) for k in STATS}

    def profile(specs, name: str) -> None:
        sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        for i, (prompt, spec) in enumerate(zip(prompts(len(specs)), specs)):
            engine.add_request(f"prof-{name}-{i}", prompt, sp, spec)
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            start = time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        while engine.has_unfinished_requests():
            engine.step()
        if args.trace_dir:
            path = os.path.join(args.trace_dir, f"trace_{name}.json")
            prof.export_chrome_trace(path)
            with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as z:
                z.write(f.read())
            os.remove(path)
        table = prof.key_averages()
        print(f"== {name}: profiled step wall {wall * 1e3:.1f} ms", flush=True)
        print(table.table(sort_by="self_cpu_time_total", row_limit=6, max_name_column_width=50))
        print(table.table(sort_by="self_device_time_total", row_limit=9, max_name_column_width=50))

    for case in ("base", "lora"):
        specs = B.case_specs(case, 64, paths, 64)
        for tokens in (24, 4):  # loads the adapters, captures the graphs, compiles the prefill's kernels
            clock.run(prompts(64), specs, tokens)
        times, delta = prefill_times(specs, 3)
        print(f"{case} prefill steps ms {times} alloc stats delta {delta}", flush=True)
    specs = B.case_specs("lora", 64, paths, 64)
    default = launch.CONFIG
    for tiles in (int(t) for t in args.tile_tokens.split(",")):
        launch.CONFIG = dataclasses.replace(default, long_tile_tokens=tiles)
        clock.run(prompts(64), specs, 2)  # compiles this tile height's kernels
        print(f"lora, long_tile_tokens {tiles}: prefill", prefill_times(specs, 4), flush=True)
        profile(specs, f"lora-tiles{tiles}")
    launch.CONFIG = default


if __name__ == "__main__":
    main()
