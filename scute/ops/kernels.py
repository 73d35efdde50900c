"""Triton kernels of the six-slot op: input-transform pre-pass, shrink, expand with epilogue.

Imported lazily (by `scute.ops.triton_ops` on first use) because `triton.jit` decides at decoration time whether
to run compiled or in the interpreter (``TRITON_INTERPRET=1``). Every value loaded is cast to float32 right after
`tl.load`: the interpreter computes bf16 arithmetic on bit patterns, and the adapter path accumulates in fp32
anyway. Table layout and flags: `scute.ops.pool`.

Why no `tl.dot`: at decode a tile holds about one token per adapter, and a tensor-core dot needs 16 rows; the
first versions padded to 16 and held [16, 64] pointer and value tiles: ~200-250 registers per thread, two CTAs
per SM, adapter weights streamed at 0.3-0.45 TB/s (H200, measured). Tiles of BLOCK_M = 4 tokens with
broadcast-multiply-sum products in fp32 (exact products, fp32 sums) keep registers low and many programs in
flight; the products are tiny next to the bytes at the ranks adapters have.
"""

from __future__ import annotations

import triton
import triton.language as tl

from scute.ops import pool as _pool

F_A = tl.constexpr(_pool.F_A)
F_ARANK = tl.constexpr(_pool.F_ARANK)
F_AHOFF = tl.constexpr(_pool.F_AHOFF)
F_BT = tl.constexpr(_pool.F_BT)
F_RANK = tl.constexpr(_pool.F_RANK)
F_BHOFF = tl.constexpr(_pool.F_BHOFF)
F_ROT = tl.constexpr(_pool.F_ROT)
F_ACTIVE = tl.constexpr(_pool.F_ACTIVE)
F_FLAGS = tl.constexpr(_pool.F_FLAGS)
F_O = tl.constexpr(_pool.F_O)
F_O2 = tl.constexpr(_pool.F_O2)
F_C = tl.constexpr(_pool.F_C)
F_V = tl.constexpr(_pool.F_V)
F_M = tl.constexpr(_pool.F_M)
F_T = tl.constexpr(_pool.F_T)
F_TB = tl.constexpr(_pool.F_TB)
F_TBN = tl.constexpr(_pool.F_TBN)
F_TBB = tl.constexpr(_pool.F_TBB)
NF = tl.constexpr(_pool.NUM_FIELDS)
HAS_O = tl.constexpr(_pool.HAS_O)
HAS_O2 = tl.constexpr(_pool.HAS_O2)
HAS_C = tl.constexpr(_pool.HAS_C)
HAS_V = tl.constexpr(_pool.HAS_V)
HAS_M = tl.constexpr(_pool.HAS_M)
HAS_T = tl.constexpr(_pool.HAS_T)
HAS_TB = tl.constexpr(_pool.HAS_TB)


