"""The slot pool's tables are plain PyTorch: built inside the engine's inference mode, updated outside it."""

from __future__ import annotations

import torch

from scute.ops import groups
from scute.ops.pool import SlotPool
from scute.ops.slots import Slots


def lora(r: int) -> Slots:
    return Slots(8, 6, A=torch.randn(r, 8), B=torch.randn(6, r))


def test_pool_built_in_inference_mode_updates_outside_it():
    slots = [[lora(2), None, None]]
    with torch.inference_mode():  # the first forward of an engine step creates the pool
        pool = SlotPool(8, (6,), 3, "cpu", torch.float32)
        pool.update(slots)
    before = pool.table.clone()
    slots[0][1] = lora(4)
    pool.update(slots)  # set_slot, between steps
    assert not pool.table.is_inference() and not torch.equal(pool.table, before)
    with torch.inference_mode():
        slots[0][2] = Slots(8, 6, o=torch.rand(6))
        pool.update(slots)


def test_a_placement_that_moves_other_slots_groups_is_applied_at_once():
    """A slot joining a group moves no other slot: the placement's writes may wait for its end (no step uses the
    slot meanwhile). Replacing the representative of a group of two moves the other member to a group of its
    own, a slot in use, with the pool's signature unchanged: the placement is marked `resigned`, applied before
    any step (a graph sharing one token order between pools would read this pool's old grouping)."""
    from scute.ops.pool import Placement

    def vera(pair) -> Slots:
        return Slots(8, 6, A=pair[0], B=pair[1], m=torch.randn(4), v=torch.randn(6), shared=frozenset({"A", "B"}))

    x, y = [(torch.randn(4, 8), torch.randn(6, 4)) for _ in range(2)]
    slots = [[vera(x), vera(x), vera(y), vera(y), None, None]]
    pool = SlotPool(8, (6,), 6, "cpu", torch.float32)
    pool.update(slots)
    assert pool.facts.groups == (0, 0, 2, 2, 4, 5)
    slots[0][4], placement = vera(x), Placement()
    pool.update_slot(slots, 4, placement)
    assert pool.facts.groups == (0, 0, 2, 2, 0, 5) and not placement.resigned
    signature, slots[0][2], placement = pool.signature, lora(4), Placement()
    pool.update_slot(slots, 2, placement)
    assert pool.facts.groups == (0, 0, 2, 3, 0, 5) and pool.signature == signature and placement.resigned


def test_shared_group_buffers_refilled_in_place():
    """A captured graph holds the shared group's buffers. The first pair's B is the adapters' own tensor (no copy per
    pool); another pair of the same shapes (another VeRA model's) gets buffers of the pool's own, once (a new
    signature: the graphs follow), which later pairs and their members' m are copied into, the signature unchanged;
    no adapter's tensor is ever written; a new rank is new buffers and a new signature."""
    def vera(pair, r: int) -> Slots:
        return Slots(8, 6, A=pair[0], B=pair[1], m=torch.randn(r), v=torch.randn(6), shared=frozenset({"A", "B"}))

    pairs = [(torch.randn(4, 8), torch.randn(6, 4)) for _ in range(2)]
    saved = [(a.clone(), b.clone()) for a, b in pairs]
    pool = SlotPool(8, (6,), 3, "cpu", torch.float32)
    pool.update([[vera(pairs[0], 4), lora(2), vera(pairs[0], 4)]])
    assert pool.shared_b[0].data_ptr() == pairs[0][1].data_ptr()  # the adapters' B itself
    assert pool.shared_a[0].data_ptr() == pairs[0][0].data_ptr()  # and A
    first = pool.signature
    pool.update([[vera(pairs[1], 4), lora(2), vera(pairs[1], 4)]])
    assert pool.signature != first and torch.equal(pool.shared_b[0], pairs[1][1])  # buffers of its own, once
    assert torch.equal(pool.shared_a[0], pairs[1][0]) and pool.shared_a[0].data_ptr() != pairs[1][0].data_ptr()
    sig, bufs = pool.signature, (pool.shared_a[0], pool.shared_b[0], pool.shared_m)
    slots = [[vera(pairs[0], 4), lora(2), vera(pairs[0], 4)]]
    pool.update(slots)
    assert pool.signature == sig and all(a is b for a, b in zip(bufs, (pool.shared_a[0], pool.shared_b[0],
                                                                        pool.shared_m)))
    assert torch.equal(pool.shared_a[0], pairs[0][0]) and torch.equal(pool.shared_b[0], pairs[0][1])
    assert torch.equal(pool.shared_m[0, 2], slots[0][2].m) and pool.max_rank == 2
    assert all(torch.equal(x, y) for pair, copy in zip(pairs, saved) for x, y in zip(pair, copy))
    pool.update([[vera((torch.randn(3, 8), torch.randn(6, 3)), 3), lora(2), None]])
    assert pool.signature != sig and [a.shape for a in pool.shared_a] == [(3, 8)]
    pool.update([[lora(2), None, None]])
    assert pool.shared_group == -1 and pool.shared_a == []


