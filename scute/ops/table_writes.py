"""Device tables written from the host without waiting for the device.

A decode step in flight reads the slot pools' tables while the host places the next adapter. A pageable
host-to-device copy waits for the device first (the driver stages it), and pinning each table's few rows alone
allocates pinned memory per table, which waits too: a placement would stall the step loop for as long as the
step in flight runs, per table. `TableWrites` gathers a placement's rows and writes them in one copy.
"""

from __future__ import annotations

import torch
from torch import Tensor


class TableWrites:
    """Host rows bound for device tables, written together by `flush`: one pinned buffer, one copy to the device
    (queued on the current stream behind the step in flight, which keeps reading the old contents; the host goes
    on), then a copy on the device into each table."""

    def __init__(self) -> None:
        self.items: list[tuple[Tensor, Tensor]] = []

    def add(self, dst: Tensor, rows: Tensor) -> None:
        """Write `rows` (host, int64, `dst`'s shape) into `dst` at the flush; at once where `dst` is on the CPU."""
        if dst.is_cuda:
            self.items.append((dst, rows))
        else:
            dst.copy_(rows)

    def flush(self) -> None:
        if not self.items:
            return
        flat = torch.cat([rows.reshape(-1) for _, rows in self.items]).pin_memory()
        staged, start = flat.to(self.items[0][0].device, non_blocking=True), 0
        for dst, rows in self.items:
            dst.copy_(staged[start:start + rows.numel()].view(rows.shape))
            start += rows.numel()
        self.items.clear()


def write(dst: Tensor, src: Tensor) -> None:
    """``dst.copy_(src)`` from the host, one tensor (a rebuild's shared buffers): on CUDA from pinned memory,
    queued behind the step in flight."""
    if dst.is_cuda:
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)


def refill(old: Tensor | None, new: Tensor, device: torch.device, dtype: torch.dtype) -> Tensor:
    """`new` in `old`'s memory when the shapes match (a captured graph keeps reading there), else a new copy."""
    if old is not None and old.shape == new.shape:
        if new.device == old.device:
            return old.copy_(new)
        write(old, new.to(old.dtype))
        return old
    return new.to(device=device, dtype=dtype).contiguous()
