"""The pass plan (`scute.ops.plan`): the launches `scute_linears_triton` makes are the plan's, and the byte
model (`scute.ops.cost`) counts the same ones.

Every Triton kernel of `scute.ops.kernels` is replaced by a spy that records its name and grid, and cuBLAS's
products of the call (the base GEMMs, the shared group's A x) are counted, for a grid of pools and token counts.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from tests.interpreter import DEVICE, interpreter_module, spy_launches, use_interpreter

FRESH_PROCESS = use_interpreter()  # before triton is imported (tests/interpreter.py)
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from scute.ops import (  # noqa: E402
    LaunchResources, SlotPool, build_lora_meta, scute_linears_deferred, scute_linears_triton, triton_ops)
from scute.ops import input_transform as input_transform_mod, launch, lora_delta  # noqa: E402
from scute.ops.cost import layer_call_bytes  # noqa: E402
from scute.ops.groups import pool_facts  # noqa: E402
from scute.ops.testing import random_slots, token_slots, vera_pair  # noqa: E402

IN = 32
KERNELS = ("input_transform_kernel", "input_tiles_kernel", "shrink_kernel", "delta_rows_kernel", "delta_tiles_kernel",
           "shared_scale_kernel", "shared_expand_kernel", "epilogue_kernel")


_in_interpreter_process, test_in_a_fresh_interpreter_process = interpreter_module(__file__, FRESH_PROCESS)


def _pool_slots(kind: str, gen: torch.Generator) -> tuple[tuple[int, ...], list[list]]:
    """``slots[p][s]`` of a pool of one of the test's kinds, with its projections' widths."""
    kw = dict(dtype=torch.float32, device=DEVICE, generator=gen)
    if kind == "lora":
        return (48,), [[random_slots("lora", IN, 48, rank=r, **kw) for r in (4, 16, 8)] + [None]]
    outs = (48,) if kind == "mixed" else (48, 16, 16)
    pair = vera_pair(8, IN, 48, **kw)
    rows = []
    for o in outs:  # every method; the VeRA pair (the shared group) shared across the projections too
        rows.append([random_slots("lora", IN, o, rank=16, bias=True, **kw), random_slots("dora", IN, o, rank=5, **kw),
                     random_slots("ia3", IN, o, **kw), random_slots("vera", IN, o, vera_pair=pair, **kw),
                     random_slots("vera", IN, o, vera_pair=pair, **kw), random_slots("oft", IN, o, block=8, **kw),
                     random_slots("road", IN, o, group=8, **kw), None])
    if kind == "qkv":
        rows[1][0] = None  # slot 0 does not adapt k
    return outs, rows


def _spy(monkeypatch) -> tuple[list[tuple[str, tuple]], list[str]]:
    """Records every Triton launch (kernel, grid) and every cuBLAS product of the call."""
    launched, products = spy_launches(monkeypatch, launch.kernels(), *KERNELS), []
    linear, mm, addmm_ = F.linear, torch.mm, torch.Tensor.addmm_
    monkeypatch.setattr(F, "linear", lambda *a, **kw: products.append("linear") or linear(*a, **kw))
    monkeypatch.setattr(torch, "mm", lambda *a, **kw: products.append("mm") or mm(*a, **kw))
    monkeypatch.setattr(torch.Tensor, "addmm_", lambda *a, **kw: products.append("addmm") or addmm_(*a, **kw))
    zero_ = torch.Tensor.zero_
    monkeypatch.setattr(torch.Tensor, "zero_", lambda *a, **kw: products.append("zero") or zero_(*a, **kw))
    return launched, products


def _check_call(monkeypatch, kind: str, num_tokens: int, merged: bool = False, all_slots: bool = False,
                tokens: list[int] | None = None, fold: bool = False, defers: bool | None = None) -> None:
    """One call's launches against its plan, and the plan's count against the byte model's (`tokens`: the
    tokens' slots, else drawn uniformly; `defers` not None: a `scute_linears_deferred` call that defers its deltas
    or not, which the byte model does not price)."""
    deferred = defers is not None
    gen = torch.Generator().manual_seed(num_tokens)
    outs, slots = _pool_slots(kind, gen)
    pool = SlotPool(IN, outs, len(slots[0]), DEVICE, torch.float32)
    pool.update(slots)
    assert pool.facts == pool_facts(slots, outs)
    ts = (token_slots("uniform", num_tokens, len(slots[0]), generator=gen) if tokens is None
          else torch.tensor(tokens)).to(DEVICE)
    tokens = ts.tolist()
    x = torch.randn(num_tokens, IN, generator=gen).to(DEVICE)
    ws = [torch.randn(o, IN, generator=gen).to(DEVICE) for o in outs]
    bs = [None] * len(outs)
    meta = build_lora_meta(ts, pool.slot_group)
    active = None if all_slots else set(tokens)
    passes = triton_ops.call_plan(x, pool, meta, active, merged, consumer_adds=deferred)
    assert (passes.fold is not None) == fold and (passes.defer is not None) == bool(defers)
    launched, products = _spy(monkeypatch)
    call = scute_linears_deferred if deferred else scute_linears_triton
    merged_weights = (torch.cat(ws), None) if merged else None
    call(x, ws, bs, pool, meta, LaunchResources(), active_slots=active, merged=merged_weights)
    config = launch.CONFIG  # the test's (undone below with the spies); the byte model plans under it too
    monkeypatch.undo()
    assert launched == list(passes.kernel_launches())
    assert len(launched) + len(products) == passes.launches()
    assert products.count("linear") + products.count("addmm") == passes.gemms
    assert products.count("addmm") == (sum(passes.fold.adds) if fold else 0)
    if not all_slots and not deferred:
        saved, launch.CONFIG = launch.CONFIG, config
        try:
            assert layer_call_bytes(slots, IN, outs, tokens, 4, merged=merged).launches == passes.launches()
        finally:
            launch.CONFIG = saved


@pytest.mark.parametrize("num_tokens", [1, 7, 33, 130])
@pytest.mark.parametrize("kind", ["lora", "mixed", "qkv"])
def test_launches_are_the_plans(kind, num_tokens, monkeypatch):
    """Each Triton launch (kernel and grid, in order), each cuBLAS product: the plan's, and as many as the byte
    model counts (at 130 tokens the OFT slots' windows launch too; at 1 token the multi-token delta does not)."""
    _check_call(monkeypatch, kind, num_tokens)


@pytest.mark.parametrize("num_tokens", [1, 33])
@pytest.mark.parametrize("kind", ["lora", "qkv"])
def test_merged_and_any_slot(kind, num_tokens, monkeypatch):
    """Merged weights: one GEMM without an input transform (LoRA), one per projection with one (the mix's OFT);
    and a call that knows no slots (None: any slot) runs every pass of its pool."""
    _check_call(monkeypatch, kind, num_tokens, merged=True)
    _check_call(monkeypatch, kind, num_tokens, all_slots=True)


@pytest.mark.parametrize("merged", [False, True])
def test_fold_launches(merged, monkeypatch):
    """A long step of plain LoRA slots only folds: no epilogue launch, one addmm per projection (merged weights
    or not); with a base token among them it does not."""
    for tokens, fold in (([0, 1, 2] * 11, True), ([0, 1, 2] * 10 + [-1, 0, 1], False)):
        monkeypatch.setattr(launch, "CONFIG", dataclasses.replace(launch.CONFIG, fold_min_tokens=16))
        _check_call(monkeypatch, "lora", 33, merged=merged, tokens=tokens, fold=fold)


@pytest.mark.parametrize("merged", [False, True])
def test_deferred_launches(merged, monkeypatch):
    """A one-token step of a plain LoRA slot called deferred launches no epilogue; so do longer ones where the
    configuration allows (here 16 tokens), their deltas zero-filled first with a base token among them (one fill
    per projection); a step with other slots keeps the epilogue, and so does one longer than allowed."""
    _check_call(monkeypatch, "lora", 1, merged=merged, tokens=[1], defers=True)
    _check_call(monkeypatch, "lora", 2, merged=merged, tokens=[0, 1], defers=False)
    for tokens in ([0, 1, 2] * 3, [0, 1, -1, 2]):
        monkeypatch.setattr(launch, "CONFIG", dataclasses.replace(launch.CONFIG, defer_max_tokens=16))
        _check_call(monkeypatch, "lora", len(tokens), merged=merged, tokens=tokens, defers=True)
    _check_call(monkeypatch, "qkv", 1, merged=merged, tokens=[3], defers=False)


def test_base_tokens_alone(monkeypatch):
    """A step of base tokens only: the GEMMs, no Triton launch; the byte model counts the GEMMs alone."""
    gen = torch.Generator().manual_seed(0)
    outs, slots = _pool_slots("mixed", gen)
    pool = SlotPool(IN, outs, len(slots[0]), DEVICE, torch.float32)
    pool.update(slots)
    meta = build_lora_meta(torch.full((5,), -1, device=DEVICE), pool.slot_group)
    passes = triton_ops.call_plan(torch.zeros(5, IN, device=DEVICE), pool, meta, {-1})
    assert passes.kernel_launches() == () and passes.launches() == 1
    assert layer_call_bytes(slots, IN, outs, [-1] * 5, 4).launches == 1


@pytest.mark.parametrize("stray", ["windows", "multi_token_delta"])
def test_a_launcher_off_its_plan_fails_the_check(stray, monkeypatch):
    """The check above can fail: a launcher deciding for itself (here: never the windows, or a multi-token delta
    even for one token) no longer makes the plan's launches."""
    if stray == "windows":
        monkeypatch.setattr(input_transform_mod, "windowed", lambda num_tokens, block_b: False)
        case = ("mixed", 130)
    else:
        grid = lora_delta.tiles_grid
        monkeypatch.setattr(lora_delta.lora_delta_tiles_, "fn", _multi_even_for_one(grid))
        case = ("lora", 1, [1])
    with pytest.raises(AssertionError):
        _check_call(monkeypatch, *case[:2], tokens=case[2] if len(case) > 2 else None)


def _multi_even_for_one(grid):
    """A `lora_delta_tiles_` that launches (an empty walk) for one token too."""
    def fn(ds, h, table, sorted_slots, sorted_idx, tile_group, tile_start, tile_end, multi_tiles, num_multi,
           max_rank, tile_half_n, mat_dtype, block_m):
        launch.kernels().delta_tiles_kernel[grid(ds[0].device)]  # recorded by the spy, not run
    return fn


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", *sys.argv[1:]]))


def test_one_token_deferral_fills_no_zeros(monkeypatch):
    """A graph's slots list −1 for padding rows; a one-token call with a low-rank pass has none (its token is the
    adapter's), so its deltas need no zero fill; two tokens with −1 among the slots do."""
    from scute.ops.plan import plan

    gen = torch.Generator().manual_seed(0)
    outs, slots = _pool_slots("lora", gen)
    facts = pool_facts(slots, outs)
    one = plan(facts, 1, IN, 1, DEVICE, {-1, 0, 1, 2}, consumer_adds=True)
    assert one.defer is not None and not one.defer.zero and one.epilogue is None
    # a graph's slots also list the empty slot 3: it does not stop the deferral, but its token would have no
    # delta here, so the deltas are zero-filled; a slot of another method among them stops it
    empty = plan(facts, 1, IN, 1, DEVICE, {-1, 0, 1, 2, 3}, consumer_adds=True)
    assert empty.defer is not None and empty.defer.zero
    mixed = pool_facts(*reversed(_pool_slots("mixed", gen)))
    assert plan(mixed, 1, IN, 1, DEVICE, {-1, 0, 7}, consumer_adds=True).defer is None
    monkeypatch.setattr(launch, "CONFIG", dataclasses.replace(launch.CONFIG, defer_max_tokens=16))
    two = plan(facts, 2, IN, 2, DEVICE, {-1, 0, 1, 2}, consumer_adds=True)
    assert two.defer is not None and two.defer.zero
