"""The shared group's delta: VeRA-style slots that share A and B, as two dense products (scute::lora_delta_shared_)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from scute.ops.launch import cdiv, config, kernels, precision, scute_op


@scute_op("scute::lora_delta_shared_", mutates_args=("ds", "hv", "hs"))
def lora_delta_shared_(ds: list[Tensor], hv: Tensor, hs: Tensor, x: Tensor, a: list[Tensor], bs: list[Tensor],
                       m: Tensor, sorted_idx: Tensor, sorted_slots: Tensor, num_tokens_per_slot: Tensor,
                       slot_start: Tensor, group: int, a_of: list[int], outs: list[int]) -> None:
    """The low-rank delta of the pool's shared group (`scute.ops.pool`), for each projection it adapts.

    Semantics (token t of the group at sorted position i, with slot s; projection p with a_of[p] ≥ 0):
        ds[p][t] = B_p (m[p, s] ⊙ (A_{a_of[p]} x[t]))
    A x for every token (cuBLAS, stored in x's dtype as PEFT's is: which tokens are the group's is known only on
    the device; 2 µs faster per layer than a float32 A x at the mix 64/64), m ⊙ h in
    float32 rounded to the matrices' dtype, the product with B_p in float32 sums (a tile GEMM over the group's
    sorted rows, `shared_expand_kernel`), stored in ds's dtype; rows of other tokens are not written. m ⊙ h is a
    pass of its own (into hs) from `shared_fused_tokens` + 1 tokens on, else formed inside the GEMM.

    Shapes: ds as in `lora_delta_rows_`; hv [NA, T, r] (x's dtype) and hs [P, T, r] (the matrices') scratch;
    x [T, in]; a NA tensors [r, in] (any row stride); bs P tensors [out_p, r] (contiguous); m [P, M, r] float32;
    sorted_idx, sorted_slots, num_tokens_per_slot, slot_start from `LoraMeta`; group: the group's representative
    slot; a_of, outs: `SlotPool.shared_a_of`, `SlotPool.shared_outs`.
    """
    c = config()
    num_tokens, num_proj, rank = x.shape[0], len(ds), a[0].shape[0]
    if num_tokens == 0:
        return
    for i, a_i in enumerate(a):
        torch.mm(x, a_i.t(), out=hv[i])
    rank_block = max(16, 1 << (rank - 1).bit_length())  # the scale pass's whole row; the GEMM's K step is capped
    grid, block_m = expand_launch(num_tokens, outs)
    fused = not scale_pass(num_tokens)
    a_of = [*a_of, *[-1] * (3 - num_proj)]
    if not fused:
        kernels().shared_scale_kernel[scale_grid(num_tokens, num_proj)](
            hv, hs, m, sorted_idx, sorted_slots, num_tokens_per_slot, slot_start, group, num_tokens, m.shape[1], rank,
            *a_of, P=num_proj, BR=rank_block)
    kernels().shared_expand_kernel[grid](
        *ds, *[ds[0]] * (3 - num_proj), hs, hv, m, *bs, *[bs[0]] * (3 - num_proj), sorted_idx, sorted_slots,
        num_tokens_per_slot, slot_start, group, num_tokens, m.shape[1], rank, *outs, *[0] * (3 - num_proj), *a_of,
        P=num_proj, BM=block_m, BN=c.shared_block_n, BK=min(c.shared_max_block_k, rank_block),
        FUSED=fused,
        PREC=precision(hs.dtype), num_warps=c.shared_warps, num_stages=c.shared_stages)


def scale_grid(num_tokens: int, num_proj: int) -> tuple[int, int]:
    """The scale pass's grid: a program per (token, projection)."""
    return num_tokens, num_proj


def expand_launch(num_tokens: int, outs: Sequence[int]) -> tuple[tuple[int, int], int]:
    """The tile GEMM's grid over `num_tokens` tokens for projections of `outs` outputs (0: not adapted), and its
    rows (tokens) per program."""
    c = config()
    block_m = min(c.shared_max_block_m, max(16, 1 << (num_tokens - 1).bit_length()))
    return (cdiv(num_tokens, block_m), sum(cdiv(o, c.shared_block_n) for o in outs)), block_m


def scale_pass(num_tokens: int) -> bool:
    """Whether m ⊙ h is a pass of its own: above `shared_fused_tokens` tokens (below, the GEMM forms it)."""
    return num_tokens > config().shared_fused_tokens


@lora_delta_shared_.register_fake
def _(ds, hv, hs, x, a, bs, m, sorted_idx, sorted_slots, num_tokens_per_slot, slot_start, group, a_of, outs):
    return None
