"""Per-kernel GPU time of one grouped layer call (torch profiler), and the compiled kernels' registers/spills,
under a few launch configurations: where the six-slot op's time goes (a sum of kernel times: the side stream's
kernels overlap the GEMMs, so it is more than the layer's time). Run: ``PYTHONPATH=. python bench/profile_ops.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "bench")
import bench_ops as B  # noqa: E402

from scute.ops import LaunchResources, build_lora_meta, launch, scute_linears_triton  # noqa: E402

CONFIGS = {
    "default": {},
    "split1": dict(max_split_k=1),
    "tiles8w": dict(tile_warps=8),
}


def kernel_times(fn, iters: int = 10) -> dict:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = defaultdict(float)
    for e in prof.key_averages():
        if e.device_time_total > 0:
            out[e.key[:40]] += e.device_time_total / iters
    return dict(out)


def timeline(fn) -> list[str]:
    """The second of two replays of a CUDA graph of `fn` under the profiler (the first starts late): each kernel's
    stream, start (µs from the replay's first kernel), duration and name, in start order: which stream's chain is
    the layer's critical path."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    kernels = kernels[len(kernels) // 2:]
    if not kernels:
        return ["(no kernel events in the graph replay's trace)"]
    t0 = kernels[0]["ts"]
    end = max(e["ts"] + e["dur"] for e in kernels)
    lines = [f"  stream {e['args'].get('stream', '?'):>3} start {e['ts'] - t0:7.1f} dur {e['dur']:6.1f}  "
             f"{e['name'][:60]}" for e in kernels]
    return lines + [f"  span {end - t0:.1f} us"]


def compiled_stats() -> list[str]:
    lines = []
    k = launch.kernels()
    for name in ("input_transform_kernel", "shrink_kernel", "delta_rows_kernel", "delta_tiles_kernel",
                 "epilogue_kernel"):
        fn = getattr(k, name)
        for dev, caches in getattr(fn, "device_caches", {}).items():
            for key, ck in caches[0].items():
                lines.append(f"{name}: regs {getattr(ck, 'n_regs', '?')} spills {getattr(ck, 'n_spills', '?')} "
                             f"shared {getattr(ck.metadata, 'shared', '?')} warps {ck.metadata.num_warps} "
                             f"stages {ck.metadata.num_stages} consts {str(key)[-120:]}")
    return lines


DEFAULT_ROWS = "lora:64:64,lora:1:1,vera:1:1,vera:64:1,mix:64:64"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default=DEFAULT_ROWS, help="variant:batch:adapters, comma-separated")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="of: " + ", ".join(CONFIGS))
    ap.add_argument("--timeline", action="store_true", help="also each row's kernels in one graph replay, by stream")
    args = ap.parse_args()
    rows = [(v, int(b), int(n)) for v, b, n in (r.split(":") for r in args.rows.split(","))]
    configs = {c: CONFIGS[c] for c in args.configs.split(",")}
    layer = B.Layer()
    for variant, batch, n in rows:
        pools = B.build_pools(layer, variant, n, B.GROUPED)
        xs = layer.inputs(batch)
        ts = torch.arange(batch, device="cuda") % n
        for cname, cfg in configs.items():
            launch.CONFIG = dataclasses.replace(launch.LaunchConfig(), **cfg)
            metas = {pool.group_key: build_lora_meta(ts, pool.slot_group) for pool in pools.values()}
            active, resources = frozenset(ts.tolist()), LaunchResources()

            def fn():
                for names, pool in pools.items():
                    scute_linears_triton(xs[B.INPUT[names[0]]], [layer.w[p] for p in names], [None] * len(names),
                                         pool, metas[pool.group_key], resources, active_slots=active)
            times = kernel_times(fn)
            total = sum(times.values())
            parts = ", ".join(f"{k.split('_kernel')[0]} {v:.1f}" for k, v in sorted(times.items(), key=lambda x: -x[1]))
            print(f"{variant} B={batch} n={n} [{cname}] total {total:.1f} us: {parts}", flush=True)
            if args.timeline:
                print("\n".join(timeline(fn)), flush=True)
    for line in compiled_stats():
        print(line)


if __name__ == "__main__":
    main()
