"""The Triton six-slot op against the PyTorch reference, on tiny shapes (punica's grid).

Without CUDA the kernels run in Triton's interpreter on CPU tensors: ``TRITON_INTERPRET=1`` is set here, before
`scute.ops.kernels` is first imported (`triton.jit` reads it at decoration; the kernels module is imported
lazily on the first launch). With CUDA the same tests run compiled on the GPU. Also runnable as a script.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from tests.interpreter import DEVICE, interpreter_module, use_interpreter

FRESH_PROCESS = use_interpreter()  # before triton is imported (tests/interpreter.py)
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from scute.model.context import ForwardContext, forward_context  # noqa: E402
from scute.model.linear import ScuteLinear  # noqa: E402
from scute.ops import (  # noqa: E402
    SlotPool,
    build_lora_meta,
    scute_linear_ref,
    scute_linears_deferred,
    scute_linears_triton,
    triton_ops,  # noqa: E402
)
from scute.ops.elementwise import plus  # noqa: E402
from scute.ops.meta import BLOCK_M, LoraMeta, max_tiles  # noqa: E402
from scute.ops.pool_rows import F_RANK  # noqa: E402
from scute.ops.reference import input_transform_ref  # noqa: E402
from scute.ops.testing import POPULARITY, random_slots, token_slots, vera_pair  # noqa: E402
from scute.ops import input_transform as input_transform_mod, launch, shared_delta  # noqa: E402
from scute.ops.epilogue import epilogue_  # noqa: E402
from scute.ops.launch import LaunchResources  # noqa: E402
from scute.ops.input_transform import input_transform  # noqa: E402

IN, OUT = 32, 48


def set_config(monkeypatch, **changes) -> None:
    """Run the test under the launch configuration with `changes`."""
    monkeypatch.setattr(launch, "CONFIG", dataclasses.replace(launch.CONFIG, **changes))

# Small tiles keep the interpreter fast and make the tiny layers span several tiles.
HALF_N, BLOCK_K = 16, 16
RESOURCES = LaunchResources()  # what every call here shares, as one model's layers do
# tf32 dots on the GPU; exact fp32 products in the interpreter.
FP32_TOL = 5e-3 if DEVICE == "cuda" else 2e-5


_in_interpreter_process, test_in_a_fresh_interpreter_process = interpreter_module(__file__, FRESH_PROCESS)


def mixed_slots(dtype, gen, in_f=IN, out_f=OUT) -> list:
    """Every method and rank 1..256 in one layer's slots; slot 3 left empty (tokens there get the base)."""
    pair = vera_pair(8, 2 * in_f, 2 * out_f, dtype=dtype, device=DEVICE, generator=gen)
    kw = dict(dtype=dtype, device=DEVICE, generator=gen)
    return [
        random_slots("lora", in_f, out_f, rank=16, bias=True, **kw),
        random_slots("lora", in_f, out_f, rank=1, **kw),
        random_slots("dora", in_f, out_f, rank=17, bias=True, **kw),
        None,
        random_slots("ia3", in_f, out_f, **kw),
        random_slots("ia3", in_f, out_f, feedforward=True, **kw),
        random_slots("vera", in_f, out_f, vera_pair=pair, **kw),
        random_slots("vera", in_f, out_f, vera_pair=pair, **kw),
        random_slots("oft", in_f, out_f, block=8, **kw),
        random_slots("oft", in_f, out_f, block=4, block_share=True, **kw),
        random_slots("road", in_f, out_f, group=8, **kw),
        random_slots("road", in_f, out_f, group=out_f, **kw),  # a rotation group wider than a tile
        random_slots("lora", in_f, out_f, rank=256, **kw),
    ]


def run_triton(x, weights, biases, slots_per_proj, ts, dtype, **kw):
    pool = SlotPool(x.shape[1], [w.shape[0] for w in weights], len(slots_per_proj[0]), DEVICE, dtype)
    pool.update(slots_per_proj)
    meta = build_lora_meta(ts, pool.slot_group, block_m=kw.get("block_m", BLOCK_M))
    return scute_linears_triton(x, weights, biases, pool, meta, kw.get("resources", RESOURCES),
                                half_n=kw.get("half_n", HALF_N),
                                block_k=kw.get("block_k", BLOCK_K), tile_half_n=kw.get("tile_half_n", HALF_N))


def check(y, x, w, b, slots, ts, tol):
    """Adapter rows match the reference; base rows (slot −1, or an empty slot) are bit-identical to F.linear."""
    ref = scute_linear_ref(x, w, b, slots, ts)
    base = F.linear(x, w, b)
    plain = (ts < 0) | torch.tensor([slots[s] is None if s >= 0 else True for s in ts.tolist()], device=ts.device)
    assert torch.equal(y[plain], base[plain])
    err = (y.float() - ref.float()).abs().amax(1)
    scale = ref.float().abs().amax(1).clamp_min(1.0)
    assert bool((err <= tol * scale).all()), f"max rel err {(err / scale).max().item():.3g} > {tol}"
    effect = (ref.float() - base.float()).abs().amax(1)
    assert bool((effect[~plain] > 1e-3).all()), "an adapter had no effect: the test would not see errors"


def _case(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(OUT, IN, generator=gen) / IN ** 0.5).to(DEVICE, dtype)
    b = torch.randn(OUT, generator=gen).to(DEVICE, dtype)
    return gen, w, b


