"""The pass plan of one layer call: which passes `scute_linears_triton` runs and how each is launched, as a value.

`plan` turns what the host knows of a call (the pool's `PoolFacts`, the number of tokens and tiles, the step's
slots, whether merged weights are given) into a `Plan`. `scute_linears_triton` computes it once and reads every
launch parameter from it; the byte model (`scute.ops.cost`) counts its launches (and the bytes that depend on
it: the shrink's split-K partials, the shared group's scale pass) from the same value, so the two cannot drift.
Each pass's grid comes from its own module's grid function, the one its launcher calls.

Whether a CUDA graph is being captured is not an input: streams change where the passes run, not which. One
exception is counted apart: in a captured graph without one merged GEMM, each projection's epilogue runs beside
the next projection's GEMM, a launch per projection (`Plan.kernel_launches(captured=True)`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

import torch

from scute.ops.epilogue import epilogue_grid
from scute.ops.groups import PoolFacts, StepKinds, active_mask
from scute.ops.input_transform import rows_launch, windowed, windows_grid
from scute.ops.launch import block_r, choose_chunks_per_prog, choose_split_k, config, rows_half_n
from scute.ops.lora_delta import rows_grid, tiles_grid
from scute.ops.meta import BLOCK_M
from scute.ops.shared_delta import expand_launch, scale_grid, scale_pass
from scute.ops.shrink import shrink_grid


class Launch(NamedTuple):
    """One Triton kernel launch: the kernel's name in `scute.ops.kernels` and its grid."""

    kernel: str
    grid: tuple[int, ...]


class InputPlan(NamedTuple):
    """The input transform: its row kernel, and from `pre_pass_tile_tokens` tokens on its windows beside it."""

    windows: bool


class SharedPlan(NamedTuple):
    """The shared group's products: A x on cuBLAS per distinct A, the scale pass m ⊙ h, the tile GEMM."""

    products: int  # cuBLAS A x, one per distinct A
    scale: bool  # the scale pass runs (above `shared_fused_tokens` tokens; below, the GEMM forms m ⊙ h)


class LowrankPlan(NamedTuple):
    """The table's shrink and deltas."""

    split_k: int
    block_k: int
    half_n: int  # the one-token delta's half-chunk...
    chunks: int  # ...and its chunks per program
    tile_half_n: int  # the multi-token delta's half-chunk...
    multi: bool  # ...which launches for two tokens or more
    block_m: int  # tokens per tile (`LoraMeta.block_m`)


class EpiloguePlan(NamedTuple):
    """The epilogue: one launch over every projection (`chunks` per program); in a captured graph without one
    merged GEMM, one per projection (`chunks_each[p]`), each beside the next projection's GEMM (with one merged
    GEMM, `chunks_each` is empty: it has one launch there too)."""

    half_n: int
    chunks: int
    chunks_each: tuple[int, ...]


class FoldPlan(NamedTuple):
    """The fold: each projection's deltas written into a buffer of its output's shape, which its base GEMM adds
    (``z = d + x Wᵀ``, cuBLAS's C input), with no epilogue pass. For a step of `fold_min_tokens` tokens or more,
    every one of an adapter whose slots are all plain low-rank deltas (`PoolFacts.plain_mask`), and in each
    projection either every token has a delta or none has: every row of a buffer is written, and a projection
    without deltas is the plain GEMM, as for base tokens (whose rows must stay exactly ``F.linear``'s)."""

    adds: tuple[bool, ...]  # projection p's GEMM adds the deltas (else no token of the step has one there)


class DeferPlan(NamedTuple):
    """The deferral: each projection's deltas left for its output's consumer to add (``z + d`` in float32,
    rounded once: what the epilogue computes for a plain low-rank slot), with no epilogue pass. For a step of
    `defer_max_tokens` tokens or fewer (one) whose adapter tokens' slots are all plain low-rank deltas
    (`PoolFacts.plain_mask`),
    when the caller adds them (`scute_linears_deferred`): the deltas run beside the GEMMs as before, and the
    epilogue's launch leaves the chain. Rows without a delta (base tokens; a slot without A in a projection) hold
    zeros (`zero`) unless there are none."""

    adds: tuple[bool, ...]  # projection p has deltas (else its output is complete and no d is returned)
    zero: bool  # some token of a projection with deltas has none: its d is zero-filled first


