"""The six-slot op on the GPU: one adapted layer call, orchestrating the passes.

One call serves ``P`` projections sharing the input ``x`` (``P = 1`` for a `ScuteLinear`):

    x'_p = input_transform(x)                       only if some slot of the pool has T      (`input_transform.py`)
    h    = shrink(x)                                A x for every token's group, split over K (`shrink.py`)
    d_p  = B_p (m ⊙ h)                              each adapter token's low-rank delta      (`lora_delta.py`; the
                                                    shared group's, VeRA's: `shared_delta.py`)
    z_p  = F.linear(x'_p or x, W_p, b_p)            the base GEMM stays on cuBLAS; in a captured graph the two
                                                    lines above run beside it, on side streams
    z_p ← o ⊙ z_p + o2 ⊙ rot_g(z_p) + c + v ⊙ d_p    in place, after GEMM p and the deltas    (`epilogue.py`)

A long step (prefill) whose slots are all plain low-rank deltas folds the last two lines into one: the GEMM adds
d_p itself (``d_p.addmm_(x, W_pᵀ)``, the delta as cuBLAS's C), with no epilogue pass (`FoldPlan`). A
one-token one (decode at one request) called through `scute_linears_deferred` returns z_p and d_p instead, for
the consumer of each output to add d_p in its own kernel (`DeferPlan`): the epilogue's launch leaves the chain.

The call computes its `Plan` (`plan.py`) once and reads every launch parameter from it. Each pass is a `ScuteOp`
(a `torch.library` custom op with a fake, so `torch.compile` traces through; a plain call elsewhere) launching
Triton kernels (`kernels/`) with the launch configuration of `launch.py`. Tokens whose slot is −1 are never read
or written by the kernels after the GEMM: their rows are exactly ``F.linear(x, W, b)``. Every launch has a fixed
grid (sized by the number of tokens and slots, not by the data) and no host sync, so
the whole call can be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from scute.ops.epilogue import epilogue_
from scute.ops.input_transform import input_rows, input_transform, input_windows, windowed
from scute.ops.launch import LaunchResources, SideStreams, choose_split_k, on, tile_tokens
from scute.ops.lora_delta import lora_delta_rows_, lora_delta_tiles_
from scute.ops.meta import LoraMeta, max_tiles
from scute.ops.plan import LowrankPlan, Plan, plan
from scute.ops.pool import SlotPool
from scute.ops.shared_delta import lora_delta_shared_
from scute.ops.shrink import shrink_, shrink_counters


# ---------------------------------------------------------------------------------------------- one layer call
def scute_linears_triton(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None], pool: SlotPool,
                         meta: LoraMeta, resources: LaunchResources, half_n: int | None = None,
                         block_k: int | None = None, tile_half_n: int | None = None,
                         active_slots: Collection[int] | None = None,
                         merged: tuple[Tensor, Tensor | None] | None = None) -> list[Tensor]:
    """``P`` adapted projections of one input (q/k/v, gate/up, or one layer): the normal form of every token.

    Semantics: ys[p] = scute_linear_ref(x, weights[p], biases[p], slots[p], token_slots) for the slots the pool
    was built from. Shapes: x [T, in]; weights[p] [out_p, in]; returns ys[p] [T, out_p] in x.dtype. `resources`:
    the layer's `LaunchResources` (side streams under CUDA-graph capture, the shrink's arrival counters).
    `active_slots`: the slots of the step's tokens, known on the host (a superset will do), so that the call runs
    only the passes they need (`SlotPool.step_kinds`: a step with no OFT token has no pre-pass, one with no VeRA
    token no shared-group products, one of base tokens only is the GEMMs); None: any slot. A CUDA graph captured
    with it is valid only for steps whose slots are among them. Ignored under torch.compile, whose graph would
    otherwise be traced again for every new set. `merged`: the weights (and biases) concatenated along the
    outputs, ``weights[p]`` being its row slices (`merged_gemm`): the base GEMMs of a step without an input
    transform then run as one.
    """
    return _call(x, weights, biases, pool, meta, resources, half_n, block_k, tile_half_n, active_slots, merged,
                 False)[0]


def scute_linears_deferred(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None], pool: SlotPool,
                           meta: LoraMeta, resources: LaunchResources, active_slots: Collection[int] | None = None,
                           merged: tuple[Tensor, Tensor | None] | None = None,
                           ) -> tuple[list[Tensor], list[Tensor | None]]:
    """`scute_linears_triton`, each output's plain low-rank delta left for its consumer to add (`DeferPlan`).

    Semantics: (zs, ds) with ``plus(zs[p], ds[p]) = scute_linears_triton(x, ...)[p]`` (`scute.ops.elementwise.plus`:
    ``z + d`` in float32, rounded to z's dtype; z itself where ds[p] is None). The deltas are deferred when the call
    has `defer_max_tokens` tokens or fewer (one) and every adapter token's slot is a plain low-rank delta; else every
    ds[p] is None and zs are complete. Shapes: as in `scute_linears_triton`; ds[p] [T, out_p] contiguous, in
    `SlotPool.delta_dtype`.
    """
    return _call(x, weights, biases, pool, meta, resources, None, None, None, active_slots, merged, True)


def _call(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None], pool: SlotPool, meta: LoraMeta,
          resources: LaunchResources, half_n: int | None, block_k: int | None, tile_half_n: int | None,
          active_slots: Collection[int] | None, merged: tuple[Tensor, Tensor | None] | None, consumer_adds: bool,
          ) -> tuple[list[Tensor], list[Tensor | None]]:
    """The layer call: its outputs, and the deltas its consumers add (all None unless deferred)."""
    x = x.contiguous()
    passes = call_plan(x, pool, meta, active_slots, merged is not None, half_n, block_k, tile_half_n, consumer_adds)
    none = [None] * len(weights)
    if not passes.kinds.expand:
        xs = _input_transform(x, pool, meta, resources) if passes.input_transform is not None else None
        return _base_gemms(x, xs, weights, biases, merged if passes.merged_gemm else None), none
    if passes.fold is not None:
        return _folded(x, weights, biases, pool, meta, resources, passes), none
    # The low-rank deltas read only x: in a captured graph the shrink and the one-token delta run on a side stream
    # beside the base GEMMs (bandwidth-bound too, but they leave part of it, and SMs, unused), the multi-token delta
    # on a second one beside the one-token delta (they write disjoint rows; at decode it usually has nothing to do,
    # and its short launch is then off the chain), and each projection's epilogue waits for them and its GEMM.
    # Their buffers and the outputs are allocated here, on this stream, and used on the side streams only before
    # the join (the caching allocator's rule for cross-stream use): every scratch buffer stays referenced until
    # the epilogues have joined, else the allocator hands its memory to the next allocation on this stream (the
    # GEMM's output) while a side stream still writes it. The shrink reads x, not x', so the side stream forks
    # before the input transform, which runs on this stream beside it. Eager steps and torch.compile run the
    # passes in line (`LaunchResources.side_streams`).
    deltas = passes.lowrank is not None or passes.shared is not None
    side = resources.side_streams(x.device) if deltas else None
    ds = [x.new_empty((x.shape[0], w.shape[0]), dtype=pool.delta_dtype(x.dtype)) for w in weights] \
        if deltas else [x.new_empty((1, 1), dtype=torch.float32)]
    scratch = []
    if passes.shared is not None:
        scratch += _shared_delta(ds, x, pool, meta, side)
    if passes.lowrank is not None:
        zero = [d for d, add in zip(ds, passes.defer.adds) if add] if passes.defer and passes.defer.zero else []
        scratch += _lowrank_delta(ds, x, pool, meta, resources, side, passes.lowrank, zero)
    xs = _input_transform(x, pool, meta, resources) if passes.input_transform is not None else None
    zs = _gemms_then_epilogues(x, xs, ds, weights, biases, merged, pool, meta, side, passes)
    del scratch  # joined: the side streams are done with it
    return zs, none if passes.defer is None else [d if add else None for d, add in zip(ds, passes.defer.adds)]


def call_plan(x: Tensor, pool: SlotPool, meta: LoraMeta, active_slots: Collection[int] | None = None,
              merged: bool = False, half_n: int | None = None, block_k: int | None = None,
              tile_half_n: int | None = None, consumer_adds: bool = False) -> Plan:
    """The `Plan` of `scute_linears_triton` (`consumer_adds`: of `scute_linears_deferred`) with these arguments
    (`active_slots` ignored under torch.compile)."""
    return plan(pool.facts, x.shape[0], x.shape[1], meta.tile_group.shape[0], x.device,
                None if torch.compiler.is_compiling() else active_slots, merged, half_n, block_k, tile_half_n,
                meta.block_m, consumer_adds)


def _folded(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None], pool: SlotPool, meta: LoraMeta,
            resources: LaunchResources, passes: Plan) -> list[Tensor]:
    """The fold (`FoldPlan`): the deltas, in line, into buffers of the outputs' shapes and dtype (every row
    written), then ``z_p = d_p (+ b_p) + x W_pᵀ`` with d_p as cuBLAS's C: the product and the delta summed in
    float32 and rounded once, d_p rounded to the output's dtype first (a plain low-rank slot's delta is its
    effect: `SlotPool.delta_dtype`). A projection without deltas is the plain GEMM."""
    ds = [x.new_empty((x.shape[0], w.shape[0])) for w in weights]
    _lowrank_delta(ds, x, pool, meta, resources, None, passes.lowrank)
    # in place: torch.addmm(d, ...) would first copy d into a new output (a pass over z of its own)
    return [((d if b is None else d.add_(b)).addmm_(x, w.t()) if add else F.linear(x, w, b))
            for d, w, b, add in zip(ds, weights, biases, passes.fold.adds)]


def _shared_delta(ds: list[Tensor], x: Tensor, pool: SlotPool, meta: LoraMeta,
                  side: SideStreams | None) -> list[Tensor]:
    """The shared group's rows of ds, on a side stream of their own; returns its scratch buffers."""
    rank = pool.shared_a[0].shape[0]
    hv = x.new_empty((len(pool.shared_a), x.shape[0], rank))
    hs = x.new_empty((pool.num_proj, x.shape[0], rank), dtype=pool.dtype)
    if side is not None:
        side.shared.wait_stream(torch.cuda.current_stream(x.device))
    with on(side.shared if side is not None else None):
        lora_delta_shared_(ds, hv, hs, x, pool.shared_a, pool.shared_b, pool.shared_m, meta.sorted_idx,
                           meta.sorted_slots, meta.num_tokens_per_slot, meta.slot_start, pool.shared_group,
                           list(pool.shared_a_of), list(pool.shared_outs))
    return [hv, hs]