# ---------------------------------------------------------------------------------------------- input transform
@triton.jit
def input_transform_kernel(x_ptr, xt_ptr, tab_ptr, slots_ptr, num_tokens, in_features, num_slots,
                           BC: tl.constexpr, BB: tl.constexpr, NBP: tl.constexpr):
    """Program (token t, chunk c, projection p): x'[p, t] = T_{p,slot}(x[t]) on its chunk; a copy if no T."""
    t, c, p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slots_ptr + t)
    row = (p * num_slots + tl.maximum(slot, 0)) * NF
    flags = tl.where(slot >= 0, tl.load(tab_ptr + row + F_FLAGS), 0)
    x_row = x_ptr + t.to(tl.int64) * in_features
    out_row = xt_ptr + (p * num_tokens + t).to(tl.int64) * in_features
    t_vec = tl.load(tab_ptr + row + F_T).to(tl.pointer_type(tl.float32))
    if (flags & HAS_TB) != 0:
        # Block-diagonal T: NBP blocks of size b per program, x'_k = T_k (t ⊙ x)_k as a broadcast-multiply-sum
        # (blocks are 4..64 wide: too small and too many for tensor cores to pay).
        b = tl.load(tab_ptr + row + F_TBB).to(tl.int32)
        shared_block = tl.load(tab_ptr + row + F_TBN) == 1
        tb = tl.load(tab_ptr + row + F_TB).to(tl.pointer_type(x_ptr.dtype.element_ty))
        k = c * NBP + tl.arange(0, NBP)
        i = tl.arange(0, BB)
        kmask = k < in_features // b
        xmask = kmask[:, None] & (i < b)[None, :]
        cols = k[:, None] * b + i[None, :]
        xk = tl.load(x_row + cols, mask=xmask, other=0.0).to(tl.float32)
        if (flags & HAS_T) != 0:
            xk = xk * tl.load(t_vec + cols, mask=xmask, other=0.0)
        kb = tl.where(shared_block, 0, k)
        blk = tb + kb[:, None, None] * b * b + i[None, :, None] * b + i[None, None, :]
        tmask = xmask[:, :, None] & (i < b)[None, None, :]
        tk = tl.load(blk, mask=tmask, other=0.0).to(tl.float32)
        y = tl.sum(tk * xk[:, None, :], axis=2)
        tl.store(out_row + cols, y.to(xt_ptr.dtype.element_ty), mask=xmask)
    else:  # names differ from the other branch's: a runtime `if` merges same-named variables, shapes must agree
        ccols = c * BC + tl.arange(0, BC)
        cmask = ccols < in_features
        xv = tl.load(x_row + ccols, mask=cmask, other=0.0)
        if (flags & HAS_T) != 0:
            xv = (xv.to(tl.float32) * tl.load(t_vec + ccols, mask=cmask, other=0.0)).to(x_ptr.dtype.element_ty)
        tl.store(out_row + ccols, xv, mask=cmask)


# ---------------------------------------------------------------------------------------------- shrink
@triton.jit
def shrink_kernel(x_ptr, h_ptr, tab_ptr, sorted_ptr, tile_group_ptr, tile_start_ptr, tile_end_ptr,
                  num_tokens, in_features, num_slots, h_width, k_per_split,
                  P: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    """Program (tile, split): h_part[split, rows, hoff:hoff+r] = x[rows, K_split] @ A_p[:, K_split]ᵀ for each
    projection p of the tile's group (split-K: enough programs to keep the memory system busy at decode)."""
    tile, split = tl.program_id(0), tl.program_id(1)
    g = tl.load(tile_group_ptr + tile)
    if g < 0:  # an unused tile: the grid is sized for the worst case, fixed for CUDA-graph capture
        return
    pos = tl.load(tile_start_ptr + tile) + tl.arange(0, BM)
    row_ok = pos < tl.load(tile_end_ptr + tile)
    x_rows = x_ptr + tl.load(sorted_ptr + pos, mask=row_ok, other=0).to(tl.int64) * in_features
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, in_features)
    offs_r, offs_k = tl.arange(0, BR), tl.arange(0, BK)
    h_rows = h_ptr + (split * num_tokens + pos).to(tl.int64) * h_width
    for p in tl.static_range(P):
        row = (p * num_slots + g) * NF
        rank = tl.load(tab_ptr + row + F_ARANK).to(tl.int32)
        a_ptr = tl.load(tab_ptr + row + F_A).to(tl.pointer_type(x_ptr.dtype.element_ty))
        hoff = tl.load(tab_ptr + row + F_AHOFF).to(tl.int32)
        # Loop to this group's own rank: an r=16 adapter pays one rank tile next to an r=256 one.
        for r0 in range(0, rank, BR):
            r = r0 + offs_r
            acc = tl.zeros((BM, BR), dtype=tl.float32)
            for k0 in range(k_lo, k_hi, BK):
                k = k0 + offs_k
                kmask = k < k_hi
                xk = tl.load(x_rows[:, None] + k[None, :], mask=row_ok[:, None] & kmask[None, :],
                             other=0.0).to(tl.float32)
                ak = tl.load(a_ptr + r[:, None] * in_features + k[None, :],
                             mask=(r < rank)[:, None] & kmask[None, :], other=0.0).to(tl.float32)
                acc += tl.sum(xk[:, None, :] * ak[None, :, :], axis=2)
            tl.store(h_rows[:, None] + hoff + r[None, :], acc, mask=row_ok[:, None] & (r < rank)[None, :])


# ---------------------------------------------------------------------------------------------- expand
@triton.jit
def _vec(base, live, cols, mask, other):
    """Per-token gather of a slot vector at `cols` ([BM, N]); `other` where the token's slot lacks it."""
    return tl.load(base[:, None] + cols[None, :], mask=mask & live[:, None], other=other)


