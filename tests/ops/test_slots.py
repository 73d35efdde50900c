"""The normal form's own rules: folding, validation, sharing of VeRA's projections."""

from __future__ import annotations

import pytest
import torch
from peft import VeraConfig

from scute.adapters import load_adapter
from scute.ops.reference import scute_linear_ref
from scute.ops.slots import Slots, fold_layers
from tests.helpers import make_adapter, tiny_model

g = torch.Generator().manual_seed(0)


def rand(*shape):
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def full_slots(shared=frozenset()):
    return Slots(8, 6, t=rand(8), o=rand(6), c=rand(6), A=rand(3, 8), m=rand(3), B=rand(6, 3), v=rand(6),
                 scale=0.7, shared=frozenset(shared))


@pytest.mark.parametrize("shared", [(), ("A",), ("B",), ("A", "B")])
def test_folding_is_exact_and_keeps_only_what_must_stay_live(shared):
    s = full_slots(shared)
    f = s.folded()
    x, w, b = rand(5, 8), rand(6, 8), rand(6)
    slots = torch.tensor([0, -1, 0, 0, -1])
    assert torch.allclose(scute_linear_ref(x, w, b, [s], slots), scute_linear_ref(x, w, b, [f], slots), rtol=1e-12)
    assert f.scale == 1.0 and "s" in f.merged
    assert (f.v is None) == ("B" not in shared)  # v only stays live when B is shared
    assert (f.m is None) == (set(shared) != {"A", "B"})  # m only when both are shared
    for name in shared:
        assert getattr(f, name) is getattr(s, name), "shared tensors are never rewritten"


def test_fold_layers_equals_each_layers_fold():
    """The batched fold gives every layer what `folded()` gives it, bit for bit, in the layers' order: plain
    low-rank layers of several scales and dtypes (batched) beside layers with m, v, shared matrices or no low-rank
    part (folded one by one)."""
    def lowrank(scale, dtype=torch.float32, **kw):
        return Slots(8, 6, A=torch.randn(3, 8, generator=g).to(dtype), B=torch.randn(6, 3, generator=g).to(dtype),
                     scale=scale, **kw)

    layers = {"a": lowrank(0.7), "b": full_slots(), "c": lowrank(2.0), "d": lowrank(0.7, c=torch.randn(6)),
              "e": full_slots(("A", "B")), "f": Slots(8, 6, o=rand(6)), "g": lowrank(0.7, torch.float64),
              "h": lowrank(1 / 3, m=torch.randn(3, generator=g)), "i": lowrank(0.7, merged=("s",)),
              **{f"many{k}": lowrank(0.25) for k in range(70)}}  # one scale over several calls of 32
    before = {name: sl.B.clone() for name, sl in layers.items() if sl.B is not None}
    got = fold_layers(layers)
    assert list(got) == list(layers)
    for name, sl in layers.items():
        want = sl.folded()
        assert got[name].scale == 1.0 and got[name].merged == want.merged and got[name].live == want.live, name
        for slot, x in want.tensors().items():
            assert torch.equal(getattr(got[name], slot), x) and getattr(got[name], slot).dtype == x.dtype, (name, slot)
    assert all(torch.equal(layers[name].B, b) for name, b in before.items()), "the layers' own tensors are kept"


def test_fold_layers_pauses_over_layers_folded_already():
    """A LoRA folded in the serving dtype (s merged, scale 1: kept as it is) still gets a pause point every 32
    layers looked at: the loader's pause points bound how long it holds the interpreter lock beside a step."""
    layers = {f"l{k}": Slots(8, 6, A=rand(3, 8), B=rand(6, 3), merged=("s",)) for k in range(100)}
    calls = []
    got = fold_layers(layers, lambda: calls.append(1))
    assert all(got[n] is sl for n, sl in layers.items()) and len(calls) == 4  # layers 0, 32, 64, 96


@pytest.mark.parametrize("kwargs,problem", [
    (dict(t=torch.ones(7)), "slot t"),
    (dict(o=torch.ones(5)), "slot o"),
    (dict(A=torch.ones(2, 8)), "given together"),
    (dict(A=torch.ones(2, 7), B=torch.ones(6, 2)), "slot A"),
    (dict(A=torch.ones(2, 8), B=torch.ones(6, 3)), "slot B"),
    (dict(m=torch.ones(2)), "need A and B"),
    (dict(t_blocks=torch.ones(3, 4, 4)), "t_blocks"),
    (dict(o2=torch.ones(6)), "rot_group"),
    (dict(o2=torch.ones(6), rot_group=4), "divide"),
])
def test_validation_names_the_slot(kwargs, problem):
    with pytest.raises(ValueError, match=problem):
        Slots(8, 6, **kwargs)


def test_vera_projections_are_shared_objects(tmp_path):
    cfg = dict(r=8, target_modules=["q_proj", "v_proj", "up_proj"], projection_prng_key=3)
    make_adapter(str(tmp_path / "a"), VeraConfig(**cfg), seed=1)
    make_adapter(str(tmp_path / "b"), VeraConfig(**cfg, save_projection=False), seed=2)
    make_adapter(str(tmp_path / "c"), VeraConfig(**{**cfg, "r": 4}), seed=3)
    model, interned = tiny_model(), {}
    a, b, c = (load_adapter(tmp_path / n, model, interned=interned) for n in "abc")
    bases = {s.A.untyped_storage().data_ptr() for ad in (a, b) for s in ad.layers.values()}
    assert len(bases) == 1, "same key, r and targets: one shared A across layers and adapters (saved or not)"
    again = load_adapter(tmp_path / "a", model, interned=interned)  # found by the file's pair, cast once
    assert {s.A.untyped_storage().data_ptr() for s in again.layers.values()} == bases
    assert sum(key[0] == "cast" for key in interned) == 4, "one cast of each saved pair's matrices (a's, c's)"
    alone = load_adapter(tmp_path / "a", model)  # another table: its own copy
    assert not bases & {s.A.untyped_storage().data_ptr() for s in alone.layers.values()}
    assert not bases & {s.A.untyped_storage().data_ptr() for s in c.layers.values()}
    s = next(iter(a.layers.values()))
    assert s.live == ("A", "m", "B", "v") and s.shared == {"A", "B"}
    assert s.num_bytes() == (8 + s.out_features) * 4  # only m and v are per adapter
    moved = a.to(dtype=torch.float64)
    assert len({s.A.untyped_storage().data_ptr() for s in moved.layers.values()}) == 1, "moving keeps it shared"
    assert all(torch.equal(m.A, s.A.double()) for m, s in zip(moved.layers.values(), a.layers.values()))
    assert not moved.layers.keys() - a.layers.keys() and all(m.m.dtype == torch.float64 for m in moved.layers.values())
    memo: dict = {}  # one memo for several adapters (the adapter manager's): the shared matrix is copied once
    pair = [ad.to(dtype=torch.float64, memo=memo) for ad in (a, b)]
    shared = {s.A.untyped_storage().data_ptr() for ad in pair for s in ad.layers.values()}
    assert len(shared) == 1 and shared != bases and len(memo) == 2, "one copy of A and one of B, for both adapters"
    alone = b.to(dtype=torch.float64)
    assert {s.A.untyped_storage().data_ptr() for s in alone.layers.values()}.isdisjoint(shared)