def _lowrank_delta(ds: list[Tensor], x: Tensor, pool: SlotPool, meta: LoraMeta, resources: LaunchResources,
                   side: SideStreams | None, lp: LowrankPlan, zero: Sequence[Tensor] = ()) -> list[Tensor]:
    """The shrink, then the one-token and multi-token deltas (beside each other) into ds (the buffers in `zero`
    zero-filled first, on the same stream); returns the shrink's partials."""
    h = x.new_empty((lp.split_k, x.shape[0], pool.h_width), dtype=torch.float32)
    tiles = (meta.sorted_slots, meta.sorted_idx, meta.tile_group, meta.tile_start, meta.tile_end)
    lowrank = side.lowrank if side is not None else None
    beside = side.tiles if side is not None and lp.multi else None  # for one token the tiles op is empty
    if lowrank is not None:
        lowrank.wait_stream(torch.cuda.current_stream(x.device))  # the fork: x is ready
    with on(lowrank):
        for d in zero:
            d.zero_()
        counters = resources.counters(x.device, shrink_counters(meta.tile_group.shape[0], pool.max_rank, pool.num_proj))
        shrink_(h, counters, x, pool.table, meta.sorted_idx, meta.tile_group, meta.tile_start, meta.tile_end,
                pool.num_proj, pool.max_rank, lp.block_k, lp.block_m)
    if beside is not None:
        beside.wait_stream(lowrank)
    with on(beside if beside is not None else lowrank):
        lora_delta_tiles_(ds, h, pool.table, *tiles, meta.multi_tiles, meta.num_multi, pool.max_rank, lp.tile_half_n,
                          pool.dtype, lp.block_m)
    with on(lowrank):
        lora_delta_rows_(ds, h, pool.table, *tiles, lp.half_n, lp.chunks, pool.max_rank, pool.dtype, lp.block_m)
    if beside is not None:
        lowrank.wait_stream(beside)
    return [h]


