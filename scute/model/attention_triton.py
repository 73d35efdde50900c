"""Triton kernels of the paged attention: store K/V into the pages, and attend over paged K/V.

One attention kernel serves decode and chunked prefill alike: a program takes BLOCK_Q query tokens of one
request times the GROUP query heads that share one KV head (GQA rows packed into the M dimension of the
dot, so each K/V page is loaded once per group), and walks the request's pages from its block table with an
online softmax. Accumulation is float32; float32 inputs use IEEE dots (no TF32), so fp32 results match the
PyTorch reference to rounding.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

LOG2E = 1.4426950408889634


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # a padding token (CUDA-graph batches): nothing to store
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + h * HEAD_DIM + d
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Semantics: k_cache.view(-1, Hkv, D)[slot_mapping[t]] = k[t] (same for v), skipping slot −1.
    Shapes: k, v [T, Hkv, D] (any strides with a unit last one); caches [num_blocks, block_size, Hkv, D]."""
    num_tokens, num_kv_heads, head_dim = k.shape
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, qsl_ptr, seq_lens_ptr, block_tables_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, scale_log2, num_q_blocks,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, WINDOW: tl.constexpr, IEEE: tl.constexpr,
):
    seq = tl.program_id(0) // num_q_blocks
    qb = tl.program_id(0) % num_q_blocks
    kvh = tl.program_id(1)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if qb * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len  # position of the request's first query token
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    m = tl.arange(0, BLOCK_M)
    tok = qb * BLOCK_Q + m // GROUP_PAD
    g = m % GROUP_PAD
    row_ok = (tok < q_len) & (g < GROUP)
    head = kvh * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = first_pos + tok
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = tl.minimum(seq_len, first_pos + (qb + 1) * BLOCK_Q)  # causal: no query here sees past this
    kv_begin = 0
    if WINDOW > 0:
        kv_begin = tl.maximum(first_pos + qb * BLOCK_Q - WINDOW + 1, 0) // PAGE * PAGE
    n = tl.arange(0, PAGE)
    for start in range(kv_begin, kv_end, PAGE):
        page = tl.load(block_tables_ptr + seq * stride_bt + start // PAGE).to(tl.int64)
        pos = start + n
        offs = (page * PAGE + n)[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM + d[None, :]
        kv_mask = (pos < kv_end)[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2
        ok = pos[None, :] <= q_pos[:, None]
        if WINDOW > 0:
            ok = ok & (pos[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta, scale: float, window: int | None) -> Tensor:
    """Semantics: `scute.model.attention.torch_paged_attention` (after the store). q [T, H, D] (unit last
    stride); k_cache/v_cache [num_blocks, PAGE, Hkv, D]; returns out [T, H, D] in q.dtype."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    rows = 16 if meta.max_query_len == 1 else 64  # dot M >= 16 on NVIDIA; decode needs few rows
    block_q = max(1, rows // group_pad)
    num_q_blocks = math.ceil(meta.max_query_len / block_q)
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    grid = (meta.num_seqs * num_q_blocks, num_kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
        scale * LOG2E, num_q_blocks,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, GROUP_PAD=group_pad, BLOCK_Q=block_q,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), PAGE=page, WINDOW=window or 0,
        IEEE=q.dtype == torch.float32,
    )
    return out
