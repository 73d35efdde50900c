"""The device's two ceilings, measured the one way every floor in Scute uses them.

Copy bandwidth: a device-to-device copy of a 2 GiB tensor, counting the bytes read plus the bytes written, median
of 20 copies run back to back (an event between each two) after a second of warm-up copies. An idle GPU clocks
low: a first copy, or one right after idle, reads low, and so did copies timed one at a time with a host wait
between them (4.13-4.25 TB/s on an H200 where back-to-back copies give 4.27 in every repeat). The byte floor of anything is its bytes over this figure. Matmul rate: a bf16 product of two
8192 x 8192 matrices of random values, median of 10 (random, not zeros: zeros run faster).
"""

from __future__ import annotations

import statistics
import time

import torch


def _median_ms(fn, reps: int = 10) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(device: str = "cuda", nbytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy of `nbytes` (read + write counted)."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    t_end = time.time() + 1.0
    while time.time() < t_end:
        dst.copy_(src)
        torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(21)]
    events[0].record()
    for event in events[1:]:
        dst.copy_(src)
        event.record()
    torch.cuda.synchronize()
    ms = statistics.median(a.elapsed_time(b) for a, b in zip(events, events[1:]))
    del src, dst
    return 2 * nbytes / (ms * 1e-3)


def matmul_rate(device: str = "cuda", n: int = 8192) -> float:
    """FLOP/s of a bf16 n x n x n matrix product on random data."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    ms = _median_ms(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3)