def _gemms_then_epilogues(x: Tensor, xs: Tensor | None, ds: list[Tensor], weights: Sequence[Tensor],
                          biases: Sequence[Tensor | None], merged, pool: SlotPool, meta: LoraMeta,
                          side: SideStreams | None, passes: Plan) -> list[Tensor]:
    """The base GEMMs, each projection's epilogue after its GEMM and the deltas. One merged GEMM: one epilogue
    launch for every projection after it; else, in a graph, each epilogue beside the next projection's GEMM.
    Deferred (no epilogue): the GEMMs, then the join."""
    ep = passes.epilogue
    if side is not None and passes.shared is not None:
        side.lowrank.wait_stream(side.shared)
    if side is None or passes.merged_gemm or ep is None:
        zs = _base_gemms(x, xs, weights, biases, merged if passes.merged_gemm else None)
        if side is not None:
            torch.cuda.current_stream(x.device).wait_stream(side.lowrank)
        if ep is not None:
            epilogue_(zs, ds, pool.table, meta.token_slots, ep.half_n, ep.chunks)
        return zs
    main, zs = torch.cuda.current_stream(x.device), []
    for p, (w, b) in enumerate(zip(weights, biases)):
        zs.append(F.linear(x if xs is None else xs[p], w, b))
        side.lowrank.wait_stream(main)
        with on(side.lowrank):
            epilogue_([zs[p]], [ds[p]], pool.table[p:p + 1], meta.token_slots, ep.half_n, ep.chunks_each[p])
    main.wait_stream(side.lowrank)
    return zs


