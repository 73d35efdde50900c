"""The decoder layer's elementwise ops as one kernel each: RMSNorm, residual add + RMSNorm, rotary embedding,
SiLU·mul, residual add.

The ones that consume an adapted projection's output (add + RMSNorm after o, SiLU·mul after gate/up, the residual
add after down) take its deferred delta too (`scute.ops.scute_linears_deferred`): they complete the output
(``z + d`` in float32, rounded once, as the epilogue would) as they load it, so a one-token decode step of a
plain LoRA adapter launches no epilogue for those projections.

In eager PyTorch each is a chain of small kernels (HF's RMSNorm: 6, 7 with the residual add before it; rotary
embedding of q and k: 10; SiLU·mul: 2); inside a decode CUDA graph a small kernel still costs a few
microseconds, so on a 32-layer model they add about 18 x 32 launches per step. Each op here is one Triton kernel
on CUDA and the reference math elsewhere. They round where the PyTorch chain rounds (every intermediate the
chain stores in the input dtype is rounded to it here too); the GPU compiler may contract a product into a sum,
RMSNorm sums in another order than `torch.mean` and SiLU's exponential is Triton's: results within an ulp of the
chain's, the same in the eager and the graphed step (both run these kernels).
"""

from __future__ import annotations

import torch
from torch import Tensor

from scute.ops import triton_enabled


def _kernels():
    from scute.ops import elementwise_kernels  # lazy: triton.jit reads TRITON_INTERPRET when decorating

    return elementwise_kernels


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Semantics (HF's LlamaRMSNorm): ``weight * (x / sqrt(mean(x², -1) + eps))`` with the normalization in
    float32, rounded to x's dtype before the product with weight. Shapes: x [..., N], weight [N]."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Semantics: `rms_norm_ref`, one program per row on CUDA (x's rows need a unit last stride; otherwise the
    reference). Shapes: x [..., N], weight [N]; returns x's shape in weight's and x's dtypes promoted."""
    if not triton_enabled(x) or x.stride(-1) != 1:
        return rms_norm_ref(x, weight, eps)
    rows = x.reshape(-1, x.shape[-1])
    out = _norm_out(rows, weight)
    _kernels().rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.shape[1], rows.stride(0), eps,
                                                 **_row_launch(rows.shape[1]))
    return out.view(x.shape)


def plus(x: Tensor, d: Tensor | None) -> Tensor:
    """Semantics: a deferred output completed, ``x + d`` in float32 rounded to x's dtype (x if d is None). Shapes:
    d of x's number of elements, any float dtype."""
    return x if d is None else (x.float() + d.reshape(x.shape).float()).to(x.dtype)


def add_rms_norm_ref(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                     dx: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Semantics (HF's decoder layer: ``h = residual + x`` then the post-attention RMSNorm of h):
    returns ``(rms_norm_ref(h, weight, eps), h)``, h in x's dtype; x is ``plus(x, dx)``. Shapes: x, residual
    [..., N], weight [N], dx x's number of elements."""
    h = residual + plus(x, dx)
    return rms_norm_ref(h, weight, eps), h


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                 dx: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Semantics: `add_rms_norm_ref`, one program per row on CUDA (one kernel instead of the add and the norm: a
    decode step of a 32-layer model launches 32 fewer); x and residual need a unit last stride and one shape and
    dtype, otherwise the reference. Shapes: as `add_rms_norm_ref`."""
    if not triton_enabled(x) or x.stride(-1) != 1 or residual.stride(-1) != 1 or x.shape != residual.shape or \
            x.dtype != residual.dtype:
        return add_rms_norm_ref(x, residual, weight, eps, dx)
    rows, res = x.reshape(-1, x.shape[-1]), residual.reshape(-1, x.shape[-1])
    d = rows if dx is None else dx.reshape(rows.shape)
    out, total = _norm_out(rows, weight), torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    _kernels().add_rms_norm_kernel[(rows.shape[0],)](rows, d, res, weight, out, total, rows.shape[1], rows.stride(0),
                                                     d.stride(0), res.stride(0), eps, HAS_D=dx is not None,
                                                     **_row_launch(rows.shape[1]))
    return out.view(x.shape), total.view(x.shape)


def _norm_out(rows: Tensor, weight: Tensor) -> Tensor:
    """The normalized rows' buffer: weight's and x's dtypes promoted, as ``weight * h`` gives."""
    return torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, rows.dtype), device=rows.device)


