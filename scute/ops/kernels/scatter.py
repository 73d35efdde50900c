"""The kernel of `scute.ops.table_writes.scatter_rows` (semantics there)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n_rows"])
def scatter_rows_kernel(buf_ptr, n_rows, BLOCK: tl.constexpr):
    """Program: one row. buf = [addresses (n_rows) | offsets (n_rows + 1) | values]; values[offsets[i]:offsets[i+1]]
    are stored at address i (int64 elements)."""
    i = tl.program_id(0)
    dst = tl.load(buf_ptr + i).to(tl.pointer_type(tl.int64))
    start = tl.load(buf_ptr + n_rows + i)
    n = tl.load(buf_ptr + n_rows + i + 1) - start
    cols = tl.arange(0, BLOCK)
    vals = tl.load(buf_ptr + 2 * n_rows + 1 + start + cols, mask=cols < n)
    tl.store(dst + cols, vals, mask=cols < n)


@triton.jit(do_not_specialize=["n_rows"])
def copy_rows_kernel(buf_ptr, n_rows, BLOCK: tl.constexpr):
    """Program: one row. buf = [destinations (n_rows) | sources (n_rows) | lengths (n_rows)]: lengths[i] float32
    elements are copied from source i to destination i, or ones stored where source i is 0."""
    i = tl.program_id(0)
    dst = tl.load(buf_ptr + i).to(tl.pointer_type(tl.float32))
    raw = tl.load(buf_ptr + n_rows + i)
    src = raw.to(tl.pointer_type(tl.float32))
    n = tl.load(buf_ptr + 2 * n_rows + i)
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n
        vals = tl.load(src + cols, mask=mask & (raw + 0 * cols != 0), other=1.0)
        tl.store(dst + cols, vals, mask=mask)
