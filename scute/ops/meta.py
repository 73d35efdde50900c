"""Per-step token metadata of the adapter kernels (vLLM's LoRA kernel metadata, plus a tile list).

Built once per step from ``token_adapter_slots`` and shared by every layer: tokens stably sorted by their
slot's *group* (a slot is its own group unless several slots share VeRA-style matrices, see `scute.ops.pool`),
tokens per group, start offsets, and the list of tiles of up to ``block_m`` tokens the shrink and delta kernels
run over (`BLOCK_M` at decode; a long step's tiles are longer, `scute.ops.launch.tile_tokens`, so that each
group's A and B are read once per tile of many tokens, not per 16).
Everything is computed on the device with fixed-size outputs: no host sync, no data-dependent Python branch, so
the decode step can be captured in a CUDA graph (replaying it recomputes the metadata for the new slots).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

BLOCK_M = 16  # tokens per tile at decode: the smallest tl.dot tile (a tile then holds ~1 token, the rest masked)


def max_tiles(num_tokens: int, num_slots: int, block_m: int = BLOCK_M) -> int:
    """Upper bound of the tile count: Σ_g ceil(c_g / BM) ≤ T // BM + (number of groups present)."""
    return num_tokens // block_m + min(num_tokens, num_slots)


@dataclass
class LoraMeta:
    """Token metadata of one step for one slot grouping (all int32, on the tokens' device).

    token_slots [T]: each token's adapter slot (−1 = base model).
    sorted_idx [T]: token indices stably sorted by group; base tokens last.
    sorted_slots [T]: ``token_slots[sorted_idx]`` (saves the kernels one dependent load).
    num_tokens_per_slot [M], slot_start [M]: tokens of each group and where they start in `sorted_idx`
        (indexed by the group's representative slot; 0 for other slots).
    tile_group [NT], tile_start [NT], tile_end [NT]: tile j covers sorted positions
        ``[tile_start[j], min(tile_start[j] + block_m, tile_end[j]))`` of group ``tile_group[j]``; −1 = no tile.
    multi_tiles [NT], num_multi [1]: the tiles of two tokens or more, in order, then −1; how many there are
        (the multi-token delta loops over exactly these: at decode usually none).
    block_m: tokens per tile at most (the kernels' tile height).
    """

    token_slots: Tensor
    sorted_idx: Tensor
    sorted_slots: Tensor
    num_tokens_per_slot: Tensor
    slot_start: Tensor
    tile_group: Tensor
    tile_start: Tensor
    tile_end: Tensor
    multi_tiles: Tensor
    num_multi: Tensor
    block_m: int = BLOCK_M

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    @staticmethod
    def empty(num_tokens: int, num_slots: int, device: torch.device | str, block_m: int = BLOCK_M) -> LoraMeta:
        """Preallocated buffers, to be filled in place by ``build_lora_meta(..., out=meta)``."""
        nt = max_tiles(num_tokens, num_slots, block_m)
        sizes = (num_tokens, num_tokens, num_tokens, num_slots, num_slots, nt, nt, nt, nt, 1)
        return LoraMeta(*(torch.empty(n, dtype=torch.int32, device=device) for n in sizes), block_m=block_m)


TENSORS = tuple(f.name for f in fields(LoraMeta) if f.name != "block_m")  # the int32 tensors of a LoraMeta


def build_lora_meta(token_slots: Tensor, slot_group: Tensor, out: LoraMeta | None = None,
                    block_m: int = BLOCK_M) -> LoraMeta:
    """Sort the step's tokens by adapter group and cut each group into tiles.

    Semantics:
        key[t] = slot_group[token_slots[t]] if token_slots[t] >= 0 else M        (base tokens sort last)
        sorted_idx = stable argsort(key);  num_tokens_per_slot[g] = #{t : key[t] = g}
        slot_start = exclusive cumsum(num_tokens_per_slot)
        tiles: for each g in increasing order, ceil(count_g / block_m) tiles of consecutive sorted positions;
        multi_tiles: the indices of the tiles holding two tokens or more, compacted.

    Shapes: token_slots [T] int (values in [-1, M)), slot_group [M] int; returns `LoraMeta` (see there),
    written into `out` if given (same T, M and block_m).
    """
    num_slots, num_tokens = slot_group.shape[0], token_slots.shape[0]
    ts = token_slots.long()
    key = torch.where(ts >= 0, slot_group.long()[ts.clamp(min=0)], num_slots)
    sorted_idx = torch.sort(key, stable=True).indices
    # scatter_add_ rather than bincount: bincount's output size depends on the data (a host sync).
    counts = torch.zeros(num_slots + 1, dtype=torch.long, device=ts.device).scatter_add_(0, key, torch.ones_like(key))
    starts = torch.cumsum(counts, 0) - counts
    ntiles = (counts[:num_slots] + block_m - 1) // block_m
    tiles_end = torch.cumsum(ntiles, 0)
    j = torch.arange(max_tiles(num_tokens, num_slots, block_m), device=ts.device)
    g = torch.searchsorted(tiles_end, j, right=True)  # the group whose tile range holds tile j (M: none)
    gc = g.clamp(max=num_slots - 1)
    tile_start = starts[gc] + (j - (tiles_end[gc] - ntiles[gc])) * block_m
    tile_end = starts[gc] + counts[gc]
    multi = (g < num_slots) & (torch.minimum(tile_start + block_m, tile_end) - tile_start >= 2)
    at = torch.where(multi, torch.cumsum(multi, 0) - 1, j.shape[0])  # non-multi tiles go to a spare last entry
    multi_tiles = torch.full((j.shape[0] + 1,), -1, dtype=torch.long, device=ts.device).scatter_(0, at, j)
    meta = LoraMeta(ts, sorted_idx, ts[sorted_idx], counts[:num_slots], starts[:num_slots],
                    torch.where(g < num_slots, gc, -1), tile_start, tile_end, multi_tiles[:-1], multi.sum()[None],
                    block_m)
    if out is None:
        return LoraMeta(*(getattr(meta, name).to(torch.int32) for name in TENSORS), block_m=block_m)
    assert out.block_m == block_m, "out was allocated for another tile size"
    for name in TENSORS:
        getattr(out, name).copy_(getattr(meta, name))
    return out

