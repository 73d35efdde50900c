"""Triton kernels of `scute.ops.elementwise` (semantics and references there). Values are loaded in their
dtype and upcast to float32 at once (the interpreter computes 16-bit floats wrongly otherwise); every rounding
to the input dtype that the PyTorch chain does is done here too, at the same place."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rms_normed(x, w_ptr, out_ptr, row, cols, mask, n_cols, eps):
    """Store w * (x * rsqrt(mean(x²) + eps)).to(x dtype) as row `row` of out (x: one row in its dtype)."""
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    h = (xf * tl.rsqrt(var + eps)).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, x_stride, eps, BLOCK: tl.constexpr):
    """Program: one row. out = w * (x * rsqrt(mean(x²) + eps)).to(x dtype), in out's dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    _rms_normed(tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0), w_ptr, out_ptr, row, cols, mask,
                n_cols, eps)


@triton.jit
def _plus(x, d_ptr, offs, mask, HAS_D: tl.constexpr):
    """x + d in float32, rounded to x's dtype (`scute.ops.elementwise.plus`); x if not HAS_D."""
    if HAS_D:
        d = tl.load(d_ptr + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def add_rms_norm_kernel(x_ptr, d_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, n_cols, x_stride, d_stride, r_stride, eps,
                        HAS_D: tl.constexpr, BLOCK: tl.constexpr):
    """Program: one row. s = (r + x) rounded to x's dtype, stored; out = rms_norm(s) as `rms_norm_kernel`. HAS_D:
    x is first completed with its deferred delta d."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = _plus(tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0), d_ptr, row * d_stride + cols, mask, HAS_D)
    r = tl.load(r_ptr + row * r_stride + cols, mask=mask, other=0.0)
    s = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
    tl.store(sum_ptr + row * n_cols + cols, s, mask=mask)
    _rms_normed(s, w_ptr, out_ptr, row, cols, mask, n_cols, eps)


@triton.jit
def rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_stride, k_stride, q_heads, k_heads, HALF: tl.constexpr,
                BLOCK_H: tl.constexpr):
    """Program (token t, tensor: 0 = q, 1 = k): every head of that token, in place. For halves x1, x2 of a head:
    out1 = x1·cos1 + (−x2)·sin1, out2 = x2·cos2 + x1·sin2, each product and the sum rounded to x's dtype."""
    t, which = tl.program_id(0).to(tl.int64), tl.program_id(1)
    ptr, stride, heads = q_ptr, q_stride, q_heads
    if which == 1:
        ptr, stride, heads = k_ptr, k_stride, k_heads
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = h < heads
    base = ptr + t * stride + h * (2 * HALF) + d
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    ty = x1.dtype
    c1 = tl.load(cos_ptr + t * (2 * HALF) + d).to(tl.float32)
    c2 = tl.load(cos_ptr + t * (2 * HALF) + HALF + d).to(tl.float32)
    s1 = tl.load(sin_ptr + t * (2 * HALF) + d).to(tl.float32)
    s2 = tl.load(sin_ptr + t * (2 * HALF) + HALF + d).to(tl.float32)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    o1 = (x1f * c1).to(ty).to(tl.float32) + (-x2f * s1).to(ty).to(tl.float32)
    o2 = (x2f * c2).to(ty).to(tl.float32) + (x1f * s2).to(ty).to(tl.float32)
    tl.store(base, o1.to(ty), mask=mask)
    tl.store(base + HALF, o2.to(ty), mask=mask)


@triton.jit
def silu_mul_kernel(gate_ptr, up_ptr, dg_ptr, du_ptr, out_ptr, n_cols, gate_stride, up_stride, HAS_D: tl.constexpr,
                    BLOCK: tl.constexpr):
    """Program (row, column block): out = silu(gate).to(dtype) * up, rounded to the dtype. HAS_D: gate and up
    are first completed with their deferred deltas (dg, du: contiguous rows)."""
    row, cb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = cb * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = _plus(tl.load(gate_ptr + row * gate_stride + cols, mask=mask, other=0.0), dg_ptr, row * n_cols + cols, mask,
              HAS_D)
    u = _plus(tl.load(up_ptr + row * up_stride + cols, mask=mask, other=0.0), du_ptr, row * n_cols + cols, mask,
              HAS_D).to(tl.float32)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def residual_add_kernel(r_ptr, x_ptr, d_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Program: BLOCK elements. out = r + (x completed with its deferred delta d), each sum rounded to the
    dtype (contiguous tensors of one shape)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = _plus(tl.load(x_ptr + offs, mask=mask, other=0.0), d_ptr, offs, mask, True)
    r = tl.load(r_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, (r.to(tl.float32) + x.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)