def _row_launch(n_cols: int) -> dict:
    """Launch parameters of a one-row-per-program norm: the row in one block."""
    return dict(BLOCK=_pow2(n_cols), num_warps=8 if n_cols >= 2048 else 4)


def rotate_half(x: Tensor) -> Tensor:
    """Semantics: [x1 | x2] -> [−x2 | x1] along the last axis (HF's). Shapes: x [..., D], D even."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_ref(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Semantics (HF's apply_rotary_pos_emb, heads on the middle axis): ``x·cos + rotate_half(x)·sin`` per head,
    rotate_half([x1 | x2]) = [−x2 | x1]. Shapes: q [T, H, D], k [T, Hkv, D], cos/sin [T, D] (in q's dtype)."""
    cos, sin = cos[:, None], sin[:, None]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rope_(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Semantics: `rope_ref`, in place on CUDA (one program per token and tensor; q and k may be strided views,
    heads of a merged q/k/v output, with contiguous heads), returning (q, k). Shapes: as `rope_ref`."""
    if not triton_enabled(q) or q.stride(-1) != 1 or k.stride(-1) != 1 or q.stride(1) != q.shape[2] or \
            k.stride(1) != k.shape[2]:
        return rope_ref(q, k, cos, sin)
    cos, sin = cos.contiguous(), sin.contiguous()
    num_tokens, heads, dim = q.shape
    _kernels().rope_kernel[(num_tokens, 2)](
        q, k, cos, sin, q.stride(0), k.stride(0), heads, k.shape[1], HALF=dim // 2,
        BLOCK_H=_pow2(max(heads, k.shape[1])), num_warps=4)
    return q, k


def silu_mul_ref(gate: Tensor, up: Tensor, d_gate: Tensor | None = None, d_up: Tensor | None = None) -> Tensor:
    """Semantics: ``silu(gate) * up``, silu rounded to the input dtype first (as two PyTorch ops round), gate and
    up first completed with their deferred deltas (`plus`). Shapes: gate, up [T, N]; d_gate, d_up T·N elements or
    None; returns [T, N] in gate's dtype."""
    return torch.nn.functional.silu(plus(gate, d_gate)) * plus(up, d_up)


def silu_mul(gate: Tensor, up: Tensor, d_gate: Tensor | None = None, d_up: Tensor | None = None) -> Tensor:
    """Semantics: `silu_mul_ref`, in one kernel on CUDA. Shapes: gate and up [T, N] with a unit last stride
    (column slices of one merged gate/up output will do); the deltas [T, N] contiguous (one of them alone is added
    first, apart); returns [T, N]."""
    if not triton_enabled(gate) or gate.dim() != 2 or gate.stride(-1) != 1 or up.stride(-1) != 1:
        return silu_mul_ref(gate, up, d_gate, d_up)
    if (d_gate is None) != (d_up is None):
        gate, up, d_gate, d_up = plus(gate, d_gate), plus(up, d_up), None, None
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    block = 1024
    _kernels().silu_mul_kernel[(gate.shape[0], -(-gate.shape[1] // block))](
        gate, up, gate if d_gate is None else d_gate, up if d_up is None else d_up, out, gate.shape[1],
        gate.stride(0), up.stride(0), HAS_D=d_gate is not None, BLOCK=block, num_warps=4)
    return out


def residual_add(residual: Tensor, x: Tensor, dx: Tensor | None = None) -> Tensor:
    """Semantics: ``residual + plus(x, dx)`` (HF's decoder layer's second residual add, x completed with its
    deferred delta), each sum rounded to the dtype. One kernel on CUDA when there is a delta; else the add.
    Shapes: residual and x alike; dx x's number of elements or None; returns x's shape."""
    if dx is None or not triton_enabled(x) or not (x.is_contiguous() and residual.is_contiguous()) or \
            x.shape != residual.shape or x.dtype != residual.dtype:
        return residual + plus(x, dx)
    out, block = torch.empty_like(x), 2048
    _kernels().residual_add_kernel[(-(-x.numel() // block),)](residual, x, dx, out, x.numel(), BLOCK=block,
                                                              num_warps=4)
    return out


def _pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()
