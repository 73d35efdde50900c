"""Pinned host memory that the device's kernels read and write, so that the steps never use a copy engine.

A copy between pinned host memory and a CUDA device (``Tensor.copy_``, a cudaMemcpyAsync) runs on a copy engine,
and a copy engine runs the copies of every stream in the order they were queued: a step's few kilobytes of inputs
queued behind an adapter load's megabytes on the loader's stream wait for all of them. On the H200
(`bench/bench_side_stream.py`) a step's inputs landed 4.8-7.3 ms after the step before them behind 512 MB of the
side stream's copies in 1-64 MB commands, 0.03 ms without; read by a kernel instead, 0.02-0.06 ms either way. With
unified virtual addressing a pinned host tensor has one address on the host and the device: a kernel reads or
writes it across the bus, beside whatever the copy engines run. The engine's per-step transfers (a graph step's
inputs, every step's sampler output, a placement's table rows, an eager step's inputs) go through here; the adapter
loader's bulk copies keep the copy engines.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np
import torch
from torch import Tensor

_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}  # an integer dtype per element size
_TYPESTR = {torch.int64: "<i8", torch.int32: "<i4", torch.int16: "<i2", torch.uint8: "|u1"}
# `keep`'s host tensors until their events end, a queue per stream (a stream's events end in order; the loader's
# stream may run its work long after the step loop's)
_IN_FLIGHT: dict[int, deque[tuple[Tensor, torch.cuda.Event]]] = {}
_LOCK = threading.Lock()
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}  # host_to_device's dtypes


class _Interface:
    """A pinned host tensor's bytes as ``__cuda_array_interface__`` describes a device array (`device_view`)."""

    def __init__(self, host: Tensor) -> None:
        self.host = host  # the view keeps this object, hence the memory, alive
        self.__cuda_array_interface__ = {"shape": (host.numel(),), "typestr": _TYPESTR[host.dtype],
                                         "data": (host.data_ptr(), False), "version": 3, "strides": None}


def device_view(host: Tensor, device: torch.device | str = "cuda") -> Tensor:
    """Semantics: `host` as a tensor on `device` at the same address (its kernels read and write the host's
    memory). Shapes: host any shape, contiguous, pinned, of a dtype of 1, 2, 4 or 8 bytes; returns the same shape
    and dtype; the view keeps `host` alive. Needs the host address to be the device address (unified virtual
    addressing, as on x86 and Grace hosts with torch's pinned allocator); a view torch would place elsewhere raises."""
    if not host.is_pinned() or not host.is_contiguous():
        raise ValueError("device_view: a contiguous tensor in pinned host memory")
    bits = host.reshape(-1).view(_BITS[host.element_size()])
    view = torch.as_tensor(_Interface(bits), device=device)
    if view.data_ptr() != host.data_ptr():  # torch copied it to another device than the one it is mapped for
        raise RuntimeError(f"pinned host memory is not addressable from {device} at its own address")
    return view.view(host.dtype).view(host.shape)


def copy_by_kernel(dst: Tensor, src: Tensor) -> Tensor:
    """Semantics: ``dst[...] = src`` bit for bit, by an elementwise kernel (an integer add of 0 over their bits),
    not a copy engine: ``Tensor.copy_`` between two CUDA tensors of one dtype is a cudaMemcpyAsync, which for a
    `device_view` of host memory runs on a copy engine. Shapes: dst and src alike in shape and dtype, on one CUDA
    device (either a `device_view`). Returns dst."""
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"copy_by_kernel: {src.dtype} {list(src.shape)} into {dst.dtype} {list(dst.shape)}")
    bits = _BITS[dst.element_size()]
    torch.add(src.view(bits), 0, out=dst.view(bits))
    return dst


def to_device(host: Tensor, out: Tensor | None = None, device: torch.device | str = "cuda") -> Tensor:
    """Semantics: `host` on `device` (into `out`, on its device, if given), read there by a kernel queued on the
    current stream (`copy_by_kernel`); `host` is kept alive until the kernel has run (an event behind it), as the
    caching host allocator keeps the memory of a copy it queued. Shapes: host pinned, contiguous; out alike."""
    if out is None:
        out = torch.empty(host.shape, dtype=host.dtype, device=device)
    if host.numel() == 0:  # nothing to read (and no memory to view)
        return out
    copy_by_kernel(out, device_view(host, out.device))
    keep(host, out.device)
    return out


def to_host(x: Tensor) -> Tensor:
    """Semantics: a pinned host tensor that a kernel queued on the current stream of `x`'s device fills with `x`
    (`copy_by_kernel`: not a copy engine, where ``x.cpu()`` would wait behind an adapter load's copies); read it
    once that stream has run the kernel (an event, a synchronize). Shapes: x any shape, on a CUDA device; returns
    a contiguous tensor of its shape and dtype."""
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    if host.numel():
        copy_by_kernel(device_view(host, x.device), x)
        keep(host, x.device)
    return host


def keep(host: Tensor, device: torch.device) -> torch.cuda.Event:
    """Keep `host` (pinned memory a kernel queued on `device`'s current stream reads or writes) alive until that
    stream has run the work queued so far, as the caching host allocator keeps the memory of a copy it queued:
    freed before, its memory could be handed out again while the kernel still uses it. Returns the event that marks
    the point."""
    stream = torch.cuda.current_stream(device)
    event = torch.cuda.Event()
    event.record(stream)
    with _LOCK:
        queue = _IN_FLIGHT.setdefault(stream.cuda_stream, deque())
        queue.append((host, event))
        while queue and queue[0][1].query():
            queue.popleft()
    return event


def host_to_device(values: list, dtype: torch.dtype, device: torch.device, out: Tensor | None = None) -> Tensor:
    """Semantics: ``torch.tensor(values, dtype)`` on `device`. On CUDA the host tensor is pinned and read by a
    kernel queued on the current stream (`to_device`: not a copy engine, where it would wait behind an adapter
    load's copies), so building a step's inputs never waits for the GPU. `out`: a preallocated buffer to write
    into (its first len(values) entries; returned as that slice), so tensors can live at fixed addresses. The list
    is read by numpy (about 3x faster than `torch.tensor` per element: a long prompt's inputs, a penalized batch's
    tokens). Shapes: values a list (of lists) of numbers, rectangular; dtype int64, int32 or float32; returns its
    shape."""
    array = np.array(values, dtype=_NUMPY[dtype])
    dst = None if out is None else out[tuple(slice(n) for n in array.shape)]
    if device.type != "cuda":
        host = torch.from_numpy(array)
        return host.to(device) if dst is None else dst.copy_(host)
    host = torch.empty(array.shape, dtype=dtype, pin_memory=True)
    host.numpy()[...] = array
    return to_device(host, dst, device)