def test_step_kinds():
    """The passes a step runs follow its slots: OFT's T is the pre-pass alone, IA3's output scale the epilogue
    alone, a VeRA member the shared group's products, a LoRA the table's kernels; None is every pass of the pool."""
    pair = (torch.randn(4, 8), torch.randn(6, 4))
    vera = Slots(8, 6, A=pair[0], B=pair[1], m=torch.randn(4), v=torch.randn(6), shared=frozenset({"A", "B"}))
    oft = Slots(8, 6, t_blocks=torch.randn(2, 4, 4))
    slots = [[lora(2), vera, vera, oft, Slots(8, 6, o=torch.rand(6)), None]]
    pool = SlotPool(8, (6,), 6, "cpu", torch.float32)
    pool.update(slots)
    kinds = {s: tuple(pool.step_kinds({s})) for s in range(6)}
    assert kinds == {0: (False, False, True, True), 1: (False, True, False, True), 2: (False, True, False, True),
                     3: (True, False, False, False), 4: (False, False, False, True), 5: (False,) * 4}
    assert tuple(pool.step_kinds({-1})) == (False,) * 4
    assert tuple(pool.step_kinds({0, 3, -1})) == (True, False, True, True)
    assert tuple(pool.step_kinds(None)) == (True, True, True, True)
    pool.update([[lora(2), None, None, None, Slots(8, 6, o=torch.rand(6)), None]])  # None: the pool's passes
    assert tuple(pool.step_kinds(None)) == (False, False, True, True)
    assert pool.shared_group < 0
    before = pool.signature  # a diagonal T (IA3 feed-forward) adds the pre-pass alone: a graph must be captured anew
    pool.update([[lora(2), None, None, None, Slots(8, 6, o=torch.rand(6)), Slots(8, 6, t=torch.rand(8))]])
    assert tuple(pool.step_kinds(None)) == (True, False, True, True) and pool.signature != before


def _same_signature(pool: SlotPool, fresh: SlotPool) -> bool:
    """The signatures agree but for their last entry: whether the shared group's B buffers are the pool's own,
    which follows the pool's history (a pool that met two pairs of one shape owns them, a fresh build does not)."""
    return pool.signature[:-1] == fresh.signature[:-1] and isinstance(pool.signature[-1], bool)


def _decoded(pool: SlotPool) -> list:
    """The table with every pointer replaced by the values it points to (pools built apart differ only there)."""
    from scute.ops.pool_rows import F_A, F_B, F_C, F_M, F_O, F_O2, F_T, F_TB, F_V

    by_ptr = {y.data_ptr(): y for _, y in pool._cache.values()}
    out = []
    for p in range(pool.num_proj):
        for s in range(pool.num_slots):
            row = pool.table[p, s].tolist()
            for f in (F_A, F_B, F_C, F_M, F_O, F_O2, F_T, F_TB, F_V):
                row[f] = None if row[f] == 0 else by_ptr[row[f]].flatten().tolist()
            out.append(row)
    return out


