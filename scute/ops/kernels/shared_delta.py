"""Triton kernels of the shared group's scale pass and tile GEMM."""

from __future__ import annotations

import triton
import triton.language as tl

from scute.ops.kernels.common import _proj_of_program, _pick


@triton.jit(do_not_specialize=["num_tokens"])
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


@triton.jit(do_not_specialize=["num_tokens"])
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
