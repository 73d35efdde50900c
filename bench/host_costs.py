"""Host time of the primitives an eager layer call is made of, in µs per call (CUDA): a Triton launch with few
and with many arguments, a side-stream switch and a wait, an allocation, a cuBLAS GEMM's launch, a column split,
and a `torch.library` custom op with a trivial body. The figures behind `ScuteOp` and `LaunchResources.side_streams`
(docs/performance.md). Run: ``PYTHONPATH=. python3 bench/host_costs.py``.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _two_args(a0, n):
    pass


@triton.jit
def _many_args(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, i0, i1, i2, i3, i4, i5, i6,
               i7, i8, i9, i10, i11, i12, i13, i14, i15, i16, i17, i18, i19, P: tl.constexpr, Q: tl.constexpr):
    pass


@torch.library.custom_op("scute_bench::noop_", mutates_args=("a",))
def _noop_(a: torch.Tensor, b: list[torch.Tensor], n: int) -> None:
    return None


def per_call(fn, n: int = 2000) -> float:
    """µs of host time per call (the GPU is idle enough that launches never wait for it)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * elapsed / n


def main() -> None:
    dev = "cuda"
    x = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    small = torch.randn(1, 64, device=dev)
    ptrs = [torch.empty(16, device=dev) for _ in range(16)]
    side, main_stream = torch.cuda.Stream(), torch.cuda.current_stream()

    def switch():
        with torch.cuda.stream(side):
            pass

    rows = {
        "Triton launch, 2 arguments": per_call(lambda: _two_args[(1,)](small, 3)),
        "Triton launch, 16 pointers + 20 ints": per_call(lambda: _many_args[(1,)](*ptrs, *range(1, 21), P=2, Q=3)),
        "torch.cuda.stream context": per_call(switch),
        "Stream.wait_stream": per_call(lambda: side.wait_stream(main_stream)),
        "Tensor.new_empty": per_call(lambda: x.new_empty((64, 4096))),
        "F.linear 64 x 4096 x 4096 (launch)": per_call(lambda: F.linear(x, w), 300),
        "split into 3 columns": per_call(lambda: x.split([1000, 1000, 2096], dim=1)),
        "custom op, trivial body": per_call(lambda: _noop_(small, [small, small, small], 3)),
    }
    print(torch.cuda.get_device_name())
    for name, us in rows.items():
        print(f"{name:40s} {us:8.1f} us")


if __name__ == "__main__":
    main()
