"""The low-rank delta passes: d_p = B_p (m ⊙ h) for each adapter token (scute::lora_delta_rows_ for the tokens
of one-token tiles, scute::lora_delta_tiles_ for multi-token tiles; they write disjoint rows of d)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from scute.ops.launch import (block_r, cdiv, config, kernels, persistent_programs, precision, row_block_r, scute_op,
                              tl_dtype)


@scute_op("scute::lora_delta_rows_", mutates_args=("ds",))
def lora_delta_rows_(ds: list[Tensor], h: Tensor, table: Tensor, sorted_slots: Tensor, sorted_idx: Tensor,
                     tile_group: Tensor, tile_start: Tensor, tile_end: Tensor, half_n: int, chunks_per_prog: int,
                     max_rank: int, mat_dtype: torch.dtype, block_m: int) -> None:
    """The low-rank delta of the tokens of one-token tiles (most tokens at decode), for each projection.

    Semantics (token t with slot a ≥ 0 at sorted position i, projection p, group g of a with rank r > 0):
        ds[p][t] = B_{p,g} (m_a ⊙ Σ_s h[s, i, hoff : hoff + r])
    (h[0] alone where the shrink summed the splits: see `shrink_`), computed in float32 and stored in ds's dtype
    (`SlotPool.delta_dtype`: the model's dtype, or float32 for a pool whose delta can be much larger than the
    adapter's net effect, e.g. DoRA's); for t alone in its tile. `lora_delta_tiles_` writes the other adapter
    tokens' rows; rows of base tokens are not written.

    Shapes: ds = P ≤ 3 tensors [T, out_p] (contiguous, one dtype), mat_dtype the pool's matrix dtype, h from
    `shrink_`, sorted_slots [T] int32, the rest (and `block_m`) as in `shrink_`. A program per (tile,
    `chunks_per_prog` chunks of 2·half_n columns of one projection), in rank steps of `row_block_r(max_rank,
    half_n)`.
    """
    c = config()
    num_tokens = ds[0].shape[0]
    if num_tokens == 0:
        return
    outs = [d.shape[1] for d in ds] + [0] * (3 - len(ds))
    kernels().delta_rows_kernel[rows_grid(tile_group.shape[0], outs, half_n, chunks_per_prog)](
        *_delta_args(ds, outs, h, table, sorted_slots, sorted_idx, tile_group, tile_start, tile_end),
        chunks_per_prog, B_TY=tl_dtype(mat_dtype), P=len(ds), SPLIT_K=h.shape[0], BM=block_m,
        BR=row_block_r(max_rank, half_n), BN=2 * half_n, ONCE_ABOVE=c.row_block_r, num_warps=c.expand_warps,
        num_stages=c.expand_stages)


def rows_grid(num_tiles: int, outs: Sequence[int], half_n: int, chunks_per_prog: int) -> tuple[int, int]:
    """`lora_delta_rows_`'s grid: a program per (tile, `chunks_per_prog` chunks of 2·half_n columns of one
    projection)."""
    return num_tiles, sum(cdiv(n, 2 * half_n * chunks_per_prog) for n in outs)


def tiles_grid(device: torch.device) -> tuple[int]:
    """`lora_delta_tiles_`'s grid: the persistent programs of `device`."""
    return (persistent_programs(device),)


@lora_delta_rows_.register_fake
def _(ds, h, table, sorted_slots, sorted_idx, tile_group, tile_start, tile_end, half_n, chunks_per_prog, max_rank,
      mat_dtype, block_m):
    return None


@scute_op("scute::lora_delta_tiles_", mutates_args=("ds",))
def lora_delta_tiles_(ds: list[Tensor], h: Tensor, table: Tensor, sorted_slots: Tensor, sorted_idx: Tensor,
                      tile_group: Tensor, tile_start: Tensor, tile_end: Tensor, multi_tiles: Tensor,
                      num_multi: Tensor, max_rank: int, tile_half_n: int, mat_dtype: torch.dtype,
                      block_m: int) -> None:
    """The semantics of `lora_delta_rows_` for the tokens of multi-token tiles (prefill, a popular adapter, a
    shared VeRA group), from h[0] (the shrink sums these tiles' splits there). The two write disjoint rows of ds,
    so they may run at the same time.

    Shapes: as in `lora_delta_rows_`; multi_tiles [NT], num_multi [1] (`LoraMeta`); max_rank ≥ every rank in the
    table. A persistent walk of the (multi-token tile, run of chunks of 2·tile_half_n columns) items.
    """
    c = config()
    num_tokens = ds[0].shape[0]
    if num_tokens < 2:
        return
    outs = [d.shape[1] for d in ds] + [0] * (3 - len(ds))
    (programs,) = grid = tiles_grid(ds[0].device)
    kernels().delta_tiles_kernel[grid](
        *_delta_args(ds, outs, h, table, sorted_slots, sorted_idx, tile_group, tile_start, tile_end), multi_tiles,
        num_multi, c.tile_items_per_program * programs, B_TY=tl_dtype(mat_dtype), P=len(ds), BM=block_m,
        BR=block_r(max_rank), BN=2 * tile_half_n, PREC=precision(mat_dtype), num_warps=c.tile_warps,
        num_stages=c.tile_stages)


@lora_delta_tiles_.register_fake
def _(ds, h, table, sorted_slots, sorted_idx, tile_group, tile_start, tile_end, multi_tiles, num_multi, max_rank,
      tile_half_n, mat_dtype, block_m):
    return None


def _delta_args(ds, outs, h, table, sorted_slots, sorted_idx, tile_group, tile_start, tile_end) -> tuple:
    """The arguments both delta kernels start with (three d pointers, unused ones repeating the first)."""
    return (*ds, *[ds[0]] * (3 - len(ds)), h, table, sorted_slots, sorted_idx, tile_group, tile_start, tile_end,
            ds[0].shape[0], table.shape[1], h.shape[2], *outs)
