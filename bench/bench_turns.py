"""What the adapter loader's Python costs a GPU-bound step loop's host work, on the CPU alone.

The loader shares the interpreter lock with the step loop (`scute.engine.adapter_loader.Turns`). Here the step
loop is emulated as `Engine._step` runs a decode step on a GPU: inside its turn and with the garbage collector's
automatic collections held, ``--host-ms`` of Python (half before its wait, half after), and a wait for "the GPU"
(`Turns.waiting`, the young collections due run first, as `Engine._land` does) until ``--gpu-ms`` after the step
began. A quiet phase of ``--steps`` steps alternates with a loading phase in which a cold LoRA folder is loaded
every ``--interval`` seconds by the engine's own loader (`AdapterManager._job`: read, convert, rows in the slot
pools; the CPU path: the file copied and cast on the CPU, where a GPU engine's load lands in a device buffer) until
``--cold`` are done; ``--rounds`` rounds. Reports the host work's time per step (the fixed Python that takes
``--host-ms`` alone) quiet and while loading, median / p99 / max, the steps' wall time, the loader's longest
stretches between pause points (`stretches.py`), and what freeing an 84 MB host tensor (a LoRA's CPU-tier copy of
the 8B shape) costs the thread that lets it go (`free_ms`: why `AdapterLoader.drop` does it on the loader). A stand-in for `bench_background_loads.py` where no GPU is at
hand: it times the turns' rule and the pause points, not the GPU's work.

Run: ``SCUTE_TRITON_CPU=1 TRITON_INTERPRET=1 PYTHONPATH=. python3 bench/bench_turns.py --out turns.json``
(the slot pools with Triton's CPU tables, as a GPU engine has them). Two versions of the loader compare by
running this script with ``PYTHONPATH`` at each tree (``git archive COMMIT scute | tar -x -C DIR``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_engine as B  # noqa: E402
from bench_request_rate import percentile  # noqa: E402
from profile_load import llama_8b_shape  # noqa: E402
from stretches import Stretches  # noqa: E402
from stretches import summary as stretch_summary  # noqa: E402


def python_work(n: int) -> int:
    """Pure Python, as a step's host work is mostly: `n` dictionary writes."""
    d: dict[int, int] = {}
    for i in range(n):
        d[i & 255] = i
    return len(d)


def calibrate(ms: float) -> int:
    """The `python_work` size that takes about `ms` alone (the best of a few tries)."""
    n = 20_000
    best = min(timed(python_work, n) for _ in range(5))
    return max(1, int(n * ms / (1e3 * best)))


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


class Steps:
    """The emulated step loop (module docstring): `step` runs one; returns (wall s, host work s)."""

    def __init__(self, engine, host_ms: float, gpu_ms: float) -> None:
        self.turns, self.collections = engine.adapters.loader.turns, engine.collections
        self.half, self.gpu_s = calibrate(host_ms / 2), gpu_ms / 1e3

    def step(self) -> tuple[float, float]:
        start = time.perf_counter()
        with self.turns.step_loop(), self.collections.held():
            host = timed(python_work, self.half)
            with self.turns.waiting():
                self.collections.run_due(young=0.125)
                time.sleep(max(0.0, start + self.gpu_s - time.perf_counter()))
            host += timed(python_work, self.half)
        return time.perf_counter() - start, host


def loading_phase(engine, steps: Steps, cold: list[str], interval: float, max_steps: int) -> list[tuple]:
    """Steps while the loader loads one of `cold` every `interval` seconds, until every load is done."""
    manager, futures, rows = engine.adapters, [], []
    start, todo = time.perf_counter(), list(cold)
    while todo or not all(f.done() for f in futures):
        if todo and time.perf_counter() - start >= interval * len(futures):
            futures.append(manager.loader.submit(manager._job, todo.pop(0)))
        rows.append(steps.step())
        if len(rows) > max_steps:
            raise RuntimeError(f"loads did not finish in {len(rows)} steps")
    for f in futures:
        f.result()  # a failed load fails the bench
    return rows