class Plan(NamedTuple):
    """The passes of one layer call, in the order they are launched (None: the pass does not run), and the sizes
    their grids are computed from (`kernel_launches`: the host's hot path never needs the grids themselves, each
    launcher computes its own with the same grid function)."""

    kinds: StepKinds
    shared: SharedPlan | None
    lowrank: LowrankPlan | None
    input_transform: InputPlan | None
    merged_gemm: bool  # the base GEMMs run as one over the merged weights
    gemms: int  # base GEMMs (cuBLAS)
    epilogue: EpiloguePlan | None
    facts: PoolFacts
    num_tokens: int
    in_features: int
    num_tiles: int
    device: torch.device
    fold: FoldPlan | None = None
    defer: DeferPlan | None = None

    def kernel_launches(self, captured: bool = False) -> tuple[Launch, ...]:
        """Every Triton launch of the call, in order (in a captured graph the epilogues interleave with the
        GEMMs, and without one merged GEMM there is one per projection)."""
        if self.num_tokens == 0:  # every launcher returns before its launch
            return ()
        out: list[Launch] = []
        if self.shared is not None:
            outs = self.facts.shared_outs
            out += [Launch("shared_scale_kernel", scale_grid(self.num_tokens, len(outs)))] if self.shared.scale else []
            out.append(Launch("shared_expand_kernel", expand_launch(self.num_tokens, outs)[0]))
        if self.lowrank is not None:
            out += _lowrank_launches(self)
        if self.input_transform is not None:
            out += _input_launches(self)
        if self.epilogue is not None:
            ep, outs = self.epilogue, self.facts.out_features
            pieces = zip(((o,) for o in outs), ep.chunks_each) if captured and not self.merged_gemm else \
                [(outs, ep.chunks)]
            out += [Launch("epilogue_kernel", epilogue_grid(self.num_tokens, o, ep.half_n, n)) for o, n in pieces]
        return tuple(out)

    def launches(self, captured: bool = False) -> int:
        """Every kernel launch of the call: Triton's, the base GEMMs, the shared group's A x (cuBLAS) and the
        deferral's zero fills; not the fold's bias add."""
        products = self.shared.products if self.shared is not None and self.num_tokens else 0
        zeros = sum(self.defer.adds) if self.defer is not None and self.defer.zero and self.num_tokens else 0
        return len(self.kernel_launches(captured)) + self.gemms + products + zeros


class StepFacts(NamedTuple):
    """What `plan` reads of a pool's slots for a step, beyond what `SlotPool.signature` holds (`step_facts`): two
    steps of equal sizes over a pool of one signature with equal `StepFacts` have equal plans, so a CUDA graph
    captured for one replays the other (`scute.engine.cuda_graph`)."""

    kinds: StepKinds  # the passes the step's slots need here
    base: bool  # a token of the step may have no adapter (−1 among its slots, or its slots unknown)
    plain: bool  # its slots are known, and each with something here is a plain low-rank delta
    adds: tuple[bool, ...]  # projection p: some slot of the step has A there (all False unless `plain`)
    partial: bool  # some slot of the step has no A in a projection that has deltas (False unless `plain`)


def step_facts(facts: PoolFacts, active_slots: Collection[int] | None) -> StepFacts:
    """The `StepFacts` of a step whose tokens use only `active_slots` (None: any slot)."""
    mask = active_mask(active_slots)
    kinds = StepKinds(*(mask & m != 0 for m in facts.kind_masks))
    base = active_slots is None or -1 in active_slots
    if active_slots is None or mask & ~facts.plain_mask & (facts.kind_masks.input_transform | facts.kind_masks.expand):
        return StepFacts(kinds, base, False, (False,) * len(facts.lowrank_masks), False)
    return StepFacts(kinds, base, True, tuple(mask & m != 0 for m in facts.lowrank_masks),
                     any(mask & m not in (0, mask) for m in facts.lowrank_masks))


def bucket_facts(step: StepFacts, num_tokens: int) -> StepFacts:
    """`step` as far as `plan` reads it for `num_tokens` tokens: with a base token among more than one, whether a
    slot lacks A changes nothing (no fold; a deferral writes zeros anyway), so a graph of such a step is kept when
    the last free slot of a pool is filled."""
    return step._replace(partial=False) if step.base and num_tokens > 1 and step.partial else step


