"""Device tables written from the host without waiting for the device.

A decode step in flight reads the slot pools' tables while the host places the next adapter. A pageable
host-to-device copy waits for the device first (the driver stages it), and pinning each table's few rows alone
allocates pinned memory per table, which waits too: a placement would stall the step loop for as long as the
step in flight runs, per table. `TableWrites` gathers a placement's rows and writes them from one pinned buffer.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from scute.ops.mapped import host_to_device, to_device


class TableWrites:
    """Rows of device tables written from the host together (`flush`): one pinned buffer, read to the device by a
    kernel queued on the current stream behind the step in flight (which keeps reading the old contents; the host
    goes on; `scute.ops.mapped`: not a copy engine, where it would wait behind an adapter load's copies), and a
    kernel per kind of row that stores each where it belongs: rows of int64 values from the host (`scatter_rows`),
    rows of float32 copied on the device or set to ones (`copy_rows`). A few calls into torch for a placement's
    hundreds of rows: each call lets the loader thread take the interpreter lock, and the step loop waits to get it
    back. On the CPU each row is written by itself."""

    # `_table`'s answers by the table's id, across writes (a placement writes a few rows into each of a hundred
    # tables and more, the same tables every placement): the entry's weak reference tells a table that died, whose
    # id a new one may have, from the one it was made for
    _TABLES: dict[int, tuple[weakref.ref, tuple[int, int, int, tuple[int, ...]]]] = {}
    _MAX_TABLES = 4096

    def __init__(self) -> None:
        self.rows: list[tuple[Tensor, tuple[int, ...], list[int]]] = []
        self.copies: list[tuple[Tensor, tuple[int, ...], Tensor | None]] = []

    def add(self, table: Tensor, index: tuple[int, ...], values: list[int]) -> None:
        """Write `values` at the flush along the last, contiguous dimension of an int64 table: as the row
        ``table[index]`` (an index of all but the last dimension), or from the element ``table[index]`` on."""
        dim, width, _, _ = self._table(table)
        first = index[-1] if len(index) == dim else 0
        if width < 0 or first + len(values) > width or (len(index) < dim and len(values) != width):
            raise ValueError("TableWrites writes rows of contiguous int64 tables, within a row")
        self.rows.append((table, index, values))

    def add_column(self, table: Tensor, s: int, rows: list[list[int]]) -> None:
        """`add` each of `rows` as the whole row ``table[p, s]`` of a [P, slots, width] table, p = 0, 1, ...:
        checked once for all of them."""
        dim, width, _, _ = self._table(table)
        if width < 0 or dim != 3 or len(rows) > table.shape[0] or any(len(row) != width for row in rows):
            raise ValueError("TableWrites.add_column writes whole rows of a contiguous int64 [P, slots, width] table")
        self.rows += [(table, (p, s), row) for p, row in enumerate(rows)]

    @classmethod
    def _table(cls, table: Tensor) -> tuple[int, int, int, tuple[int, ...]]:
        """(the table's dims, its last dimension's size (-1 unless an int64 table contiguous along it), its
        address, its strides in bytes), worked out once per table (`_TABLES`)."""
        got = cls._TABLES.get(id(table))
        if got is not None and got[0]() is table:
            return got[1]
        ok = table.dtype == torch.int64 and table.stride(-1) == 1
        facts = (table.dim(), table.shape[-1] if ok else -1, table.data_ptr(),
                 tuple(st * table.element_size() for st in table.stride()))
        if len(cls._TABLES) >= cls._MAX_TABLES:
            cls._TABLES.clear()
        cls._TABLES[id(table)] = (weakref.ref(table), facts)
        return facts

    def _address(self, table: Tensor, index: tuple[int, ...]) -> int:
        """The address of ``table[index]``."""
        *_, address, strides = self._table(table)
        return address + sum(i * st for i, st in zip(index, strides))

    def copy(self, table: Tensor, index: tuple[int, ...], src: Tensor | None) -> None:
        """Copy `src` (a vector on the table's device, float32 as served; None: ones) into the float32 row
        ``table[index]`` at the flush."""
        if table.dtype != torch.float32 or table.stride(-1) != 1 or (src is not None and src.shape != table.shape[-1:]):
            raise ValueError("TableWrites copies vectors into whole rows of contiguous float32 tables")
        self.copies.append((table, index, src))

    def flush(self) -> None:
        rows, copies, self.rows, self.copies = self.rows, self.copies, [], []
        device = next((t.device for t, _, _ in rows + copies), None)
        if device is None or device.type != "cuda":  # through numpy views: no computing call into torch either
            for table, index, values in rows:
                row, first = (index[:-1], index[-1]) if len(index) == table.dim() else (index, 0)
                table.numpy()[row][first:first + len(values)] = values
            for table, index, src in copies:
                table[index] = 1.0 if src is None else src
            return
        addresses, offsets, values = [self._address(t, i) for t, i, _ in rows], [0], []
        for _, _, row in rows:
            values += row
            offsets.append(len(values))
        head = addresses + offsets + values if rows else []
        sources = [x if x is None or (x.dtype == torch.float32 and x.is_contiguous()) else x.float().contiguous()
                   for _, _, x in copies]  # kept until the copy is queued (stream order keeps the memory theirs)
        tail = [self._address(t, i) for t, i, _ in copies] + [0 if x is None else x.data_ptr() for x in sources] + \
            [t.shape[-1] for t, _, _ in copies]
        buf = host_to_device(head + tail, torch.int64, device)  # through numpy into a pinned buffer
        if rows:
            scatter_rows(buf[:len(head)], len(rows), max(len(r) for _, _, r in rows))
        if copies:
            copy_rows(buf[len(head):], len(copies), max(t.shape[-1] for t, _, _ in copies))


def scatter_rows(buf: Tensor, n_rows: int, width: int) -> None:
    """Store rows of int64 values at addresses, in one launch.

    Semantics: ``buf = [addresses (n_rows) | offsets (n_rows + 1) | values]`` (int64, on the device the addresses
    are on); row i, ``values[offsets[i]:offsets[i + 1]]`` (at most `width` long), is stored as int64 elements from
    address i on. Addresses are `Tensor.data_ptr` values of live tensors the caller keeps. Shapes: buf int64
    [2·n_rows + 1 + values]; width ≥ the longest row."""
    from scute.ops.kernels import scatter  # lazy: triton.jit reads TRITON_INTERPRET when decorating

    scatter.scatter_rows_kernel[(n_rows,)](buf, n_rows, BLOCK=1 << max(width - 1, 0).bit_length())


def copy_rows(buf: Tensor, n_rows: int, width: int) -> None:
    """Copy float32 rows from address to address on the device, or set them to ones, in one launch.

    Semantics: ``buf = [destinations (n_rows) | sources (n_rows) | lengths (n_rows)]`` (int64, on the device);
    ``lengths[i]`` (at most `width`) float32 elements from source i are stored from destination i on, or ones
    where source i is 0. Addresses are `Tensor.data_ptr` values of live tensors the caller keeps. Shapes: buf int64
    [3·n_rows]; width ≥ the longest length."""
    from scute.ops.kernels import scatter  # lazy: triton.jit reads TRITON_INTERPRET when decorating

    scatter.copy_rows_kernel[(n_rows,)](buf, n_rows, BLOCK=min(1 << max(width - 1, 0).bit_length(), 1024))


def write(dst: Tensor, src: Tensor) -> None:
    """``dst.copy_(src)`` from the host, one tensor (a rebuild's shared buffers): on CUDA read from pinned memory
    by a kernel queued behind the step in flight (`scute.ops.mapped.to_device`)."""
    if dst.is_cuda:
        to_device(src.to(dst.dtype).expand(dst.shape).contiguous().pin_memory(), dst)
    else:
        dst.copy_(src)


def refill(old: Tensor | None, new: Tensor, device: torch.device, dtype: torch.dtype) -> Tensor:
    """`new` in `old`'s memory when the shapes match (a captured graph keeps reading there), else a new copy: the
    buffer is the pool's own, never `new` itself (a later refill writes into it, and `new` may be an adapter's
    tensor that other adapters share, such as VeRA's B)."""
    if old is not None and old.shape == new.shape:
        if new.device == old.device:
            return old.copy_(new)
        write(old, new.to(old.dtype))
        return old
    return torch.empty(new.shape, dtype=dtype, device=device).copy_(new)
