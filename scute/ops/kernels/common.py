"""Table fields, flags and the helpers the kernels of several passes share (`scute.ops.pool` lays the table out)."""

from __future__ import annotations

import triton
import triton.language as tl

from scute.ops import pool_rows as _pool

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


@triton.jit
def _has(flags, bit: tl.constexpr, like):
    """(flags & bit) != 0 as a mask shaped like `like` (Triton's interpreter rejects a scalar bool in a mask)."""
    return ((flags & bit) + like * 0) != 0


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
def _b_of_group(tab_ptr, grow, ty: tl.constexpr):
    """The group's B pointer and padded row length (a multiple of 8: `SlotPool` pads)."""
    return _ptr(tab_ptr, grow + F_B, ty), tl.multiple_of(tl.load(tab_ptr + grow + F_BLD).to(tl.int32), 8)
