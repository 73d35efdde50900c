"""The deferral (`LaunchConfig.defer_max_tokens`) on and off in one process: decode ms/step of base and LoRA
batches through `Engine` with CUDA graphs, every one of the 64 device slots holding a LoRA adapter.

A one-token call of plain LoRA slots returns o's, gate/up's and down's outputs before their deltas, and the
kernels that consume them add the deltas (`scute.ops.plan.DeferPlan`); off, each call runs its epilogue. The
rounds alternate on / off (the graphs re-captured for each) so that the GPU's drift over the run falls on both;
each figure is the median of three runs of ``--new-tokens`` tokens. Llama-3-8B shape, random bf16 weights, as in
`bench_engine.py`.

Run on a GPU: ``PYTHONPATH=. python3 bench/ab_defer.py [--rounds 3] [--out ab_defer.json]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_engine as B  # noqa: E402

CASES = (("base", 1), ("lora", 1), ("lora", 16), ("lora", 64))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--on", type=int, default=None, help="defer_max_tokens of the deferred rounds (default: the "
                   "configuration's; 511 defers every call below fold_min_tokens, as bench/results/ab_defer_h200.log)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--root", default="/tmp/scute-ab-defer")
    p.add_argument("--out", default="ab_defer.json")
    args = p.parse_args()
    from scute.ops import launch

    engine, paths, clock, prompts = B.lora_burst_engine(32, args.root)
    clock.run(prompts(64), B.case_specs("lora", 64, paths, 64), 2)  # every slot holds one of the adapters
    default, rows = launch.CONFIG, []
    for rnd in range(args.rounds):
        for defer in (default.defer_max_tokens if args.on is None else args.on, 0):
            launch.CONFIG = dataclasses.replace(default, defer_max_tokens=defer)
            engine.runner.graphs.graphs.clear()  # captured again under this configuration
            engine.runner.graphs.pool = torch.cuda.graph_pool_handle()
            row = dict(round=rnd, defer_max_tokens=defer)
            for case, batch in CASES:
                specs = B.case_specs(case, batch, paths, 64)
                clock.run(prompts(batch), specs, 8)  # captures this batch's graph
                row[f"{case}-{batch}"] = statistics.median(
                    clock.run(prompts(batch), specs, args.new_tokens)["decode_ms"] for _ in range(3))
            rows.append(row)
            print(", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                  flush=True)
    launch.CONFIG = default
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), command="PYTHONPATH=. python3 " + " ".join(sys.argv),
                       rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
