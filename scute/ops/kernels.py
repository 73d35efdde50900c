"""Triton kernels of the six-slot op: input-transform pre-pass, shrink, expand with epilogue.

Imported lazily (`scute.ops.launch.kernels`, on first use) because `triton.jit` decides at decoration time whether
to run compiled or in the interpreter (``TRITON_INTERPRET=1``). Table layout and flags: `scute.ops.pool`.

A tile is up to BLOCK_M = 16 tokens of one adapter group (at decode: one token). The shrink is a tile GEMM on
tensor cores (`tl.dot` of x and A in their own dtype: exact products, fp32 sums; fp32 inputs in IEEE fp32, no
tf32) over the grid (tile, K split x rank tile, projection); masked rows move no bytes. The delta d = B (m ⊙ h)
(float32 sums, stored in `SlotPool.delta_dtype`) is two launches, each compiled to its own register count (at
decode, the programs an SM holds are what hides their load latency): `delta_rows_kernel` runs a one-token tile
(most tiles at decode) as a row, whose h is a rank-length vector (its product with a block of B rows is a
multiply-sum along each row's contiguous rank values, in fp32, over rank steps of 16, or up to 64 in a pool of
wide ranks: `launch.row_block_r`); `delta_tiles_kernel` runs a tile of several tokens as a tensor-core
product (h split in two 16-bit parts: about 16 mantissa bits), reading each B block once for all of them. The shrink's
K-split partials of h are summed by the row kernel as it reads them, or once by the shrink for multi-token tiles
and groups wider than one rank step (see `shrink_kernel`). None of these reads the base output, so they run
beside the base GEMM; `epilogue_kernel` then applies o ⊙ z + o2 ⊙ rot(z) + c + v ⊙ d to each adapter token.
"""

from __future__ import annotations

import triton
import triton.language as tl

from scute.ops import pool as _pool

F_A = tl.constexpr(_pool.F_A)
F_ARANK = tl.constexpr(_pool.F_ARANK)
F_AHOFF = tl.constexpr(_pool.F_AHOFF)
F_B = tl.constexpr(_pool.F_B)
F_BLD = tl.constexpr(_pool.F_BLD)
F_RANK = tl.constexpr(_pool.F_RANK)
F_BHOFF = tl.constexpr(_pool.F_BHOFF)
F_ROT = tl.constexpr(_pool.F_ROT)
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
HAS_LR = tl.constexpr(_pool.HAS_LR)


@triton.jit
def _ptr(tab_ptr, at, ty: tl.constexpr):
    """The pointer stored in the table at `at` (scalar or tensor of offsets), typed `ty`, with the pool's alignment
    promise (every tensor it points to starts 16-byte aligned: `SlotPool` checks): without the hint Triton cannot
    vectorise loads through a pointer it read from memory and moves 2 bytes per instruction."""
    return tl.multiple_of(tl.load(tab_ptr + at).to(tl.pointer_type(ty)), 16)


