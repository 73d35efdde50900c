"""Tensor-parallel sharding of the normal form (scute/ops/tp.py), on the CPU in float64.

Column-parallel: concatenating the ranks' outputs gives the full layer's; row-parallel: summing the ranks' partial
outputs (the all-reduce) does, with the bias and c on rank 0 only. Every refusal is tested, and so is the need for
each rule: a wrong rule (or ignoring a refused condition) makes the check fail.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from scute.ops.reference import rotate_pairs, scute_linear_ref
from scute.ops.slots import Slots
from scute.ops.testing import random_slots, vera_pair
from scute.ops.tp import shard_range, shard_slots, shard_weight

IN, OUT, RANK = 32, 48, 6
TOL = dict(rtol=1e-12, atol=1e-12)
DT = torch.float64


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rnd(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g, dtype=DT) * scale


def full_slots(g, *, block=4, group=4, fold=False) -> Slots:
    """Every slot at once, unfolded (t, t_blocks, o, o2/rot_g, c, A, m, B, v, scale)."""
    q = rnd(g, IN // block, block, block, scale=0.3)
    s = Slots(IN, OUT, t=1 + rnd(g, IN, scale=0.2), t_blocks=torch.eye(block, dtype=DT) + q - q.transpose(-2, -1),
              o=1 + rnd(g, OUT, scale=0.2), o2=rnd(g, OUT, scale=0.3), rot_group=group, c=rnd(g, OUT, scale=0.1),
              A=rnd(g, RANK, IN, scale=IN ** -0.5), m=rnd(g, RANK), B=rnd(g, OUT, RANK, scale=RANK ** -0.5),
              v=rnd(g, OUT), scale=0.7)
    return s.folded() if fold else s


def method_slots(method: str, g, **kw) -> Slots:
    if method == "full":
        return full_slots(g, **kw)
    if method == "ia3_ff":
        return random_slots("ia3", IN, OUT, dtype=DT, generator=g, feedforward=True)
    if method == "vera":
        return random_slots("vera", IN, OUT, dtype=DT, generator=g, vera_pair=kw["pair"])
    if method == "lora_bias":
        return random_slots("lora", IN, OUT, rank=RANK, dtype=DT, generator=g, bias=True)
    kw.setdefault("rank", RANK)
    return random_slots(method, IN, OUT, dtype=DT, generator=g, **kw)


def full_output(x, w, b, slots, ts):
    return scute_linear_ref(x, w, b, slots, ts)


def tp_output(x, w, b, slots, ts, kind, world_size, shard=shard_slots, shard_w=shard_weight):
    """The layer computed rank by rank and recombined: column → concatenated, row → summed (the all-reduce)."""
    parts = []
    for r in range(world_size):
        wr, br = shard_w(w, b, kind, r, world_size)
        sr = [None if s is None else shard(s, kind, r, world_size) for s in slots]
        if kind == "column":
            parts.append(scute_linear_ref(x, wr, br, sr, ts))
        else:
            lo, hi = shard_range(IN, r, world_size)
            parts.append(scute_linear_ref(x[:, lo:hi], wr, br, sr, ts))
    return torch.cat(parts, dim=-1) if kind == "column" else torch.stack(parts).sum(0)


def layer(g, bias=True):
    return rnd(g, 40, IN), rnd(g, OUT, IN, scale=IN ** -0.5), rnd(g, OUT) if bias else None


def check(slots, kind, world_size, ts=None, bias=True, seed=1):
    g = gen(seed)
    x, w, b = layer(g, bias)
    if ts is None:
        ts = torch.randint(-1, len(slots), (x.shape[0],), generator=g)
        ts[:len(slots) + 1] = torch.arange(-1, len(slots))  # every slot present, base tokens too
    want = full_output(x, w, b, slots, ts)
    # the adapters matter: a check against the base layer alone would pass vacuously otherwise
    present = [a for a in ts.unique().tolist() if a >= 0 and slots[a] is not None and slots[a].live]
    base = torch.nn.functional.linear(x, w, b)
    for a in present:
        assert (want[ts == a] - base[ts == a]).abs().max() > 1e-3
    got = tp_output(x, w, b, slots, ts, kind, world_size)
    torch.testing.assert_close(got, want, **TOL)
    return x, w, b, ts, want


# ---------------------------------------------------------------------------------------------------- exactness
CASES = [
    ("lora", {}), ("lora_bias", {}), ("dora", {"bias": True}), ("dora", {}), ("ia3", {}), ("ia3_ff", {}),
    ("vera", {}), ("oft", {"block": 2}), ("oft", {"block": 4}), ("oft", {"block": 8}),
    ("oft", {"block": 8, "block_share": True}), ("road", {"group": 2}), ("road", {"group": 4}),
    ("road", {"group": 12}), ("full", {}), ("full", {"fold": True}), ("full", {"block": 8, "group": 6}),
]
CASE_IDS = ["-".join([m, *(f"{k}{v}" for k, v in kw.items())]) for m, kw in CASES]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("method,kw", CASES, ids=CASE_IDS)
def test_sharded_layer_equals_full_layer(method, kw, kind, world_size):
    g = gen(2)
    if method == "vera":
        kw = {"pair": vera_pair(RANK, IN + 8, OUT + 8, dtype=DT, generator=g)}
    slots = [method_slots(method, g, **kw), method_slots(method, g, **kw)]
    check(slots, kind, world_size)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("bias", [True, False])
def test_mixed_batch_of_many_methods(kind, world_size, bias):
    """One batch, many adapters of every method (two VeRA adapters sharing one pair), an empty slot, base tokens."""
    g = gen(3)
    pair = vera_pair(RANK, IN, OUT, dtype=DT, generator=g)
    slots = [method_slots("lora", g), method_slots("dora", g, bias=True), None, method_slots("ia3", g),
             method_slots("ia3_ff", g), method_slots("vera", g, pair=pair), method_slots("vera", g, pair=pair),
             method_slots("oft", g, block=4), method_slots("oft", g, block=8, block_share=True),
             method_slots("road", g, group=4), method_slots("full", g), method_slots("lora_bias", g)]
    check(slots, kind, world_size, bias=bias)


@pytest.mark.parametrize("popular", [-1, 0])
def test_all_tokens_one_slot(popular):
    g = gen(4)
    slots = [method_slots("dora", g, bias=True), method_slots("full", g)]
    for kind in ("column", "row"):
        check(slots, kind, 4, ts=torch.full((40,), popular))


# ---------------------------------------------------------------------------------------------------- structure
@pytest.mark.parametrize("kind", ["column", "row"])
def test_shapes_views_and_shared_matrices_stay_shared(kind):
    g = gen(5)
    pair = vera_pair(RANK, IN + 8, OUT + 8, dtype=DT, generator=g)
    a, b = method_slots("vera", g, pair=pair), method_slots("vera", g, pair=pair)
    for r in range(4):
        sa, sb = shard_slots(a, kind, r, 4), shard_slots(b, kind, r, 4)
        assert (sa.in_features, sa.out_features) == ((IN, OUT // 4) if kind == "column" else (IN // 4, OUT))
        assert sa.shared == a.shared and sa.merged == a.merged
        for name in ("A", "B"):  # same storage, offset, shape, stride: the pool's key for one shared matrix
            x, y = getattr(sa, name), getattr(sb, name)
            assert x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() == pair[name == "B"].data_ptr()
            assert (x.storage_offset(), x.shape, x.stride()) == (y.storage_offset(), y.shape, y.stride())
        assert sa.m is a.m  # rank space: replicated on both kinds
        assert (sa.v is a.v) == (kind == "row")


@pytest.mark.parametrize("kind", ["column", "row"])
def test_sharding_commutes_with_folding(kind):
    s = full_slots(gen(6))
    for r in range(4):
        x, y = shard_slots(s, kind, r, 4).folded(), shard_slots(s.folded(), kind, r, 4)
        assert x.live == y.live
        for name in x.live:
            torch.testing.assert_close(getattr(x, name), getattr(y, name), rtol=1e-14, atol=1e-14)


def test_row_bias_and_c_on_rank_0_only():
    g = gen(7)
    s = method_slots("dora", g, bias=True)
    w, b = rnd(g, OUT, IN), rnd(g, OUT)
    for r in range(4):
        assert (shard_slots(s, "row", r, 4).c is None) == (r > 0)
        assert (shard_weight(w, b, "row", r, 4)[1] is None) == (r > 0)
        torch.testing.assert_close(shard_slots(s, "column", r, 4).c, s.c[r * 12:(r + 1) * 12], rtol=0, atol=0)
    assert torch.equal(torch.cat([shard_weight(w, b, "column", r, 4)[0] for r in range(4)]), w)
    assert torch.equal(torch.cat([shard_weight(w, b, "row", r, 4)[0] for r in range(4)], dim=1), w)
    assert shard_weight(w, None, "row", 0, 4)[1] is None


# ---------------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("world_size,group,ok", [(2, 8, True), (4, 8, False), (4, 24, False), (2, 48, False),
                                                 (4, 12, True), (8, 6, True), (8, 4, False)])
def test_rotation_on_column_layer_needs_whole_groups_per_rank(world_size, group, ok):
    slots = [method_slots("road", gen(8), group=group)]
    if ok:
        check(slots, "column", world_size)
        return
    with pytest.raises(ValueError, match=r"slot o2 .*rot_group .*divide out_features / world_size"):
        shard_slots(slots[0], "column", 0, world_size)
    check(slots, "row", world_size)  # a row layer holds every output: no condition


@pytest.mark.parametrize("world_size,block,share,ok", [(2, 16, False, True), (4, 16, False, False),
                                                       (4, 16, True, False), (4, 32, True, False),
                                                       (8, 4, False, True), (8, 8, True, False)])
def test_block_transform_on_row_layer_needs_whole_blocks_per_rank(world_size, block, share, ok):
    slots = [method_slots("oft", gen(9), block=block, block_share=share)]
    if ok:
        check(slots, "row", world_size)
        return
    with pytest.raises(ValueError, match=r"slot t_blocks .*block size .*divide in_features / world_size"):
        shard_slots(slots[0], "row", world_size - 1, world_size)
    check(slots, "column", world_size)  # a column layer sees the full input: no condition


@pytest.mark.parametrize("kind,world_size,match", [("column", 5, "out_features 48 .* 5 ranks"),
                                                   ("row", 5, "in_features 32 .* 5 ranks"),
                                                   ("row", 64, "in_features 32 .* 64 ranks")])
def test_uneven_split_refused(kind, world_size, match):
    s = method_slots("lora", gen(10))
    with pytest.raises(ValueError, match=match):
        shard_slots(s, kind, 0, world_size)
    with pytest.raises(ValueError, match=match):
        shard_weight(torch.zeros(OUT, IN), None, kind, 0, world_size)


@pytest.mark.parametrize("kind,rank,world_size,match", [("diagonal", 0, 2, "unknown parallel kind"),
                                                        ("column", 2, 2, r"rank 2 is not in \[0, world_size=2\)"),
                                                        ("row", -1, 2, "rank -1"), ("row", 0, 0, "world_size must")])
def test_bad_arguments_refused(kind, rank, world_size, match):
    s = method_slots("lora", gen(11))
    with pytest.raises(ValueError, match=match):
        shard_slots(s, kind, rank, world_size)
    with pytest.raises(ValueError, match=match):
        shard_weight(torch.zeros(OUT, IN), None, kind, rank, world_size)


def test_bias_shape_checked():
    with pytest.raises(ValueError, match="bias has shape"):
        shard_weight(torch.zeros(OUT, IN), torch.zeros(IN), "column", 0, 2)


# ----------------------------------------------------------------------------------------- the rules are needed
def _wrong(rule):
    """shard_slots with one slot's rule replaced by `rule(full, right, rank, world_size) -> Slots`."""
    return lambda s, kind, r, n: rule(s, shard_slots(s, kind, r, n), r, n)