def free_ms(nbytes: int = 84 << 20, repeats: int = 5) -> float:
    """Median ms the thread that lets go of a host tensor of `nbytes` (written, as a CPU tier's copy is) spends
    freeing it: the munmap `AdapterLoader.drop` takes off the step loop."""
    times = []
    for _ in range(repeats):
        box = [torch.ones(nbytes, dtype=torch.uint8)]
        times.append(timed(box.clear))
    return 1e3 * statistics.median(times)


def stats(rows: list[tuple], i: int) -> dict[str, float]:
    values = [1e3 * r[i] for r in rows]
    return dict(median_ms=statistics.median(values), p99_ms=percentile(values, 99), max_ms=max(values))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=512, help="a narrower 8B shape (`profile_load.llama_8b_shape`)")
    p.add_argument("--cold", type=int, default=10, help="cold adapters loaded per round")
    p.add_argument("--interval", type=float, default=0.05, help="seconds between two loads")
    p.add_argument("--host-ms", type=float, default=3.0, help="the step loop's Python a step, alone")
    p.add_argument("--gpu-ms", type=float, default=8.0, help="a step's time on the emulated GPU")
    p.add_argument("--steps", type=int, default=100, help="steps of a quiet phase")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-loading-steps", type=int, default=2000)
    p.add_argument("--root", default="/tmp/scute-bench-turns")
    p.add_argument("--out", default="turns.json")
    args = p.parse_args(argv)
    from scute import Engine, SamplingParams

    model = llama_8b_shape(args.layers, args.hidden, torch.device("cpu"), torch.float32)
    paths = B.make_adapters(model, "lora", 1 + args.cold * args.rounds, args.root)
    engine = Engine(model, device="cpu", dtype="float32", enforce_eager=True, max_adapters=2, max_adapter_rank=64,
                    max_model_len=64, max_num_seqs=2, kv_cache_memory_bytes=64 << 20)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=1), [paths[0]], use_tqdm=False)  # the pools exist
    engine.adapters.loader.submit(engine.adapters._job, paths[0]).result()  # compiled, warmed
    steps = Steps(engine, args.host_ms, args.gpu_ms)
    quiet, loading = [], []
    with Stretches() as stretches:
        for r in range(args.rounds):
            quiet += [steps.step() for _ in range(args.steps)]
            cold = paths[1 + r * args.cold:1 + (r + 1) * args.cold]
            loading += loading_phase(engine, steps, cold, args.interval, args.max_loading_steps)
            print(f"  round {r}: {len(loading)} loading steps so far", flush=True)
    result = dict(command=" ".join(sys.argv), torch=torch.__version__, layers=args.layers, hidden=args.hidden,
                  host_ms=args.host_ms, gpu_ms=args.gpu_ms, interval_s=args.interval,
                  loads=args.cold * args.rounds, quiet_steps=len(quiet), loading_steps=len(loading),
                  free_84mb_ms=free_ms(),
                  quiet_host=stats(quiet, 1), loading_host=stats(loading, 1), quiet_wall=stats(quiet, 0),
                  loading_wall=stats(loading, 0))
    result["host_p99_over_quiet_median"] = result["loading_host"]["p99_ms"] / result["quiet_host"]["median_ms"]
    result["wall_p99_over_quiet_median"] = result["loading_wall"]["p99_ms"] / result["quiet_wall"]["median_ms"]
    for phase in ("quiet", "loading"):
        h, w = result[f"{phase}_host"], result[f"{phase}_wall"]
        print(f"{phase:>8}: host work median {h['median_ms']:.2f} / p99 {h['p99_ms']:.2f} / max {h['max_ms']:.2f} ms;"
              f" step median {w['median_ms']:.2f} / p99 {w['p99_ms']:.2f} / max {w['max_ms']:.2f} ms")
    print(f"loading host p99 / quiet median {result['host_p99_over_quiet_median']:.2f}x, step p99 / quiet median "
          f"{result['wall_p99_over_quiet_median']:.2f}x; freeing an 84 MB host tensor {result['free_84mb_ms']:.1f} ms")
    print("the loader's longest stretches between pause points:")
    result["stretches"] = stretch_summary(stretches.records, top=8)
    return B.save(result, args.out)


if __name__ == "__main__":
    main()
