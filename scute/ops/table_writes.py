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
    """Rows of int64 device tables written from the host together (`flush`): one pinned buffer, one copy to the
    device queued on the current stream behind the step in flight (which keeps reading the old contents; the host
    goes on), and one kernel that stores each row where it belongs (`scatter_rows`). Three calls into torch for a
    placement's hundreds of rows: each call lets the loader thread take the interpreter lock, and the step loop
    waits to get it back. On the CPU each row is written by itself."""

    def __init__(self) -> None:
        self.rows: list[tuple[Tensor, tuple[int, ...], list[int]]] = []

    def add(self, table: Tensor, index: tuple[int, ...], values: list[int]) -> None:
        """Write `values` into ``table[index]`` at the flush: a row along the table's last, contiguous dimension."""
        if table.dtype != torch.int64 or table.stride(-1) != 1 or len(values) != table.shape[-1]:
            raise ValueError("TableWrites writes whole rows of contiguous int64 tables")
        self.rows.append((table, index, values))

    def flush(self) -> None:
        rows, self.rows = self.rows, []
        if not rows or not rows[0][0].is_cuda:
            for table, index, values in rows:
                table[index] = torch.tensor(values, dtype=torch.int64)
            return
        addresses, offsets, values = [], [0], []
        for table, index, row in rows:
            addresses.append(table.data_ptr() + 8 * sum(i * st for i, st in zip(index, table.stride())))
            values += row
            offsets.append(len(values))
        buf = torch.tensor(addresses + offsets + values, dtype=torch.int64, pin_memory=True)
        scatter_rows(buf.to(rows[0][0].device, non_blocking=True), len(rows), max(len(r) for _, _, r in rows))


def scatter_rows(buf: Tensor, n_rows: int, width: int) -> None:
    """Store rows of int64 values at addresses, in one launch.

    Semantics: ``buf = [addresses (n_rows) | offsets (n_rows + 1) | values]`` (int64, on the device the addresses
    are on); row i, ``values[offsets[i]:offsets[i + 1]]`` (at most `width` long), is stored as int64 elements from
    address i on. Addresses are `Tensor.data_ptr` values of live tensors the caller keeps."""
    from scute.ops.kernels import scatter  # lazy: triton.jit reads TRITON_INTERPRET when decorating

    scatter.scatter_rows_kernel[(n_rows,)](buf, n_rows, BLOCK=1 << max(width - 1, 0).bit_length())


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
