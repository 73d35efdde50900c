"""The input transform pass: x'_p = T_{p,a}(x) for every token and projection (scute::input_transform).

A program per token (and chunks of its input) copies x or applies the slot's diagonal / block-diagonal T
(`input_transform_kernel`); from `pre_pass_tile_tokens` tokens on, the tokens of block-diagonal slots with
`window_min_tokens` or more run in windows of BLOCK_M tokens on tensor cores (`input_tiles_kernel`), each block
of T read once per window.
"""

from __future__ import annotations

from torch import Tensor

from scute.ops.launch import cdiv, config, kernels, precision, scute_op
from scute.ops.meta import BLOCK_M


@scute_op("scute::input_transform", mutates_args=())
def input_transform(x: Tensor, table: Tensor, token_slots: Tensor, sorted_idx: Tensor, sorted_slots: Tensor,
                    num_tokens_per_slot: Tensor, slot_start: Tensor, num_proj: int, block_b: int,
                    min_block: int) -> Tensor:
    """Each token's input transform, for each projection of the pool.

    Semantics:
        out[p, t] = T_{p,a}(x[t]) with a = token_slots[t]:
                    t ⊙ x[t] (diag), then chunk k ← t_blocks[k or 0] @ chunk k
        out[p, t] = x[t]                                    if a == −1 or slot a of projection p has no T
    Reference: `scute.ops.reference.input_transform_ref` (per projection).

    Shapes: x [T, in] (fp16/bf16/fp32, contiguous), table [P, M, NUM_FIELDS] int64 (`SlotPool.table`),
    token_slots [T] int32, the rest of `LoraMeta` as named; block_b = power of two ≥ the largest OFT block,
    min_block = the smallest one. Returns [P, T, in] in x.dtype. From `pre_pass_tile_tokens` tokens on, the tokens
    of a block-diagonal T whose slot has `window_min_tokens` or more run in windows of BLOCK_M tokens on tensor
    cores (`input_tiles_kernel`, a second launch: a captured layer call runs it on a side stream, calling the two
    launches itself, `input_windows` and `input_rows`): each block of T read once per window, not once per token.
    """
    out = x.new_empty((num_proj, *x.shape))
    if x.shape[0] == 0:
        return out
    tiled = windowed(x.shape[0], block_b)
    if tiled:
        input_windows(out, x, table, sorted_idx, sorted_slots, num_tokens_per_slot, slot_start, block_b, min_block)
    input_rows(out, x, table, token_slots, num_tokens_per_slot, block_b, min_block, tiled)
    return out


def input_rows(out: Tensor, x: Tensor, table: Tensor, token_slots: Tensor, num_tokens_per_slot: Tensor,
               block_b: int, min_block: int, skip_windowed: bool) -> None:
    """`input_transform`'s launch of a program per token (and chunks of its input): writes out[:, t] for every
    token t, except, with `skip_windowed`, those `input_windows` writes. A program takes `pre_pass_iters` chunks
    of `pre_pass_t_elems` elements of T, or from `pre_pass_tile_tokens` tokens on as much T in fewer, wider chunks."""
    c = config()
    num_tokens, in_features = x.shape
    grid, blocks_per_prog, iters = rows_launch(num_tokens, in_features, out.shape[0], block_b, min_block)
    kernels().input_transform_kernel[grid](
        x, out, table, token_slots, num_tokens_per_slot, num_tokens, in_features, table.shape[1], c.window_min_tokens,
        BC=c.pre_pass_copy, BB=block_b, NBP=blocks_per_prog, B_EXACT=min_block == block_b, ITERS=iters,
        SKIP_TILED=skip_windowed, num_warps=c.pre_pass_warps)


def input_windows(out: Tensor, x: Tensor, table: Tensor, sorted_idx: Tensor, sorted_slots: Tensor,
                  num_tokens_per_slot: Tensor, slot_start: Tensor, block_b: int, min_block: int) -> None:
    """`input_transform`'s launch of a program per window of BLOCK_M sorted positions: writes out[:, t] for the
    tokens of block-diagonal slots with `window_min_tokens` or more, on tensor cores."""
    c = config()
    num_tokens, in_features = x.shape
    grid = windows_grid(num_tokens, in_features, out.shape[0], min_block)
    kernels().input_tiles_kernel[grid](
        x, out, table, sorted_idx, sorted_slots, num_tokens_per_slot, slot_start, num_tokens, in_features,
        table.shape[1], c.window_min_tokens, BM=BLOCK_M, BB=max(16, block_b), NBP=c.tile_blocks,
        B_EXACT=min_block == block_b and block_b >= 16, PREC=precision(x.dtype), num_warps=c.window_warps)


def windowed(num_tokens: int, block_b: int) -> bool:
    """Whether `input_transform` launches `input_windows` beside `input_rows`: from `pre_pass_tile_tokens` tokens
    on, for a pool with a block-diagonal T (block_b 1, IA3's diagonal alone, would be windows of nothing)."""
    return num_tokens >= config().pre_pass_tile_tokens and block_b > 1


def rows_launch(num_tokens: int, in_features: int, num_proj: int, block_b: int,
                min_block: int) -> tuple[tuple[int, int, int], int, int]:
    """`input_rows`'s grid, blocks of T per chunk and chunks per program."""
    c = config()
    t_elems = c.pre_pass_t_elems if num_tokens < c.pre_pass_tile_tokens else c.pre_pass_prefill_t_elems
    blocks_per_prog = max(1, t_elems // (block_b * block_b))
    chunks = max(cdiv(in_features, c.pre_pass_copy), cdiv(in_features // min_block, blocks_per_prog))
    iters = max(1, pre_pass_iters(num_tokens) * c.pre_pass_t_elems // t_elems)
    return (num_tokens, cdiv(chunks, iters), num_proj), blocks_per_prog, iters


def windows_grid(num_tokens: int, in_features: int, num_proj: int, min_block: int) -> tuple[int, int, int]:
    """`input_windows`'s grid: a program per window of BLOCK_M sorted positions, `tile_blocks` blocks of T and
    projection."""
    return cdiv(num_tokens, BLOCK_M), cdiv(in_features // min_block, config().tile_blocks), num_proj


def pre_pass_iters(num_tokens: int) -> int:
    """Chunks per program of the input transform: 1 below 2·`pre_pass_tokens` tokens (decode: the latency of one
    chunk), then a power of two up to 8, about one per `pre_pass_tokens` tokens (fewer, longer programs: each pays
    its setup once; OFT at 256 tokens 3-4 µs faster per layer, the mix 12)."""
    return min(8, 1 << (max(num_tokens // config().pre_pass_tokens, 1).bit_length() - 1))


@input_transform.register_fake
def _(x, table, token_slots, sorted_idx, sorted_slots, num_tokens_per_slot, slot_start, num_proj, block_b,
      min_block):
    return x.new_empty((num_proj, *x.shape))
