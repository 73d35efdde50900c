"""What the adapter loader's work on its side stream costs a step's work on the engine's stream, on one GPU.

A decode step on the engine's stream begins with small host-to-device copies (its inputs: `ModelRunner.
_write_inputs`, from pinned mirrors), then replays its graph. While it runs, the loader's stream may be copying an
adapter's bytes to the device (`AdapterCheckpoint.land_arrived`, `Staging`) and running its kernels (the leaves'
sha256, the finite check). Two measurements, each the median of ``--repeats``:

- *copies*: the engine's stream runs a memory-bound stand-in for a step (``--step-ms`` of GEMVs), then the
  step's input copies (``--input-kb``, three pinned host buffers) and a small kernel; the side stream copies
  ``--side-mb`` from pinned memory to the device, issued as the stand-in starts, in commands of each
  ``--chunks-kb`` (0: no side copy); the inputs copied (a copy engine's work) or read by a kernel from the pinned
  buffers' device addresses (`scute.ops.mapped`: what the engine does). Reported: the time from the stand-in's
  end to the small kernel's end (the step's inputs waiting behind the side stream's copies on the copy engine),
  and the side copy's rate.
- *kernels*: the same stand-in timed alone and beside the side stream's sha256 of ``--hash-mb`` (`sha256_leaves`,
  and its kernel at other launch shapes: lanes per program, warps; at most 16-132 programs, each hashing several
  groups of leaves: fewer SMs busy for longer), the landing's finite check (`_finite_flags`)
  and two others (one ``vector_norm``, ``isfinite(..).all()``) over it as bf16, and one ``--hash-mb`` copy: how
  much each slows the step's kernels.

Run on a GPU: ``PYTHONPATH=. python3 bench/bench_side_stream.py --out side_stream.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from scute.adapters.checkpoint import _finite_flags
from scute.adapters.safetensors_file import LEAF
from scute.ops.mapped import copy_by_kernel, device_view
from scute.ops.sha256 import sha256_leaves


def stand_in(weights: torch.Tensor, x: torch.Tensor, times: int) -> None:
    for _ in range(times):
        torch.mv(weights, x)


def calibrate(weights: torch.Tensor, x: torch.Tensor, step_ms: float) -> int:
    """GEMVs over `weights` that take about `step_ms` on the GPU."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stand_in(weights, x, 3)
    start.record()
    stand_in(weights, x, 10)
    end.record()
    end.synchronize()
    return max(1, round(step_ms / (start.elapsed_time(end) / 10)))