@pytest.mark.parametrize("num_tokens", [1, 3, 7, 33])
@pytest.mark.parametrize("popularity", POPULARITY)
def test_every_method_mixed(popularity, num_tokens):
    gen, w, b = _case(torch.float32, seed=num_tokens)
    slots = mixed_slots(torch.float32, gen)
    ts = token_slots(popularity, num_tokens, len(slots), generator=gen).to(DEVICE)
    x = torch.randn(num_tokens, IN, generator=gen).to(DEVICE)
    (y,) = run_triton(x, [w], [b], [slots], ts, torch.float32)
    check(y, x, w, b, slots, ts, FP32_TOL)


@pytest.mark.parametrize("block_m", [32, 64])
def test_long_tiles(block_m):
    """A long step's tiles (`launch.tile_tokens`): every method mixed, groups of one token to several tiles."""
    gen, w, b = _case(torch.float32, seed=block_m)
    slots = mixed_slots(torch.float32, gen)
    counts = {0: 2 * block_m + 3, 2: block_m, 4: 5, 6: block_m + 1, 7: 1, 8: 9, 12: block_m - 1, -1: 4, 3: 2}
    ts = _shuffled(counts, gen)
    x = torch.randn(ts.shape[0], IN, generator=gen).to(DEVICE)
    (y,) = run_triton(x, [w], [b], [slots], ts, torch.float32, block_m=block_m)
    check(y, x, w, b, slots, ts, FP32_TOL)