def _base_gemms(x: Tensor, xs: Tensor | None, weights: Sequence[Tensor], biases: Sequence[Tensor | None],
                merged: tuple[Tensor, Tensor | None] | None) -> list[Tensor]:
    """z_p = W_p x'_p + b_p: one GEMM over the `merged` weights if given (the plan gives them only when every
    projection reads x itself; the outputs are then column slices of one [T, Σ out_p] tensor), else one per
    projection."""
    if merged is not None:
        return merged_gemm(x, *merged, [w.shape[0] for w in weights])
    return [F.linear(x if xs is None else xs[p], w, b) for p, (w, b) in enumerate(zip(weights, biases))]


def merged_gemm(x: Tensor, weight: Tensor, bias: Tensor | None, out_features: Sequence[int]) -> list[Tensor]:
    """Semantics: [F.linear(x, W_p, b_p) for each p] where W = cat(W_p), b = cat(b_p): one GEMM (vLLM's
    QKVParallelLinear / MergedColumnParallelLinear), its output split into column slices (views)."""
    return list(F.linear(x, weight, bias).split(list(out_features), dim=1))


def _input_transform(x: Tensor, pool: SlotPool, meta: LoraMeta, resources: LaunchResources) -> Tensor:
    """x' of every projection. Its two launches write disjoint tokens: in a CUDA graph the windows run on a side
    stream beside the row kernel (in line, where no slot has enough tokens, 256 tokens of 64 OFT adapters, their
    launches alone took 13 µs of a layer's critical path; beside it the layer still pays 13-22 µs for the forks
    and joins)."""
    args = (meta.sorted_idx, meta.sorted_slots, meta.num_tokens_per_slot, meta.slot_start)
    side = resources.side_streams(x.device) if windowed(x.shape[0], pool.block_b) else None
    if side is None:
        return input_transform(x, pool.table, meta.token_slots, *args, pool.num_proj, pool.block_b, pool.min_block)
    out = x.new_empty((pool.num_proj, *x.shape))
    side.windows.wait_stream(torch.cuda.current_stream(x.device))
    with on(side.windows):
        input_windows(out, x, pool.table, *args, pool.block_b, pool.min_block)
    input_rows(out, x, pool.table, meta.token_slots, meta.num_tokens_per_slot, pool.block_b, pool.min_block, True)
    torch.cuda.current_stream(x.device).wait_stream(side.windows)
    return out


def call_transient_bytes(num_tokens: int, in_features: int, out_features: Sequence[int], num_slots: int,
                         max_rank: int, elem: int) -> int:
    """The most device memory one `scute_linears_triton` call allocates besides its outputs, for a pool of
    `num_slots` slots of rank ≤ `max_rank` with an input transform: x' [P, T, in] (`elem` bytes each), the
    shrink's partials [S, T, P·max_rank] (float32), the shared group's A x and m ⊙ h (at most [P, T, max_rank]
    each, `elem` bytes) and the delta [T, Σ out_p] (float32 at most: `SlotPool.delta_dtype`). Freed when the call
    returns."""
    num_proj = len(out_features)
    split = choose_split_k(in_features, max_tiles(num_tokens, num_slots, tile_tokens(num_tokens)) * num_proj)
    return num_tokens * (num_proj * in_features * elem + (split * 4 + 2 * elem) * num_proj * max_rank
                         + sum(out_features) * 4)


def scute_linear_triton(x: Tensor, weight: Tensor, bias: Tensor | None, pool: SlotPool, meta: LoraMeta,
                        resources: LaunchResources, active_slots: Collection[int] | None = None) -> Tensor:
    """One adapted linear layer by the Triton kernels (`scute_linears_triton` of one projection).

    Semantics: `scute.ops.reference.scute_linear_ref` over the pool's slots (``pool.num_proj == 1``) and the
    step's token slots (`meta`). Shapes: x [T, in], weight [out, in], bias [out] or None; returns [T, out]."""
    return scute_linears_triton(x, [weight], [bias], pool, meta, resources, active_slots=active_slots)[0]
