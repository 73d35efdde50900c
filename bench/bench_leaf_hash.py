"""The adapter identity's hash tree (`scute.adapters.safetensors_file.Digest`) over one file's worth of bytes: its 8 KB
leaves hashed by the GPU kernel (`scute.ops.sha256.sha256_leaves`, on CUDA) against hashlib on the host's reader
threads (`READERS` of them, a run of leaves each: the CPU path), and against hashlib over 4 MB leaves on the same
threads (what a tree of large leaves costs the host: the cost of the small leaves' calls).

``--mb`` bytes of random data (84 by default: a LoRA r16 of the Llama-3-8B shape on all seven projections, bf16),
median of ``--repeats`` runs after a warm-up (which compiles the kernel), the GPU's synchronized. On a GPU also
what the kernel costs work running beside it (`beside_steps`: matrix products of a decode step's shape, alone and
with the kernel on a side stream).

Run: ``PYTHONPATH=. python3 bench/bench_leaf_hash.py [--out leaf_hash.json]`` (on a GPU machine for the kernel's
row). Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch


def median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def beside_steps(data: torch.Tensor, leaf: int, repeats: int) -> dict[str, float]:
    """What the kernel costs work running beside it, as a load's hash runs beside the decode steps: 40 matrix
    products of a decode step's shape (64 tokens through a 4096 x 28672 bf16 weight, reading the weight: bound by
    the memory's bandwidth, as a step is), timed on the current stream alone and with the kernel launched on a
    side stream just before them (seconds, GPU events, median of `repeats`)."""
    from scute.ops.sha256 import sha256_leaves

    x = torch.randn(64, 4096, device=data.device, dtype=torch.bfloat16)
    w = torch.randn(4096, 28672, device=data.device, dtype=torch.bfloat16)
    side = torch.cuda.Stream()

    def timed(hash_beside: bool) -> float:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if hash_beside:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                sha256_leaves(data, leaf)
        start.record()
        for _ in range(40):
            torch.mm(x, w)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3

    rows = {}
    for label, beside in (("40 decode-shaped matmuls alone", False), ("40 decode-shaped matmuls beside it", True)):
        timed(beside)  # warm-up
        rows[label] = statistics.median(timed(beside) for _ in range(repeats))
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=84.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="leaf_hash.json")
    args = p.parse_args(argv)
    from scute.adapters.safetensors_file import LEAF, READERS
    from scute.ops.sha256 import sha256_leaves, sha256_leaves_ref

    n = max(1, int(args.mb * 1e6) // LEAF)
    data = torch.randint(0, 256, (n * LEAF,), dtype=torch.uint8)
    pool = ThreadPoolExecutor(READERS)

    def on_threads(leaf: int) -> None:
        k = max(1, min(READERS, n * LEAF // leaf))  # a buffer under one leaf: one run
        runs = [(i * n // k * LEAF, (i + 1) * n // k * LEAF) for i in range(k)]
        list(pool.map(lambda r: sha256_leaves_ref(data[r[0]:r[1]], leaf), runs))

    rows = {f"hashlib, {LEAF >> 10} KB leaves, {READERS} threads": median_s(lambda: on_threads(LEAF), args.repeats),
            f"hashlib, 4 MB leaves, {READERS} threads": median_s(lambda: on_threads(4 << 20), args.repeats)}
    if torch.cuda.is_available():
        on_gpu = data.cuda()
        assert sha256_leaves(on_gpu[:64 * LEAF], LEAF).cpu().numpy().tobytes() == sha256_leaves_ref(
            data[:64 * LEAF], LEAF)

        def kernel() -> None:
            sha256_leaves(on_gpu, LEAF)
            torch.cuda.synchronize()

        rows[f"GPU kernel, {LEAF >> 10} KB leaves ({torch.cuda.get_device_name()})"] = median_s(kernel, args.repeats)
        rows.update(beside_steps(on_gpu, LEAF, args.repeats))
    mb = n * LEAF / 1e6
    print(f"{mb:.1f} MB")
    print(f"{'':<52} {'ms':>8} {'GB/s':>8}")
    for name, s in rows.items():  # GB/s: of the hashed bytes, for the hashes' rows
        print(f"{name:<52} {1e3 * s:8.2f} " + ("" if name.startswith("40 ") else f"{mb / 1e3 / s:8.1f}"))
    result = dict(mb=mb, leaf=LEAF, readers=READERS, torch=torch.__version__, ms={k: 1e3 * s for k, s in rows.items()})
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