def test_long_steps_get_long_tiles(monkeypatch):
    """The forward context builds a step's metadata with the tile height the launch configuration gives its
    length."""
    monkeypatch.setattr(launch, "CONFIG", dataclasses.replace(launch.CONFIG, long_step_tokens=40, long_tile_tokens=32))
    group = torch.arange(4, dtype=torch.int32, device=DEVICE)
    for num_tokens, block_m in ((39, BLOCK_M), (40, 32)):
        ctx = ForwardContext(torch.zeros(num_tokens, dtype=torch.long, device=DEVICE))
        meta = ctx.lora_meta(num_tokens, group, None)
        assert meta.block_m == block_m and meta.tile_group.shape[0] == max_tiles(num_tokens, 4, block_m)
        assert (meta.tile_group >= 0).sum() == -(-num_tokens // block_m)


@pytest.mark.parametrize("num_tokens", [7, 33])
def test_fp16(num_tokens):
    gen, w, b = _case(torch.float16, seed=100 + num_tokens)
    slots = mixed_slots(torch.float16, gen)
    ts = token_slots("uniform", num_tokens, len(slots), generator=gen).to(DEVICE)
    x = torch.randn(num_tokens, IN, generator=gen).to(DEVICE, torch.float16)
    (y,) = run_triton(x, [w], [b], [slots], ts, torch.float16)
    check(y, x, w, b, slots, ts, 2e-3)


def test_delta_in_the_model_dtype():
    """A pool whose low-rank slots only add v ⊙ d (LoRA, VeRA; IA3, OFT and RoAd have no d) keeps d in the model's
    dtype; one with a slot that also scales or shifts z (DoRA, LoRA with a bias) keeps it in float32."""
    gen, w, b = _case(torch.float16, seed=17)
    kw = dict(dtype=torch.float16, device=DEVICE, generator=gen)
    pair = vera_pair(8, 2 * IN, 2 * OUT, **kw)
    slots = [random_slots("lora", IN, OUT, rank=16, **kw), random_slots("vera", IN, OUT, vera_pair=pair, **kw),
             random_slots("vera", IN, OUT, vera_pair=pair, **kw), random_slots("ia3", IN, OUT, **kw),
             random_slots("oft", IN, OUT, block=8, **kw), random_slots("road", IN, OUT, group=8, **kw),
             random_slots("lora", IN, OUT, rank=100, **kw)]
    pool = SlotPool(IN, (OUT,), len(slots), DEVICE, torch.float16)
    pool.update([slots])
    assert pool.delta_dtype(torch.float16) == torch.float16
    ts = token_slots("skewed", 33, len(slots), generator=gen).to(DEVICE)
    x = torch.randn(33, IN, generator=gen).to(DEVICE, torch.float16)
    (y,) = run_triton(x, [w], [b], [slots], ts, torch.float16)
    check(y, x, w, b, slots, ts, 2e-3)
    for exact in (random_slots("dora", IN, OUT, rank=4, **kw), random_slots("lora", IN, OUT, bias=True, **kw)):
        pool = SlotPool(IN, (OUT,), len(slots) + 1, DEVICE, torch.float16)
        pool.update([[*slots, exact]])
        assert pool.delta_dtype(torch.float16) == torch.float32


def test_bf16():
    """bf16 weights and activations. The interpreter computes bf16 dots on bit patterns, so on the CPU the
    bf16 values are upcast to fp32 after loading (the kernels then see bf16-valued fp32 tensors); the GPU runs
    real bf16 (exact products on tensor cores, fp32 sums, h split in two bf16 halves)."""
    gen, w, b = _case(torch.bfloat16, seed=7)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    slots = [s if s is None else s.to(dtype) for s in mixed_slots(torch.bfloat16, gen)]
    ts = token_slots("uniform", 33, len(slots), generator=gen).to(DEVICE)
    x = torch.randn(33, IN, generator=gen).to(DEVICE, torch.bfloat16).to(dtype)
    w, b = w.to(dtype), b.to(dtype)
    (y,) = run_triton(x, [w], [b], [slots], ts, dtype)
    check(y, x, w, b, slots, ts, 1.6e-2 if dtype == torch.bfloat16 else FP32_TOL)


@pytest.mark.parametrize("popularity", ["identical", "skewed"])
def test_row_and_tile_chunks_differ(popularity, monkeypatch):
    """The two expand launches cut the columns differently (one-token tiles: chunks of 2·32 columns; multi-token
    tiles: 2·16, one chunk per persistent item), RoAd pairs included: each launch must cover every column of its
    own tiles."""
    set_config(monkeypatch, tile_half_n=16)
    set_config(monkeypatch, tile_items_per_program=1 << 20)
    gen, w, b = _case(torch.float32, seed=31)
    slots = mixed_slots(torch.float32, gen)
    ts = token_slots(popularity, 33, len(slots), generator=gen).to(DEVICE)
    x = torch.randn(33, IN, generator=gen).to(DEVICE)
    (y,) = run_triton(x, [w], [b], [slots], ts, torch.float32, half_n=32, tile_half_n=None)
    check(y, x, w, b, slots, ts, FP32_TOL)


def test_row_rank_step():
    """The one-token delta's rank step: 16 for a rank-16 pool; for a pool of wide ranks, as wide as its chunk allows
    within the block of a rank-16 pool (2·HALF_N x 16 elements), up to 64 (the tests' wide pools run at 64)."""
    assert launch.row_block_r(16, launch.CONFIG.half_n) == 16
    assert launch.row_block_r(256, 64) == 16 and launch.row_block_r(256, 32) == 32
    assert launch.row_block_r(256, 16) == 64 and launch.row_block_r(100, 16) == 64
    assert launch.row_block_r(32, 16) == 32
    assert launch.rows_half_n(1, [OUT], 256) == 16  # a VeRA-wide pool at decode: narrow chunks, 64-rank steps


def test_ranks_1_to_256_in_one_batch():
    gen, w, b = _case(torch.float32, seed=3)
    ranks = [1, 2, 15, 16, 17, 31, 64, 100, 256]
    slots = [random_slots("lora", IN, OUT, rank=r, dtype=torch.float32, device=DEVICE, generator=gen) for r in ranks]
    ts = token_slots("uniform", 33, len(slots), generator=gen).to(DEVICE)
    x = torch.randn(33, IN, generator=gen).to(DEVICE)
    pool = SlotPool(IN, (OUT,), len(slots), DEVICE, torch.float32)
    pool.update([slots])
    # per-group rank in the table: the r=1 adapter's programs loop once, not 256/16 times
    assert pool.table[0, :, F_RANK].tolist() == ranks and pool.h_width == 256
    (y,) = run_triton(x, [w], [b], [slots], ts, torch.float32)
    check(y, x, w, b, slots, ts, FP32_TOL)


def test_odd_shapes_and_block_sizes():
    """in=48 with OFT blocks of 12 and 6 (not powers of two), out=40 with RoAd groups of 10 and 40, odd tiles."""
    in_f, out_f = 48, 40
    gen = torch.Generator().manual_seed(11)
    w = (torch.randn(out_f, in_f, generator=gen) / in_f ** 0.5).to(DEVICE)
    b = torch.randn(out_f, generator=gen).to(DEVICE)
    kw = dict(dtype=torch.float32, device=DEVICE, generator=gen)
    slots = [random_slots("oft", in_f, out_f, block=12, **kw), random_slots("oft", in_f, out_f, block=6, **kw),
             random_slots("road", in_f, out_f, group=10, **kw), random_slots("road", in_f, out_f, group=40, **kw),
             random_slots("lora", in_f, out_f, rank=5, **kw)]
    ts = token_slots("uniform", 7, len(slots), generator=gen).to(DEVICE)
    x = torch.randn(7, in_f, generator=gen).to(DEVICE)
    (y,) = run_triton(x, [w], [b], [slots], ts, torch.float32)
    check(y, x, w, b, slots, ts, FP32_TOL)


def test_epilogue_only_pool():
    """IA3 (output side) and RoAd only: no low-rank path, no shrink launch, the epilogue still runs."""
    gen, w, b = _case(torch.float32, seed=5)
    kw = dict(dtype=torch.float32, device=DEVICE, generator=gen)
    slots = [random_slots("ia3", IN, OUT, **kw), random_slots("road", IN, OUT, group=4, **kw), None]
    ts = token_slots("uniform", 7, 3, generator=gen).to(DEVICE)
    x = torch.randn(7, IN, generator=gen).to(DEVICE)
    (y,) = run_triton(x, [w], [b], [slots], ts, torch.float32)
    check(y, x, w, b, slots, ts, FP32_TOL)


@pytest.mark.parametrize("split", [2, 4])
def test_split_partials(split, monkeypatch):
    """The shrink splits K: the one-token delta sums the partials of one-token tiles of one rank step (r ≤ 16),
    the last split to arrive sums those of wider groups (r = 17, 256) and of multi-token tiles into split 0.
    Every popularity law; the arrival counters are back to zero after each call (the next call relies on it).
    K = 64: on the GPU a split needs 16 columns."""
    set_config(monkeypatch, target_programs=1 << 20)
    set_config(monkeypatch, max_split_k=split)
    in_f = 64
    gen = torch.Generator().manual_seed(41)
    w = (torch.randn(OUT, in_f, generator=gen) / in_f ** 0.5).to(DEVICE)
    b = torch.randn(OUT, generator=gen).to(DEVICE)
    slots = mixed_slots(torch.float32, gen, in_f)
    assert launch.choose_split_k(in_f, 1, BLOCK_K) == split
    resources = LaunchResources()
    for law in ("distinct", "identical", "skewed"):
        ts = token_slots(law, 33, len(slots), generator=gen).to(DEVICE)
        x = torch.randn(33, in_f, generator=gen).to(DEVICE)
        (y,) = run_triton(x, [w], [b], [slots], ts, torch.float32, resources=resources)
        check(y, x, w, b, slots, ts, FP32_TOL)
        assert int(resources.counters(x.device, 1).abs().sum()) == 0  # the buffer the call used


@pytest.mark.parametrize("expand_programs", [1024, 1])
def test_three_projections_one_launch(expand_programs, monkeypatch):
    """q/k/v-style grouping: one pre-pass, one shrink, one expand for three outputs; VeRA's shared A (same in
    for all three) is multiplied once and read once, in the shared group (slot 6) and in a second pair's group,
    which stays in the table (slot 7). With a target of 1 expand program, each program streams every chunk of its
    projection."""
    set_config(monkeypatch, target_expand_programs=expand_programs)
    gen = torch.Generator().manual_seed(21)
    outs = (48, 16, 16)  # k and v of one width: VeRA's B views coincide
    ws = [(torch.randn(o, IN, generator=gen) / IN ** 0.5).to(DEVICE) for o in outs]
    bs = [torch.randn(o, generator=gen).to(DEVICE) if o != 16 else None for o in outs]
    per_proj = [mixed_slots(torch.float32, gen, IN, o) for o in outs]
    pairs = [vera_pair(8, IN, max(outs), device=DEVICE, generator=gen) for _ in range(2)]
    for p, o in enumerate(outs):  # VeRA slots 6, 7: each pair shared across the projections too
        kw = dict(dtype=torch.float32, device=DEVICE, generator=gen)
        per_proj[p][6] = random_slots("vera", IN, o, vera_pair=pairs[0], **kw)
        per_proj[p][7] = random_slots("vera", IN, o, vera_pair=pairs[1], **kw)
    per_proj[1][0] = None  # slot 0 does not adapt k
    ts = token_slots("zipf", 33, 13, generator=gen).to(DEVICE)
    x = torch.randn(33, IN, generator=gen).to(DEVICE)
    pool = SlotPool(IN, outs, 13, DEVICE, torch.float32)
    pool.update(per_proj)
    assert pool.table[:, 7, 1].tolist() == [8, 0, 0]  # A rank computed for the first projection only
    assert pool.shared_group == 6 and len(pool.shared_a) == 1 and pool.shared_a_of == (0, 0, 0)
    assert pool.table[:, 6, F_RANK].tolist() == [0, 0, 0]
    ys = run_triton(x, ws, bs, per_proj, ts, torch.float32)
    for y, w, b, slots in zip(ys, ws, bs, per_proj):
        check(y, x, w, b, slots, ts, FP32_TOL)


def test_shared_matrix_read_once():
    """Slots whose A and B are views of one pair form one group: one tile run, one copy in the pool."""
    gen = torch.Generator().manual_seed(4)
    pair = vera_pair(8, IN, OUT, device=DEVICE, generator=gen)
    slots = [random_slots("vera", IN, OUT, vera_pair=pair, device=DEVICE, generator=gen) for _ in range(6)]
    slots[2] = random_slots("lora", IN, OUT, rank=4, device=DEVICE, generator=gen)
    pool = SlotPool(IN, (OUT,), 6, DEVICE, torch.float32)
    pool.update([slots])
    assert pool.group_key == (0, 0, 2, 0, 0, 0)
    ts = torch.tensor([0, 1, 3, 4, 5, 2, 0, 1], device=DEVICE)
    meta = build_lora_meta(ts, pool.slot_group)
    groups = [g for g in meta.tile_group.tolist() if g >= 0]
    assert groups == sorted(groups) and set(groups) == {0, 2} and meta.num_tokens_per_slot[0] == 7
    assert len(pool._cache) == 2 * 5 + 2  # m, v per VeRA slot; LoRA A, B (the pair is the shared group's)
    assert pool.shared_group == 0 and [a.shape for a in pool.shared_a] == [(8, IN)]
    assert pool.shared_b[0].shape == (OUT, 8)
    assert pool.max_rank == 4  # the pair's rank is not in the table
    x = torch.randn(8, IN, generator=gen).to(DEVICE)
    w = (torch.randn(OUT, IN, generator=gen) / IN ** 0.5).to(DEVICE)
    check(run_triton(x, [w], [None], [slots], ts, torch.float32)[0], x, w, None, slots, ts, FP32_TOL)


@pytest.mark.parametrize("block_m", [BLOCK_M, 64])
@pytest.mark.parametrize("popularity", POPULARITY)
def test_meta(popularity, block_m):
    gen = torch.Generator().manual_seed(9)
    for num_tokens in (1, 3, 7, 33, 100, 300):
        ts = token_slots(popularity, num_tokens, 12, generator=gen)
        group = torch.tensor([0, 1, 2, 2, 4, 5, 2, 7, 8, 9, 10, 11], dtype=torch.int32)
        meta = build_lora_meta(ts, group, block_m=block_m)
        key = torch.where(ts >= 0, group.long()[ts.clamp(min=0)], 12)
        assert torch.equal(meta.sorted_idx.long(), torch.sort(key, stable=True).indices)
        covered = []
        for g, s, e in zip(meta.tile_group.tolist(), meta.tile_start.tolist(), meta.tile_end.tolist()):
            if g >= 0:
                rows = meta.sorted_idx[s:min(s + block_m, e)].long()
                assert bool((key[rows] == g).all())
                covered += rows.tolist()
        assert sorted(covered) == sorted((ts >= 0).nonzero().squeeze(1).tolist())
        assert meta.tile_group.shape[0] == max_tiles(num_tokens, 12, block_m)
        out = LoraMeta.empty(num_tokens, 12, "cpu", block_m)
        build_lora_meta(ts, group, out=out, block_m=block_m)
        assert all(torch.equal(getattr(out, f), getattr(meta, f)) for f in ("sorted_idx", "tile_group", "tile_end"))


def _pre_pass(x, pool, ts):
    meta = build_lora_meta(ts, pool.slot_group)
    return input_transform(x, pool.table, meta.token_slots, meta.sorted_idx, meta.sorted_slots,
                           meta.num_tokens_per_slot, meta.slot_start, 1, pool.block_b, pool.min_block)


def _shuffled(counts: dict, gen) -> torch.Tensor:
    """Token slots with `counts[slot]` tokens of each slot, in a random order."""
    ts = torch.tensor([s for s, n in counts.items() for _ in range(n)])
    return ts[torch.randperm(ts.shape[0], generator=gen)].to(DEVICE)


@pytest.mark.parametrize(("blocks", "iters", "tiled"), [
    ("mixed", 1, False), ("equal", 1, False), ("mixed", 4, False), ("equal", 2, False), ("sixteen", 1, False),
    ("diag", 1, False), ("mixed", 1, True), ("equal", 2, True), ("sixteen", 1, True), ("diag", 1, True)])
def test_input_transform_matches_reference(blocks, iters, tiled, monkeypatch):
    """Blocks of 8 and 4 in one pool (runtime block strides), or every block 8 or 16 wide (constant strides,
    B_EXACT), or blocks of 8 after a diagonal t in slot 8 (T = blocks ∘ diag: the normal form allows both); one
    chunk per program, or 2 or 4 (as in large steps; the last program's chunks run past the input); tiled: as
    from PRE_PASS_TILE_TOKENS tokens, OFT slots of 17 and 16 tokens (slot 10 an OFT too) run as windows of 16 on
    tensor cores, one window holding the last of slot 8, slot 9's 3 tokens (left to the row kernel) and the
    first of slot 10."""
    gen, _, _ = _case(torch.float32, seed=12)
    ts = _shuffled({8: 17, 9: 3, 10: 16, 0: 2, -1: 2}, gen) if tiled else \
        torch.tensor([8, 9, 8, -1, 9, 0, 8], device=DEVICE)
    set_config(monkeypatch, pre_pass_tokens=ts.shape[0] // iters)
    set_config(monkeypatch, pre_pass_tile_tokens=1 if tiled else 1 << 30)
    assert input_transform_mod.pre_pass_iters(ts.shape[0]) == iters
    slots = mixed_slots(torch.float32, gen)
    kw = dict(dtype=torch.float32, device=DEVICE, generator=gen)
    block = {"mixed": 8, "equal": 8, "sixteen": 16, "diag": 8}[blocks]
    slots[10] = random_slots("oft", IN, OUT, block=block, **kw)
    if blocks != "mixed":
        slots[9] = random_slots("oft", IN, OUT, block=block, block_share=True, **kw)
        slots[8] = random_slots("oft", IN, OUT, block=block, **kw)
    if blocks == "diag":
        t = random_slots("ia3", IN, OUT, feedforward=True, **kw).t
        slots[8] = dataclasses.replace(slots[8], t=t)
    x = torch.randn(ts.shape[0], IN, generator=gen).to(DEVICE)
    pool = SlotPool(IN, (OUT,), len(slots), DEVICE, torch.float32)
    pool.update([slots])
    assert (pool.min_block == pool.block_b) == (blocks != "mixed")
    torch.testing.assert_close(_pre_pass(x, pool, ts)[0], input_transform_ref(x, slots, ts), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("iters", "tiled"), [(1, False), (4, False), (4, True)])
def test_input_transform_several_chunks_per_program(iters, tiled, monkeypatch):
    """A wide input (2048: 4 chunks of copies, 4 of 64 blocks of 8) with 1 or 4 chunks per program: OFT, diagonal
    (IA3 feed-forward), LoRA (a copy) and base tokens; tiled: 18 tokens of the OFT slot as windows of 16 (64
    programs of 4 blocks each)."""
    in_f, gen = 2048, torch.Generator().manual_seed(13)
    ts = _shuffled({0: 18, 1: 2, 2: 1, -1: 1}, gen) if tiled else torch.tensor([0, 2, -1, 1, 0, 0, 1], device=DEVICE)
    set_config(monkeypatch, pre_pass_tokens=ts.shape[0] // iters)
    set_config(monkeypatch, pre_pass_tile_tokens=1 if tiled else 1 << 30)
    kw = dict(dtype=torch.float32, device=DEVICE, generator=gen)
    slots = [random_slots("oft", in_f, OUT, block=8, **kw), random_slots("ia3", in_f, OUT, feedforward=True, **kw),
             random_slots("lora", in_f, OUT, rank=4, **kw)]
    x = torch.randn(ts.shape[0], in_f, generator=gen).to(DEVICE)
    pool = SlotPool(in_f, (OUT,), len(slots), DEVICE, torch.float32)
    pool.update([slots])
    torch.testing.assert_close(_pre_pass(x, pool, ts)[0], input_transform_ref(x, slots, ts), rtol=1e-5, atol=1e-5)


def test_input_windows_and_rows_split_the_tokens():
    """The two pre-pass launches write disjoint tokens (on the GPU they run at once: a token written by both would
    be a race that the result cannot show): the windows exactly the tokens of OFT slots with WINDOW_MIN_TOKENS
    (16) or more, the row kernel every other token. Slot 9's 3 OFT tokens open a window (sorted positions 16-18)."""
    gen, _, _ = _case(torch.float32, seed=14)
    slots = mixed_slots(torch.float32, gen)
    slots[10] = random_slots("oft", IN, OUT, block=8, dtype=torch.float32, device=DEVICE, generator=gen)
    ts = _shuffled({8: 16, 9: 3, 10: 16, 12: 2, -1: 2}, gen)
    x = torch.randn(ts.shape[0], IN, generator=gen).to(DEVICE)
    pool = SlotPool(IN, (OUT,), len(slots), DEVICE, torch.float32)
    pool.update([slots])
    meta = build_lora_meta(ts, pool.slot_group)
    assert meta.sorted_slots[16].item() == 9 and launch.CONFIG.window_min_tokens == 16
    n = ts.shape[0]
    windows = torch.full((1, n, IN), float("nan"), device=DEVICE)
    input_transform_mod.input_windows(windows, x, pool.table, meta.sorted_idx, meta.sorted_slots,
                                      meta.num_tokens_per_slot, meta.slot_start, pool.block_b, pool.min_block)
    rows = torch.full((1, n, IN), float("nan"), device=DEVICE)
    input_transform_mod.input_rows(rows, x, pool.table, meta.token_slots, meta.num_tokens_per_slot, pool.block_b,
                                   pool.min_block, True)
    big = torch.isin(ts, torch.tensor([8, 10], device=DEVICE)).cpu()
    assert torch.equal(windows[0].isfinite().all(1).cpu(), big)
    assert torch.equal(rows[0].isfinite().all(1).cpu(), ~big)
    ref = input_transform_ref(x, slots, ts)
    torch.testing.assert_close(torch.where(big[:, None].to(DEVICE), windows[0], rows[0]), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused", [False, True])
def test_shared_group_writes_only_its_rows(fused, monkeypatch):
    """The shared group's delta writes exactly its members' rows of d (on the GPU it runs beside the other deltas,
    which write the other rows: a row written by both would be a race the result cannot show), with the right
    values: 70 members over two row tiles (the second partly past the count), rank 8 (a masked K step); m ⊙ h by
    the scale pass, or formed inside the tile GEMM (`SHARED_FUSED_TOKENS`)."""
    set_config(monkeypatch, shared_fused_tokens=1 << 20 if fused else 0)
    gen, _, _ = _case(torch.float32, seed=15)
    pair = vera_pair(8, IN + 8, OUT + 4, device=DEVICE, generator=gen)  # wider: each layer's A a strided slice
    kw = dict(dtype=torch.float32, device=DEVICE, generator=gen)
    slots = [random_slots("lora", IN, OUT, rank=4, **kw), random_slots("vera", IN, OUT, vera_pair=pair, **kw),
             random_slots("ia3", IN, OUT, **kw), random_slots("vera", IN, OUT, vera_pair=pair, **kw)]
    ts = _shuffled({1: 40, 3: 30, 0: 5, 2: 3, -1: 2}, gen)
    ts[0] = 0  # a non-member in row 0, where a masked-off row's token index would point
    x = torch.randn(ts.shape[0], IN, generator=gen).to(DEVICE)
    pool = SlotPool(IN, (OUT,), len(slots), DEVICE, torch.float32)
    pool.update([slots])
    meta = build_lora_meta(ts, pool.slot_group)
    assert not pool.shared_a[0].is_contiguous() and pool.shared_a[0].data_ptr() == pair[0].data_ptr()  # A as held
    n, r = ts.shape[0], pool.shared_a[0].shape[0]
    ds = [torch.full((n, OUT), float("nan"), device=DEVICE)]
    hv, hs = x.new_empty((1, n, r)), x.new_empty((1, n, r))
    shared_delta.lora_delta_shared_(ds, hv, hs, x, pool.shared_a, pool.shared_b, pool.shared_m, meta.sorted_idx,
                                  meta.sorted_slots, meta.num_tokens_per_slot, meta.slot_start, pool.shared_group,
                                  list(pool.shared_a_of), list(pool.shared_outs))
    member = ((ts == 1) | (ts == 3)).cpu()
    assert torch.equal(ds[0].isfinite().all(1).cpu(), member)
    for t in member.nonzero().flatten().tolist():
        sl = slots[int(ts[t])]
        torch.testing.assert_close(ds[0][t], sl.B @ (sl.m * (sl.A @ x[t])), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens, active, passes", [
    ([0, -1, 12, 0], {0, 12, -1}, {"shrink_", "epilogue_"}),  # LoRA: neither the OFT pre-pass nor VeRA's products
    ([0, -1, 12, 0], None, {"input_transform", "lora_delta_shared_", "shrink_", "epilogue_"}),  # any slot
    ([6, 7, 8, -1], {6, 7, 8, -1}, {"input_transform", "lora_delta_shared_", "epilogue_"}),  # VeRA and OFT
    ([4, 4], {4}, {"epilogue_"}),  # IA3's output scale
    ([-1, -1, -1], {-1}, set()),  # base tokens: the GEMM alone
])
def test_step_runs_the_passes_of_its_slots(tokens, active, passes, monkeypatch):
    """Given the step's slots on the host (`active_slots`), a call of a pool of every method runs only the passes
    those slots need, and its result is the reference's (base rows bit-identical to F.linear)."""
    gen, w, b = _case(torch.float32, seed=21)
    slots = mixed_slots(torch.float32, gen)
    pool = SlotPool(IN, (OUT,), len(slots), DEVICE, torch.float32)
    pool.update([slots])
    called = set()
    for name in ("input_transform", "lora_delta_shared_", "shrink_", "epilogue_"):
        def spy(*args, _op=getattr(triton_ops, name), _name=name, **kw):
            called.add(_name)
            return _op(*args, **kw)
        monkeypatch.setattr(triton_ops, name, spy)
    ts = torch.tensor(tokens, device=DEVICE)
    x = torch.randn(len(tokens), IN, generator=gen).to(DEVICE)
    (y,) = scute_linears_triton(x, [w], [b], pool, build_lora_meta(ts, pool.slot_group), RESOURCES, half_n=HALF_N,
                                block_k=BLOCK_K, active_slots=active)
    assert called == passes
    check(y, x, w, b, slots, ts, FP32_TOL)


def _three_projections(case: str, seed: int):
    """A q/k/v-like pool (48, 16, 16 outputs) of three LoRA slots of ranks 4, 16, 8 over 40 tokens using all three:
    `case` "k_unadapted" (no slot adapts k), "k_partly" (slot 0 does not), "base_token" (one token of slot −1),
    "dora" (slot 2 DoRA); returns the generator, weights, slots, token slots, x, pool, metadata and the step's
    slots."""
    gen = torch.Generator().manual_seed(seed)
    outs = (48, 16, 16)
    kw = dict(dtype=torch.float32, device=DEVICE, generator=gen)
    ws = [(torch.randn(o, IN, generator=gen) / IN ** 0.5).to(DEVICE) for o in outs]
    per_proj = [[random_slots("dora" if case == "dora" and s == 2 else "lora", IN, o, rank=r, **kw)
                 for s, r in enumerate((4, 16, 8))] for o in outs]
    if case == "k_unadapted":
        per_proj[1] = [None] * 3
    if case == "k_partly":
        per_proj[1][0] = None
    ts = torch.randint(0, 3, (40,), generator=gen)
    ts[:3] = torch.tensor([0, 1, 2])
    if case == "base_token":
        ts[5] = -1
    ts, x = ts.to(DEVICE), torch.randn(40, IN, generator=gen).to(DEVICE)
    pool = SlotPool(IN, outs, 3, DEVICE, torch.float32)
    pool.update(per_proj)
    return gen, ws, per_proj, ts, x, pool, build_lora_meta(ts, pool.slot_group), set(ts.tolist())


@pytest.mark.parametrize("case, folds", [("lora", True), ("k_unadapted", True), ("bias", True),
                                         ("k_partly", False), ("base_token", False), ("dora", False)])
def test_fold(case, folds, monkeypatch):
    """A long step of plain LoRA slots adds its deltas in the GEMMs (no epilogue), exactly: every projection where
    every token has a delta, the plain GEMM where none has (k unadapted), a bias too; a step that cannot fold
    (one slot without k, a base token, a DoRA slot) takes the epilogue."""
    set_config(monkeypatch, fold_min_tokens=16)
    gen, ws, per_proj, ts, x, pool, meta, active = _three_projections(case, 5)
    bs = [torch.randn(w.shape[0], generator=gen).to(DEVICE) if case == "bias" and p == 0 else None
          for p, w in enumerate(ws)]
    passes = triton_ops.call_plan(x, pool, meta, active)
    assert (passes.fold is not None) == folds and (passes.epilogue is None) == folds
    if folds:
        assert passes.fold.adds == (True, case != "k_unadapted", True)
    epilogues = []
    monkeypatch.setattr(triton_ops, "epilogue_", lambda *a, **k: epilogues.append(1) or epilogue_(*a, **k))
    ys = scute_linears_triton(x, ws, bs, pool, meta, RESOURCES, half_n=HALF_N, block_k=BLOCK_K, tile_half_n=HALF_N,
                              active_slots=active)
    assert bool(epilogues) != folds
    for y, w, b, slots in zip(ys, ws, bs, per_proj):
        check(y, x, w, b, slots, ts, FP32_TOL)


@pytest.mark.parametrize("case, adds, zero", [("lora", (True, True, True), False),
                                              ("k_unadapted", (True, False, True), False),
                                              ("k_partly", (True, True, True), True),
                                              ("base_token", (True, True, True), True),
                                              ("dora", None, None), ("long", None, None)])
def test_deferred(case, adds, zero, monkeypatch):
    """A decode-sized step of plain LoRA slots called deferred returns each output before its delta and the
    delta (no epilogue); completed (`plus`), they are bit-identical to the call's outputs. Rows without a delta
    (a slot without k, a base token) get zeros; a DoRA slot, or a step long enough to fold, defers nothing. (The
    configuration defers up to 64 tokens here: by default only one, where it pays.)"""
    set_config(monkeypatch, fold_min_tokens=32 if case == "long" else 512, defer_max_tokens=64)
    _, ws, per_proj, ts, x, pool, meta, active = _three_projections(case, 6)
    passes = triton_ops.call_plan(x, pool, meta, active, consumer_adds=True)
    assert (passes.defer is not None) == (adds is not None)
    if adds is not None:
        assert passes.defer == (adds, zero) and passes.epilogue is None
    epilogues = []
    monkeypatch.setattr(triton_ops, "epilogue_", lambda *a, **k: epilogues.append(1) or epilogue_(*a, **k))
    zs, ds = scute_linears_deferred(x, ws, [None] * 3, pool, meta, RESOURCES, active_slots=active)
    assert bool(epilogues) == (adds is None and case != "long")
    assert [d is not None for d in ds] == list(adds or (False,) * 3)
    ys = scute_linears_triton(x, ws, [None] * 3, pool, meta, RESOURCES, active_slots=active)
    for y, z, d, w, slots in zip(ys, zs, ds, ws, per_proj):
        assert torch.equal(plus(z, d), y)
        check(y, x, w, None, slots, ts, FP32_TOL)


def test_scute_linear_module(monkeypatch):
    """ScuteLinear on the Triton path (forced on CPU) equals its reference path; set_slot updates in place."""
    monkeypatch.setenv("SCUTE_TRITON_CPU", "1")
    gen = torch.Generator().manual_seed(2)
    layer = ScuteLinear(torch.nn.Linear(IN, OUT).to(DEVICE), max_adapters=13)
    slots = mixed_slots(torch.float32, gen)
    for i, s in enumerate(slots):
        layer.set_slot(i, s)
    ts = token_slots("skewed", 7, 13, generator=gen).to(DEVICE)
    x = torch.randn(1, 7, IN, generator=gen).to(DEVICE)
    with forward_context(ForwardContext(token_adapter_slots=ts)):
        y = layer(x)
        table = layer.pool.table.data_ptr()
        layer.set_slot(0, random_slots("lora", IN, OUT, rank=3, device=DEVICE, generator=gen))
        y2 = layer(x)
    assert layer.pool.table.data_ptr() == table
    with torch.no_grad():
        check(y[0], x[0], layer.weight, layer.bias, slots, ts, FP32_TOL)
        check(y2[0], x[0], layer.weight, layer.bias, layer.slots, ts, FP32_TOL)
    # the context's host-side slots reach the op: a step of LoRA tokens runs no pre-pass for the pool's OFT slots
    called = []
    op = input_transform
    monkeypatch.setattr(triton_ops, "input_transform", lambda *a, **kw: called.append(1) or op(*a, **kw))
    ts = torch.tensor([0, 1, -1, 0, 12, 1, 0], device=DEVICE)
    for active in (None, frozenset(ts.tolist())):
        with forward_context(ForwardContext(token_adapter_slots=ts, active_adapter_slots=active)):
            y3 = layer(x)
        with torch.no_grad():
            check(y3[0], x[0], layer.weight, layer.bias, layer.slots, ts, FP32_TOL)
    assert len(called) == 1


def _mixed_layer(seed: int, num_tokens: int):
    """One projection with the mixed slots in a pool, uniform token slots, x and the step's metadata."""
    gen, w, b = _case(torch.float32, seed=seed)
    slots = mixed_slots(torch.float32, gen)
    pool = SlotPool(IN, (OUT,), len(slots), DEVICE, torch.float32)
    pool.update([slots])
    ts = token_slots("uniform", num_tokens, len(slots), generator=gen).to(DEVICE)
    x = torch.randn(num_tokens, IN, generator=gen).to(DEVICE)
    return w, b, slots, pool, ts, x, build_lora_meta(ts, pool.slot_group)


@pytest.mark.parametrize("known_slots", [False, True])
def test_custom_ops_trace_under_torch_compile(known_slots):
    """The op traces whole (fullgraph); under compile `active_slots` is ignored: here a set of the base model
    alone, which, honoured, would leave every adapter row at the base output."""
    w, b, slots, pool, ts, x, meta = _mixed_layer(seed=8, num_tokens=7)
    active = frozenset({-1}) if known_slots else None

    def layer(x):
        return scute_linears_triton(x, [w], [b], pool, meta, RESOURCES, half_n=HALF_N, block_k=BLOCK_K,
                                    active_slots=active)[0] * 1.0

    torch._dynamo.reset()
    y = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    check(y, x, w, b, slots, ts, FP32_TOL)


def test_passes_are_custom_ops_under_compile_and_plain_calls_in_eager(monkeypatch):
    """Under torch.compile each pass is its `torch.library` op in the traced graph; an eager call never enters
    the dispatcher (its wrapping cost more host time than the launch inside it)."""
    from scute.ops import triton_ops as T

    w, b, slots, pool, ts, x, meta = _mixed_layer(seed=9, num_tokens=5)

    def layer(x):
        return scute_linears_triton(x, [w], [b], pool, meta, RESOURCES)[0] * 1.0

    traced = []

    def backend(gm, example_inputs):
        traced.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm

    torch._dynamo.reset()
    torch.compile(layer, fullgraph=True, backend=backend)(x)
    assert {"scute.shrink_.default", "scute.epilogue_.default"} <= set(traced), traced
    for name in ("input_transform", "shrink_", "lora_delta_rows_", "lora_delta_tiles_", "epilogue_"):
        monkeypatch.setattr(getattr(T, name), "op", None)  # an eager call through the op would now fail
    check(layer(x), x, w, b, slots, ts, FP32_TOL)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", *sys.argv[1:]]))
