"""`scute.ops.mapped`: pinned host memory read and written by the device's kernels. `copy_by_kernel` is bit-exact on
any device (checked on the CPU too); the views and `to_device` need a CUDA device."""

from __future__ import annotations

import gc

import pytest
import torch

from scute.ops import mapped

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _odd_values(dtype: torch.dtype, n: int = 64) -> torch.Tensor:
    """Values whose bits an arithmetic copy could change: -0.0, NaNs with payloads, infinities, subnormals."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**15, 2**15, (n,), dtype=torch.int16, generator=g)
    if dtype.itemsize == 4:
        bits = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=g)
        bits[:4] = torch.tensor([-2**31, 0x7FC00001, 0x7F800000, 1], dtype=torch.int32)  # -0.0, NaN, inf, subnormal
    elif dtype.is_floating_point:
        bits[:3] = torch.tensor([-2**15, 0x7FC1, 0x7F80], dtype=torch.int16)
    return bits.view(dtype)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_copy_by_kernel_is_bit_exact(device, dtype):
    if dtype == torch.int64:
        src = torch.tensor([-2**63, 2**63 - 1, 0, -1, 12345], dtype=torch.int64)
    elif dtype == torch.bool:
        src = torch.tensor([True, False, True])
    else:
        src = _odd_values(dtype)
    src = src.to(device)
    dst = torch.empty_like(src)
    mapped.copy_by_kernel(dst, src)
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[src.element_size()]
    assert torch.equal(dst.view(bits).cpu(), src.view(bits).cpu())


def test_copy_by_kernel_refuses_other_shapes_and_dtypes():
    with pytest.raises(ValueError, match="copy_by_kernel"):
        mapped.copy_by_kernel(torch.empty(3), torch.empty(4))
    with pytest.raises(ValueError, match="copy_by_kernel"):
        mapped.copy_by_kernel(torch.empty(3), torch.empty(3, dtype=torch.float64))


def test_device_view_refuses_pageable_memory():
    with pytest.raises(ValueError, match="pinned"):
        mapped.device_view(torch.zeros(4))


@cuda
def test_device_view_reads_and_writes_host_memory():
    host = torch.arange(12, dtype=torch.int32).reshape(3, 4).pin_memory()
    view = mapped.device_view(host)
    assert view.is_cuda and view.shape == host.shape and view.data_ptr() == host.data_ptr()
    out = torch.empty(3, 4, dtype=torch.int32, device="cuda")
    mapped.copy_by_kernel(out, view)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), host)
    host[1] = 7  # the host writes; the next kernel reads what it wrote
    mapped.copy_by_kernel(out, view)
    torch.cuda.synchronize()
    assert out[1].tolist() == [7] * 4
    mapped.copy_by_kernel(view[2], torch.full((4,), -5, dtype=torch.int32, device="cuda"))  # a kernel writes
    torch.cuda.synchronize()
    assert host[2].tolist() == [-5] * 4 and host[0].tolist() == [0, 1, 2, 3]


@cuda
def test_to_device_keeps_the_host_tensor_until_read():
    torch.cuda._sleep(200_000_000)  # the stream busy: the read is queued well behind the host's return
    values = _odd_values(torch.float32, 1 << 16)
    host = values.pin_memory()
    out = mapped.to_device(host)
    kept = host.data_ptr()
    del host
    gc.collect()
    assert kept in _held()  # still referenced: its memory not handed out
    for _ in range(4):  # pinned tensors allocated meanwhile get other memory
        assert torch.empty(1 << 16, pin_memory=True).data_ptr() != kept
    torch.cuda.synchronize()
    assert torch.equal(out.cpu().view(torch.int32), values.view(torch.int32))
    mapped.to_device(torch.zeros(1, pin_memory=True))
    torch.cuda.synchronize()
    mapped.to_device(torch.zeros(1, pin_memory=True))
    assert kept not in _held()  # let go once read


def _held() -> list[int]:
    """The addresses of the host tensors `mapped.keep` holds."""
    return [h.data_ptr() for queue in mapped._IN_FLIGHT.values() for h, _ in queue]


@cuda
def test_a_busy_stream_holds_back_only_its_own_host_tensors():
    """Each stream's host tensors are let go as that stream reads them: a side stream's queued work (an adapter
    load's) does not keep the step loop's stream's tensors, whose memory the next steps' allocations reuse."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(400_000_000)
        slow = torch.zeros(8, pin_memory=True)
        mapped.to_device(slow)
    first = torch.arange(8, pin_memory=True)
    kept, slow_at = first.data_ptr(), slow.data_ptr()
    mapped.to_device(first)
    del first, slow
    torch.cuda.current_stream().synchronize()
    mapped.to_device(torch.zeros(1, pin_memory=True))
    assert kept not in _held() and slow_at in _held()
    side.synchronize()


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_to_host_writes_by_kernel_bit_exact(dtype):
    """`to_host` of a (non-contiguous) device tensor: pinned, its values bit for bit once the stream ran the
    kernel, which is queued behind the stream's earlier work (not run at once)."""
    src = (torch.tensor([True, False, True, True]) if dtype == torch.bool else _odd_values(dtype, 256)).cuda()
    src = src.reshape(2, -1).t()  # a transposed view
    torch.cuda._sleep(100_000_000)
    host = mapped.to_host(src)
    assert not torch.cuda.current_stream().query()  # queued behind the sleep, not waited for
    assert host.is_pinned() and host.shape == src.shape and host.dtype == dtype and host.is_contiguous()
    torch.cuda.current_stream().synchronize()
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[src.element_size()]
    assert torch.equal(host.view(bits), src.cpu().contiguous().view(bits))
    assert mapped.to_host(src[:0]).numel() == 0


@cuda
def test_to_device_writes_into_a_slice():
    out = torch.zeros(4, 6, dtype=torch.int64, device="cuda")
    mapped.to_device(torch.arange(8, dtype=torch.int64).reshape(2, 4).pin_memory(), out[:2, :4])
    torch.cuda.synchronize()
    want = torch.zeros(4, 6, dtype=torch.int64)
    want[:2, :4] = torch.arange(8).reshape(2, 4)
    assert torch.equal(out.cpu(), want)


@cuda
def test_to_device_of_nothing():
    out = mapped.to_device(torch.empty(0, 3, dtype=torch.int64).pin_memory())
    assert out.shape == (0, 3) and out.is_cuda
