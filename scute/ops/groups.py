"""What a pool's slots imply on the host, from the slots alone: their groups, the passes each slot's tokens need,
and the sizes the passes are launched with (`PoolFacts`). `SlotPool.update` keeps them beside its device table;
the byte model (`scute.ops.cost`) computes them for slots that were never packed into a pool."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from typing import NamedTuple

from torch import Tensor

from scute.ops.slots import Slots


class StepKinds(NamedTuple):
    """The passes of one layer call (`SlotPool.step_kinds`)."""

    input_transform: bool
    shared: bool  # the shared group's products
    lowrank: bool  # the table's shrink and deltas
    expand: bool  # the epilogue


class PoolFacts(NamedTuple):
    """A pool's host values that decide its calls' passes and launches (`scute.ops.plan`)."""

    out_features: tuple[int, ...]
    groups: tuple[int, ...]  # each slot's group representative
    shared_group: int  # the shared group's representative, −1 if none
    kind_masks: StepKinds  # for each pass, the slots whose tokens need it (bit s: slot s)
    max_rank: int  # the largest rank in the table (the shared group's is not there)
    block_b: int  # power-of-two cover of the largest OFT block (1: none)
    min_block: int  # the smallest OFT block (1: none)
    exact_delta: bool  # some slot keeps its delta in float32 (`SlotPool.delta_dtype`)
    shared_a_of: tuple[int, ...]  # projection p's index among the shared group's distinct A's, −1: not adapted
    shared_outs: tuple[int, ...]  # out_p where the shared group adapts p, else 0
    plain_mask: int = 0  # slots whose every projection is a plain low-rank delta or nothing (bit s: slot s)
    lowrank_masks: tuple[int, ...] = ()  # per projection, the slots with A there
    # counts that let a slot leave without a pass over the others (`_changed_alone`)
    top_rank_slots: int = 0  # groups outside the shared one whose largest rank is `max_rank` (when it is > 0)
    exact_slots: int = 0  # slots that keep their delta in float32
    shared_size: int = 0  # the shared group's members
    runner_up: int = 0  # the members of the largest other group of shared matrices

    @property
    def shared_products(self) -> int:
        """The shared group's distinct A's: one A x (cuBLAS) each."""
        return max(self.shared_a_of, default=-1) + 1


class SlotFacts(NamedTuple):
    """What one slot's column (its slots in every projection) contributes to its pool's `PoolFacts`."""

    share_key: tuple | None  # `_share_key`: slots with equal keys form one group
    transform: bool  # some projection has T
    expand: bool  # some projection has an epilogue term
    lowrank_in: tuple[bool, ...]  # each projection has A
    ranks: tuple[int, ...]  # A's rank in each projection that has one
    blocks: tuple[int, ...]  # the OFT block size in each projection that has one
    exact_delta: bool
    plain: bool  # every projection is a plain low-rank delta (A, m, B) or nothing, and one has A

    @property
    def lowrank(self) -> bool:
        """Some projection has A."""
        return any(self.lowrank_in)


def slot_facts(column: Sequence[Slots | None]) -> SlotFacts:
    """One slot's `SlotFacts` from its slots in each projection, in one pass over them (a load computes it for
    every pool, a placement for every pool it changes)."""
    transform = expand = exact = False
    plain = True
    lowrank_in, ranks, blocks = [], [], []
    for sl in column:
        if sl is None:
            lowrank_in.append(False)
            continue
        f = sl.__dict__  # the fields, read without an attribute lookup each (as `Slots.live` does)
        a, tb, epilogue = f["A"], f["t_blocks"], f["o"] is not None or f["o2"] is not None or f["c"] is not None
        lowrank_in.append(a is not None)
        transform = transform or f["t"] is not None or tb is not None
        expand = expand or epilogue or a is not None
        if a is not None:
            ranks.append(a.shape[0])
            exact = exact or epilogue
        if tb is not None:
            blocks.append(tb.shape[-1])
        plain = plain and not (epilogue or f["t"] is not None or tb is not None or f["v"] is not None)
    return SlotFacts(_share_key(list(column)), transform, expand, tuple(lowrank_in), tuple(ranks), tuple(blocks),
                     exact, bool(ranks) and plain)


def pool_facts(slots: Sequence[Sequence[Slots | None]], out_features: Sequence[int],
               memo: list | None = None) -> PoolFacts:
    """The `PoolFacts` of a pool of ``slots[p][s]`` (folded) with `out_features[p]` outputs. `memo` (a list the
    caller keeps, one entry per slot) keeps each slot's `SlotFacts` with the column it came from: a column whose
    slots are the same objects is not looked at again, so a pool whose one slot changed pays for that slot."""
    num_slots = len(slots[0])
    columns = [[row[s] for row in slots] for s in range(num_slots)]
    facts = []
    keep = memo is not None and len(memo) == num_slots
    for s, column in enumerate(columns):
        ids, hit = tuple(map(id, column)), memo[s] if keep else None
        if hit is None or hit[0] != ids:  # the column holds other slots (the memo keeps the old ones alive)
            hit = (ids, column, slot_facts(column))
            if keep:
                memo[s] = hit
        facts.append(hit[2])
    groups, shared = _groups([f.share_key for f in facts])
    lowrank = [facts[g].lowrank for g in groups]
    masks = StepKinds(*(sum(1 << s for s in range(num_slots) if bit(s)) for bit in (
        lambda s: facts[s].transform, lambda s: lowrank[s] and groups[s] == shared,
        lambda s: lowrank[s] and groups[s] != shared, lambda s: facts[s].expand)))
    tops = [max(facts[g].ranks, default=0) for g in set(groups) - {shared}]
    max_rank = max(tops, default=0)
    blocks = [b for f in facts for b in f.blocks]
    a_of = shared_a_of(columns[shared]) if shared >= 0 else (-1,) * len(slots)
    sizes = Counter(g for g in groups if facts[g].share_key is not None)  # the groups of shared matrices
    exact = sum(f.exact_delta for f in facts)
    return shared_facts(PoolFacts(
        tuple(out_features), tuple(groups), shared, masks, max_rank,
        1 << (max(blocks, default=1) - 1).bit_length(), min(blocks, default=1), exact > 0,
        a_of, tuple(0 if a < 0 else o for a, o in zip(a_of, out_features)),
        sum(1 << s for s, f in enumerate(facts) if f.plain and groups[s] != shared),
        tuple(sum(1 << s for s, f in enumerate(facts) if f.lowrank_in[p]) for p in range(len(slots))),
        tops.count(max_rank) if max_rank else 0, exact, sizes.pop(shared, 0), max(sizes.values(), default=0)))


# Pools of one kind (a model's q/k/v pools, its o pools, ...) hold alike slots: an adapter adapts every layer, so
# a placement changes each such pool from equal facts in the same way. Equal facts are one object (`shared_facts`,
# where they are computed in full, at a cost that grows with the slots anyway), and a change of one slot is worked
# out once per object (`_TRANSITIONS`, keyed by its identity: no hash of facts that grow with the slots), so a
# placement over 128 pools works out 4 transitions, not 128. Both are bounded; a miss only costs the computation.
_SHARED: dict[PoolFacts, PoolFacts] = {}
_TRANSITIONS: dict[tuple, tuple[PoolFacts, PoolFacts | None]] = {}  # (id(prev), ...) -> (prev, its transition)
_MAX_SHARED, _MAX_TRANSITIONS = 256, 256


def shared_facts(facts: PoolFacts) -> PoolFacts:
    """The one object of facts equal to `facts` (see `_SHARED`)."""
    got = _SHARED.setdefault(facts, facts)
    if len(_SHARED) > _MAX_SHARED:
        del _SHARED[next(iter(_SHARED))]  # the oldest
    return got


def pool_facts_slot(prev: PoolFacts, slots: Sequence[Sequence[Slots | None]], s: int, memo: list,
                    new: SlotFacts | None = None) -> tuple[PoolFacts, bool]:
    """`pool_facts(slots, prev.out_features, memo)` when only slot `s` changed since `prev` was computed with
    `memo`, and whether they came from slot `s` alone: without a pass over the other slots when the change cannot
    move another slot's group or one of the pool's extremes (`_changed_alone`: then no other slot's group moved,
    s represents no other slot and the shared group kept its representative), else the full computation. A
    placement among a thousand adapters then costs a pool the facts of one slot. `new`: slot s's `SlotFacts`, if
    known (computed ahead: `scute.ops.pool_rows.prepare_column`)."""
    column = [row[s] for row in slots]
    keep = len(memo) == len(slots[0])
    hit = memo[s] if keep else None
    rep = prev.shared_group
    rep_facts = memo[rep][2] if hit is not None and rep >= 0 and memo[rep] is not None else None
    new = slot_facts(column) if new is None else new
    facts = None if hit is None else _transition(prev, hit[2], new, s, rep_facts)
    if keep:
        memo[s] = (tuple(map(id, column)), column, new)  # the full computation below reuses it
    return (pool_facts(slots, prev.out_features, memo), False) if facts is None else (facts, True)


def _transition(prev: PoolFacts, old: SlotFacts, new: SlotFacts, s: int,
                rep_facts: SlotFacts | None) -> PoolFacts | None:
    """`_changed_alone`, worked out once per `prev` object (`_TRANSITIONS`): pools of one kind share it."""
    key = (id(prev), s, old, new, rep_facts)  # an entry keeps its prev alive: no other object has that id
    hit = _TRANSITIONS.get(key)
    if hit is not None:
        return hit[1]
    facts = _changed_alone(prev, old, new, s, rep_facts)
    _TRANSITIONS[key] = (prev, facts)
    if len(_TRANSITIONS) > _MAX_TRANSITIONS:
        del _TRANSITIONS[next(iter(_TRANSITIONS))]
    return facts


def _changed_alone(prev: PoolFacts, old: SlotFacts, new: SlotFacts, s: int,
                   rep_facts: SlotFacts | None) -> PoolFacts | None:
    """`prev` with slot s's facts `old` replaced by `new` (`rep_facts`: the shared group's representative's), or
    None where that needs the other slots: s joins, leaves or starts a group of shared matrices other than as a
    member of the shared group after its representative (other slots' groups, or which group is shared, may move),
    leaves the shared group when that may stop it being the largest, either has an OFT block (the block extremes),
    or it held the largest rank and no other group does (the counts in `PoolFacts` say)."""
    shared = prev.shared_group
    key = None if rep_facts is None or s <= shared else rep_facts.share_key
    joins, was_member = key is not None and new.share_key == key, key is not None and old.share_key == key
    if old.blocks or new.blocks or (new.share_key is not None and not joins):
        return None
    if old.share_key is not None and not was_member:
        return None
    size = prev.shared_size + joins - was_member
    if was_member and not joins and size <= prev.runner_up:
        return None
    top = 0 if joins else max(new.ranks, default=0)  # the shared group's rank is not the table's
    own = max(old.ranks, default=0) if old.share_key is None else 0
    count = prev.top_rank_slots - (own == prev.max_rank > 0)
    if count == 0 and prev.max_rank > top:
        return None
    max_rank = max(prev.max_rank, top)
    count = 1 if top > prev.max_rank else count + (top == max_rank > 0)
    exact = prev.exact_slots - old.exact_delta + new.exact_delta
    bit = 1 << s

    def put(mask: int, on: bool) -> int:
        return mask | bit if on else mask & ~bit

    k = prev.kind_masks
    kinds = StepKinds(put(k.input_transform, new.transform), put(k.shared, joins and rep_facts.lowrank),
                      put(k.lowrank, not joins and new.lowrank), put(k.expand, new.expand))
    groups = prev.groups if prev.groups[s] == (shared if joins else s) else \
        prev.groups[:s] + (shared if joins else s,) + prev.groups[s + 1:]
    return prev._replace(groups=groups, kind_masks=kinds, max_rank=max_rank, exact_delta=exact > 0,
                         plain_mask=put(prev.plain_mask, new.plain and not joins),
                         lowrank_masks=tuple(put(m, on) for m, on in zip(prev.lowrank_masks, new.lowrank_in)),
                         top_rank_slots=count, exact_slots=exact, shared_size=size)


def shared_a_of(column: Sequence[Slots | None]) -> tuple[int, ...]:
    """Each projection's index among the distinct A's (by storage, in order) of one slot's `column`, −1 where it
    has none (VeRA's q, k and v share one)."""
    keys: list[tuple] = []
    out = []
    for sl in column:
        if sl is None or sl.A is None:
            out.append(-1)
            continue
        key = storage_key(sl.A, "mat")
        if key not in keys:
            keys.append(key)
        out.append(keys.index(key))
    return tuple(out)


class ActiveSlots(frozenset):
    """The distinct slots of a step's tokens, known on the host (−1, the base model, may be among them), with
    their bit mask (bit s: slot s) computed once: every layer call of the step reads it (`step_kinds`)."""

    def __new__(cls, slots=()):
        self = super().__new__(cls, slots)
        self.mask = sum(1 << s for s in self if s >= 0)
        return self


def active_mask(active: Collection[int] | None) -> int:
    """The bit mask of the adapter slots in `active` (−1 among them is not a bit); None (any slot): every bit."""
    return -1 if active is None else (active if isinstance(active, ActiveSlots) else ActiveSlots(active)).mask


def step_kinds(masks: StepKinds, active: Collection[int] | None) -> StepKinds:
    """The passes a step runs when its tokens use only the slots in `active` (host-side; −1, the base model, may
    be among them), or None: any slot."""
    mask = active_mask(active)
    return StepKinds(*(mask & m != 0 for m in masks))


def _groups(keys: Sequence[tuple | None]) -> tuple[list[int], int]:
    """Each slot's group representative from its `_share_key` (the lowest slot with the same key), and the shared
    group's (the group of shared matrices with the most members, ties to the lowest; −1 if there is none)."""
    first: dict[tuple, int] = {}
    groups = [s if key is None else first.setdefault(key, s) for s, key in enumerate(keys)]
    sizes = Counter(groups)
    return groups, max(first.values(), key=lambda g: (sizes[g], -g), default=-1)


def storage_key(x: Tensor, kind: str) -> tuple:
    """The identity of a tensor's memory as `kind` (shared matrices are found by it, not by value): its first
    element's address, dtype, shape and strides (two tensors alive at one address view one storage there)."""
    return kind, x.device, x.dtype, x.data_ptr(), x.shape, x.stride()


def slot_storages(sl: Slots, matrix_bytes: int, names: Collection[str] | None = None) -> dict[tuple, int]:
    """Each live tensor of a slot (of those named in `names`; None: all) by its storage identity
    (`storage_key`), with its bytes as the device holds it: matrices at `matrix_bytes` per element, vectors in
    float32."""
    return {storage_key(x, "vec" if x.dim() == 1 else "mat"): x.numel() * (4 if x.dim() == 1 else matrix_bytes)
            for name, x in sl.tensors().items() if names is None or name in names}


def needs_expand(sl: Slots | None) -> bool:
    """Whether a slot changes the base output at all (an epilogue term or a low-rank part)."""
    return sl is not None and (sl.o is not None or sl.o2 is not None or sl.c is not None or sl.A is not None)


def _share_key(column: list[Slots | None]) -> tuple | None:
    """A key equal for slots that may share a group (shared A and B in every projection they adapt), else None. A
    slot with a block-diagonal T is its own group (the input transform's tiles apply one slot's T to a group)."""
    if not any(sl is not None and sl.A is not None for sl in column):
        return None
    if any(sl is not None and sl.t_blocks is not None for sl in column):
        return None
    key = []
    for sl in column:
        if sl is None:
            key.append(None)
        elif sl.A is None or not {"A", "B"} <= sl.shared:
            return None
        else:
            key.append((storage_key(sl.A, "mat"), storage_key(sl.B, "matB"), sl.rot_group))
    return tuple(key)
