"""Triton kernels of the low-rank delta d = B (m ⊙ h): one-token rows, multi-token tiles."""

from __future__ import annotations

import triton
import triton.language as tl

from scute.ops.kernels.common import (F_RANK, F_BHOFF, F_FLAGS, F_M, NF, HAS_M, _ptr, _has, _proj_of_program, _pick,
                                      _b_of_group)


@triton.jit
def _h_row(h_ptr, m, flags, i, r0, rank, hoff, num_tokens, h_width, SPLIT_K: tl.constexpr, BR: tl.constexpr,
           ONCE_ABOVE: tl.constexpr):
    """m ⊙ h of sorted row i for rank rows [r0, r0 + BR) (zero past the rank): the shrink's SPLIT_K partials in
    one 2-D load, summed (a group of rank > ONCE_ABOVE: split 0 alone, which the shrink summed them into)."""
    r = r0 + tl.arange(0, BR)
    s = tl.arange(0, SPLIT_K)
    rows = (s * num_tokens + i).to(tl.int64) * h_width + hoff
    mask = (s < tl.where(rank > ONCE_ABOVE, 1, SPLIT_K))[:, None] & (r < rank)[None, :]
    h = tl.sum(tl.load(h_ptr + rows[:, None] + r[None, :], mask=mask, other=0.0), axis=0)
    return h * tl.load(m + r, mask=(r < rank) & _has(flags, HAS_M, r), other=1.0)


@triton.jit
def _b_block(b_ptr, ldb, r0, n_out, cols, BR: tl.constexpr):
    """B[cols, r0 : r0 + BR] ([len(cols), BR] in B's dtype). B keeps PEFT's [out, r] layout with rows padded to
    `ldb` (a multiple of 8; zeros past the rank): the rank axis is contiguous, so each column's rank values are
    16-byte loads and the rank sum stays inside a thread (a pair of threads at most), whatever the warps."""
    r = r0 + tl.arange(0, BR)
    mask = (cols < n_out)[:, None] & (r < ldb)[None, :]
    return tl.load(b_ptr + cols[:, None] * ldb + r[None, :], mask=mask, other=0.0)


@triton.jit
def _row_delta(h, b_ptr, ldb, r0, n_out, cols, BR: tl.constexpr):
    """B[cols, r0 : r0 + BR] @ h ([BR] fp32): [len(cols)] fp32, exact fp32 products."""
    return tl.sum(_b_block(b_ptr, ldb, r0, n_out, cols, BR).to(tl.float32) * h[None, :], axis=1)


@triton.jit
def _h_tile(h_ptr, m, m_live, pos, row_ok, r0, rank, hoff, h_width, BR: tl.constexpr):
    """m ⊙ h of the tile's rows for rank rows [r0, r0 + BR) (zero past the rank), from split 0 (the shrink sums a
    multi-token tile's partials there)."""
    r = r0 + tl.arange(0, BR)
    mask = row_ok[:, None] & (r < rank)[None, :]
    h = tl.load(h_ptr + pos.to(tl.int64)[:, None] * h_width + hoff + r[None, :], mask=mask, other=0.0)
    return h * tl.load(m[:, None] + r[None, :], mask=mask & m_live[:, None], other=1.0)


@triton.jit
def _tile_delta(h, b_ptr, ldb, r0, n_out, cols, BR: tl.constexpr, PREC: tl.constexpr):
    """h [BM, BR] (fp32) @ B[cols, r0 : r0 + BR]ᵀ on tensor cores: [BM, len(cols)] fp32. 16-bit B multiplies h
    as two 16-bit parts (hi = h rounded, lo = h − hi: about 16 mantissa bits); fp32 in IEEE fp32 (no tf32)."""
    bt = tl.trans(_b_block(b_ptr, ldb, r0, n_out, cols, BR))
    if b_ptr.dtype.element_ty == tl.float32:
        return tl.dot(h, bt, input_precision=PREC)
    hi = h.to(b_ptr.dtype.element_ty)
    lo = (h - hi.to(tl.float32)).to(b_ptr.dtype.element_ty)
    return tl.dot(lo, bt, tl.dot(hi, bt))


