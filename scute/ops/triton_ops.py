"""The six-slot op on the GPU: Triton kernels registered as `torch.library` custom ops.

One adapted layer call (``P`` projections sharing the input ``x``; ``P = 1`` for a `ScuteLinear`):

    x'_p = input_transform(x)                       only if some slot of the pool has T      (scute::input_transform)
    h    = shrink(x)                                A x for every token's group, split over K (scute::shrink_)
    d_p  = B_p (m ⊙ h)                              each adapter token's low-rank delta      (scute::lora_delta_rows_,
                                                    one-token tiles; scute::lora_delta_tiles_, the others)
    z_p  = F.linear(x'_p or x, W_p, b_p)            the base GEMM stays on cuBLAS; on the GPU the two lines
                                                    above run beside it, on side streams
    z_p ← o ⊙ z_p + o2 ⊙ rot_g(z_p) + c + v ⊙ d_p    in place, on the GPU on a side stream as soon as GEMM p and
                                                    the deltas are done                      (scute::epilogue_)

Tokens whose slot is −1 are never read or written by the kernels after the GEMM: their rows are exactly
``F.linear(x, W, b)``. Every launch has a fixed grid (sized by the number of tokens and slots, not by the data)
and no host sync, so the whole call can be captured in a CUDA graph; the fake implementations let
`torch.compile` trace through it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Collection, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from scute.ops.meta import BLOCK_M, LoraMeta, max_tiles
from scute.ops.pool import SlotPool

BLOCK_K = 128  # shrink K tile
HALF_N = 64  # one-token delta chunk = 2·HALF_N output columns (rank steps: `row_block_r`)
EPILOGUE_HALF_N = 512  # the epilogue's chunk: EPILOGUE_HALF_N column pairs
TILE_HALF_N = 128  # multi-token tiles: chunk = 2·TILE_HALF_N columns at rank tile 16 or 32; a larger rank tile
# narrows it (the B block of a rank step stays 2·TILE_HALF_N x 32 elements)
ROW_BLOCK_R = 16  # rank step of one-token tiles, up to ROW_MAX_BLOCK_R for a pool of wide ranks whose chunks
ROW_MAX_BLOCK_R = 64  # are narrow enough (`row_block_r`)
MAX_BLOCK_R = 64  # rank tile: the pool's largest rank rounded up to a power of two in [16, 64]; larger ranks
# get several rank tiles (the shrink's grid, the multi-token delta's loop)
TARGET_PROGRAMS = 1024  # the shrink's split-K aims at this many programs (~8 per SM on an H200)...
MAX_SPLIT_K = 16  # ...whose partials the one-token delta sums in one load of SPLIT_K x ROW_BLOCK_R
PRE_PASS_TOKENS = 64  # the input transform's programs take one more chunk per this many tokens (`pre_pass_iters`)
PRE_PASS_TILE_TOKENS = 128  # ...and from this many tokens on, block transforms of slots with WINDOW_MIN_TOKENS
WINDOW_MIN_TOKENS = BLOCK_M  # tokens or more run in windows of BLOCK_M tokens (at least BLOCK_M: a window then holds
# two such slots at most; windows from 2 tokens a slot measured faster for 256 tokens of one OFT adapter, 116 ->
# 84 us per layer, and slower for 256 tokens of 64 adapters, 142 -> 188)
TILE_BLOCKS, WINDOW_WARPS = 2, 4  # blocks of T per program of those windows (one batched product; 4 blocks at 4
# warps take 168 registers), and warps: OFT 256/1 and 256/16 10-17 us faster per layer than 4 blocks one after the
# other (4 blocks at 8 warps, or 8 at 16, gained less)
PRE_PASS_COPY = 1024  # the row kernel: elements a program copies (tokens without a block transform)...
PRE_PASS_T_ELEMS = 4096  # ...and elements of T a program reads (whole blocks): ~4k at 4 warps, no register spill
PRE_PASS_PREFILL_T_ELEMS = 8192  # from PRE_PASS_TILE_TOKENS tokens on, with as many times fewer chunks per program:
# the same T per program in wider vectors (OFT 256/64 -19 us, 256/1 -5, the mix 256/64 -4; twice the T per program
# instead cost the mix 256/64 5-9 us)
PRE_PASS_WARPS = 4
TARGET_EXPAND_PROGRAMS = 4096  # the one-token delta and the epilogue give each program enough chunks to bring
# their grid to this
# Triton launch options (module constants: the bench tunes them). HALF_N 64 and 1 warp for the one-token delta
# are what `bench/bench_ops.py --sweep` picked on the H200, by a small margin over 128 and 2 warps
# (bench/results/sweep_half_n_h200.json); 3 persistent programs per SM for the multi-token delta, 4 items each:
# bench/results/sweep_tile_programs_h200.json.
SHRINK_WARPS, EXPAND_WARPS, TILE_WARPS, SHRINK_STAGES, EXPAND_STAGES, TILE_STAGES = 4, 1, 4, 3, 1, 1
EPILOGUE_WARPS = 4  # with EPILOGUE_HALF_N 512: the sweep's pick (the epilogue's shape moves the layer by ~1 µs)
SHARED_BLOCK_N, SHARED_MAX_BLOCK_M, SHARED_MAX_BLOCK_K = 128, 64, 64  # the shared group's tile GEMM
SHARED_WARPS, SHARED_STAGES = 4, 3
SHARED_FUSED_TOKENS = 16  # up to this many tokens that GEMM forms m ⊙ h itself, without the scale pass (one launch
# fewer: VeRA at 1 and 16 tokens 9-10 us faster per layer); from 64 tokens on, its
# per-column-tile gathers of h and m cost more than the pass (VeRA 64/1 +25 us, 256/1 +95)
TILE_PROGRAMS_PER_SM = 3  # the multi-token delta is persistent: this many programs per SM walk its items...
TILE_ITEMS_PER_PROGRAM = 4  # ...about this many each (an item's setup is a chain of ~6 dependent loads, so a
# prefill of many tiles gives each item a run of chunks; a few tiles, one chunk per item)


class ScuteOp:
    """One pass: a `torch.library` custom op (with its fake) that `torch.compile` traces, called as the plain
    function it wraps everywhere else. The dispatcher's wrapping of a Python custom op (schema checks, in-place
    bookkeeping) costs an eager call 30-170 µs of host time, more than the Triton launch inside it
    (`bench/profile_step.py`); a CUDA graph records the same launches either way."""

    def __init__(self, name: str, mutates_args: tuple[str, ...], fn) -> None:
        self.fn, self.op = fn, torch.library.custom_op(name, fn, mutates_args=mutates_args)
        functools.update_wrapper(self, fn)

    def register_fake(self, fake):
        return self.op.register_fake(fake)

    def __call__(self, *args, **kwargs):
        return (self.op if torch.compiler.is_compiling() else self.fn)(*args, **kwargs)


def scute_op(name: str, mutates_args: tuple[str, ...]):
    """Decorator: the function as a `ScuteOp` named `name`."""
    return lambda fn: ScuteOp(name, mutates_args, fn)


def _kernels():
    from scute.ops import kernels  # lazy: triton.jit reads TRITON_INTERPRET when the kernels are decorated

    return kernels


def block_r(max_rank: int, cap: int | None = None) -> int:
    """Rank tile of a pool whose largest rank is `max_rank`: a power of two in [16, cap] (tl.dot needs 16; cap
    defaults to MAX_BLOCK_R)."""
    return min(max(16, 1 << (max(max_rank, 1) - 1).bit_length()), cap or MAX_BLOCK_R)


def rank_tiles(max_rank: int) -> int:
    """Rank tiles of a pool whose largest rank is `max_rank` (the shrink's grid has one program per tile)."""
    return triton_cdiv(max_rank, block_r(max_rank))


def choose_split_k(in_features: int, programs: int, block_k: int = BLOCK_K) -> int:
    """Split-K factor of the shrink, given its `programs` per split (tiles x projections: a wide rank's extra rank
    tiles add programs of their own, and must not cut every other group's split): at decode one adapter's A is
    read by a handful of programs unless K is split. A power of two, fixed by the shapes."""
    want = min(max(1, TARGET_PROGRAMS // max(programs, 1)), MAX_SPLIT_K, triton_cdiv(in_features, block_k))
    return 1 << (want.bit_length() - 1)  # a power of two: the splits are summed with one tl.arange


def choose_chunks_per_prog(num_tiles: int, out_features: Sequence[int], half_n: int = HALF_N) -> int:
    """Column chunks per program of the one-token delta (`num_tiles` tiles) or of the epilogue (that many tokens):
    each program pays a setup of several dependent loads, so it streams several chunks once the grid would exceed
    TARGET_EXPAND_PROGRAMS."""
    chunks = sum(triton_cdiv(o, 2 * half_n) for o in out_features)
    return max(1, triton_cdiv(num_tiles * chunks, TARGET_EXPAND_PROGRAMS))


def row_block_r(max_rank: int, half_n: int) -> int:
    """Rank step of the one-token delta: the pool's largest rank rounded up to a power of two in [ROW_BLOCK_R,
    ROW_MAX_BLOCK_R], as long as the [2·half_n, step] block of B stays within the 2·HALF_N x ROW_BLOCK_R elements
    of a rank-16 pool (one warp's registers). A VeRA token at decode (rank 256, chunks of 32 columns) then walks 4
    rank steps instead of 16, each a load the one warp waits for."""
    return max(ROW_BLOCK_R, min(block_r(max_rank, ROW_MAX_BLOCK_R), ROW_BLOCK_R * HALF_N // half_n))


def rows_half_n(num_tiles: int, out_features: Sequence[int], max_rank: int, half_n: int = HALF_N) -> int:
    """Half-chunk of the one-token delta: `half_n`, halved (down to 16) while a chunk of the pool's widest rank
    holds more of B than a rank-16 chunk at HALF_N, and the grid stays within TARGET_EXPAND_PROGRAMS. A one-token
    program reads chunk x rank elements of B in serial rank steps: with one token of rank 256 (VeRA at decode) a
    128-column chunk is 16 steps of one program, and a whole projection a few dozen programs; narrower chunks
    spread it over the SMs."""
    while half_n > 16 and max_rank * half_n > ROW_BLOCK_R * HALF_N and \
            num_tiles * sum(triton_cdiv(o, half_n) for o in out_features) <= TARGET_EXPAND_PROGRAMS:
        half_n //= 2
    return half_n


@functools.cache
def persistent_programs(device: torch.device) -> int:
    """Programs of a persistent launch on `device` (a few per SM; 4 in the CPU interpreter). Not capped by what
    an SM holds: at 255 registers only 2 of the 3 fit, yet capping to 2 cost the mix at B=256/64 31 µs and gained
    VeRA prefill 12."""
    if device.type != "cuda":
        return 4
    return TILE_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------- custom ops
@scute_op("scute::input_transform", mutates_args=())
def input_transform(x: Tensor, table: Tensor, token_slots: Tensor, sorted_idx: Tensor, sorted_slots: Tensor,
                    num_tokens_per_slot: Tensor, slot_start: Tensor, num_proj: int, block_b: int,
                    min_block: int) -> Tensor:
    """Each token's input transform, for each projection of the pool.

    Semantics:
        out[p, t] = T_{p,a}(x[t]) with a = token_slots[t]:  t ⊙ x[t] (diag), then chunk k ← t_blocks[k or 0] @ chunk k
        out[p, t] = x[t]                                    if a == −1 or slot a of projection p has no T
    Reference: `scute.ops.reference.input_transform_ref` (per projection).

    Shapes: x [T, in] (fp16/bf16/fp32, contiguous), table [P, M, NUM_FIELDS] int64 (`SlotPool.table`),
    token_slots [T] int32, the rest of `LoraMeta` as named; block_b = power of two ≥ the largest OFT block,
    min_block = the smallest one. Returns [P, T, in] in x.dtype. From PRE_PASS_TILE_TOKENS tokens on, the tokens
    of a block-diagonal T whose slot has WINDOW_MIN_TOKENS or more run in windows of BLOCK_M tokens on tensor
    cores (`input_tiles_kernel`, a second launch, on a side stream on the GPU): each block of T read once per
    window, not once per token.
    """
    out = x.new_empty((num_proj, *x.shape))
    if x.shape[0] == 0:
        return out
    # block_b 1: the pool has no block-diagonal T (IA3's diagonal alone), and windows would be a grid of nothing
    tiled = x.shape[0] >= PRE_PASS_TILE_TOKENS and block_b > 1
    # The two launches write disjoint tokens of out: in a CUDA graph the windows run on a side stream beside the row
    # kernel. In line, where no slot has enough tokens (256 tokens of 64 OFT adapters), their launches alone took
    # 13 µs of a layer's critical path; beside it the layer still pays 13-22 µs for the forks and joins.
    side = _side_streams(x.device) if tiled else None
    if side is not None:
        side[2].wait_stream(torch.cuda.current_stream(x.device))
    if tiled:
        with _on(side, 2):
            input_windows(out, x, table, sorted_idx, sorted_slots, num_tokens_per_slot, slot_start, block_b,
                          min_block)
    input_rows(out, x, table, token_slots, num_tokens_per_slot, block_b, min_block, tiled)
    if side is not None:
        torch.cuda.current_stream(x.device).wait_stream(side[2])
    return out


def input_rows(out: Tensor, x: Tensor, table: Tensor, token_slots: Tensor, num_tokens_per_slot: Tensor,
               block_b: int, min_block: int, skip_windowed: bool) -> None:
    """`input_transform`'s launch of a program per token (and chunks of its input): writes out[:, t] for every
    token t, except, with `skip_windowed`, those `input_windows` writes. A program takes `pre_pass_iters` chunks
    of PRE_PASS_T_ELEMS elements of T, or from PRE_PASS_TILE_TOKENS tokens on as much T in fewer, wider chunks."""
    num_tokens, in_features = x.shape
    t_elems = PRE_PASS_T_ELEMS if num_tokens < PRE_PASS_TILE_TOKENS else PRE_PASS_PREFILL_T_ELEMS
    blocks_per_prog = max(1, t_elems // (block_b * block_b))
    chunks = max(triton_cdiv(in_features, PRE_PASS_COPY), triton_cdiv(in_features // min_block, blocks_per_prog))
    iters = max(1, pre_pass_iters(num_tokens) * PRE_PASS_T_ELEMS // t_elems)
    _kernels().input_transform_kernel[(num_tokens, triton_cdiv(chunks, iters), out.shape[0])](
        x, out, table, token_slots, num_tokens_per_slot, num_tokens, in_features, table.shape[1], WINDOW_MIN_TOKENS,
        BC=PRE_PASS_COPY, BB=block_b, NBP=blocks_per_prog, B_EXACT=min_block == block_b, ITERS=iters,
        SKIP_TILED=skip_windowed, num_warps=PRE_PASS_WARPS)


def input_windows(out: Tensor, x: Tensor, table: Tensor, sorted_idx: Tensor, sorted_slots: Tensor,
                  num_tokens_per_slot: Tensor, slot_start: Tensor, block_b: int, min_block: int) -> None:
    """`input_transform`'s launch of a program per window of BLOCK_M sorted positions: writes out[:, t] for the
    tokens of block-diagonal slots with WINDOW_MIN_TOKENS or more, on tensor cores."""
    num_tokens, in_features = x.shape
    grid = (triton_cdiv(num_tokens, BLOCK_M), triton_cdiv(in_features // min_block, TILE_BLOCKS), out.shape[0])
    _kernels().input_tiles_kernel[grid](
        x, out, table, sorted_idx, sorted_slots, num_tokens_per_slot, slot_start, num_tokens, in_features,
        table.shape[1], WINDOW_MIN_TOKENS, BM=BLOCK_M, BB=max(16, block_b), NBP=TILE_BLOCKS,
        B_EXACT=min_block == block_b and block_b >= 16, PREC=_precision(x.dtype), num_warps=WINDOW_WARPS)


def pre_pass_iters(num_tokens: int) -> int:
    """Chunks per program of the input transform: 1 below 2·PRE_PASS_TOKENS tokens (decode: the latency of one
    chunk), then a power of two up to 8, about one per PRE_PASS_TOKENS tokens (fewer, longer programs: each pays
    its setup once; OFT at 256 tokens 3-4 µs faster per layer, the mix 12)."""
    return min(8, 1 << (max(num_tokens // PRE_PASS_TOKENS, 1).bit_length() - 1))


@input_transform.register_fake
def _(x, table, token_slots, sorted_idx, sorted_slots, num_tokens_per_slot, slot_start, num_proj, block_b,
      min_block):
    return x.new_empty((num_proj, *x.shape))


@scute_op("scute::shrink_", mutates_args=("h",))
def shrink_(h: Tensor, x: Tensor, table: Tensor, sorted_idx: Tensor, tile_group: Tensor, tile_start: Tensor,
            tile_end: Tensor, num_proj: int, max_rank: int, block_k: int) -> None:
    """Down projection of every token by its group's A (all projections of the pool), split over K.

    Semantics:
        Σ_s h[s, i, hoff_{p,g} : hoff_{p,g} + r_{p,g}] = A_{p,g} x[sorted_idx[i]]     for each tile's rows i (group g)
    (the rank-space scale m is applied by the delta; rows of base tokens and unused columns are not written).
    Multi-token tiles and groups wider than ROW_BLOCK_R have the sum in h[0] instead (summed once, in split order).

    Shapes: h [split_k, T, h_width] float32, indexed by *sorted* position; x [T, in], table (see
    `input_transform`), sorted_idx [T], tile_* [NT] int32 (`LoraMeta`); max_rank ≥ every rank in the table
    (sizes the grid's rank tiles).
    """
    split_k, num_tokens, h_width = h.shape
    in_features = x.shape[1]
    if num_tokens == 0:
        return
    k_per_split = triton_cdiv(triton_cdiv(in_features, split_k), block_k) * block_k
    rt = rank_tiles(max_rank)
    grid = (tile_group.shape[0], split_k * rt, num_proj)
    _kernels().shrink_kernel[grid](
        x, h, arrival_counters(x.device, grid[0] * rt * num_proj), table, sorted_idx, tile_group, tile_start,
        tile_end, num_tokens, in_features, table.shape[1], h_width, k_per_split, SPLIT_K=split_k, RT=rt, BM=BLOCK_M,
        BR=block_r(max_rank), BK=block_k, PREC=_precision(x.dtype), ONCE_ABOVE=ROW_BLOCK_R,
        num_warps=SHRINK_WARPS, num_stages=SHRINK_STAGES)


@shrink_.register_fake
def _(h, x, table, sorted_idx, tile_group, tile_start, tile_end, num_proj, max_rank, block_k):
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


@functools.cache
def _tl_dtype(dtype: torch.dtype):
    """The Triton dtype of a torch matrix dtype (a kernel constant: the pool table's pointers are untyped)."""
    import triton.language as tl

    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # 16-bit inputs: products are exact either way


@scute_op("scute::lora_delta_rows_", mutates_args=("ds",))
def lora_delta_rows_(ds: list[Tensor], h: Tensor, table: Tensor, sorted_slots: Tensor, sorted_idx: Tensor,
                     tile_group: Tensor, tile_start: Tensor, tile_end: Tensor, half_n: int, chunks_per_prog: int,
                     max_rank: int, mat_dtype: torch.dtype) -> None:
    """The low-rank delta of the tokens of one-token tiles (most tokens at decode), for each projection.

    Semantics (token t with slot a ≥ 0 at sorted position i, projection p, group g of a with rank r > 0):
        ds[p][t] = B_{p,g} (m_a ⊙ Σ_s h[s, i, hoff : hoff + r])
    (h[0] alone where the shrink summed the splits: see `shrink_`), computed in float32 and stored in ds's dtype
    (`SlotPool.delta_dtype`: the model's dtype, or float32 for a pool whose delta can be much larger than the
    adapter's net effect, e.g. DoRA's); for t alone in its tile. `lora_delta_tiles_` writes the other adapter
    tokens' rows; rows of base tokens are not written.

    Shapes: ds = P ≤ 3 tensors [T, out_p] (contiguous, one dtype), mat_dtype the pool's matrix dtype, h from
    `shrink_`, sorted_slots [T] int32, the rest as in `shrink_`. A program per (tile, `chunks_per_prog` chunks of
    2·half_n columns of one projection), in rank steps of `row_block_r(max_rank, half_n)`.
    """
    num_tokens = ds[0].shape[0]
    if num_tokens == 0:
        return
    outs = [d.shape[1] for d in ds] + [0] * (3 - len(ds))
    progs = sum(triton_cdiv(n, 2 * half_n * chunks_per_prog) for n in outs)
    _kernels().delta_rows_kernel[(tile_group.shape[0], progs)](
        *_delta_args(ds, outs, h, table, sorted_slots, sorted_idx, tile_group, tile_start, tile_end),
        chunks_per_prog, B_TY=_tl_dtype(mat_dtype), P=len(ds), SPLIT_K=h.shape[0], BM=BLOCK_M,
        BR=row_block_r(max_rank, half_n), BN=2 * half_n, ONCE_ABOVE=ROW_BLOCK_R, num_warps=EXPAND_WARPS,
        num_stages=EXPAND_STAGES)


@lora_delta_rows_.register_fake
def _(ds, h, table, sorted_slots, sorted_idx, tile_group, tile_start, tile_end, half_n, chunks_per_prog, max_rank,
      mat_dtype):
    return None


@scute_op("scute::lora_delta_tiles_", mutates_args=("ds",))
def lora_delta_tiles_(ds: list[Tensor], h: Tensor, table: Tensor, sorted_slots: Tensor, sorted_idx: Tensor,
                      tile_group: Tensor, tile_start: Tensor, tile_end: Tensor, multi_tiles: Tensor,
                      num_multi: Tensor, max_rank: int, tile_half_n: int, mat_dtype: torch.dtype) -> None:
    """The semantics of `lora_delta_rows_` for the tokens of multi-token tiles (prefill, a popular adapter, a
    shared VeRA group), from h[0] (the shrink sums these tiles' splits there). The two write disjoint rows of ds,
    so they may run at the same time.

    Shapes: as in `lora_delta_rows_`; multi_tiles [NT], num_multi [1] (`LoraMeta`); max_rank ≥ every rank in the
    table. A persistent walk of the (multi-token tile, run of chunks of 2·tile_half_n columns) items.
    """
    num_tokens = ds[0].shape[0]
    if num_tokens < 2:
        return
    outs = [d.shape[1] for d in ds] + [0] * (3 - len(ds))
    programs = persistent_programs(ds[0].device)
    _kernels().delta_tiles_kernel[(programs,)](
        *_delta_args(ds, outs, h, table, sorted_slots, sorted_idx, tile_group, tile_start, tile_end), multi_tiles,
        num_multi, TILE_ITEMS_PER_PROGRAM * programs, B_TY=_tl_dtype(mat_dtype), P=len(ds), BM=BLOCK_M,
        BR=block_r(max_rank), BN=2 * tile_half_n, PREC=_precision(mat_dtype), num_warps=TILE_WARPS,
        num_stages=TILE_STAGES)


@lora_delta_tiles_.register_fake
def _(ds, h, table, sorted_slots, sorted_idx, tile_group, tile_start, tile_end, multi_tiles, num_multi, max_rank,
      tile_half_n, mat_dtype):
    return None


@scute_op("scute::lora_delta_shared_", mutates_args=("ds", "hv", "hs"))
def lora_delta_shared_(ds: list[Tensor], hv: Tensor, hs: Tensor, x: Tensor, a: Tensor, bs: list[Tensor], m: Tensor,
                       sorted_idx: Tensor, sorted_slots: Tensor, num_tokens_per_slot: Tensor, slot_start: Tensor,
                       group: int, a_of: list[int], outs: list[int]) -> None:
    """The low-rank delta of the pool's shared group (`scute.ops.pool`), for each projection it adapts.

    Semantics (token t of the group at sorted position i, with slot s; projection p with a_of[p] ≥ 0):
        ds[p][t] = B_p (m[p, s] ⊙ (A_{a_of[p]} x[t]))
    A x for every token (cuBLAS, stored in x's dtype as PEFT's is: which tokens are the group's is known only on
    the device; 2 µs faster per layer than a float32 A x at the mix 64/64), m ⊙ h in
    float32 rounded to the matrices' dtype, the product with B_p in float32 sums (a tile GEMM over the group's
    sorted rows, `shared_expand_kernel`), stored in ds's dtype; rows of other tokens are not written. m ⊙ h is a
    pass of its own (into hs) from SHARED_FUSED_TOKENS + 1 tokens on, else formed inside the GEMM.

    Shapes: ds as in `lora_delta_rows_`; hv [NA, T, r] (x's dtype) and hs [P, T, r] (the matrices') scratch;
    x [T, in]; a [NA, r, in]; bs P tensors [out_p, r] (contiguous); m [P, M, r] float32; sorted_idx,
    sorted_slots, num_tokens_per_slot, slot_start from `LoraMeta`; group: the group's representative slot;
    a_of, outs: `SlotPool.shared_a_of`, `SlotPool.shared_outs`.
    """
    num_tokens, num_proj, rank = x.shape[0], len(ds), a.shape[1]
    if num_tokens == 0:
        return
    for i in range(a.shape[0]):
        torch.mm(x, a[i].t(), out=hv[i])
    rank_block = max(16, 1 << (rank - 1).bit_length())  # the scale pass's whole row; the GEMM's K step is capped
    fused = num_tokens <= SHARED_FUSED_TOKENS
    a_of = [*a_of, *[-1] * (3 - num_proj)]
    if not fused:
        _kernels().shared_scale_kernel[(num_tokens, num_proj)](
            hv, hs, m, sorted_idx, sorted_slots, num_tokens_per_slot, slot_start, group, num_tokens, m.shape[1], rank,
            *a_of, P=num_proj, BR=rank_block)
    block_m = min(SHARED_MAX_BLOCK_M, max(16, 1 << (num_tokens - 1).bit_length()))
    grid = (triton_cdiv(num_tokens, block_m), sum(triton_cdiv(o, SHARED_BLOCK_N) for o in outs))
    _kernels().shared_expand_kernel[grid](
        *ds, *[ds[0]] * (3 - num_proj), hs, hv, m, *bs, *[bs[0]] * (3 - num_proj), sorted_idx, sorted_slots,
        num_tokens_per_slot, slot_start, group, num_tokens, m.shape[1], rank, *outs, *[0] * (3 - num_proj), *a_of,
        P=num_proj, BM=block_m, BN=SHARED_BLOCK_N, BK=min(SHARED_MAX_BLOCK_K, rank_block), FUSED=fused,
        PREC=_precision(hs.dtype), num_warps=SHARED_WARPS, num_stages=SHARED_STAGES)


@lora_delta_shared_.register_fake
def _(ds, hv, hs, x, a, bs, m, sorted_idx, sorted_slots, num_tokens_per_slot, slot_start, group, a_of, outs):
    return None


def _delta_args(ds, outs, h, table, sorted_slots, sorted_idx, tile_group, tile_start, tile_end) -> tuple:
    """The arguments both delta kernels start with (three d pointers, unused ones repeating the first)."""
    return (*ds, *[ds[0]] * (3 - len(ds)), h, table, sorted_slots, sorted_idx, tile_group, tile_start, tile_end,
            ds[0].shape[0], table.shape[1], h.shape[2], *outs)


@scute_op("scute::epilogue_", mutates_args=("zs",))
def epilogue_(zs: list[Tensor], ds: list[Tensor], table: Tensor, token_slots: Tensor, half_n: int,
              chunks_per_prog: int) -> None:
    """The epilogue, in place on each projection's base output.

    Semantics (token t with slot a ≥ 0, projection p, group g of a; z = zs[p][t] before the call):
        zs[p][t] ← o ⊙ z + o2 ⊙ rot_g(z) + c + v ⊙ ds[p][t]       (ds[p][t] = 0 if g has no low-rank part in p)
    with empty slots as identity / zero, computed in float32 and stored in z's dtype; rows of base tokens
    (slot −1) are not touched. Reference: `scute.ops.reference.epilogue_ref`.

    Shapes: zs = P ≤ 3 tensors [T, out_p] (unit column stride, any row stride: column slices of one merged
    GEMM's output will do; one dtype), ds as many contiguous tensors of the same shapes
    (from the delta ops; any, if the pool has no low-rank slot), token_slots [T] int32. A program per (token,
    `chunks_per_prog` chunks of 2·half_n columns of one projection).
    """
    num_tokens = zs[0].shape[0]
    if num_tokens == 0:
        return
    outs = [z.shape[1] for z in zs] + [0] * (3 - len(zs))
    progs = sum(triton_cdiv(n, 2 * half_n * chunks_per_prog) for n in outs)
    _kernels().epilogue_kernel[(num_tokens, progs)](
        *zs, *[zs[0]] * (3 - len(zs)), *ds, *[ds[0]] * (3 - len(ds)), table, token_slots, table.shape[1], *outs,
        *[z.stride(0) for z in zs], *[0] * (3 - len(zs)), chunks_per_prog, P=len(zs), HB=half_n,
        num_warps=EPILOGUE_WARPS)


@epilogue_.register_fake
def _(zs, ds, table, token_slots, half_n, chunks_per_prog):
    return None


# ---------------------------------------------------------------------------------------------- one layer call
def scute_linears_triton(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None], pool: SlotPool,
                         meta: LoraMeta, half_n: int = HALF_N, block_k: int = BLOCK_K,
                         tile_half_n: int | None = None, active_slots: Collection[int] | None = None,
                         merged: tuple[Tensor, Tensor | None] | None = None) -> list[Tensor]:
    """``P`` adapted projections of one input (q/k/v, gate/up, or one layer): the normal form of every token.

    Semantics: ys[p] = scute_linear_ref(x, weights[p], biases[p], slots[p], token_slots) for the slots the pool
    was built from. Shapes: x [T, in]; weights[p] [out_p, in]; returns ys[p] [T, out_p] in x.dtype.
    `active_slots`: the slots of the step's tokens, known on the host (a superset will do), so that the call runs
    only the passes they need (`SlotPool.step_kinds`: a step with no OFT token has no pre-pass, one with no VeRA
    token no shared-group products, one of base tokens only is the GEMMs); None: any slot. A CUDA graph captured
    with it is valid only for steps whose slots are among them. Ignored under torch.compile, whose graph would
    otherwise be traced again for every new set. `merged`: the weights (and biases) concatenated along the
    outputs, ``weights[p]`` being its row slices (`merged_gemm`): the base GEMMs of a step without an input
    transform then run as one.
    """
    x = x.contiguous()
    kinds = pool.step_kinds(None if torch.compiler.is_compiling() else active_slots)
    if not kinds.expand:
        xs = _input_transform(x, pool, meta) if kinds.input_transform else None
        return _base_gemms(x, xs, weights, biases, merged)
    # The low-rank deltas read only x: on the GPU the shrink and the one-token delta run on a side stream, beside
    # the base GEMMs (bandwidth-bound too, but they leave part of it, and SMs, unused), the multi-token delta on a
    # second one beside the one-token delta (they write disjoint rows; at decode it usually has nothing to do, and
    # its short launch is then off the chain), and each projection's epilogue waits for them and its GEMM. Their
    # buffers and the outputs are allocated here, on this stream, and used on the side streams only before the
    # join (the caching allocator's rule for cross-stream use). The shrink reads x, not x', so the side stream
    # forks before the input transform, which runs on this stream beside it. Side streams are used while a CUDA graph is
    # captured (`_side_streams`); eager steps and torch.compile run the passes in line.
    shared, lowrank = kinds.shared, kinds.lowrank
    ds = [x.new_empty((x.shape[0], w.shape[0]), dtype=pool.delta_dtype(x.dtype)) for w in weights] \
        if lowrank or shared else [x.new_empty((1, 1), dtype=torch.float32)]
    side = _side_streams(x.device) if lowrank or shared else None
    main = torch.cuda.current_stream(x.device) if side is not None else None
    if shared:  # on a side stream of its own: it writes only the shared group's rows of ds
        hv = x.new_empty((pool.shared_a.shape[0], x.shape[0], pool.shared_a.shape[1]))
        hs = x.new_empty((pool.num_proj, x.shape[0], pool.shared_a.shape[1]), dtype=pool.dtype)
        if side is not None:
            side[3].wait_stream(main)
        with _on(side, 3):
            lora_delta_shared_(ds, hv, hs, x, pool.shared_a, pool.shared_b, pool.shared_m, meta.sorted_idx,
                               meta.sorted_slots, meta.num_tokens_per_slot, meta.slot_start, pool.shared_group,
                               list(pool.shared_a_of), list(pool.shared_outs))
    if lowrank:
        split_k = choose_split_k(x.shape[1], meta.tile_group.shape[0] * pool.num_proj, block_k)
        h = x.new_empty((split_k, x.shape[0], pool.h_width), dtype=torch.float32)
        tile_half_n = max(16, (tile_half_n or TILE_HALF_N) * 32 // max(block_r(pool.max_rank), 32))
        rows_hn = rows_half_n(meta.tile_group.shape[0], pool.out_features, pool.max_rank, half_n)
        chunks = choose_chunks_per_prog(meta.tile_group.shape[0], pool.out_features, rows_hn)
        tiles = (meta.sorted_slots, meta.sorted_idx, meta.tile_group, meta.tile_start, meta.tile_end)
        if side is not None:
            side[0].wait_stream(main)  # the fork: x is ready
        with _on(side, 0):
            shrink_(h, x, pool.table, meta.sorted_idx, meta.tile_group, meta.tile_start, meta.tile_end,
                    pool.num_proj, pool.max_rank, block_k)
        fork = side is not None and x.shape[0] > 1  # a shape: for one token the tiles op launches nothing
        if fork:
            side[1].wait_stream(side[0])
        with _on(side, 1):
            lora_delta_tiles_(ds, h, pool.table, *tiles, meta.multi_tiles, meta.num_multi, pool.max_rank,
                              tile_half_n, pool.dtype)
        with _on(side, 0):
            lora_delta_rows_(ds, h, pool.table, *tiles, rows_hn, chunks, pool.max_rank, pool.dtype)
        if fork:
            side[0].wait_stream(side[1])
    xs = _input_transform(x, pool, meta) if kinds.input_transform else None
    if side is None or (merged is not None and xs is None):
        zs = _base_gemms(x, xs, weights, biases, merged)
        if side is not None:  # one GEMM: the epilogue of every projection after it, in one launch
            if shared:
                side[0].wait_stream(side[3])
            main.wait_stream(side[0])
        epilogue_(zs, ds, pool.table, meta.token_slots, EPILOGUE_HALF_N,
                  choose_chunks_per_prog(x.shape[0], pool.out_features, EPILOGUE_HALF_N))
        return zs
    # Each projection's epilogue runs on the side stream as soon as its GEMM and the deltas are done, beside the
    # next projection's GEMM (the epilogue of the last one is the only one after the GEMMs).
    if shared:
        side[0].wait_stream(side[3])
    zs = []
    for p, (w, b) in enumerate(zip(weights, biases)):
        zs.append(F.linear(x if xs is None else xs[p], w, b))
        side[0].wait_stream(main)
        with _on(side, 0):
            epilogue_([zs[p]], [ds[p]], pool.table[p:p + 1], meta.token_slots, EPILOGUE_HALF_N,
                      choose_chunks_per_prog(x.shape[0], pool.out_features[p:p + 1], EPILOGUE_HALF_N))
    main.wait_stream(side[0])
    return zs


def _base_gemms(x: Tensor, xs: Tensor | None, weights: Sequence[Tensor], biases: Sequence[Tensor | None],
                merged: tuple[Tensor, Tensor | None] | None) -> list[Tensor]:
    """z_p = W_p x'_p + b_p: one GEMM over the merged weights when every projection reads x itself (the outputs
    are then column slices of one [T, Σ out_p] tensor), else one per projection."""
    if xs is None and merged is not None:
        return merged_gemm(x, *merged, [w.shape[0] for w in weights])
    return [F.linear(x if xs is None else xs[p], w, b) for p, (w, b) in enumerate(zip(weights, biases))]


def merged_gemm(x: Tensor, weight: Tensor, bias: Tensor | None, out_features: Sequence[int]) -> list[Tensor]:
    """Semantics: [F.linear(x, W_p, b_p) for each p] where W = cat(W_p), b = cat(b_p): one GEMM (vLLM's
    QKVParallelLinear / MergedColumnParallelLinear), its output split into column slices (views)."""
    return list(F.linear(x, weight, bias).split(list(out_features), dim=1))


def _input_transform(x: Tensor, pool: SlotPool, meta: LoraMeta) -> Tensor:
    """x' of every projection."""
    return input_transform(x, pool.table, meta.token_slots, meta.sorted_idx, meta.sorted_slots,
                           meta.num_tokens_per_slot, meta.slot_start, pool.num_proj, pool.block_b, pool.min_block)


def call_transient_bytes(num_tokens: int, in_features: int, out_features: Sequence[int], num_slots: int,
                         max_rank: int, elem: int) -> int:
    """The most device memory one `scute_linears_triton` call allocates besides its outputs, for a pool of
    `num_slots` slots of rank ≤ `max_rank` with an input transform: x' [P, T, in] (`elem` bytes each), the
    shrink's partials [S, T, P·max_rank] (float32), the shared group's A x and m ⊙ h (at most [P, T, max_rank]
    each, `elem` bytes) and the delta [T, Σ out_p] (float32 at most: `SlotPool.delta_dtype`). Freed when the call
    returns."""
    num_proj = len(out_features)
    split = choose_split_k(in_features, max_tiles(num_tokens, num_slots) * num_proj)
    return num_tokens * (num_proj * in_features * elem + (split * 4 + 2 * elem) * num_proj * max_rank
                         + sum(out_features) * 4)


_SIDE: dict[torch.device, tuple[torch.cuda.Stream, ...]] = {}


def _side_streams(device: torch.device) -> tuple[torch.cuda.Stream, ...] | None:
    """The device's side streams while a CUDA graph is being captured: the shrink, the one-token delta and the
    epilogues; the multi-token delta; the pre-pass's windows; the shared group's delta (one set per device, so that
    every shrink of a device runs in order: they share the arrival counters). None otherwise (under torch.compile,
    off the GPU, and in eager steps: there each fork and join costs the host ~10-20 µs, which a step launched from
    Python pays on its critical path; a graph pays it once, at capture)."""
    if device.type != "cuda" or torch.compiler.is_compiling() or not torch.cuda.is_current_stream_capturing():
        return None
    if device not in _SIDE:
        _SIDE[device] = tuple(torch.cuda.Stream(device) for _ in range(4))
    return _SIDE[device]


def _on(side: tuple[torch.cuda.Stream, ...] | None, i: int):
    """Run on side stream `i` (in line when there is none)."""
    return torch.cuda.stream(side[i]) if side is not None else contextlib.nullcontext()


def scute_linear_triton(x: Tensor, weight: Tensor, bias: Tensor | None, pool: SlotPool, meta: LoraMeta,
                        active_slots: Collection[int] | None = None) -> Tensor:
    """One adapted linear layer (``pool.num_proj == 1``); semantics of `scute_linear_ref`."""
    return scute_linears_triton(x, [weight], [bias], pool, meta, active_slots=active_slots)[0]