def copies(args, weights, x, times, side_stream) -> list[dict]:
    kb = args.input_kb
    inputs = [torch.zeros(kb * 256 // 3, dtype=torch.int32, pin_memory=True) for _ in range(3)]
    views = [device_view(t) for t in inputs]
    dev_inputs = [t.to("cuda") for t in inputs]
    src = torch.empty(args.side_mb << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device="cuda")
    rows = []
    for chunk_kb, by_kernel in [(c, k) for c in args.chunks_kb for k in (False, True)]:
        delays, rates = [], []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            side = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            stand_in(weights, x, times)
            ends[0].record()
            for d, s, v in zip(dev_inputs, inputs, views):
                if by_kernel:
                    copy_by_kernel(d, v)
                else:
                    d.copy_(s, non_blocking=True)
            dev_inputs[0].add_(1)
            ends[1].record()
            if chunk_kb:
                with torch.cuda.stream(side_stream):
                    side[0].record()
                    step = chunk_kb << 10
                    for a in range(0, src.numel(), step):
                        dst[a:a + step].copy_(src[a:a + step], non_blocking=True)
                    side[1].record()
            torch.cuda.synchronize()
            delays.append(ends[0].elapsed_time(ends[1]))
            if chunk_kb:
                rates.append(src.numel() / side[0].elapsed_time(side[1]) / 1e6)
        rows.append({"chunk_kb": chunk_kb, "inputs_by": "kernel" if by_kernel else "copy",
                     "inputs_after_step_ms": statistics.median(delays),
                     "inputs_after_step_max_ms": max(delays),
                     "side_copy_gb_s": statistics.median(rates) if rates else None})
        print(f"side copy in {chunk_kb or '-':>6} KB commands, inputs by {rows[-1]['inputs_by']:<6}: they land "
              f"{rows[-1]['inputs_after_step_ms']:.3f} ms (max {rows[-1]['inputs_after_step_max_ms']:.3f}) after "
              f"its stand-in" + (f"; side copy {rows[-1]['side_copy_gb_s']:.1f} GB/s" if rates else ""), flush=True)
    return rows


def kernels(args, weights, x, times, side_stream) -> list[dict]:
    data = torch.randint(0, 255, (args.hash_mb << 20,), dtype=torch.uint8, device="cuda")
    src = torch.empty(args.hash_mb << 20, dtype=torch.uint8, pin_memory=True)
    from scute.ops import sha256 as sha  # the kernel at other launch shapes than `sha256_leaves`'
    from scute.ops.sha256_kernels import sha256_leaves_kernel

    sha256_leaves(data[:LEAF], LEAF)  # its table made
    n, out = data.numel() // LEAF, torch.empty(data.numel() // LEAF, 8, dtype=torch.int32, device="cuda")

    def sha256_at(block: int, warps: int):
        return lambda: sha256_leaves_kernel[(-(-n // block),)](data, out, sha._TABLES[data.device], n, 0, LEAF=LEAF,
                                                                 BLOCK=block, num_warps=warps)
    values = data.view(torch.bfloat16)
    works = {
        "none": lambda: None,
        "sha256": lambda: sha256_leaves(data, LEAF),
        **{f"sha256 b{b} w{w}": sha256_at(b, w) for b, w in ((64, 2), (128, 4), (32, 2))},
        **{f"sha256 p{p}": (lambda p=p: sha256_leaves(data, LEAF, programs=p)) for p in (16, 33, 66, 132)},
        "finite": lambda: _finite_flags([values]),  # the landing's check
        "finite norm": lambda: torch.linalg.vector_norm(values, float("inf")).isfinite(),
        "isfinite": lambda: torch.isfinite(values).all(),
        "copy": lambda: data.copy_(src, non_blocking=True),
    }
    rows = []
    for name, work in works.items():
        times_ms, side_ms = [], []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            ev[0].record()
            with torch.cuda.stream(side_stream):
                ev[2].record()
                work()
                ev[3].record()
            stand_in(weights, x, times)
            ev[1].record()
            torch.cuda.synchronize()
            times_ms.append(ev[0].elapsed_time(ev[1]))
            side_ms.append(ev[2].elapsed_time(ev[3]))
        rows.append({"side": name, "step_ms": statistics.median(times_ms), "side_ms": statistics.median(side_ms)})
        print(f"stand-in beside {name:<14}: {rows[-1]['step_ms']:.3f} ms (side work {rows[-1]['side_ms']:.3f} ms)",
              flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--step-ms", type=float, default=5.0)
    p.add_argument("--input-kb", type=int, default=300)
    p.add_argument("--side-mb", type=int, default=512)
    p.add_argument("--chunks-kb", type=lambda s: [int(v) for v in s.split(",")], default=[0, 256, 1024, 4096,
                                                                                             16384, 65536])
    p.add_argument("--hash-mb", type=int, default=84)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out")
    args = p.parse_args()
    weights = torch.randn(32768, 16384, dtype=torch.bfloat16, device="cuda")  # 1 GiB: a GEMV reads it whole
    x = torch.randn(16384, dtype=torch.bfloat16, device="cuda")
    times = calibrate(weights, x, args.step_ms)
    side_stream = torch.cuda.Stream()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args),
              "copies": copies(args, weights, x, times, side_stream),
              "kernels": kernels(args, weights, x, times, side_stream)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