@triton.jit
def _group_of_program(tab_ptr, tile_group_ptr, tile_start_ptr, tile_end_ptr, tile, p, num_slots, BM: tl.constexpr):
    """The tile's group, its rows [start, end) and the group's table row for projection p; g < 0 if there is
    nothing to do (an unused tile, or a group without a low-rank part in this projection)."""
    g = tl.load(tile_group_ptr + tile)  # −1: an unused tile (the grid is sized for the worst case, fixed for graphs)
    start = tl.load(tile_start_ptr + tile)
    end = tl.minimum(start + BM, tl.load(tile_end_ptr + tile))
    grow = (p * num_slots + tl.maximum(g, 0)) * NF
    if g >= 0:
        if tl.load(tab_ptr + grow + F_RANK) == 0:
            g = g * 0 - 1
    return g, start, end, grow


@triton.jit(do_not_specialize=["num_tokens", "chunks_per_prog"])
def delta_rows_kernel(d0_ptr, d1_ptr, d2_ptr, h_ptr, tab_ptr, sorted_slots_ptr, sorted_ptr, tile_group_ptr,
                      tile_start_ptr, tile_end_ptr, num_tokens, num_slots, h_width, out0, out1, out2,
                      chunks_per_prog, B_TY: tl.constexpr, P: tl.constexpr, SPLIT_K: tl.constexpr,
                      BM: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, ONCE_ABOVE: tl.constexpr):
    """Program (tile, n-range) of a one-token tile (most tiles at decode; `delta_tiles_kernel` takes the others):
    d[t, cols] = B (m ⊙ h) (float32) over `chunks_per_prog` chunks of BN columns of one projection. The token's h is a
    rank-length vector; its product with a block of B rows is a multiply-sum along each row's contiguous rank
    values in fp32, over rank steps of BR (16, or up to 64 in a pool of wide ranks), so a token walks only as
    many steps as its own rank needs."""
    tile, pid_n = tl.program_id(0), tl.program_id(1)
    p, prog, n_out = _proj_of_program(pid_n, out0, out1, out2, chunks_per_prog * BN, P)
    g, start, end, grow = _group_of_program(tab_ptr, tile_group_ptr, tile_start_ptr, tile_end_ptr, tile, p,
                                            num_slots, BM)
    if g < 0 or end - start != 1:
        return
    d_ptr = _pick(p, d0_ptr, d1_ptr, d2_ptr, P)
    rank = tl.load(tab_ptr + grow + F_RANK).to(tl.int32)
    hoff = tl.load(tab_ptr + grow + F_BHOFF).to(tl.int32)
    b_ptr, ldb = _b_of_group(tab_ptr, grow, B_TY)
    d_row = d_ptr + tl.load(sorted_ptr + start).to(tl.int64) * n_out
    srow = (p * num_slots + tl.load(sorted_slots_ptr + start)) * NF
    flags = tl.load(tab_ptr + srow + F_FLAGS)
    m = _ptr(tab_ptr, srow + F_M, tl.float32)
    # The first rank step's h is loaded once (ranks <= BR need no other); larger ranks reload theirs per chunk.
    h0 = _h_row(h_ptr, m, flags, start, 0, rank, hoff, num_tokens, h_width, SPLIT_K, BR, ONCE_ABOVE)
    c_lo = prog * chunks_per_prog
    for chunk in range(c_lo, tl.minimum(c_lo + chunks_per_prog, tl.cdiv(n_out, BN))):
        cols = chunk * BN + tl.arange(0, BN)
        d = _row_delta(h0, b_ptr, ldb, 0, n_out, cols, BR)
        for r0 in range(BR, rank, BR):
            h = _h_row(h_ptr, m, flags, start, r0, rank, hoff, num_tokens, h_width, SPLIT_K, BR, ONCE_ABOVE)
            d += _row_delta(h, b_ptr, ldb, r0, n_out, cols, BR)
        tl.store(d_row + cols, d.to(d_row.dtype.element_ty), mask=cols < n_out)


