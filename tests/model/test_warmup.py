"""`warm_kernels`: the layer calls a placement makes new, run once per kind of pool and token count over a scratch
pool, never touching the model's slots, pools or outputs.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (``tests/interpreter.py``), so the warm-up's
calls run the real op there too.
"""

from __future__ import annotations

import types

import pytest
import torch

from tests.interpreter import DEVICE, interpreter_module, use_interpreter

FRESH_PROCESS = use_interpreter()  # before triton is imported (tests/interpreter.py)
pytest.importorskip("triton")

import scute.model.warmup as warmup_mod
from scute.adapters import load_adapter
from scute.model.context import ForwardContext, forward_context
from scute.model.hf import layer_pools, place_adapter, swap_linears
from scute.model.layers import mlp_forward
from tests.helpers import FIVE_METHODS, make_adapter, tiny_model

_in_interpreter_process, test_in_a_fresh_interpreter_process = interpreter_module(__file__, FRESH_PROCESS,
                                                                                  triton_cpu=True)


@pytest.fixture
def calls(monkeypatch):
    """(tokens, projections, active slots, deferred) of every layer call the warm-up makes."""
    record = []

    def counted(op, deferred):
        def call(x, weights, *args, active_slots=None, **kw):
            record.append((x.shape[0], len(weights), active_slots, deferred))
            return op(x, weights, *args, active_slots=active_slots, **kw)
        return call

    for name, deferred in (("scute_linears_triton", False), ("scute_linears_deferred", True)):
        monkeypatch.setattr(warmup_mod, name, counted(getattr(warmup_mod, name), deferred))
    return record


def _logits(model, slots: list[int]):
    ids = torch.tensor([[5, 17, 9]] * len(slots))  # one prompt on every row: rows differ by their adapter
    ctx = ForwardContext(token_adapter_slots=torch.tensor(slots).repeat_interleave(3).to(DEVICE))
    with torch.no_grad(), forward_context(ctx):
        return model(ids.to(DEVICE)).logits.cpu()


def test_new_kinds_of_pools_are_run_once_each_and_nothing_of_the_model_changes(tmp_path, calls):
    paths = {}
    for name, seed in (("lora", 1), ("ia3", 2), ("ia3_2", 3)):
        paths[name] = str(tmp_path / name)
        make_adapter(paths[name], FIVE_METHODS[name.split("_")[0]](), "llama", torch.float32, seed=seed)
    model = tiny_model("llama").to(DEVICE)
    linears = swap_linears(model, 4)
    for layer in model.model.layers:  # gate/up through `project`, as the engine's forwards call them
        layer.mlp.forward = types.MethodType(mlp_forward, layer.mlp)
    units = list(layer_pools(linears))
    lora, ia3, ia3_2 = (load_adapter(paths[n], model, name=n) for n in ("lora", "ia3", "ia3_2"))
    place_adapter(linears, 1, lora)
    before = _logits(model, [1, -1])  # builds the layers' pools
    slots = {name: list(lin.slots) for name, lin in linears.items()}
    pools = {name: (lin.pool, None if lin.group is None else lin.group.pool) for name, lin in linears.items()}
    tables = {id(p): p.table.clone() for ps in pools.values() for p in ps if p is not None}
    warmed: set = set()

    n = warmup_mod.warm_kernels(units, ia3, (1, 16), warmed)
    # IA3 adapts k, v (the q/k/v group's pool) and down (its own): two kinds of pool, each at one layer of two;
    # each token count with the passes of the adapter's slot and of the whole pool, one token also deferred
    assert n == len(calls) == 2 * (2 * 2 + 2)
    assert sorted({(t, p) for t, p, _, _ in calls}) == [(1, 1), (1, 3), (16, 1), (16, 3)]
    # slot 0, the first free one: the adapter's passes alone, and the pool's (LoRA's in slot 1 too)
    assert {None if a is None else frozenset(a) for _, _, a, _ in calls} == {frozenset({0}), None}
    assert sum(deferred for *_, deferred in calls) == 4
    assert warmup_mod.warm_kernels(units, ia3_2, (1, 16), warmed) == 0  # the same kinds: nothing new
    assert warmup_mod.warm_kernels(units, ia3_2, (1, 16), set()) == n  # a new engine's set: run again
    assert warmup_mod.warm_kernels(units, lora, (), set()) == 0  # no token counts (the CPU path's engine)

    for name, lin in linears.items():  # the model's slots and pools are only read
        assert lin.slots == slots[name] and (lin.pool, None if lin.group is None else lin.group.pool) == pools[name]
    assert all(torch.equal(p.table, tables[id(p)]) for ps in pools.values() for p in ps if p is not None)
    assert torch.equal(_logits(model, [1, -1]), before)
    place_adapter(linears, 0, ia3)
    after = _logits(model, [0, 1, -1])
    assert torch.allclose(after[1:], before, atol=1e-5) and not torch.allclose(after[0], after[2], atol=1e-3)
    # the pools' signatures changed with the placement, the plans of a second IA3 adapter's calls did not
    assert warmup_mod.warm_kernels(units, ia3_2, (1, 16), warmed) == 0
