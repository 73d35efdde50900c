"""The shrink pass: h = A x for every token's group, split over K (scute::shrink_)."""

from __future__ import annotations

import torch
from torch import Tensor

from scute.ops.launch import block_r, cdiv, config, kernels, precision, rank_tiles, scute_op


@scute_op("scute::shrink_", mutates_args=("h",))
def shrink_(h: Tensor, x: Tensor, table: Tensor, sorted_idx: Tensor, tile_group: Tensor, tile_start: Tensor,
            tile_end: Tensor, num_proj: int, max_rank: int, block_k: int, block_m: int) -> None:
    """Down projection of every token by its group's A (all projections of the pool), split over K.

    Semantics:
        Σ_s h[s, i, hoff_{p,g} : hoff_{p,g} + r_{p,g}] = A_{p,g} x[sorted_idx[i]]     for each tile's rows i (group g)
    (the rank-space scale m is applied by the delta; rows of base tokens and unused columns are not written).
    Multi-token tiles and groups wider than `row_block_r` have the sum in h[0] instead (summed once, in split order).

    Shapes: h [split_k, T, h_width] float32, indexed by *sorted* position; x [T, in], table (see
    `input_transform`), sorted_idx [T], tile_* [NT] int32 (`LoraMeta`, tiles of up to `block_m` tokens);
    max_rank ≥ every rank in the table (sizes the grid's rank tiles).
    """
    c = config()
    split_k, num_tokens, h_width = h.shape
    in_features = x.shape[1]
    if num_tokens == 0:
        return
    k_per_split = cdiv(cdiv(in_features, split_k), block_k) * block_k
    rt = rank_tiles(max_rank)
    grid = shrink_grid(tile_group.shape[0], split_k, max_rank, num_proj)
    kernels().shrink_kernel[grid](
        x, h, arrival_counters(x.device, grid[0] * rt * num_proj), table, sorted_idx, tile_group, tile_start,
        tile_end, num_tokens, in_features, table.shape[1], h_width, k_per_split, SPLIT_K=split_k, RT=rt, BM=block_m,
        BR=block_r(max_rank), BK=block_k, PREC=precision(x.dtype), ONCE_ABOVE=c.row_block_r,
        num_warps=c.shrink_warps, num_stages=c.shrink_stages)


def shrink_grid(num_tiles: int, split_k: int, max_rank: int, num_proj: int) -> tuple[int, int, int]:
    """The shrink's grid: a program per (tile, split of K and rank tile, projection)."""
    return num_tiles, split_k * rank_tiles(max_rank), num_proj


@shrink_.register_fake
def _(h, x, table, sorted_idx, tile_group, tile_start, tile_end, num_proj, max_rank, block_k, block_m):
    return None


_COUNTERS: dict[torch.device, list[Tensor]] = {}


def arrival_counters(device: torch.device, n: int) -> Tensor:
    """At least `n` int32 zeros the shrink's split programs count their arrivals in: each counter is reset by its
    last arrival, so one buffer per device serves every call (all shrinks of a device run in order on its side
    stream). A larger call gets a larger buffer; the smaller ones are kept, since captured graphs hold them."""
    bufs = _COUNTERS.setdefault(device, [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device))
    return bufs[-1]