@triton.jit(do_not_specialize=["num_tokens"])
def delta_tiles_kernel(d0_ptr, d1_ptr, d2_ptr, h_ptr, tab_ptr, sorted_slots_ptr, sorted_ptr, tile_group_ptr,
                       tile_start_ptr, tile_end_ptr, num_tokens, num_slots, h_width, out0, out1, out2,
                       multi_tiles_ptr, num_multi_ptr, target_items, B_TY: tl.constexpr, P: tl.constexpr,
                       BM: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
    """The tiles of several tokens (prefill, a popular adapter, a shared VeRA group): the semantics of
    `delta_rows_kernel` for all of a tile's rows at once, on tensor cores, reading each B block once for all of
    them, over rank steps of BR. Persistent: a fixed number of programs walks the items (multi-token tile, a run
    of chunks of BN columns of one projection) of this step (`LoraMeta.multi_tiles`), so a step without any
    (most decode steps) costs one short launch, not a grid of programs that all return. An item's setup (its rows,
    slots, m, first h) is paid once for its chunks; the run length is set here, from this step's number of
    multi-token tiles, to give about `target_items` items (a few per program)."""
    num_multi = tl.load(num_multi_ptr)
    chunks = tl.cdiv(out0, BN)
    if P > 1:
        chunks += tl.cdiv(out1, BN)
    if P > 2:
        chunks += tl.cdiv(out2, BN)
    chunks_per_item = tl.maximum(tl.cdiv(num_multi * chunks, target_items), 1)
    cols_per_item = chunks_per_item * BN
    items = tl.cdiv(out0, cols_per_item)
    if P > 1:
        items += tl.cdiv(out1, cols_per_item)
    if P > 2:
        items += tl.cdiv(out2, cols_per_item)
    for item in range(tl.program_id(0), num_multi * items, tl.num_programs(0)):
        tile = tl.load(multi_tiles_ptr + item // items)
        p, prog, n_out = _proj_of_program(item % items, out0, out1, out2, cols_per_item, P)
        g, start, end, grow = _group_of_program(tab_ptr, tile_group_ptr, tile_start_ptr, tile_end_ptr, tile, p,
                                                num_slots, BM)
        if g >= 0:
            c_lo = prog * chunks_per_item
            _delta_tile(_pick(p, d0_ptr, d1_ptr, d2_ptr, P), n_out, h_ptr, tab_ptr, sorted_slots_ptr, sorted_ptr, p,
                        num_slots, start, end, c_lo, tl.minimum(c_lo + chunks_per_item, tl.cdiv(n_out, BN)), grow,
                        h_width, B_TY, BM, BR, BN, PREC)


@triton.jit
def _delta_tile(d_ptr, n_out, h_ptr, tab_ptr, sorted_slots_ptr, sorted_ptr, p, num_slots, start, end, c_lo, c_hi,
                grow, h_width, B_TY: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
                PREC: tl.constexpr):
    """One item of `delta_tiles_kernel`: chunks [c_lo, c_hi) of a multi-token tile."""
    rank = tl.load(tab_ptr + grow + F_RANK).to(tl.int32)
    hoff = tl.load(tab_ptr + grow + F_BHOFF).to(tl.int32)
    b_ptr, ldb = _b_of_group(tab_ptr, grow, B_TY)
    pos = start + tl.arange(0, BM)
    row_ok = pos < end
    tok = tl.load(sorted_ptr + pos, mask=row_ok, other=0)
    srow = (p * num_slots + tl.load(sorted_slots_ptr + pos, mask=row_ok, other=0)) * NF
    m = _ptr(tab_ptr, srow + F_M, tl.float32)
    m_live = (tl.load(tab_ptr + srow + F_FLAGS, mask=row_ok, other=0) & HAS_M) != 0
    h0 = _h_tile(h_ptr, m, m_live, pos, row_ok, 0, rank, hoff, h_width, BR)
    d_rows = d_ptr + tok.to(tl.int64) * n_out
    for chunk in range(c_lo, c_hi):
        cols = chunk * BN + tl.arange(0, BN)
        d = _tile_delta(h0, b_ptr, ldb, 0, n_out, cols, BR, PREC)
        for r0 in range(BR, rank, BR):
            h = _h_tile(h_ptr, m, m_live, pos, row_ok, r0, rank, hoff, h_width, BR)
            d += _tile_delta(h, b_ptr, ldb, r0, n_out, cols, BR, PREC)
        tl.store(d_rows[:, None] + cols[None, :], d.to(d_rows.dtype.element_ty),
                 mask=row_ok[:, None] & (cols < n_out)[None, :])