@triton.jit
def _row_vector(tab_ptr, srow, flags, bit, field):
    """Each row's base pointer of a slot vector and whether its slot has it (loaded once per program)."""
    return tl.load(tab_ptr + srow + field).to(tl.pointer_type(tl.float32)), (flags & bit) != 0


@triton.jit
def _h_tile(h_ptr, m_base, m_live, pos, row_ok, r0, rank, hoff, num_tokens, h_width,
            SPLIT_K: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr):
    """m ⊙ h for rank rows [r0, r0 + BR): the shrink's SPLIT_K partials in ONE 3-D load, then summed (a loop of
    loads would be a chain of dependent L2 round trips: it made the first version 5x slower at decode)."""
    r = r0 + tl.arange(0, BR)
    s = tl.arange(0, SPLIT_K)
    rows = (s[:, None] * num_tokens + pos[None, :]).to(tl.int64) * h_width + hoff
    mask = row_ok[:, None] & (r < rank)[None, :]
    h = tl.sum(tl.load(h_ptr + rows[:, :, None] + r[None, None, :], mask=mask[None, :, :], other=0.0), axis=0)
    return h * _vec(m_base, m_live, r, mask, 1.0)


@triton.jit
def _delta(h, bt_ptr, r0, rank, n_out, cols, BR: tl.constexpr):
    """h [BM, BR] @ Bᵀ[r0:r0+BR, cols] as a broadcast-multiply-sum: [BM, HB] fp32."""
    r = r0 + tl.arange(0, BR)
    mask = (r < rank)[:, None] & (cols < n_out)[None, :]
    bt = tl.load(bt_ptr + r[:, None] * n_out + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return tl.sum(h[:, :, None] * bt[None, :, :], axis=1)


@triton.jit
def _epilogue(z, cols, partner, sign, delta, mask, o, o_live, o2, o2_live, c, c_live, v, v_live):
    """o ⊙ z + o2 ⊙ rot(z) + c + v ⊙ delta, in the reference's order (rot(z) = sign · partner); each vector given
    by its rows' base pointers and liveness. o2's term is a where, not a multiply by 0: an inf in the partner
    column must not turn a plain token's output into NaN."""
    y = _vec(o, o_live, cols, mask, 1.0) * z
    y += tl.where(o2_live[:, None], _vec(o2, o2_live, cols, mask, 0.0) * (sign * partner), 0.0)
    y += _vec(c, c_live, cols, mask, 0.0)
    return y + _vec(v, v_live, cols, mask, 1.0) * delta


@triton.jit
def expand_kernel(z0_ptr, z1_ptr, z2_ptr, h_ptr, tab_ptr, sorted_slots_ptr, sorted_ptr, tile_group_ptr, tile_start_ptr,
                  tile_end_ptr, num_tokens, num_slots, h_width, out0, out1, out2, chunks_per_prog,
                  P: tl.constexpr, SPLIT_K: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr, HB: tl.constexpr):
    """Program (tile, n-range): z[rows, cols] ← epilogue(z) + v ⊙ (B (m ⊙ h)) in place for `chunks_per_prog`
    chunks of 2·HB columns of one projection: the setup (table, rows, h) is paid once per program and the Bᵀ
    tiles stream. A chunk's columns are HB pairs (j, j + g/2) of RoAd groups of g (g = 2·HB without rotation:
    plain contiguous tiles), so rot_g(z) only reads columns the program owns: in place is safe."""
    tile, pid_n = tl.program_id(0), tl.program_id(1)
    g = tl.load(tile_group_ptr + tile)
    if g < 0:  # an unused tile: the grid is sized for the worst case, fixed for CUDA-graph capture
        return
    # One launch serves P projections: programs of projection 0, then 1, then 2. Runtime values in every branch
    # (pid_n * 0, not 0): both sides of a runtime `if` must have one type.
    z_ptr, n_out, prog, p = z0_ptr, out0 + pid_n * 0, pid_n, pid_n * 0
    progs0 = tl.cdiv(tl.cdiv(out0, 2 * HB), chunks_per_prog)
    progs1 = tl.cdiv(tl.cdiv(out1, 2 * HB), chunks_per_prog)
    if P > 1:
        if pid_n >= progs0:
            z_ptr, n_out, prog, p = z1_ptr, out1 + pid_n * 0, pid_n - progs0, pid_n * 0 + 1
    if P > 2:
        if pid_n >= progs0 + progs1:
            z_ptr, n_out, prog, p = z2_ptr, out2 + pid_n * 0, pid_n - progs0 - progs1, pid_n * 0 + 2
    grow = (p * num_slots + g) * NF
    if tl.load(tab_ptr + grow + F_ACTIVE) == 0:  # no member of the group touches this projection's output
        return
    pos = tl.load(tile_start_ptr + tile) + tl.arange(0, BM)
    row_ok = pos < tl.load(tile_end_ptr + tile)
    tok = tl.load(sorted_ptr + pos, mask=row_ok, other=0)
    srow = (p * num_slots + tl.load(sorted_slots_ptr + pos, mask=row_ok, other=0)) * NF
    flags = tl.load(tab_ptr + srow + F_FLAGS, mask=row_ok, other=0)
    rank = tl.load(tab_ptr + grow + F_RANK).to(tl.int32)
    hoff = tl.load(tab_ptr + grow + F_BHOFF).to(tl.int32)
    rot = tl.load(tab_ptr + grow + F_ROT).to(tl.int32)
    bt_ptr = tl.load(tab_ptr + grow + F_BT).to(tl.pointer_type(z0_ptr.dtype.element_ty))
    m, m_live = _row_vector(tab_ptr, srow, flags, HAS_M, F_M)
    o, o_live = _row_vector(tab_ptr, srow, flags, HAS_O, F_O)
    o2, o2_live = _row_vector(tab_ptr, srow, flags, HAS_O2, F_O2)
    c, c_live = _row_vector(tab_ptr, srow, flags, HAS_C, F_C)
    v, v_live = _row_vector(tab_ptr, srow, flags, HAS_V, F_V)
    # The first rank tile's h is loaded once (ranks <= 16 need no other); larger ranks reload theirs per chunk.
    h0 = _h_tile(h_ptr, m, m_live, pos, row_ok, 0, rank, hoff, num_tokens, h_width, SPLIT_K, BM, BR)
    half = tl.where(rot > 0, rot // 2, HB)
    z_rows = z_ptr + tok.to(tl.int64) * n_out
    c_lo = prog * chunks_per_prog
    for chunk in range(c_lo, tl.minimum(c_lo + chunks_per_prog, tl.cdiv(n_out, 2 * HB))):
        q = chunk * HB + tl.arange(0, HB)
        col_a = (q // half) * (2 * half) + q % half
        col_b = col_a + half
        d_a = _delta(h0, bt_ptr, 0, rank, n_out, col_a, BR)
        d_b = _delta(h0, bt_ptr, 0, rank, n_out, col_b, BR)
        for r0 in range(BR, rank, BR):
            h = _h_tile(h_ptr, m, m_live, pos, row_ok, r0, rank, hoff, num_tokens, h_width, SPLIT_K, BM, BR)
            d_a += _delta(h, bt_ptr, r0, rank, n_out, col_a, BR)
            d_b += _delta(h, bt_ptr, r0, rank, n_out, col_b, BR)
        mask_a = row_ok[:, None] & (col_a < n_out)[None, :]
        mask_b = row_ok[:, None] & (col_b < n_out)[None, :]
        z_a = tl.load(z_rows[:, None] + col_a[None, :], mask=mask_a, other=0.0).to(tl.float32)
        z_b = tl.load(z_rows[:, None] + col_b[None, :], mask=mask_b, other=0.0).to(tl.float32)
        y_a = _epilogue(z_a, col_a, z_b, -1.0, d_a, mask_a, o, o_live, o2, o2_live, c, c_live, v, v_live)
        y_b = _epilogue(z_b, col_b, z_a, 1.0, d_b, mask_b, o, o_live, o2, o2_live, c, c_live, v, v_live)
        tl.store(z_rows[:, None] + col_a[None, :], y_a.to(z0_ptr.dtype.element_ty), mask=mask_a)
        tl.store(z_rows[:, None] + col_b[None, :], y_b.to(z0_ptr.dtype.element_ty), mask=mask_b)