WRONG = {
    # column: B "replicated" (every rank uses rank 0's rows: the only replication a [out/N, r] slot allows)
    "column B replicated": ("column", "lora", lambda s, t, r, n: replace(t, B=s.B[:OUT // n])),
    "column v not sliced": ("column", "vera", lambda s, t, r, n: replace(t, v=s.v[:OUT // n])),
    "column o not sliced": ("column", "ia3", lambda s, t, r, n: replace(t, o=s.o[:OUT // n])),
    "column c not sliced": ("column", "lora_bias", lambda s, t, r, n: replace(t, c=s.c[:OUT // n])),
    "column A sliced": ("column", "lora", lambda s, t, r, n: replace(
        t, A=torch.cat([s.A[:, r * IN // n:(r + 1) * IN // n], torch.zeros(RANK, IN - IN // n, dtype=DT)], 1))),
    "row c on every rank": ("row", "lora_bias", lambda s, t, r, n: replace(t, c=s.c)),
    "row A not sliced": ("row", "lora", lambda s, t, r, n: replace(t, A=s.A[:, :IN // n])),
    "row B split": ("row", "lora", lambda s, t, r, n: replace(
        t, B=s.B * (torch.arange(OUT) // (OUT // n) == r).to(DT)[:, None])),
    "row o on rank 0 only": ("row", "ia3", lambda s, t, r, n: t if r == 0 else replace(t, o=None)),
    "row t not sliced": ("row", "ia3_ff", lambda s, t, r, n: replace(t, t=s.t[:IN // n])),
    "row blocks not sliced": ("row", "oft", lambda s, t, r, n: replace(t, t_blocks=s.t_blocks[:t.t_blocks.shape[0]])),
}


@pytest.mark.parametrize("name", WRONG)
def test_a_wrong_rule_is_caught(name):
    kind, method, rule = WRONG[name]
    g = gen(12)
    kw = {"pair": vera_pair(RANK, IN, OUT, dtype=DT, generator=g)} if method == "vera" else {}
    slots = [method_slots(method, g, **kw)]
    x, w, b, ts, want = check(slots, kind, 4)  # the right rule passes...
    got = tp_output(x, w, b, slots, ts, kind, 4, shard=_wrong(rule))
    assert not torch.allclose(got, want, **TOL)  # ...the wrong one does not


def test_row_bias_on_every_rank_is_caught():
    g = gen(13)
    slots = [method_slots("dora", g, bias=True)]
    x, w, b, ts, want = check(slots, "row", 2)
    def every_rank(w_, b_, kind, r, n):
        return shard_weight(w_, b_, kind, r, n)[0], b_
    assert not torch.allclose(tp_output(x, w, b, slots, ts, "row", 2, shard_w=every_rank), want, **TOL)


def test_refused_conditions_really_need_other_ranks_data():
    """What the refusals protect: a rank's rot_g outputs (column) or T inputs (row) depend on data it lacks."""
    g = gen(14)
    z = rnd(g, 3, OUT)
    for group, w in ((8, 12), (24, 12), (8, 24)):
        full = rotate_pairs(z, group)
        z2 = z.clone()
        z2[:, w:] += 1.0  # change only what rank 0 does not hold
        assert (w % group != 0) == (not torch.equal(rotate_pairs(z2, group)[:, :w], full[:, :w]))
    for block, w in ((16, 8), (8, 8), (32, 16)):
        s = method_slots("oft", g, block=block)
        x = rnd(g, 3, IN)
        x2 = x.clone()
        x2[:, w:] += 1.0
        def tx(v):
            return torch.einsum("kij,nkj->nki", s.t_blocks, v.unflatten(-1, (-1, block))).flatten(-2)
        assert (w % block != 0) == (not torch.equal(tx(x2)[:, :w], tx(x)[:, :w]))