def test_update_slot_equals_a_rebuild(monkeypatch):
    """Placing adapters slot by slot (`update_slot`: only the slot's rows for a slot of its own, a rebuild when the
    grouping changes; the pool's facts from the slot's alone where they can be) gives the table, facts and device
    copies a pool built from the same slots at once has; an evicted adapter's copies are dropped."""
    from scute.ops.testing import random_slots

    g = torch.Generator().manual_seed(0)
    pairs = [(torch.randn(4, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(2)]

    def vera(k: int = 0) -> Slots:
        return Slots(8, 6, A=pairs[k][0], B=pairs[k][1], m=torch.randn(4, generator=g), v=torch.randn(6, generator=g),
                     shared=frozenset({"A", "B"}))

    makers = [lambda: lora(2), lambda: lora(5), vera, lambda: Slots(8, 6, o=torch.rand(6, generator=g)),
              lambda: random_slots("dora", 8, 6, rank=3, generator=g),
              lambda: random_slots("oft", 8, 6, block=4, generator=g), lambda: None, lambda: lora(5),
              lambda: vera(1)]
    slots = [[None] * 5 for _ in range(2)]
    pool = SlotPool(8, (6, 6), 5, "cpu", torch.float32)
    pool.update(slots)
    rebuilds, update = [], pool.update
    pool.update = lambda *args: rebuilds.append(1) or update(*args)
    alone, changed_alone = [], groups._changed_alone  # the facts from the changed slot's alone
    monkeypatch.setattr(groups, "_changed_alone", lambda *a: alone.append(changed_alone(*a)) or alone[-1])
    order, joined = torch.randint(0, len(makers), (160,), generator=g).tolist(), 0
    for step, (s, m) in enumerate(zip(torch.randint(0, 5, (160,), generator=g).tolist(), order)):
        for p in range(2):
            slots[p][s] = makers[m]() if (p + step) % 3 else None  # projections adapted or not
        before = len(rebuilds)
        pool.update_slot(slots, s)
        joined += m == 2 and len(rebuilds) == before and any(sl is not None for sl in (slots[0][s], slots[1][s]))
        fresh = SlotPool(8, (6, 6), 5, "cpu", torch.float32)
        fresh.update(slots)
        where = f"step {step}: slot {s} <- {m}"
        assert _decoded(pool) == _decoded(fresh), where
        assert _same_signature(pool, fresh) and pool.facts == fresh.facts, where
        assert torch.equal(pool.slot_group, fresh.slot_group), where
        assert len(pool._cache) == len(fresh._cache), where
        assert torch.equal(pool.shared_m, fresh.shared_m), where
        assert len(pool.shared_a) == len(fresh.shared_a), where
        assert all(torch.equal(a, b) for a, b in zip(pool.shared_a, fresh.shared_a)), where
    assert 0 < len(rebuilds) < 80 and joined, "the slot's rows alone ran (a VeRA slot joining the shared group too)"
    assert len(rebuilds) >= 1, "and a rebuild, for a change of the grouping"
    assert sum(f is not None for f in alone) >= 10, "the facts from the changed slot's alone, often"


def test_an_eviction_is_worked_out_from_the_slot_alone(monkeypatch):
    """Emptying the slot of an adapter that holds the pool's largest rank, or of a member of the shared group, costs
    the slot alone while another group holds that rank and the shared group stays the largest (a full pool
    evicting for memory must not pay for every resident adapter), and gives the facts a rebuild gives; the last
    holder of the largest rank, or a shared group that may stop being the largest, costs the full computation."""
    g = torch.Generator().manual_seed(1)
    pairs = [(torch.randn(4, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(2)]

    def vera(k: int) -> Slots:
        return Slots(8, 6, A=pairs[k][0], B=pairs[k][1], m=torch.randn(4, generator=g), shared=frozenset({"A", "B"}))

    # slots 0-2: LoRA of rank 5, 5, 2; 3-5: VeRA of one pair; 6: VeRA of another (the runner-up group); 7: empty
    slots = [[lora(5), lora(5), lora(2), vera(0), vera(0), vera(0), vera(1), None]]
    pool = SlotPool(8, (6,), 8, "cpu", torch.float32)
    pool.update(slots)
    full, pool_facts = [], groups.pool_facts
    monkeypatch.setattr(groups, "pool_facts", lambda *a: full.append(1) or pool_facts(*a))
    for s, alone in [(0, True), (1, False), (5, True), (4, False)]:
        slots[0][s] = None
        before = len(full)
        pool.update_slot(slots, s)
        assert (len(full) == before) is alone, f"slot {s}"
        fresh = SlotPool(8, (6,), 8, "cpu", torch.float32)
        fresh.update(slots)
        assert pool.facts == fresh.facts and pool.signature == fresh.signature, f"slot {s}"
        assert torch.equal(pool.slot_group, fresh.slot_group) and _decoded(pool) == _decoded(fresh), f"slot {s}"
    assert pool.facts.max_rank == 4 and pool.facts.shared_group == 3  # the other pair's VeRA is in the table


def test_pools_of_one_kind_work_out_a_placement_once(monkeypatch):
    """Six pools of one kind (a model's layers), each given its own alike adapter slot after slot: the change of
    their facts is worked out once per placement and shared (one object), not once per pool; a pool given another
    rank works out its own; every pool's facts equal those of a pool built from its slots at once."""
    monkeypatch.setattr(groups, "_SHARED", {})
    monkeypatch.setattr(groups, "_TRANSITIONS", {})
    alone, changed_alone = [], groups._changed_alone
    monkeypatch.setattr(groups, "_changed_alone", lambda *a: alone.append(1) or changed_alone(*a))
    pools = [SlotPool(8, (6, 6), 4, "cpu", torch.float32) for _ in range(6)]
    slots = [[[None] * 4 for _ in range(2)] for _ in pools]
    for pool, own in zip(pools, slots):
        pool.update(own)  # built empty, as on a first forward
    for s in range(4):
        before = len(alone)
        for i, pool in enumerate(pools):
            rank = 5 if (s, i) == (2, 3) else 2  # one pool's adapter differs at slot 2
            for p in range(2):
                slots[i][p][s] = lora(rank)
            pool.update_slot(slots[i], s)
            fresh = SlotPool(8, (6, 6), 4, "cpu", torch.float32)
            fresh.update(slots[i])
            assert pool.facts == fresh.facts and pool.signature == fresh.signature, (s, i)
        assert len(alone) - before == (2 if s >= 2 else 1), s  # from slot 2 on, pool 3's facts are its own
        assert len({id(p.facts) for p in pools}) == (2 if s >= 2 else 1)


def _qkv_and_o(num_slots: int):
    """A q/k/v group and a lone o projection (8 -> 6) with their pools: (members, group, o, linears by name)."""
    from scute.model.linear import LinearGroup, ScuteLinear, pool_for

    members = [ScuteLinear(torch.nn.Linear(8, 6), num_slots) for _ in range(3)]
    group, alone = LinearGroup("qkv_proj", members), ScuteLinear(torch.nn.Linear(8, 6), num_slots)
    x = torch.zeros(2, 8)
    group.pool, alone.pool = pool_for(None, x, members), pool_for(None, x, [alone])
    return members, group, alone, {"q": members[0], "k": members[1], "v": members[2], "o": alone}


def _served(r: int, g: torch.Generator, scaled: bool = False) -> Slots:
    """A LoRA-like slot (8 -> 6) as a float32 pool serves it (rank `r` a multiple of 8), with v; o too if `scaled`."""
    return Slots(8, 6, A=torch.randn(r, 8, generator=g), B=torch.randn(6, r, generator=g),
                 v=torch.rand(6, generator=g), o=torch.rand(6, generator=g) if scaled else None)


def test_placing_an_adapter_updates_each_pool_once(monkeypatch):
    """`place_adapter` sets a group's members together: the group's pool is updated once, not once per member."""
    from types import SimpleNamespace

    from scute.model.hf import place_adapter

    members, group, alone, linears = _qkv_and_o(3)
    calls = []
    update_slot = SlotPool.update_slot
    monkeypatch.setattr(SlotPool, "update_slot", lambda self, *a: calls.append(self) or update_slot(self, *a))
    place_adapter(linears, 1, SimpleNamespace(name="a", layers={"q": lora(2), "v": lora(3), "o": lora(2)}))
    assert sorted(map(id, calls)) == sorted([id(group.pool), id(alone.pool)])
    assert [m.slots[1] is not None for m in members] == [True, False, True] and members[1].num_filled == 0
    fresh = SlotPool(8, (6, 6, 6), 3, "cpu", torch.float32)
    fresh.update([m.slots for m in members])
    assert _decoded(group.pool) == _decoded(fresh)


def test_placing_a_served_slot_calls_torch_for_metadata_only():
    """A placement runs on the step loop while the adapter loader thread runs Python: every call into torch that
    computes (a no-op `.to()` included) hands the loader the interpreter lock, and the step loop waits a switch
    interval to get it back (a placement built from unserved tensors makes hundreds of them). Setting a slot
    whose tensors are as the pool serves them (matrices in its dtype, ranks a multiple of 8, vectors in float32)
    asks torch for metadata only; its rows wait in the placement's `TableWrites` until the flush."""
    from torch.overrides import TorchFunctionMode

    from scute.ops.pool import Placement

    class Calls(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.add(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    served = lambda r: _served(r, g, scaled=True)  # noqa: E731

    pair = [(torch.randn(8, 8, generator=g), torch.randn(6, 8, generator=g)) for _ in range(2)]

    def vera(p: int) -> Slots:  # a member of a group sharing VeRA's matrices: its m is the pool's shared_m row
        return Slots(8, 6, A=pair[p][0], B=pair[p][1], m=torch.randn(8, generator=g), v=torch.rand(6, generator=g),
                     shared=frozenset({"A", "B"}))

    for placed in ([served(16), served(8)], [vera(0), vera(1)]):
        pool = SlotPool(8, (6, 6), 5, "cpu", torch.float32)
        slots = [[served(8), vera(0), vera(0), None, None], [served(16), vera(1), vera(1), None, None]]
        pool.update(slots)
        slots[0][3], slots[1][3] = placed
        placement, before, m = Placement(), pool.table.clone(), pool.shared_m.clone()
        writes = placement.writes
        with Calls() as calls:
            pool.update_slot(slots, 3, placement)
        assert calls.names <= {"__get__", "data_ptr", "dim", "element_size", "is_contiguous", "stride"}, calls.names
        assert torch.equal(pool.table, before) and torch.equal(pool.shared_m, m)
        joins = placed[0].shared == {"A", "B"}  # its group is the shared one: its entry of slot_group too
        assert len(writes.rows) == 2 + joins and len(writes.copies) == 2  # and its rows of the shared group's m
        writes.flush()
        fresh = SlotPool(8, (6, 6), 5, "cpu", torch.float32)
        fresh.update(slots)
        assert _decoded(pool) == _decoded(fresh) and torch.equal(pool.shared_m, fresh.shared_m)
        assert torch.equal(pool.slot_group, fresh.slot_group) and int(pool.slot_group[3]) == (1 if joins else 3)


def test_rows_prepared_off_the_step_loop_place_as_the_slots_do(monkeypatch):
    """`prepare_adapter` (the adapter loader, as it stages an adapter) computes its rows in every pool from the
    adapter alone; placing it then takes them as they are (no row is built on the step loop) and leaves the tables
    a fresh build of the slots gives. Rows prepared for other slots are ignored. A column of shared matrices
    (VeRA's) gets a member's rows: the first such adapter, which forms the group, is placed by a rebuild; the next
    joins it with its rows as prepared."""
    from types import SimpleNamespace

    from scute.model.hf import layer_pools, place_adapter, prepare_adapter

    g = torch.Generator().manual_seed(5)
    served = lambda r: _served(r, g)  # noqa: E731

    members, group, alone, linears = _qkv_and_o(5)
    units = list(layer_pools(linears))
    built = []
    fill = SlotPool._fill_column
    monkeypatch.setattr(SlotPool, "_fill_column", lambda self, *a: built.append(self) or fill(self, *a))
    pair = (torch.randn(8, 8, generator=g), torch.randn(6, 8, generator=g))
    vera = Slots(8, 6, A=pair[0], B=pair[1], m=torch.randn(8, generator=g), shared=frozenset({"A", "B"}))
    one = SimpleNamespace(name="one", layers={"q": served(8), "v": served(16), "o": served(8)})
    two = SimpleNamespace(name="two", layers={"k": served(8), "o": served(16)})
    shared = SimpleNamespace(name="vera", layers={"q": vera, "o": served(8)})
    joins = SimpleNamespace(name="vera2", layers={"q": Slots(8, 6, A=pair[0], B=pair[1], m=torch.randn(8, generator=g),
                                                          shared=frozenset({"A", "B"})), "o": served(8)})
    prepared = prepare_adapter(units, one)
    assert set(prepared) == {group.pool, alone.pool}
    place_adapter(linears, 1, one, prepared)
    assert built == []  # every row as prepared
    place_adapter(linears, 2, two, prepared)  # rows prepared for `one`: not these slots
    assert sorted(map(id, built)) == sorted([id(group.pool), id(alone.pool)])
    ready = prepare_adapter(units, shared)
    assert set(ready) == {group.pool, alone.pool} and ready[group.pool].member
    place_adapter(linears, 3, shared, ready)
    assert {id(p) for p in built[2:]} == {id(group.pool)}  # the o pool as prepared; the q/k/v pool rebuilt
    del built[:]
    place_adapter(linears, 4, joins, prepare_adapter(units, joins))
    assert built == [] and group.pool.facts.groups[4] == 3  # joined the group with its rows as prepared
    for pool, slots in ((group.pool, [m.slots for m in members]), (alone.pool, [alone.slots])):
        fresh = SlotPool(8, pool.out_features, 5, "cpu", torch.float32)
        fresh.update(slots)
        assert _decoded(pool) == _decoded(fresh) and pool.facts == fresh.facts and pool.signature == fresh.signature


def test_a_b_whose_rank_is_not_a_multiple_of_8_is_padded_as_its_rows_are_prepared():
    """`prepare_column` given `then` (the adapter loader's: run once the values have landed): a B of rank 4 gets
    its padded copy there (zeros past its rank), its values copied by the work given to `then`, not before (here
    B is written between the two); placing the prepared rows then builds nothing and gives the table a fresh
    build gives. Without `then` such a column is the pool's to copy on the step loop (None)."""
    from scute.ops.pool import Placement
    from scute.ops.pool_rows import copies_of, prepare_column

    g = torch.Generator().manual_seed(7)
    pool = SlotPool(8, (6, 6), 3, "cpu", torch.float32)
    slots = [[None] * 3 for _ in range(2)]
    pool.update(slots)
    column = [Slots(8, 6, A=torch.randn(4, 8, generator=g), B=torch.zeros(6, 4), v=torch.rand(6, generator=g)),
              _served(8, g)]
    assert prepare_column(pool, column) is None
    later = []
    ready = prepare_column(pool, column, later.append)
    (padded,) = copies_of({pool: ready})
    assert padded.shape == (6, 8) and len(later) == 1 and not padded.any()
    column[0].B.copy_(torch.randn(6, 4, generator=g))  # the values land
    later[0]()
    assert torch.equal(padded[:, :4], column[0].B) and not padded[:, 4:].any()
    for p in range(2):
        slots[p][1] = column[p]
    placement, built = Placement({pool: ready}), []
    fill = pool._fill_column
    pool._fill_column = lambda *a: built.append(1) or fill(*a)
    pool.update_slot(slots, 1, placement)
    placement.writes.flush()
    assert built == []  # the rows as prepared, the padded copy among the pool's
    fresh = SlotPool(8, (6, 6), 3, "cpu", torch.float32)
    fresh.update(slots)
    assert _decoded(pool) == _decoded(fresh) and pool.facts == fresh.facts


def test_placements_with_prepared_rows_equal_a_rebuild():
    """Random placements (LoRA, VeRA of three pairs, IA3-like, empty; projections adapted or not) each with the rows
    `prepare_column` computed ahead: the table, facts and shared buffers equal a fresh build of the same slots at
    every step, and the prepared rows are taken, a VeRA member's among them."""
    from scute.ops.pool import Placement
    from scute.ops.pool_rows import prepare_column

    g = torch.Generator().manual_seed(3)
    pairs = [(torch.randn(8, 8, generator=g), torch.randn(6, 8, generator=g)) for _ in range(3)]

    def vera(k: int) -> Slots:
        return Slots(8, 6, A=pairs[k][0], B=pairs[k][1], m=torch.randn(8, generator=g), v=torch.randn(6, generator=g),
                     shared=frozenset({"A", "B"}))

    makers = [lambda: _served(8, g), lambda: _served(16, g), lambda: vera(0), lambda: vera(0), lambda: vera(1),
              lambda: vera(2), lambda: Slots(8, 6, o=torch.rand(6, generator=g)), lambda: None]
    slots = [[None] * 6 for _ in range(2)]
    pool = SlotPool(8, (6, 6), 6, "cpu", torch.float32)
    pool.update(slots)
    taken = {False: 0, True: 0}
    fill = pool._fill_column
    for step, (s, m) in enumerate(zip(torch.randint(0, 6, (150,), generator=g).tolist(),
                                      torch.randint(0, len(makers), (150,), generator=g).tolist())):
        for p in range(2):
            slots[p][s] = makers[m]() if (p + step) % 4 else None
        ready = prepare_column(pool, [row[s] for row in slots])
        placement, built = Placement({} if ready is None else {pool: ready}), []
        pool._fill_column = lambda *a: built.append(1) or fill(*a)
        pool.update_slot(slots, s, placement)
        placement.writes.flush()
        if ready is not None and not built:
            taken[ready.member] += 1
        fresh = SlotPool(8, (6, 6), 6, "cpu", torch.float32)
        fresh.update(slots)
        where = f"step {step}: slot {s} <- {m}"
        assert _decoded(pool) == _decoded(fresh) and pool.facts == fresh.facts, where
        assert _same_signature(pool, fresh) and torch.equal(pool.slot_group, fresh.slot_group), where
        assert torch.equal(pool.shared_m, fresh.shared_m), where
    assert taken[False] > 20 and taken[True] > 0, taken
