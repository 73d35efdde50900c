"""Triton kernels of the epilogue o ⊙ z + o2 ⊙ rot(z) + c + v ⊙ d."""

from __future__ import annotations

import triton
import triton.language as tl

from scute.ops.kernels.common import (F_ROT, F_FLAGS, F_O, F_O2, F_C, F_V, NF, HAS_O, HAS_O2, HAS_C, HAS_V, HAS_LR,
                                      _ptr, _has, _proj_of_program, _pick)


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


@triton.jit(do_not_specialize=["chunks_per_prog"])
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
