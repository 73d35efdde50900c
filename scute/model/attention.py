"""Paged attention, registered with `transformers.AttentionInterface` under the name "scute".

The HF model calls `scute_attention` in every attention layer with the step's packed queries/keys/values
(one row of T tokens from many requests). The function stores the new K/V into the layer's paged cache at
`slot_mapping`, then attends each token to its own request's cached K/V. The step's metadata comes from the
forward context's `attn` field (an `AttentionMetadata`); K/V caches are per layer, indexed by the HF module's
`layer_idx`.

Backends: "torch" (any device; SDPA per request over K/V gathered from the pages — the CPU path),
"triton" (CUDA: a KV-store kernel and one paged-attention kernel for decode and chunked prefill alike),
"flash" (flash-attn's varlen kernel over the pages, used when installed; needs block_size % 256 == 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from scute.model.context import get_forward_context

ATTENTION_NAME = "scute"


@dataclass
class AttentionMetadata:
    """Per-step inputs of the attention function (all device tensors live at fixed buffer addresses).

    slot_mapping: [T] int64, the KV slot (block_id * block_size + offset) each new token is written to.
    query_start_loc: [S+1] int32, where each request's tokens start in the packed row.
    seq_lens: [S] int32, each request's length after this step (cached + new tokens).
    block_tables: [S, W] int32, each request's KV blocks (first ceil(seq_len / block_size) entries valid).
    max_query_len, max_seq_len: host ints, the largest of each (grid sizes).
    query_start_loc_host, seq_lens_host: the same as Python lists (the torch backend loops over requests).
    kv_caches: per layer (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim].
    kv_index: the torch backend's gather index of the step (`kv_gather_index`), built with the metadata by the
        engine so that every layer reuses it; None: each call builds it.
    """

    slot_mapping: Tensor
    query_start_loc: Tensor
    seq_lens: Tensor
    block_tables: Tensor
    max_query_len: int
    max_seq_len: int
    query_start_loc_host: list[int]
    seq_lens_host: list[int]
    kv_caches: list[tuple[Tensor, Tensor]]
    backend: str = "torch"
    kv_index: Tensor | None = field(default=None, repr=False)  # torch backend: `kv_gather_index`, if built

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)


def scute_attention(
    module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
    scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None, **kwargs,
) -> tuple[Tensor, None]:
    """The `AttentionInterface` entry point. query [1, H, T, D], key/value [1, Hkv, T, D];
    returns ([1, T, H, D], None)."""
    meta: AttentionMetadata = get_forward_context().attn
    k_cache, v_cache = meta.kv_caches[module.layer_idx]
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, heads, D]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    window = sliding_window if sliding_window and sliding_window > 0 else None
    if meta.backend == "triton":
        from scute.model.attention_triton import paged_attention, store_kv

        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, meta, scale, window)
    elif meta.backend == "flash":
        out = _flash_attention(q, k, v, k_cache, v_cache, meta, scale, window)
    else:
        out = torch_paged_attention(q, k, v, k_cache, v_cache, meta, scale, window)
    return out[None], None


def register_attention() -> None:
    """Register `scute_attention` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, scute_attention)


def torch_paged_attention(
    q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
    scale: float, window: int | None,
) -> Tensor:
    """Store K/V into the pages, then SDPA for each request over its gathered K/V.

    Semantics (the reference of every backend): for token t of request i at position p = seq_len_i −
    q_len_i + j, out[t] = softmax(scale · q[t] · K_i[0..p]ᵀ) · V_i[0..p], keys restricted to p − window < p'
    when a sliding window is set; K_i/V_i are the request's cached K/V (this step's included).
    """
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_flat, v_flat = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    k_flat[meta.slot_mapping] = k.to(k_cache.dtype)
    v_flat[meta.slot_mapping] = v.to(v_cache.dtype)
    index = meta.kv_index if meta.kv_index is not None else kv_gather_index(meta, k_cache.shape[1])
    keys, values = k_flat[index].transpose(0, 1), v_flat[index].transpose(0, 1)  # [Hkv, sum L, D]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    qsl, kv_start = meta.query_start_loc_host, 0
    for i, seq_len in enumerate(meta.seq_lens_host):
        q_start, q_end = qsl[i], qsl[i + 1]
        qi = q[q_start:q_end].transpose(0, 1)  # [H, q_len, D]
        ki, vi = keys[:, kv_start:kv_start + seq_len], values[:, kv_start:kv_start + seq_len]
        mask = _mask(q_end - q_start, seq_len, window, q.device)
        oi = F.scaled_dot_product_attention(qi[None], ki[None], vi[None], attn_mask=mask, scale=scale,
                                            enable_gqa=True)
        out[q_start:q_end] = oi[0].transpose(0, 1)
        kv_start += seq_len
    return out


def kv_gather_index(meta: AttentionMetadata, block_size: int) -> Tensor:
    """The KV slots of every request's positions 0..seq_len-1, concatenated: [sum seq_lens] int64 (a few
    vectorized ops, whatever the number of requests)."""
    device = meta.block_tables.device
    lens = torch.tensor(meta.seq_lens_host, dtype=torch.int64, device=device)
    req = torch.repeat_interleave(torch.arange(len(meta.seq_lens_host), device=device), lens)
    pos = torch.arange(req.shape[0], device=device) - (torch.cumsum(lens, 0) - lens)[req]
    return meta.block_tables[req, pos // block_size].long() * block_size + pos % block_size


def _mask(q_len: int, seq_len: int, window: int | None, device: torch.device) -> Tensor | None:
    """Causal (and sliding-window) mask of q_len queries at the end of a seq_len sequence; None if full."""
    if q_len == 1 and (window is None or seq_len <= window):
        return None
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def _flash_attention(
    q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
    scale: float, window: int | None,
) -> Tensor:
    """flash-attn's varlen kernel reads K/V straight from the pages (block_table); optional dependency."""
    from flash_attn import flash_attn_varlen_func

    from scute.model.attention_triton import store_kv

    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return flash_attn_varlen_func(
        q, k_cache, v_cache,
        cu_seqlens_q=meta.query_start_loc, cu_seqlens_k=_cu_seqlens(meta.seq_lens),
        max_seqlen_q=meta.max_query_len, max_seqlen_k=meta.max_seq_len,
        softmax_scale=scale, causal=True, window_size=(-1, -1) if window is None else (window - 1, 0),
        block_table=meta.block_tables,
    )


def _cu_seqlens(seq_lens: Tensor) -> Tensor:
    return F.pad(seq_lens.cumsum(0, dtype=torch.int32), (1, 0))


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True
