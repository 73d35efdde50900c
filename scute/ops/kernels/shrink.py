"""Triton kernels of the shrink (split-K tile GEMM of x and each group's A)."""

from __future__ import annotations

import triton
import triton.language as tl

from scute.ops.kernels.common import F_A, F_ARANK, F_AHOFF, NF, _ptr


@triton.jit(do_not_specialize=["num_tokens"])
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