# ---------------------------------------------------------------------------------------------- input transform
@triton.jit
def input_transform_kernel(x_ptr, xt_ptr, tab_ptr, slots_ptr, count_ptr, num_tokens, in_features, num_slots,
                           tile_min, BC: tl.constexpr, BB: tl.constexpr, NBP: tl.constexpr, B_EXACT: tl.constexpr,
                           ITERS: tl.constexpr, SKIP_TILED: tl.constexpr):
    """Program (token t, chunks [c·ITERS, (c + 1)·ITERS), projection p): x'[p, t] = T_{p,slot}(x[t]) on its
    chunks; a copy if no T. B_EXACT: every block of the pool is BB wide (the usual case), so block strides are
    constants and x and T are read in 16-byte vectors (with a runtime block size Triton reads them one element at
    a time). ITERS > 1 in large steps: fewer, longer programs, each paying its setup (its slot's table row, then
    T's pointer: dependent loads) once. On the H200 that saved 3-12 µs per layer at 256 tokens, far less than
    predicted: the pre-pass there is bound by its arithmetic (docs/performance.md, "What is open").
    SKIP_TILED: tokens of a block-diagonal T whose slot has `tile_min` tokens or more (count_ptr: tokens per
    slot) are left to `input_tiles_kernel`."""
    t, c, p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slots_ptr + t)
    row = (p * num_slots + tl.maximum(slot, 0)) * NF
    flags = tl.where(slot >= 0, tl.load(tab_ptr + row + F_FLAGS), 0)
    if SKIP_TILED:
        if (flags & HAS_TB) != 0:
            if tl.load(count_ptr + slot) >= tile_min:
                return
    x_row = x_ptr + t.to(tl.int64) * in_features
    out_row = xt_ptr + (p * num_tokens + t).to(tl.int64) * in_features
    t_vec = _ptr(tab_ptr, row + F_T, tl.float32)
    if (flags & HAS_TB) != 0:
        # Block-diagonal T: NBP blocks of size b per program, x'_k = T_k (t ⊙ x)_k as a broadcast-multiply-sum
        # (blocks are 4..64 wide: too small and too many for tensor cores to pay).
        b = tl.load(tab_ptr + row + F_TBB).to(tl.int32)
        if B_EXACT:
            b = BB
        shared_block = tl.load(tab_ptr + row + F_TBN) == 1
        tb = _ptr(tab_ptr, row + F_TB, x_ptr.dtype.element_ty)
        i = tl.arange(0, BB)
        for j in tl.static_range(ITERS):
            k = (c * ITERS + j) * NBP + tl.arange(0, NBP)
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
        for j in tl.static_range(ITERS):
            ccols = (c * ITERS + j) * BC + tl.arange(0, BC)
            cmask = ccols < in_features
            xv = tl.load(x_row + ccols, mask=cmask, other=0.0)
            if (flags & HAS_T) != 0:
                xv = (xv.to(tl.float32) * tl.load(t_vec + ccols, mask=cmask, other=0.0)).to(x_ptr.dtype.element_ty)
            tl.store(out_row + ccols, xv, mask=cmask)


@triton.jit
def input_tiles_kernel(x_ptr, xt_ptr, tab_ptr, sorted_ptr, sorted_slots_ptr, count_ptr, start_ptr, num_tokens,
                       in_features, num_slots, tile_min, BM: tl.constexpr, BB: tl.constexpr, NBP: tl.constexpr,
                       B_EXACT: tl.constexpr, PREC: tl.constexpr):
    """Program (window w of BM sorted positions, NBP blocks from c·NBP, projection p): the window's tokens of a
    slot with a block-diagonal T and `tile_min` tokens or more (`input_transform_kernel` with SKIP_TILED takes
    every other token): x'[p, rows, block k] = T_k (t ⊙ x)[rows, block k], the NBP blocks one batched
    tensor-core product [NBP, BM, BB] @ [NBP, BB, BB] (blocks of b < BB columns padded with zeros; BB ≥ 16).
    Tokens are sorted by group, and a slot with a block transform is its own group (`SlotPool`), so a window
    holds the tokens of at most two such slots of `tile_min` ≥ BM tokens: the slot of its first position and that
    of its last (a grid over windows, fixed by the number of tokens alone). 16-bit x and T: exact products, fp32
    sums; with a diagonal t as well, t ⊙ x and T in fp32 (IEEE). A program's work is short and its setup a chain
    of dependent loads, so the chain is kept to three links: the window's tokens and slots, their table rows,
    then x and T."""
    w, c, p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pos = w * BM + tl.arange(0, BM)
    tok = tl.load(sorted_ptr + tl.minimum(pos, num_tokens - 1)).to(tl.int64)
    first = tl.load(sorted_slots_ptr + w * BM)
    last = tl.load(sorted_slots_ptr + tl.minimum(w * BM + BM, num_tokens) - 1)
    for side in tl.static_range(2):
        slot = first
        if side == 1:
            slot = last
        known = tl.maximum(slot, 0)
        row = (p * num_slots + known) * NF
        flags = tl.where(slot >= 0, tl.load(tab_ptr + row + F_FLAGS), 0)
        count = tl.load(count_ptr + known)
        lo = tl.load(start_ptr + known)
        b = tl.load(tab_ptr + row + F_TBB).to(tl.int32)
        if B_EXACT:
            b = BB
        num_blocks = tl.load(tab_ptr + row + F_TBN)
        tb_raw = tl.load(tab_ptr + row + F_TB)
        t_vec = _ptr(tab_ptr, row + F_T, tl.float32)
        # T's pointer and block count in the condition (true whenever HAS_TB is): the compiler would otherwise
        # sink their loads into the branch, one more dependent load before T's
        if ((flags & HAS_TB) != 0) & (count >= tile_min) & ((side == 0) | (slot != first)) & (tb_raw != 0) \
                & (num_blocks > 0):
            tb = tl.multiple_of(tb_raw.to(tl.pointer_type(x_ptr.dtype.element_ty)), 16)  # as `_ptr` does
            _input_tile(x_ptr + tok * in_features, xt_ptr + (p * num_tokens + tok) * in_features, tb, t_vec, b,
                        num_blocks == 1, flags, (pos >= lo) & (pos < lo + count), c, in_features, BB, NBP, PREC)


