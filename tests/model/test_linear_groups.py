"""`LinearGroup`: q/k/v and gate/up served by one op call (`group(x)`, `project`), against the same layers alone
and the reference path.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1`` + ``SCUTE_TRITON_CPU=1``,
the set-up of ``tests/interpreter.py``, including its fresh process when triton was imported first). The op calls
and shrink launches are counted, so a grouping that silently stopped grouping fails here.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from tests.interpreter import DEVICE, interpreter_module, use_interpreter

FRESH_PROCESS = use_interpreter()  # before triton is imported (tests/interpreter.py)
pytest.importorskip("triton")

import torch.nn.functional as F

import scute.model.linear as linear_mod
from scute.adapters import load_adapter
from scute.model.context import ForwardContext, forward_context
from scute.model.hf import place_adapter, swap_linears
from scute.model.layers import mlp_forward
from scute.model.linear import LinearGroup, ScuteLinear, project
from scute.ops import scute_linear_ref, triton_ops
from scute.ops.testing import random_slots, token_slots, vera_pair
from tests.helpers import FIVE_METHODS, make_adapter, rel_err, tiny_model

IN, OUTS, SLOTS = 32, (48, 16, 16), 6
TOL = 5e-3 if DEVICE == "cuda" else 1e-5  # tf32 dots on the GPU; exact fp32 products in the interpreter


_in_interpreter_process, test_in_a_fresh_interpreter_process = interpreter_module(__file__, FRESH_PROCESS,
                                                                                  triton_cpu=True)


@pytest.fixture
def calls(monkeypatch):
    """Records the number of projections of every op call `ScuteLinear`/`LinearGroup` make, and shrink launches."""
    record = {"ops": [], "shrink": 0}

    def counted(op):
        def call(x, weights, *args, **kw):
            record["ops"].append(len(weights))
            return op(x, weights, *args, **kw)
        return call

    def counted_shrink(*args, **kw):
        record["shrink"] += 1
        return shrink_(*args, **kw)

    shrink_ = triton_ops.shrink_
    for name in ("scute_linears_triton", "scute_linears_deferred"):  # the model's forwards call both
        monkeypatch.setattr(linear_mod, name, counted(getattr(linear_mod, name)))
    monkeypatch.setattr(triton_ops, "shrink_", counted_shrink)
    return record


# ---------------------------------------------------------------------------------------------- a tiny Llama
def _llama(paths: dict, packed: dict | None, device: str = DEVICE):
    """The tiny Llama with adapters (converted where its weights are); its MLPs call gate/up through `project`
    (scute.model.layers' MLP forward), its attention HF's own (q, k, v called one by one: each alone)."""
    model = tiny_model("llama").to(device)
    linears = swap_linears(model, 8) if packed is None else swap_linears(model, 8, packed_modules_mapping=packed)
    for slot, (name, path) in enumerate(paths.items()):
        place_adapter(linears, slot, load_adapter(path, model, name=name))
    return _fused_mlps(model)


def _fused_mlps(model):
    for layer in model.model.layers:
        layer.mlp.forward = types.MethodType(mlp_forward, layer.mlp)
    return model


def _logits(model, input_ids, row_slots, device=DEVICE):
    ctx = ForwardContext(token_adapter_slots=row_slots.repeat_interleave(input_ids.shape[1]).to(device))
    with torch.no_grad(), forward_context(ctx):
        logits = model(input_ids.to(device)).logits
    return logits.cpu()


def test_tiny_llama_grouped_equals_alone_equals_reference(tmp_path, calls, monkeypatch):
    paths = {}
    for i, (name, config) in enumerate(FIVE_METHODS.items()):  # lora adapts all 7 projections of a layer
        paths[name] = str(tmp_path / name)
        make_adapter(paths[name], config(), "llama", torch.float32, seed=20 + i)
    input_ids = torch.randint(0, 128, (7, 3), generator=torch.Generator().manual_seed(5))
    row_slots = torch.tensor([2, -1, 0, 4, 1, -1, 3])  # vera, base, lora, oft, dora, base, ia3
    with torch.no_grad():
        base_here = _fused_mlps(tiny_model("llama").to(DEVICE))(input_ids.to(DEVICE)).logits.cpu()

    grouped = _logits(_llama(paths, None), input_ids, row_slots)
    # per layer: q, k, v and o alone, gate/up in one call, down alone; the LM head has no adapter
    assert calls["ops"] == [1, 1, 1, 1, 2, 1] * 2 and calls["shrink"] == 12
    calls["ops"], calls["shrink"] = [], 0
    alone = _logits(_llama(paths, {}), input_ids, row_slots)
    assert calls["ops"] == [1] * 14 and calls["shrink"] == 14
    monkeypatch.delenv("SCUTE_TRITON_CPU")
    with torch.no_grad():
        base = _fused_mlps(tiny_model("llama"))(input_ids).logits
    model = _llama(paths, None, "cpu")
    reference = _logits(model, input_ids, row_slots, "cpu")

    for row, slot in enumerate(row_slots.tolist()):
        if slot < 0:  # base rows: exactly the base model's logits, on every path
            assert torch.equal(grouped[row], base_here[row]) and torch.equal(alone[row], base_here[row])
            assert torch.equal(reference[row], base[row])
        else:
            assert rel_err(grouped[row], reference[row]) <= TOL, row
            assert rel_err(alone[row], reference[row]) <= TOL, row
            assert rel_err(grouped[row], alone[row]) <= TOL, row
            assert rel_err(reference[row], base[row]) > 1e-3, "the adapter had no effect: the test would not see it"


def test_ungroupable_siblings_stay_alone():
    """A set is grouped only if all its names are present with one in_features."""
    model = torch.nn.Module()
    model.attn = torch.nn.Module()
    model.attn.q_proj, model.attn.k_proj = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)  # no v_proj
    model.mlp = torch.nn.Module()
    model.mlp.gate_proj, model.mlp.up_proj = torch.nn.Linear(8, 8), torch.nn.Linear(4, 8)  # in_features differ
    model.ffn = torch.nn.Module()
    model.ffn.gate_proj, model.ffn.up_proj = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    linears = swap_linears(model, 2)
    assert [n for n, m in linears.items() if m.group is not None] == ["ffn.gate_proj", "ffn.up_proj"]
    assert linears["ffn.up_proj"].group.name == "gate_up_proj"


def test_one_launch_resources_per_model():
    """`swap_linears` hands one `LaunchResources` to every layer of a model (their shrinks share its counters,
    their captured calls its side streams); another model, or a layer made alone, has its own. The counters grow
    for a larger call and serve every smaller one after; off the GPU there are no side streams."""
    one, other = (swap_linears(tiny_model("llama"), 2) for _ in range(2))
    resources = {id(m.resources) for m in one.values()}
    assert len(resources) == 1 and resources.isdisjoint(id(m.resources) for m in other.values())
    alone = ScuteLinear(torch.nn.Linear(8, 8), 2)
    assert id(alone.resources) not in resources
    r = alone.resources
    small = r.counters(torch.device("cpu"), 10)
    assert small.numel() >= 10 and not small.any() and r.counters(torch.device("cpu"), 5) is small
    large = r.counters(torch.device("cpu"), small.numel() + 1)
    assert large.numel() > small.numel() and r.counters(torch.device("cpu"), 10) is large
    assert r.side_streams(torch.device("cpu")) is None


# ---------------------------------------------------------------------------------------------- one group
def _qkv(seed: int):
    gen = torch.Generator().manual_seed(seed)
    layers = [ScuteLinear(torch.nn.Linear(IN, o, bias=o != 16).to(DEVICE), SLOTS) for o in OUTS]
    group = LinearGroup("qkv_proj", layers)
    return gen, layers, group


def _mixed(out_f: int, gen, pair) -> list:
    kw = {"device": DEVICE, "generator": gen}
    return [random_slots("lora", IN, out_f, rank=4, bias=True, **kw), None, random_slots("vera", IN, out_f,
            vera_pair=pair, **kw), random_slots("oft", IN, out_f, block=8, **kw), random_slots("ia3", IN, out_f,
            **kw), random_slots("dora", IN, out_f, rank=3, **kw)]


def _place(layers, gen) -> None:
    pair = vera_pair(4, IN, max(OUTS), device=DEVICE, generator=gen)
    for layer in layers:
        for i, s in enumerate(_mixed(layer.out_features, gen, pair)):
            layer.set_slot(i, s)


def _check(y, layer, x, ts) -> None:
    """`layer`'s output `y` for `x` is the reference's; base rows (slot −1, or an empty slot) bit-identical."""
    with torch.no_grad():
        ref = scute_linear_ref(x, layer.weight, layer.bias, layer.slots, ts)
        base = F.linear(x, layer.weight, layer.bias)
    plain = torch.tensor([s < 0 or layer.slots[s] is None for s in ts.tolist()], device=DEVICE)
    assert torch.equal(y[plain], base[plain])
    if not plain.all():
        assert rel_err(y[~plain], ref[~plain]) <= TOL


def test_group_call_and_members_alone(calls):
    """`group(x)` and `project` compute every member in one call; a member called by itself computes alone; a
    `project` over linears that are not exactly a group's members calls each."""
    gen, (q, k, v), group = _qkv(1)
    _place((q, k, v), gen)
    ts = token_slots("uniform", 9, SLOTS, generator=gen).to(DEVICE)
    x, x2 = (torch.randn(9, IN, generator=gen).to(DEVICE) for _ in range(2))
    with torch.no_grad(), forward_context(ForwardContext(token_adapter_slots=ts)):
        yq, yk, yv = group(x)
        assert calls["ops"] == [3]
        yk2 = k(x2)
        assert calls["ops"] == [3, 1]
        yq3, yk3, yv3 = project(x, q, k, v)
        assert calls["ops"] == [3, 1, 3]
        yq4, yv4 = project(x, q, v)  # not the group's members: each alone
        assert calls["ops"] == [3, 1, 3, 1, 1]
    for y, layer, inp in ((yq, q, x), (yk, k, x), (yv, v, x), (yk2, k, x2), (yq4, q, x), (yv4, v, x)):
        _check(y, layer, inp, ts)
    assert torch.equal(yq3, yq) and torch.equal(yk3, yk) and torch.equal(yv3, yv)


def test_group_with_only_k_adapted(calls):
    gen, (q, k, v), group = _qkv(2)
    ts = token_slots("skewed", 9, SLOTS, generator=gen).to(DEVICE)
    x = torch.randn(9, IN, generator=gen).to(DEVICE)
    with torch.no_grad(), forward_context(ForwardContext(token_adapter_slots=ts)):
        for layer, y in zip((q, k, v), group(x)):  # no adapter anywhere in the group: one GEMM, no op call
            torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=1e-6, atol=1e-6)
    assert calls["ops"] == [] and group.pool is None
    k.set_slot(1, random_slots("lora", IN, k.out_features, rank=5, device=DEVICE, generator=gen))
    k.set_slot(4, random_slots("oft", IN, k.out_features, block=4, device=DEVICE, generator=gen))
    with torch.no_grad(), forward_context(ForwardContext(token_adapter_slots=ts)):
        ys = group(x)
    assert calls["ops"] == [3] and calls["shrink"] == 1
    for y, layer in zip(ys, (q, k, v)):
        _check(y, layer, x, ts)
    assert (ts == 1).any() and not torch.allclose(ys[1], F.linear(x, k.weight, k.bias)), "k's adapter had no effect"


