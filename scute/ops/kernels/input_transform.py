"""Triton kernels of the input transform (a row per token; windows of BLOCK_M tokens on tensor cores)."""

from __future__ import annotations

import triton
import triton.language as tl

from scute.ops.kernels.common import F_FLAGS, F_T, F_TB, F_TBN, F_TBB, NF, HAS_T, HAS_TB, _ptr


@triton.jit(do_not_specialize=["num_tokens"])
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


@triton.jit(do_not_specialize=["num_tokens"])
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
