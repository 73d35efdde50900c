"""The adapters' device-memory budget (`adapter_memory_bytes`): the slots never hold more than it, unused adapters
are evicted to make room (tokens unchanged), an adapter larger than the whole budget fails alone, shared storages
count once, and the default budget on a GPU has room for max_adapters + the staged LoRA adapters of rank 16,
capped at DEFAULT_SHARE of the device's memory."""

from __future__ import annotations

import pytest
import torch

from scute.config import EngineConfig
from scute.engine.adapter_manager import MAX_PREFETCH
from scute.engine.adapter_memory import (DEFAULT_RANK, DEFAULT_SHARE, AdapterMemory, Storages, adapter_budget,
                                         adapter_storages, default_budget, lora_bytes)
from tests.helpers import GREEDY, METHODS, Oracle, check, mixed_requests


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    return Oracle(tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def sizes(oracle):
    """Each method's adapter and its bytes as the slots hold them (float32 engine: 4 bytes per element)."""
    engine = oracle.engine()
    adapters = {m: engine.adapters.load(oracle.paths[m]) for m in METHODS}
    return {m: adapter_storages(a, 4).total for m, a in adapters.items()}


def _watch(engine, budget: int) -> list[int]:
    """Record the slots' bytes after every acquire, and check them against the budget."""
    seen, acquire = [], engine.adapters.acquire

    def acquire_and_check(adapter):
        slot = acquire(adapter)
        seen.append(engine.adapters.memory.used())
        assert seen[-1] <= budget, f"{seen[-1]} bytes in the slots, budget {budget}"
        return slot

    engine.adapters.acquire = acquire_and_check
    return seen


def test_the_budget_bounds_the_slots_and_eviction_keeps_tokens(oracle, sizes):
    budget = max(sizes.values()) + min(sizes.values())  # every adapter fits, never all five
    engine = oracle.engine(max_adapters=len(METHODS), adapter_memory_bytes=budget)
    seen = _watch(engine, budget)
    prompts, adapters = mixed_requests()
    specs = [None if a is None else oracle.paths[a] for a in adapters]
    for _ in range(2):
        check(oracle, engine.generate(prompts, GREEDY, specs, use_tqdm=False), prompts, adapters)
    assert seen and max(seen) <= budget < sum(sizes.values())
    assert engine.adapters.memory.pinned.bytes == 0 and not engine.adapters.memory.pinned.members  # all released
    assert engine.adapters._free_slots  # slots were emptied to make room, not all refilled


def test_eviction_passes_over_the_representative_of_shared_matrices(oracle):
    """The least recently used unused adapter is evicted, but one that holds shared matrices (VeRA's pair) in the
    lowest slot of two or more holders, which represents their group in every pool, is passed over while another
    can go; one alone with its matrices (no member to regroup) goes in its turn."""
    manager = oracle.engine(max_adapters=4).adapters
    pair, other = ("vera", 1), ("vera", 2)  # storage keys
    for slot, (ident, shared) in enumerate([("v0", {pair: 8}), ("v1", {pair: 8}), ("w0", {other: 8}), ("lora", {})]):
        manager._slot_of[ident] = slot
        manager.memory.held.add(ident, Storages(4, shared))
        manager._unused[ident] = None  # least recently used first
    manager._free_slots = []
    evicted = []
    while manager._unused:
        evicted.append(manager._evict())
    assert evicted == [1, 0, 2, 3]  # v1 (v0 represents it); then v0, alone by then, w0 (alone) and lora in turn


def test_a_full_engine_evicts_above_the_group_a_new_adapter_joins(oracle):
    """With every slot full, the slot for an adapter whose shared matrices a group in the slots holds is taken from
    above that group's lowest slot (`_evict`'s floor), not from the least recently used adapter below it, where the
    new adapter would represent the group."""
    manager = oracle.engine(max_adapters=4).adapters
    pair = ("vera", 1)
    for slot, (ident, shared) in enumerate([("lora", {}), ("v0", {pair: 8}), ("v1", {pair: 8}), ("lora2", {})]):
        manager._slot_of[ident] = slot
        manager.memory.held.add(ident, Storages(4, shared))
        manager._unused[ident] = None  # least recently used first
    manager._free_slots = []
    assert manager._evict(floor=1) == 2  # v1: above v0's slot, and not v0 (it represents the group)
    assert manager._evict() == 0  # without a floor: the least recently used


def test_an_adapter_of_shared_matrices_is_placed_above_their_group(oracle):
    """An adapter whose shared matrices adapters in the slots hold takes the lowest empty slot above theirs (below,
    it would represent their group in every pool); any other takes the lowest empty slot."""
    manager = oracle.engine(max_adapters=5).adapters
    pair = ("vera", 1)
    manager._slot_of["v"] = 2
    manager.memory.held.add("v", Storages(4, {pair: 8}))
    manager._free_slots = [0, 1, 3, 4]
    vera, lora, new_pair = {pair: 8}, {}, {("w", 1): 8}  # their shared storages
    assert [manager._free_slot(manager._group_floor(a)) for a in (vera, lora, new_pair, vera)] == [3, 0, 1, 4]
    assert manager._free_slots == []


def test_an_adapter_larger_than_the_budget_fails_alone(oracle, sizes):
    big = max(sizes, key=sizes.get)
    budget = max(n for m, n in sizes.items() if m != big)
    engine = oracle.engine(max_adapters=len(METHODS), adapter_memory_bytes=budget)
    prompts, adapters = mixed_requests()
    specs = [None if a is None else oracle.paths[a] for a in adapters]
    outputs = engine.generate(prompts, GREEDY, specs, use_tqdm=False)
    for out, adapter in zip(outputs, adapters):
        if adapter == big:
            assert out.outputs[0].finish_reason == "error" and "adapter_memory_bytes" in out.error, out.error
            assert f"{sizes[big] / 2**20:.1f} MiB" in out.error
    keep = [i for i, a in enumerate(adapters) if a != big]
    check(oracle, [outputs[i] for i in keep], [prompts[i] for i in keep], [adapters[i] for i in keep])


def test_storages_split_own_from_shared(oracle):
    """An adapter's bytes are its distinct storages' either way; only what `Slots.shared` names is kept by key
    (what other adapters may hold too), so pinning a LoRA adapter for a request is one addition, not a walk over
    its layers' tensors."""
    from scute.ops.groups import slot_storages

    engine = oracle.engine()
    for method in METHODS:
        adapter = engine.adapters.load(oracle.paths[method])
        storages = adapter_storages(adapter, 4)
        distinct = {k: n for sl in adapter.layers.values() for k, n in slot_storages(sl, 4).items()}
        assert storages.total == sum(distinct.values()) > 0, method
        assert bool(storages.shared) == (method == "vera"), method
        union = AdapterMemory(None, torch.float32).pinned
        union.add(adapter.identity, storages)
        assert union.bytes == storages.total
        union.remove(adapter.identity)
        assert union.bytes == 0 and not union._refs


def test_shared_storages_count_once(oracle):
    """Two VeRA adapters of one projection key share their A and B (one tensor per content): held together they
    cost one pair and two sets of vectors."""
    engine = oracle.engine()
    one = engine.adapters.load(oracle.paths["vera"])
    two = engine.adapters.load(oracle.paths["vera"], name="again")  # read again: its own vectors, the same pair
    two.identity = "another"  # held as a second adapter
    memory = AdapterMemory(None, torch.float32)
    memory.hold(one)
    alone = memory.used()
    memory.hold(two)
    vectors = sum(x.numel() * 4 for s in two.layers.values() for x in s.tensors().values() if x.dim() == 1)
    assert memory.used() == alone + vectors < 2 * alone
    memory.drop(one.identity)
    assert memory.used() == alone
    assert AdapterMemory(alone - 1, torch.float32).too_large(one) is not None
    assert AdapterMemory(alone, torch.float32).too_large(one) is None


def test_default_budget(oracle):
    engine = oracle.engine()
    linears = engine.adapters.linears
    assert adapter_budget(EngineConfig(device="cpu"), linears, torch.float32, torch.device("cpu"), 4) is None
    assert adapter_budget(EngineConfig(device="cpu", adapter_memory_bytes=123), linears, torch.float32,
                          torch.device("cpu"), 4) == 123
    lora = engine.adapters.load(oracle.paths["lora"])  # rank 4 on the decoder's linear layers: the estimate is exact
    adapted = {name: lin for name, lin in linears.items() if name in lora.layers}
    assert len(adapted) > 6 and lora_bytes(adapted, 4, 4) == adapter_storages(lora, 4).total
    per_lora = lora_bytes(linears, DEFAULT_RANK, 2)
    assert default_budget(linears, 8 + MAX_PREFETCH, torch.bfloat16, 1 << 40) == (8 + MAX_PREFETCH) * per_lora
    assert default_budget(linears, 1 << 20, torch.bfloat16, 1 << 30) == int(DEFAULT_SHARE * (1 << 30))  # capped
    with pytest.raises(ValueError, match="adapter_memory_bytes"):
        EngineConfig(device="cpu", adapter_memory_bytes=0)


def test_capacity_counts_shared_storages_once(oracle):
    """`Engine.adapter_capacity`: how many adapters like one fit the budget at once, the storages they share
    (VeRA's pair) counted once, at most max_adapters; without a budget, max_adapters. Each count is then held."""
    lora, vera = (adapter_storages(oracle.engine().adapters.load(oracle.paths[m]), 4) for m in ("lora", "vera"))
    pair = sum(vera.shared.values())
    assert lora.shared == {} and pair > 0
    assert oracle.engine(max_adapters=50, adapter_memory_bytes=7 * lora.own + 3).adapter_capacity(
        oracle.paths["lora"]) == 7
    assert oracle.engine(max_adapters=5, adapter_memory_bytes=7 * lora.own).adapter_capacity(oracle.paths["lora"]) == 5
    assert oracle.engine(max_adapters=50).adapter_capacity(oracle.paths["lora"]) == 50  # the CPU: no budget
    budget = pair + 9 * vera.own + 5
    engine = oracle.engine(max_adapters=50, adapter_memory_bytes=budget)
    assert engine.adapter_capacity(oracle.paths["vera"]) == 9 > budget // vera.total
    memory, first = AdapterMemory(budget, torch.float32), engine.adapters.get_by_path(oracle.paths["vera"])
    for i in range(engine.adapter_capacity(first)):  # that many distinct VeRA adapters, held together, fit
        copy = engine.adapters.load(oracle.paths["vera"], name=f"v{i}")
        copy.identity = f"v{i}"
        assert memory.fits(copy, memory.held)
        memory.hold(copy)
    assert not memory.fits(first, memory.held)