@triton.jit
def _input_tile(x_rows, out_rows, tb, t_vec, b, shared_block, flags, row_ok, c, in_features, BB: tl.constexpr,
                NBP: tl.constexpr, PREC: tl.constexpr):
    """`input_tiles_kernel`'s blocks [c·NBP, (c + 1)·NBP) for the rows `row_ok` of one slot (its T blocks at `tb`,
    b wide; t_vec its diagonal): every block's x and T are loaded at once (a loop of NBP products waited for each
    block's loads in turn)."""
    i = tl.arange(0, BB)
    k = c * NBP + tl.arange(0, NBP)
    col_ok = (i < b)[None, :] & (k < in_features // b)[:, None]  # [NBP, BB]
    cols = k[:, None] * b + i[None, :]
    mask = col_ok[:, None, :] & row_ok[None, :, None]  # [NBP, BM, BB]
    xk = tl.load(x_rows[None, :, None] + cols[:, None, :], mask=mask, other=0.0)
    blk = tb + tl.where(shared_block, 0, k).to(tl.int64)[:, None, None] * b * b
    # tk[n, i, j] = T_n[j, i]: the blocks transposed, so that y[n] = x[n] @ tk[n] = (T_n x[n]ᵀ)ᵀ
    tk = tl.load(blk + i[None, None, :] * b + i[None, :, None], mask=col_ok[:, :, None] & (i < b)[None, None, :],
                 other=0.0)
    if (flags & HAS_T) != 0:
        xf = xk.to(tl.float32) * tl.load(t_vec + cols, mask=col_ok, other=0.0)[:, None, :]
        y = tl.dot(xf, tk.to(tl.float32), input_precision="ieee")
    else:
        y = tl.dot(xk, tk, input_precision=PREC)
    tl.store(out_rows[None, :, None] + cols[:, None, :], y.to(out_rows.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------- shrink
@triton.jit
def shrink_kernel(x_ptr, h_ptr, count_ptr, tab_ptr, sorted_ptr, tile_group_ptr, tile_start_ptr, tile_end_ptr,
                  num_tokens, in_features, num_slots, h_width, k_per_split, SPLIT_K: tl.constexpr,
                  RT: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                  ONCE_ABOVE: tl.constexpr):
    """Program (tile, split x rank tile, projection p): h[split, rows, hoff + r] = x[rows, K_split] @
    A_p[r, K_split]ᵀ for the BR rank rows r of its rank tile (programs past the group's rank return at once).

    A tile of several tokens, or of a group of rank > ONCE_ABOVE (several rank steps, each re-reading h for every
    chunk of columns), has its partials summed once, in split order, into split 0 by the last of its SPLIT_K
    programs to arrive (an arrival counter per (tile, rank tile, projection), reset by that program). Other
    tiles (one token, one rank step: most tiles at decode) leave them to the one-token expand, which sums them as
    it reads h. Measured on the H200: summing every tile once cost LoRA r=16 at B=64/64 23 µs per layer (each
    split's tail waits on an atomic); summing none doubled VeRA r=256 at B=64 (the multi-token expand re-read the
    partials per chunk and spilled registers for them)."""
    tile, pid, p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    split, r0 = pid // RT, (pid % RT) * BR
    g = tl.load(tile_group_ptr + tile)
    if g < 0:  # an unused tile: the grid is sized for the worst case, fixed for CUDA-graph capture
        return
    row = (p * num_slots + g) * NF
    rank = tl.load(tab_ptr + row + F_ARANK).to(tl.int32)
    if r0 >= rank:  # this group's rank needs fewer rank tiles (or projection p has no A of its own)
        return
    a_ptr = _ptr(tab_ptr, row + F_A, x_ptr.dtype.element_ty)
    hoff = tl.load(tab_ptr + row + F_AHOFF).to(tl.int32)
    pos0 = tl.load(tile_start_ptr + tile)
    pos = pos0 + tl.arange(0, BM)
    row_ok = pos < tl.load(tile_end_ptr + tile)
    x_rows = x_ptr + tl.load(sorted_ptr + pos, mask=row_ok, other=0).to(tl.int64) * in_features
    r = r0 + tl.arange(0, BR)
    r_ok = r < rank
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, in_features)
    acc = tl.zeros((BM, BR), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < k_hi
        xk = tl.load(x_rows[:, None] + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_ptr + r[None, :] * in_features + k[:, None], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        acc = tl.dot(xk, at, acc, input_precision=PREC)
    mask = row_ok[:, None] & r_ok[None, :]
    h_rows = h_ptr + (split * num_tokens + pos).to(tl.int64) * h_width + hoff
    tl.store(h_rows[:, None] + r[None, :], acc, mask=mask)
    if SPLIT_K > 1:
        if (rank > ONCE_ABOVE) | (tl.load(tile_end_ptr + tile) - pos0 > 1):
            tl.debug_barrier()  # every thread's partial is written before the arrival is counted (release below)
            counter = count_ptr + (tile * RT + pid % RT) * tl.num_programs(2) + p
            if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1:  # the last split to arrive sums
                # one [BM, BR] partial at a time, in split order (a single [SPLIT_K, BM, BR] load held ~170
                # registers for wide ranks)
                h0_rows = h_ptr + pos.to(tl.int64) * h_width + hoff
                total = tl.load(h0_rows[:, None] + r[None, :], mask=mask, other=0.0)
                for s in range(1, SPLIT_K):
                    rows = (s * num_tokens + pos).to(tl.int64) * h_width + hoff
                    total += tl.load(h_ptr + rows[:, None] + r[None, :], mask=mask, other=0.0)
                tl.store(h0_rows[:, None] + r[None, :], total, mask=mask)
                tl.atomic_xchg(counter, 0)  # ready for the next call


# ---------------------------------------------------------------------------------------------- delta
@triton.jit
def _has(flags, bit: tl.constexpr, like):
    """(flags & bit) != 0 as a mask shaped like `like` (Triton's interpreter rejects a scalar bool in a mask)."""
    return ((flags & bit) + like * 0) != 0


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
def _proj_of_program(pid_n, out0, out1, out2, cols_per_prog, P: tl.constexpr):
    """Which projection a column program serves, and its index there: (p, prog, n_out). One launch serves P
    projections: programs of projection 0, then 1, then 2 (runtime values in every branch: pid_n * 0, not 0,
    since both sides of a runtime `if` must have one type)."""
    p, prog, n_out = pid_n * 0, pid_n, out0 + pid_n * 0
    progs0 = tl.cdiv(out0, cols_per_prog)
    progs1 = tl.cdiv(out1, cols_per_prog)
    if P > 1:
        if pid_n >= progs0:
            p, prog, n_out = pid_n * 0 + 1, pid_n - progs0, out1 + pid_n * 0
    if P > 2:
        if pid_n >= progs0 + progs1:
            p, prog, n_out = pid_n * 0 + 2, pid_n - progs0 - progs1, out2 + pid_n * 0
    return p, prog, n_out


@triton.jit
def _pick(p, x0, x1, x2, P: tl.constexpr):
    """x0, x1 or x2 by projection p."""
    x = x0
    if P > 1:
        if p == 1:
            x = x1
    if P > 2:
        if p == 2:
            x = x2
    return x


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


@triton.jit
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


@triton.jit
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


@triton.jit
def shared_scale_kernel(hv_ptr, hs_ptr, m_ptr, sorted_ptr, sorted_slots_ptr, count_ptr, start_ptr, group,
                        num_tokens, num_slots, rank, a0, a1, a2, P: tl.constexpr, BR: tl.constexpr):
    """Program (position i of the shared group's sorted rows, projection p): hs[p, i] = hv[a_p, t] ⊙ m[p, slot]
    for its token t, rounded to hs's dtype (the matrices'); a_p < 0: the group does not adapt p."""
    i, p = tl.program_id(0), tl.program_id(1)
    a = _pick(p, a0 + p * 0, a1 + p * 0, a2 + p * 0, P)  # runtime values in every branch (see `_proj_of_program`)
    if (i >= tl.load(count_ptr + group)) | (a < 0):
        return
    pos = tl.load(start_ptr + group) + i
    tok = tl.load(sorted_ptr + pos).to(tl.int64)
    slot = tl.load(sorted_slots_ptr + pos)
    r = tl.arange(0, BR)
    ok = r < rank
    h = tl.load(hv_ptr + (a * num_tokens + tok) * rank + r, mask=ok, other=0.0)
    m = tl.load(m_ptr + (p * num_slots + slot).to(tl.int64) * rank + r, mask=ok, other=0.0)
    tl.store(hs_ptr + (p * num_tokens + i).to(tl.int64) * rank + r, (h * m).to(hs_ptr.dtype.element_ty), mask=ok)


@triton.jit
def shared_expand_kernel(d0_ptr, d1_ptr, d2_ptr, hs_ptr, hv_ptr, m_ptr, b0_ptr, b1_ptr, b2_ptr, sorted_ptr,
                         sorted_slots_ptr, count_ptr, start_ptr, group, num_tokens, num_slots, rank, out0, out1, out2,
                         a0, a1, a2, P: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         FUSED: tl.constexpr, PREC: tl.constexpr):
    """Program (BM rows of the shared group, BN columns of projection p): d_p[t, cols] = hs[p, i] @ B_p[cols]ᵀ
    for the group's sorted rows i and their tokens t: a plain tile GEMM (fp32 sums) whose rows past the group's
    count, fixed only on the device, return at once. out_p: projection p's columns (0: not adapted, no
    programs). FUSED: no scale pass ran; the left operand is formed per K step instead, m[p, s] ⊙ hv[a_p, t] in
    float32 rounded to B's dtype (what the scale pass stores in hs), gathered by token and slot."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    count = tl.load(count_ptr + group)
    if pid_m * BM >= count:
        return
    p, prog, n_out = _proj_of_program(pid_n, out0, out1, out2, BN, P)
    b_ptr = _pick(p, b0_ptr, b1_ptr, b2_ptr, P)
    start = tl.load(start_ptr + group)
    rows = pid_m * BM + tl.arange(0, BM)
    row_ok = rows < count
    tok = tl.load(sorted_ptr + start + rows, mask=row_ok, other=0).to(tl.int64)
    cols = prog * BN + tl.arange(0, BN)
    col_ok = cols < n_out
    if FUSED:
        a = _pick(p, a0 + p * 0, a1 + p * 0, a2 + p * 0, P)  # runtime values in every branch (`_proj_of_program`)
        slot = tl.load(sorted_slots_ptr + start + rows, mask=row_ok, other=0)
        h_rows = hv_ptr + (a * num_tokens + tok) * rank
        m_rows = m_ptr + (p * num_slots + slot).to(tl.int64) * rank
    else:
        h_rows = hs_ptr + (p * num_tokens + rows).to(tl.int64) * rank
    b_cols = b_ptr + cols.to(tl.int64) * rank
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, rank, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < rank
        hk = row_ok[:, None] & k_ok[None, :]
        b = tl.load(b_cols[None, :] + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if FUSED:
            h = (tl.load(h_rows[:, None] + k[None, :], mask=hk, other=0.0).to(tl.float32)
                 * tl.load(m_rows[:, None] + k[None, :], mask=hk, other=0.0)).to(b.dtype)
        else:
            h = tl.load(h_rows[:, None] + k[None, :], mask=hk, other=0.0)
        acc = tl.dot(h, b, acc, input_precision=PREC)
    d_ptr = _pick(p, d0_ptr, d1_ptr, d2_ptr, P)
    tl.store(d_ptr + tok[:, None] * n_out + cols[None, :], acc.to(d_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _b_of_group(tab_ptr, grow, ty: tl.constexpr):
    """The group's B pointer and padded row length (a multiple of 8: `SlotPool` pads)."""
    return _ptr(tab_ptr, grow + F_B, ty), tl.multiple_of(tl.load(tab_ptr + grow + F_BLD).to(tl.int32), 8)


# ---------------------------------------------------------------------------------------------- epilogue
@triton.jit
def _epilogue(z, partner, sign, delta, cols, mask, flags, o, o2, c, v):
    """o ⊙ z + o2 ⊙ rot(z) + c + v ⊙ delta, in the reference's order (rot(z) = sign · partner); each vector given
    by its slot's pointer and a bit of `flags` (a dead vector moves no bytes). o2's term is a where, not a
    multiply by 0: an inf in the partner column must not turn a plain token's output into NaN."""
    y = tl.load(o + cols, mask=mask & _has(flags, HAS_O, cols), other=1.0) * z
    o2_live = _has(flags, HAS_O2, cols)
    y += tl.where(o2_live, tl.load(o2 + cols, mask=mask & o2_live, other=0.0) * (sign * partner), 0.0)
    y += tl.load(c + cols, mask=mask & _has(flags, HAS_C, cols), other=0.0)
    return y + tl.load(v + cols, mask=mask & _has(flags, HAS_V, cols), other=1.0) * delta


@triton.jit
def _epilogue_chunk(z_row, d_row, col_a, col_b, n_out, flags, o, o2, c, v):
    """One token's chunk: columns col_a and their rotation partners col_b (see `epilogue_kernel`)."""
    mask_a = col_a < n_out
    mask_b = col_b < n_out
    z_a = tl.load(z_row + col_a, mask=mask_a, other=0.0).to(tl.float32)
    z_b = tl.load(z_row + col_b, mask=mask_b, other=0.0).to(tl.float32)
    d_a = tl.load(d_row + col_a, mask=mask_a & _has(flags, HAS_LR, col_a), other=0.0).to(tl.float32)
    d_b = tl.load(d_row + col_b, mask=mask_b & _has(flags, HAS_LR, col_b), other=0.0).to(tl.float32)
    y_a = _epilogue(z_a, z_b, -1.0, d_a, col_a, mask_a, flags, o, o2, c, v)
    y_b = _epilogue(z_b, z_a, 1.0, d_b, col_b, mask_b, flags, o, o2, c, v)
    tl.store(z_row + col_a, y_a.to(z_row.dtype.element_ty), mask=mask_a)
    tl.store(z_row + col_b, y_b.to(z_row.dtype.element_ty), mask=mask_b)


@triton.jit
def epilogue_kernel(z0_ptr, z1_ptr, z2_ptr, d0_ptr, d1_ptr, d2_ptr, tab_ptr, slots_ptr, num_slots, out0, out1, out2,
                    zst0, zst1, zst2, chunks_per_prog, P: tl.constexpr, HB: tl.constexpr):
    """Program (token t, n-range): z[t, cols] ← o ⊙ z + o2 ⊙ rot_g(z) + c + v ⊙ d[t, cols] in place, over
    `chunks_per_prog` chunks of 2·HB columns of one projection (d read only if the token's group has a low-rank
    part there). A chunk's columns are HB pairs (j, j + g/2) of RoAd groups of g (without rotation: the chunk's
    two contiguous halves), so rot_g(z) only reads columns the program owns: in place is safe. Base tokens and
    tokens of slots with nothing to apply return at once. Everything a token needs is in its slot's row (the
    flags carry its group's low-rank bit): the kernel's chain of dependent loads is slot → row → data. Rows of z
    are zst_p apart (column slices of one merged GEMM's output), rows of d out_p."""
    t, pid_n = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    p, prog, n_out = _proj_of_program(pid_n, out0, out1, out2, chunks_per_prog * 2 * HB, P)
    srow = (p * num_slots + slot) * NF
    flags = tl.load(tab_ptr + srow + F_FLAGS)
    rot = tl.load(tab_ptr + srow + F_ROT).to(tl.int32)
    o, o2 = _ptr(tab_ptr, srow + F_O, tl.float32), _ptr(tab_ptr, srow + F_O2, tl.float32)
    c, v = _ptr(tab_ptr, srow + F_C, tl.float32), _ptr(tab_ptr, srow + F_V, tl.float32)
    if (flags & (HAS_O | HAS_O2 | HAS_C | HAS_LR)) == 0:
        return
    z_row = _pick(p, z0_ptr, z1_ptr, z2_ptr, P) + t.to(tl.int64) * _pick(p, zst0, zst1, zst2, P)
    d_row = _pick(p, d0_ptr, d1_ptr, d2_ptr, P) + t.to(tl.int64) * n_out
    c_lo = prog * chunks_per_prog
    c_hi = tl.minimum(c_lo + chunks_per_prog, tl.cdiv(n_out, 2 * HB))
    # Two copies of the chunk loop: columns from a runtime group size have no known contiguity (Triton would
    # then move them one element at a time); plain halves keep 16-byte accesses.
    if rot > 0:
        for chunk in range(c_lo, c_hi):
            q = chunk * HB + tl.arange(0, HB)
            col_a = (q // (rot // 2)) * rot + q % (rot // 2)
            _epilogue_chunk(z_row, d_row, col_a, col_a + rot // 2, n_out, flags, o, o2, c, v)
    else:
        for chunk in range(c_lo, c_hi):
            col_a = chunk * 2 * HB + tl.arange(0, HB)
            _epilogue_chunk(z_row, d_row, col_a, col_a + HB, n_out, flags, o, o2, c, v)
