"""Triton kernels of the paged attention: store K/V into the pages, and attend over paged K/V.

One attention kernel serves decode and chunked prefill alike: a program takes BLOCK_Q query tokens of one
request times the GROUP query heads that share one KV head (GQA rows packed into the M dimension of the
dot, so each K/V page is loaded once per group), and walks the request's pages from its block table with an
online softmax, BLOCK_N positions (several pages) per step. Accumulation is float32; float32 inputs use IEEE
dots (no TF32), so fp32 results match the PyTorch reference to rounding.

A decode step has one program per request (and KV head). Any other step has T // BLOCK_Q + S programs for T
tokens of S requests, whatever their lengths: program p finds its request s, the last one with
f(s) = query_start_loc[s] // BLOCK_Q + s <= p (a binary search), and takes its query block p − f(s); f leaves
each request at least as many programs as it has blocks, and the extra ones return at once. So the grid depends
on T and S only, and a CUDA graph of a mixed step (prompt chunks beside decode tokens, padded to T tokens and S
requests) serves every such step. A request's blocks start at multiples of BLOCK_Q of its own tokens in either
mapping, so a token's result is the same in both.

At decode (one query token per request) of a few requests (`split_max_seqs`: 16 with 8 KV heads) the KV
positions are also split (flash-decoding): a request of n
positions is cut into min(MAX_SPLITS, ceil(n / SPLIT_TOKENS)) ranges, each a program writing its unnormalized
partial result and softmax statistics, and `_combine_kernel` merges them. Without it a decode step has only
requests x KV heads programs (8 at one request), each walking its pages in series: 13 µs a layer on an H200 at
one request of 160 positions. The grid has MAX_SPLITS programs per (request, KV head) whatever the lengths
(programs past a request's splits return at once), so it is fixed for a CUDA graph, and a token's split depends
only on its own length: its result is the same in any batch on the same side of `split_max_seqs`, eager or
replayed.

The counts of requests and tokens are not specialized (`do_not_specialize`, see `scute.ops.kernels`): an eager
step of an odd token count would otherwise compile the kernels again, mid-serving.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

LOG2E = 1.4426950408889634
MAX_SPLITS = 16  # KV ranges of one decode token at most...
SPLIT_TOKENS = 32  # ...each of at least this many positions
BLOCK_N = 32  # KV positions per step of a program


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


@triton.jit(do_not_specialize=["num_seqs", "num_tokens"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_ptr, stats_ptr, qsl_ptr, seq_lens_ptr, block_tables_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, scale_log2, num_seqs, num_tokens,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, WINDOW: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, SPLIT_TOKENS: tl.constexpr, MAX_SPLITS: tl.constexpr,
    DECODE: tl.constexpr,
):
    """Program (request and block of its queries, KV head, split): softmax(q Kᵀ) V over its KV range. With
    SPLIT, the range is one of the token's splits and the program stores acc (unnormalized), the running max and
    the sum (part, stats) for `_combine_kernel`; else the normalized output. DECODE: program i is request i's
    one block; else the block is found from the program's index (the module's docstring)."""
    seq = tl.program_id(0)
    qb = 0
    if not DECODE:  # the last request s with f(s) = qsl[s] // BLOCK_Q + s <= program (f strictly increases)
        lo = 0
        hi = num_seqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= seq:
                lo = mid
            else:
                hi = mid - 1
        qb = seq - (tl.load(qsl_ptr + lo) // BLOCK_Q + lo)
        seq = lo
    kvh = tl.program_id(1)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if qb * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len  # position of the request's first query token
    kv_end = tl.minimum(seq_len, first_pos + (qb + 1) * BLOCK_Q)  # causal: no query here sees past this
    kv_begin = 0
    if WINDOW > 0:
        kv_begin = tl.maximum(first_pos + qb * BLOCK_Q - WINDOW + 1, 0) // PAGE * PAGE
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    m = tl.arange(0, BLOCK_M)
    tok = qb * BLOCK_Q + m // GROUP_PAD
    g = m % GROUP_PAD
    row_ok = (tok < q_len) & (g < GROUP)
    head = kvh * GROUP + g
    split = tl.program_id(2)
    stat = split * num_tokens * GROUP * NUM_KV_HEADS + (q_start + tok) * (GROUP * NUM_KV_HEADS) + head
    if SPLIT:
        num_splits = tl.minimum(tl.cdiv(kv_end - kv_begin, SPLIT_TOKENS), MAX_SPLITS)
        if split >= num_splits:  # past this token's splits: an empty split for the combine
            tl.store(stats_ptr + 2 * stat, float("-inf"), mask=row_ok)
            tl.store(stats_ptr + 2 * stat + 1, 0.0, mask=row_ok)
            return
        span = tl.cdiv(tl.cdiv(kv_end - kv_begin, num_splits), BLOCK_N) * BLOCK_N
        kv_begin = kv_begin + split * span
        kv_end = tl.minimum(kv_begin + span, kv_end)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = first_pos + tok
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range(kv_begin, kv_end, BLOCK_N):
        pos = start + n
        pos_ok = pos < kv_end
        page = tl.load(block_tables_ptr + seq * stride_bt + pos // PAGE, mask=pos_ok, other=0).to(tl.int64)
        offs = (page * PAGE + pos % PAGE)[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM + d[None, :]
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2
        ok = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
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
    if SPLIT:  # (split, token, head) rows of part and stats
        tl.store(part_ptr + stat[:, None] * BLOCK_D + d[None, :], acc, mask=row_ok[:, None])
        tl.store(stats_ptr + 2 * stat, m_i, mask=row_ok)
        tl.store(stats_ptr + 2 * stat + 1, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["num_tokens"])
def _combine_kernel(part_ptr, stats_ptr, out_ptr, num_tokens, stride_ot, stride_oh, NUM_HEADS: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """Program (token, head): out = Σ_s 2^(m_s − M) acc_s / Σ_s 2^(m_s − M) l_s over the splits (M = max m_s; a
    split with no visible position has m = −inf, l = 0, and its acc is not read)."""
    t, h = tl.program_id(0), tl.program_id(1)
    stat = tl.arange(0, MAX_SPLITS) * num_tokens * NUM_HEADS + t * NUM_HEADS + h
    m_s = tl.load(stats_ptr + 2 * stat)
    l_s = tl.load(stats_ptr + 2 * stat + 1)
    m_max = tl.max(m_s, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m_s - m_max)  # 0 for splits with nothing visible
    d = tl.arange(0, BLOCK_D)
    acc = tl.load(part_ptr + stat[:, None] * BLOCK_D + d[None, :], mask=(l_s > 0.0)[:, None], other=0.0)
    total = tl.sum(w * l_s, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta, scale: float, window: int | None) -> Tensor:
    """Semantics: `scute.model.attention.torch_paged_attention` (after the store). q [T, H, D] (unit last
    stride); k_cache/v_cache [num_blocks, PAGE, Hkv, D]; returns out [T, H, D] in q.dtype. A decode step (one
    query token per request) of at most `split_max_seqs` requests splits each request's KV positions and merges
    the splits (`_combine_kernel`). A request may have no query tokens, and one with seq_len 0 (a CUDA graph's
    padding) gets zeros."""
    num_tokens, num_heads, head_dim = q.shape
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    decode = meta.max_query_len == 1
    split = decode and meta.num_seqs <= split_max_seqs(num_kv_heads)
    rows = 16 if decode else 64  # dot M >= 16 on NVIDIA; decode needs few rows
    block_q = max(1, rows // group_pad)
    block_d = max(16, triton.next_power_of_2(head_dim))
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    splits = MAX_SPLITS if split else 1
    if split:  # partial results and (max, sum) per split, token and head
        part = torch.empty((splits, num_tokens, num_heads, block_d), dtype=torch.float32, device=q.device)
        stats = torch.empty((splits, num_tokens, num_heads, 2), dtype=torch.float32, device=q.device)
    else:
        part = stats = out
    programs = meta.num_seqs if decode else num_tokens // block_q + meta.num_seqs
    grid = (programs, num_kv_heads, splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, part, stats, meta.query_start_loc, meta.seq_lens, meta.block_tables,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
        scale * LOG2E, meta.num_seqs, num_tokens,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, GROUP_PAD=group_pad, BLOCK_Q=block_q,
        BLOCK_D=block_d, PAGE=page, WINDOW=window or 0, IEEE=q.dtype == torch.float32,
        BLOCK_N=max(BLOCK_N, triton.next_power_of_2(page)) if decode else triton.next_power_of_2(page),
        SPLIT=split, SPLIT_TOKENS=SPLIT_TOKENS, MAX_SPLITS=MAX_SPLITS, DECODE=decode,
    )
    if split:
        _combine_kernel[(num_tokens, num_heads)](
            part, stats, out, num_tokens, out.stride(0), out.stride(1), NUM_HEADS=num_heads, HEAD_DIM=head_dim,
            BLOCK_D=block_d, MAX_SPLITS=MAX_SPLITS)
    return out


def split_max_seqs(num_kv_heads: int) -> int:
    """The most requests a decode step splits the KV of: while requests x KV heads programs are at most 128 (about
    one per SM of an H200; more, and the split's partial results cost more than they spread). A power of two,
    so that a decode CUDA graph's padded batch (`capture_sizes`: 1, 2, 4, 8, then multiples of 16) is on the
    same side of it as the batch it replays, and the two compute alike."""
    return 1 << (max(1, 128 // num_kv_heads).bit_length() - 1)