def test_set_slot_on_one_member_updates_the_group_pool(calls):
    gen, (q, k, v), group = _qkv(3)
    _place((q, k, v), gen)
    ts = token_slots("uniform", 9, SLOTS, generator=gen).to(DEVICE)
    x = torch.randn(1, 9, IN, generator=gen).to(DEVICE)
    with torch.no_grad(), forward_context(ForwardContext(token_adapter_slots=ts)):
        before = group(x)
    table = group.pool.table.data_ptr()
    v.set_slot(0, random_slots("lora", IN, v.out_features, rank=7, device=DEVICE, generator=gen))
    v.set_slot(3, None)
    with torch.no_grad(), forward_context(ForwardContext(token_adapter_slots=ts)):
        after = group(x)
    assert calls["ops"] == [3, 3] and group.pool.table.data_ptr() == table  # updated in place
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
    changed = (ts == 0) | (ts == 3)
    assert changed.any() and not torch.allclose(after[2][0, changed], before[2][0, changed])
    for y, layer in zip(after, (q, k, v)):
        _check(y[0], layer, x[0], ts)
    assert q.pool is None and k.pool is None  # members served by the group never built a pool of their own


def test_torch_compile_runs_each_member_alone(calls):
    """Under torch.compile a group's members run alone (each with its own pool, built before tracing)."""
    gen, layers, _ = _qkv(4)
    _place(layers, gen)
    ts = token_slots("zipf", 9, SLOTS, generator=gen).to(DEVICE)
    x = torch.randn(9, IN, generator=gen).to(DEVICE)
    with torch.no_grad(), forward_context(ForwardContext(token_adapter_slots=ts)):
        eager = [layer(x) for layer in layers]
        for layer in layers:  # a compiled graph needs the pools built before: the members' own ones here
            layer.forward_alone(x)
        calls["ops"] = []
        torch._dynamo.reset()
        compiled = torch.compile(lambda x: layers[0].group(x), fullgraph=True, backend="aot_eager")(x)
    assert calls["ops"] == [1, 1, 1]
    for y, y_eager in zip(compiled, eager):
        torch.testing.assert_close(y, y_eager, rtol=TOL, atol=TOL)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", *sys.argv[1:]]))