def plan(facts: PoolFacts, num_tokens: int, in_features: int, num_tiles: int, device: torch.device,
         active_slots: Collection[int] | None = None, merged: bool = False, half_n: int | None = None,
         block_k: int | None = None, tile_half_n: int | None = None, block_m: int = BLOCK_M,
         consumer_adds: bool = False) -> Plan:
    """The plan of a call over `num_tokens` tokens of `in_features` inputs cut into `num_tiles` tiles of up to
    `block_m` tokens (the `LoraMeta`'s), for a step whose tokens use only `active_slots` (None: any); `merged`:
    merged weights are given; `half_n`, `block_k`, `tile_half_n` as in `scute_linears_triton` (None: the launch
    configuration); `consumer_adds`: the caller adds plain low-rank deltas itself (`DeferPlan`). Of the slots it
    reads only their `StepFacts` (`bucket_facts`); of the pool, what its signature holds."""
    step = bucket_facts(step_facts(facts, active_slots), num_tokens)
    kinds = step.kinds
    inputs = InputPlan(windowed(num_tokens, facts.block_b)) if kinds.input_transform else None
    fold = _fold_plan(step, num_tokens)
    defer = _defer_plan(step, num_tokens) if consumer_adds and fold is None else None
    merged_gemm = merged and inputs is None and fold is None
    shared = lowrank = epilogue = None
    if kinds.expand:
        shared = SharedPlan(facts.shared_products, scale_pass(num_tokens)) if kinds.shared else None
        lowrank = _lowrank_plan(facts, num_tokens, in_features, num_tiles, half_n, block_k, tile_half_n, block_m) \
            if kinds.lowrank else None
        epilogue = _epilogue_plan(facts.out_features, num_tokens, merged_gemm) \
            if fold is None and defer is None else None
    return Plan(kinds, shared, lowrank, inputs, merged_gemm, 1 if merged_gemm else len(facts.out_features),
                epilogue, facts, num_tokens, in_features, num_tiles, device, fold, defer)


def _fold_plan(step: StepFacts, num_tokens: int) -> FoldPlan | None:
    """The fold (`FoldPlan`), if the step's slots allow it: plain deltas only (no shared group's), every row
    written, no base token."""
    if num_tokens < config().fold_min_tokens or step.base or not _plain(step) or step.partial:
        return None
    return FoldPlan(step.adds)


def _defer_plan(step: StepFacts, num_tokens: int) -> DeferPlan | None:
    """The deferral (`DeferPlan`), if the step's slots allow it. A one-token call with a low-rank pass has an
    adapter token (a graph's slots list −1 for padding rows, which a one-token bucket has none of): its rows need
    zeros only where its slot has no A."""
    if num_tokens > config().defer_max_tokens or not _plain(step):
        return None
    return DeferPlan(step.adds, step.partial or (step.base and num_tokens > 1))


def _plain(step: StepFacts) -> bool:
    """Every slot of the step with something in this pool is a plain low-rank delta (a slot of the shared group,
    whose products write d apart, is not; a slot with nothing here, e.g. an empty one among a graph's, does not
    count), and the step has a low-rank pass."""
    return step.plain and step.kinds.lowrank and not step.kinds.shared


def _lowrank_plan(facts: PoolFacts, num_tokens: int, in_features: int, num_tiles: int, half_n: int | None,
                  block_k: int | None, tile_half_n: int | None, block_m: int) -> LowrankPlan:
    c, outs, rank = config(), facts.out_features, facts.max_rank
    block_k = block_k or c.block_k
    split_k = choose_split_k(in_features, num_tiles * len(outs), block_k)
    rows_hn = rows_half_n(num_tiles, outs, rank, half_n)
    tile_hn = (tile_half_n or c.tile_half_n) * 32 // max(block_r(rank), 32) * BLOCK_M // block_m
    return LowrankPlan(split_k, block_k, rows_hn, choose_chunks_per_prog(num_tiles, outs, rows_hn), max(16, tile_hn),
                       num_tokens > 1, block_m)


def _epilogue_plan(outs: tuple[int, ...], num_tokens: int, merged_gemm: bool) -> EpiloguePlan:
    half = config().epilogue_half_n
    chunks = choose_chunks_per_prog(num_tokens, outs, half)
    if merged_gemm or len(outs) == 1:  # no launch per projection (one projection: the same launch)
        return EpiloguePlan(half, chunks, () if merged_gemm else (chunks,))
    return EpiloguePlan(half, chunks, tuple(choose_chunks_per_prog(num_tokens, (o,), half) for o in outs))


def _lowrank_launches(p: Plan) -> list[Launch]:
    lp, outs = p.lowrank, p.facts.out_features
    multi = [Launch("delta_tiles_kernel", tiles_grid(p.device))] if lp.multi else []
    return [Launch("shrink_kernel", shrink_grid(p.num_tiles, lp.split_k, p.facts.max_rank, len(outs))), *multi,
            Launch("delta_rows_kernel", rows_grid(p.num_tiles, outs, lp.half_n, lp.chunks))]


def _input_launches(p: Plan) -> list[Launch]:
    f, num_proj = p.facts, len(p.facts.out_features)
    rows = Launch("input_transform_kernel", rows_launch(p.num_tokens, p.in_features, num_proj, f.block_b,
                                                         f.min_block)[0])
    if not p.input_transform.windows:
        return [rows]
    return [Launch("input_tiles_kernel", windows_grid(p.num_tokens, p.in_features, num_proj, f.min_block)), rows]
