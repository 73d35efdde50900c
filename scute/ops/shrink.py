"""The shrink pass: h = A x for every token's group, split over K (scute::shrink_)."""

from __future__ import annotations

from torch import Tensor

from scute.ops.launch import block_r, cdiv, config, kernels, precision, rank_tiles, scute_op


@scute_op("scute::shrink_", mutates_args=("h", "counters"))
def shrink_(h: Tensor, counters: Tensor, x: Tensor, table: Tensor, sorted_idx: Tensor, tile_group: Tensor,
            tile_start: Tensor, tile_end: Tensor, num_proj: int, max_rank: int, block_k: int, block_m: int) -> None:
    """Down projection of every token by its group's A (all projections of the pool), split over K.

    Semantics:
        Σ_s h[s, i, hoff_{p,g} : hoff_{p,g} + r_{p,g}] = A_{p,g} x[sorted_idx[i]]     for each tile's rows i (group g)
    (the rank-space scale m is applied by the delta; rows of base tokens and unused columns are not written).
    Multi-token tiles and groups wider than `row_block_r` have the sum in h[0] instead (summed once, in split order).

    Shapes: h [split_k, T, h_width] float32, indexed by *sorted* position; counters int32 zeros, at least
    `shrink_counters` of them (`LaunchResources.counters`; left zero); x [T, in], table (see
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
        x, h, counters, table, sorted_idx, tile_group, tile_start, tile_end, num_tokens, in_features, table.shape[1],
        h_width, k_per_split, SPLIT_K=split_k, RT=rt, BM=block_m,
        BR=block_r(max_rank), BK=block_k, PREC=precision(x.dtype), ONCE_ABOVE=c.row_block_r,
        num_warps=c.shrink_warps, num_stages=c.shrink_stages)


def shrink_grid(num_tiles: int, split_k: int, max_rank: int, num_proj: int) -> tuple[int, int, int]:
    """The shrink's grid: a program per (tile, split of K and rank tile, projection)."""
    return num_tiles, split_k * rank_tiles(max_rank), num_proj


def shrink_counters(num_tiles: int, max_rank: int, num_proj: int) -> int:
    """Arrival counters the shrink needs: one per (tile, rank tile, projection)."""
    return num_tiles * rank_tiles(max_rank) * num_proj


@shrink_.register_fake
def _(h, counters, x, table, sorted_idx, tile_group, tile_start, tile_end, num_proj, max_rank, block_k, block_m):
    return None
