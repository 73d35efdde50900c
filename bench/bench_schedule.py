"""Host time of `Scheduler.schedule()` while many requests wait for their adapters' loads.

A 2-layer toy Llama on the CPU; ``--waiting`` requests, each on its own IA3 folder, are queued while the adapter
loader never finishes a load (its jobs are futures left pending), so that every step passes every one of them:
what a server's step loop pays per step for a long queue of cold adapters. Prints the mean time of one
`schedule()` call per queue length.

Run: ``PYTHONPATH=. python3 bench/bench_schedule.py --waiting 100,1000``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import Future

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_engine as B  # noqa: E402
from bench_request_rate import TINY  # noqa: E402


def main(argv: list[str] | None = None) -> dict[int, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--waiting", default="100,1000", help="queue lengths")
    p.add_argument("--calls", type=int, default=50, help="schedule() calls timed per queue length")
    p.add_argument("--root", default="/tmp/scute-bench-schedule")
    args = p.parse_args(argv)
    from scute import Engine, SamplingParams

    counts = sorted(int(n) for n in args.waiting.split(","))
    model = B.random_llama(TINY, device="cpu", dtype=torch.float32)
    paths = B.make_adapters(model, "ia3", counts[-1], args.root)
    engine = Engine(model, device="cpu", dtype="float32", max_num_seqs=16, max_adapters=8,
                    max_cpu_adapters=counts[-1], max_model_len=64)
    engine.adapters.loader.submit = lambda fn, *a: Future()  # loads that never end
    result, queued = {}, 0
    for n in counts:  # the queue grows to each length in turn
        for i in range(queued, n):
            engine.add_request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=4), paths[i])
        queued = n
        engine.scheduler.schedule()  # the first call asks every new request
        start = time.perf_counter()
        for _ in range(args.calls):
            engine.scheduler.schedule()
        result[n] = (time.perf_counter() - start) / args.calls
        print(f"{n:6d} requests waiting on loads: schedule() {1e3 * result[n]:.3f} ms", flush=True)
    return result


if __name__ == "__main__":
    main()
