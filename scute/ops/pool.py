"""The slot pool: one layer's adapters packed into a device table the Triton kernels read.

A pool covers ``P`` projections that share one input (``P = 1`` for a plain `ScuteLinear`; q/k/v or gate/up
can be grouped so that one launch serves all of them) and ``num_slots`` adapter slots. It is one int64 tensor
``table [P, num_slots, NUM_FIELDS]`` of pointers and sizes, plus the device copies the pointers point to:

* per-slot fields (row = the slot): flags, the RoAd group size, and the addresses of the vectors
  ``o, o2, c, v, m, t`` (float32) and of ``t_blocks`` (the pool's matrix dtype);
* per-group fields (row = the group's representative slot): the low-rank matrices ``A [r, in]`` and
  ``B [out, r]`` (matrix dtype, contiguous; rows padded with zeros to ``ldb``, a multiple of 8, so the kernels
  read each column's rank values as 16-byte vectors: no copy when r is a multiple of 8), their rank, and where
  their rank rows live in the kernels' ``h`` buffer. Each member slot's flags also carry ``HAS_LR`` (its group
  has a low-rank part in this projection), so that the epilogue reads one row per token.

A *group* is the unit of weight reuse: slots whose A and B are views of the same shared matrices (VeRA) form one
group, so their tokens are sorted together and the shared matrices are read once per batch; every other slot is
its own group. The pool's largest such group (the *shared group*) is not in the table's low-rank fields at all: its
tokens' delta is two dense products, ``h = A x`` for every token and ``d = B (m ⊙ h)`` for the group's sorted rows
(`scute.ops.shared_delta.lora_delta_shared_`), from the matrices and each member's m in buffers of their own
(``shared_a``, ``shared_b``, ``shared_m``), so a wide shared rank (VeRA's 256) neither widens every other group's
rank tiles nor runs as 16-token tiles. Tensors are deduplicated by storage (a shared matrix is copied once per
pool, whatever the number of adapters using it), and a shared A used by several projections of one pool is
multiplied once (in the table: ``a_rank = 0`` on the duplicates, whose ``b_hoff`` points at the first one's rows of
``h``).

Only the table's *contents* change when a slot is set: a captured CUDA graph stays valid as long as `signature`
is unchanged (it holds every host-side value the launchers turn into a kernel constant or a buffer size).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from functools import lru_cache

import torch
from torch import Tensor

from scute.ops.groups import (PoolFacts, StepKinds, pool_facts, pool_facts_slot, shared_a_of, shared_facts, step_kinds,
                              storage_key)
from scute.ops.mapped import host_to_device
from scute.ops.slots import Slots
from scute.ops.table_writes import TableWrites, refill, write

from scute.ops.pool_rows import NUM_FIELDS, PreparedColumn, column_rows, served


class Placement:
    """One adapter's placement into the pools of a model, and what the caller applies when it takes effect: the
    device writes it makes (`TableWrites`) and the layers whose `version` it changes (``touched``), the rows
    prepared for it off the step loop, by pool (`pool_rows.prepare_column`), and ``resigned``: some pool's
    `signature` changed, or the group of a slot other than the placed one (a graph captured before may read a
    buffer the pool replaced, or share one token order between this pool and another whose grouping now differs
    for slots in use: the caller applies the placement before a step runs, and the graphs follow)."""

    def __init__(self, prepared: dict[SlotPool, PreparedColumn] | None = None) -> None:
        self.writes, self.prepared = TableWrites(), prepared or {}
        self.touched: list = []
        self.resigned = False


class SlotPool:
    """Device tables of the adapters of ``P`` projections (one input, ``out_features[p]`` outputs each).

    Attributes set by `update`: ``table`` (device, int64 [P, num_slots, NUM_FIELDS]), ``slot_group`` (device int64
    [num_slots]: each slot's group representative), ``group_key`` (host tuple of the same, None when every slot is
    its own group), ``h_width`` (rank rows of ``h`` per token), ``exact_delta`` (some slot adds its low-rank delta
    to a base output it also scales, rotates or shifts: see `delta_dtype`), ``block_b`` / ``min_block``
    (power-of-two cover of the largest OFT block, smallest OFT block), ``max_rank`` (the largest rank in the table:
    sizes the kernels' rank tiles). The shared group (module docstring): ``shared_group`` (its representative slot,
    −1 if none), ``shared_a`` (NA tensors [r, in], any row stride: its distinct A's), ``shared_a_of`` (host tuple:
    projection p's index there, −1 if the group does not adapt p), ``shared_b`` (P tensors [out_p, r]; a
    placeholder where it does not),
    ``shared_outs`` (out_p, 0 where it does not), ``shared_m`` ([P, num_slots, r] float32: each member's m, ones if
    it has none). ``kind_masks`` (host `StepKinds` of ints): for each pass, the slots whose tokens need it, as bit
    masks (bit s: slot s); `step_kinds` turns the slots of a step into the passes the step runs, and
    ``step_kinds(None)`` gives the passes the pool has at all. ``facts``: the host values above that decide a
    call's passes and launches, as one `PoolFacts` (`scute.ops.groups`, computed from the slots alone).
    ``signature`` (host tuple): everything a captured graph bakes in (`_set_facts`). The grouping itself is not
    in it: a graph computes the tokens' order from ``slot_group`` at replay, so a VeRA adapter joining the shared
    group keeps the graphs (only which pools share one grouping is baked in: `scute.engine.cuda_graph`).
    """

    # The engine runs its steps under torch.inference_mode; the pool is created on a first forward but updated
    # in place later by set_slot, outside it: its tensors must be normal tensors, never inference tensors (what
    # makes them leaves inference mode: `update` and `_fill_column`; a placement of prepared rows makes none).
    @torch.inference_mode(False)
    def __init__(self, in_features: int, out_features: Sequence[int], num_slots: int,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        self.in_features, self.out_features = in_features, tuple(out_features)
        self.num_slots, self.device, self.dtype = num_slots, torch.device(device), dtype
        self.num_proj = len(self.out_features)
        self.table = torch.zeros(self.num_proj, num_slots, NUM_FIELDS, dtype=torch.int64, device=self.device)
        self.slot_group = torch.arange(num_slots, dtype=torch.int64, device=self.device)
        self._cache: dict[tuple, tuple[Tensor, Tensor]] = {}
        self._slot_keys: list[set[tuple]] = [set() for _ in range(num_slots)]
        self._key_refs: Counter[tuple] = Counter()  # how many slots use each copy
        self._widths = [0] * num_slots
        self._facts_memo: list = [None] * num_slots  # each slot's `SlotFacts` and the column it came from
        self._joined = 0  # slots in another slot's group (group_key is None without any)
        self.h_width = 1
        self._clear_shared()
        self._set_facts(shared_facts(PoolFacts(self.out_features, tuple(range(num_slots)), -1, StepKinds(0, 0, 0, 0),
                                               0, 1, 1, False, self.shared_a_of, self.shared_outs)))

    def _clear_shared(self) -> None:
        self.shared_group, self.shared_a_of, self.shared_outs = -1, (-1,) * self.num_proj, (0,) * self.num_proj
        self.shared_a: list[Tensor] = []
        self.shared_b: list[Tensor] = []
        # shared_a and shared_b: copies of the pool's own, or the adapters' A and B themselves (`_fill_shared`)
        self._owned = False
        self.shared_m = torch.empty(0, dtype=torch.float32, device=self.device)
        self._shared_src: tuple = ()

    def step_kinds(self, active: Collection[int] | None) -> StepKinds:
        """The passes a step runs when its tokens use only the slots in `active` (host-side; −1, the base
        model, may be among them), or None: any slot (what a CUDA graph replayed for other steps must assume)."""
        return step_kinds(self.kind_masks, active)

    def delta_dtype(self, out_dtype: torch.dtype) -> torch.dtype:
        """The dtype the kernels keep each token's low-rank delta d = B (m ⊙ h) in, for outputs in `out_dtype`.

        A slot whose epilogue is ``y = z + v ⊙ d`` (LoRA, VeRA, ...) has the effect v ⊙ d: rounding d to the
        output's dtype adds at most one rounding of the effect itself, below the output's own. A slot that also
        scales, rotates or shifts z (DoRA: ``o ⊙ z + v ⊙ d``) can have an effect much smaller than d (the two
        terms cancel), which d's rounding would swamp: such a pool keeps d in float32."""
        return torch.float32 if self.exact_delta else out_dtype

    # ------------------------------------------------------------------ device copies
    def _dev(self, x: Tensor, kind: str, keep: dict, mine: set) -> Tensor:
        """The pool's copy of `x` (kind 'vec': float32; 'mat': matrix dtype; 'matB': matrix dtype, rows padded with
        zeros to a multiple of 8), made once per storage; its key joins `mine` (the copies a slot uses). The cache
        holds `x` itself, so the storage (and the key) cannot be reused while cached."""
        key = storage_key(x, kind)
        mine.add(key)
        hit = keep.get(key) or self._cache.get(key)  # keep first: a storage met twice in one update is copied once
        if hit is None and served(x, kind, self.device, self.dtype):
            hit = (x, x)  # no call into torch: each would let the adapter loader's thread in (`TableWrites`)
        elif hit is None:
            y = x.to(device=self.device, dtype=torch.float32 if kind == "vec" else self.dtype).contiguous()
            if kind == "matB" and y.shape[1] % 8:
                y = torch.nn.functional.pad(y, (0, -y.shape[1] % 8))
            if y.data_ptr() % 16:  # the kernels are promised 16-byte aligned starts (vectorised loads)
                y = y.clone()
            hit = (x, y)
        keep[key] = hit
        return hit[1]

    # ------------------------------------------------------------------ building
    @torch.inference_mode(False)
    def update(self, slots: Sequence[Sequence[Slots | None]]) -> None:
        """Rebuild the table from ``slots[p][s]`` (folded: scale 1) and copy it into place."""
        if len(slots) != self.num_proj or any(len(row) != self.num_slots for row in slots):
            raise ValueError(f"pool needs {self.num_proj} lists of {self.num_slots} slots")
        keep: dict[tuple, tuple[Tensor, Tensor]] = {}
        facts = pool_facts(slots, self.out_features, self._facts_memo)
        groups, shared = list(facts.groups), facts.shared_group
        self._slot_keys = [set() for _ in range(self.num_slots)]  # the keys of the copies each slot uses
        self._widths = [0] * self.num_slots  # each group's rank rows of h, at its representative
        columns = []
        for s in range(self.num_slots):
            rows, self._widths[s] = self._fill_column(slots, s, groups[s], shared, keep, self._slot_keys[s])
            columns.append(rows)
        if shared < 0:
            self._clear_shared()
        else:
            self._fill_shared(slots, [s for s, g in enumerate(groups) if g == shared], shared)
        self._cache = keep
        self._key_refs = Counter(key for keys in self._slot_keys for key in keys)
        write(self.table, torch.tensor(columns, dtype=torch.int64).transpose(0, 1).contiguous())
        write(self.slot_group, torch.tensor(groups, dtype=torch.int64))
        self.h_width = max(max(self._widths), 1)
        self._joined = sum(g != s for s, g in enumerate(groups))
        self._set_facts(facts)

    def update_slot(self, slots: Sequence[Sequence[Slots | None]], s: int, placement: Placement | None = None) -> None:
        """`update` after a change of slot `s` alone (``slots`` holds every slot, `s` already changed). When no other
        slot's group changes with it (`s` represents no other slot, before or after, and the shared group keeps its
        representative), only slot `s`'s rows are rebuilt and copied — its own group's fields, or its row of the
        shared group's m when it joins that group (another VeRA adapter of the same matrices) — and only its old
        device copies dropped: placing an adapter then costs a pool host work that does not grow with the adapters
        it holds. Any other change of the grouping runs `update`. Within a `placement` (flushed by the caller), the
        rows it prepared for this pool and these slots are taken as they are, and the slot's rows go to the device
        with the placement's; without one, now."""
        before = self.signature
        moved = self._update_slot(slots, s, placement)
        if placement is not None and (self.signature != before or moved):
            placement.resigned = True

    def _update_slot(self, slots: Sequence[Sequence[Slots | None]], s: int, placement: Placement | None) -> bool:
        """`update_slot`'s work; whether the group of a slot other than `s` moved (only a rebuild moves one)."""
        column = [row[s] for row in slots]
        ready = None if placement is None else placement.prepared.get(self)
        if ready is not None and (ready.pool is not self or ready.ids != tuple(map(id, column))):
            ready = None
        facts, alone = pool_facts_slot(self.facts, slots, s, self._facts_memo, None if ready is None else ready.facts)
        old, new, shared = self.facts.groups, facts.groups, self.shared_group
        if not alone:  # the full computation ran: unless no other slot's group moved, rebuild the table
            others_old, others_new = old[:s] + old[s + 1:], new[:s] + new[s + 1:]
            if facts.shared_group != shared or s == shared or others_old != others_new or s in others_old \
                    or s in others_new:
                self.update(slots)
                return others_old != others_new
        group = new[s]
        out = TableWrites() if placement is None else placement.writes
        if ready is not None and (group != s) == ready.member:  # its own group, or a member of another slot's
            rows, width, keep, mine = ready.rows, ready.width, ready.keep, set(ready.keep)
        else:
            keep, mine = {}, set()
            rows, width = self._fill_column(slots, s, group, shared, keep, mine)
        was, self._widths[s] = self._widths[s], width
        self.h_width = max(self.h_width, width) if width >= was or was < self.h_width else max(max(self._widths), 1)
        if shared >= 0:  # its row of the shared group's m: its own if it is a member, else ones
            for p, sl in enumerate(column):
                member = group == shared and sl is not None and sl.m is not None
                out.copy(self.shared_m, (p, s), sl.m if member else None)
        if old[s] != group:
            self._joined += (group != s) - (old[s] != s)
            out.add(self.slot_group, (s,), [group])
        self._use(s, keep, mine)
        out.add_column(self.table, s, rows)
        if placement is None:
            out.flush()
        self._set_facts(facts)
        return False

    def _use(self, s: int, keep: dict, mine: set) -> None:
        """Slot s now uses the copies whose keys are `mine` (`keep`: the copies by key): its old copies that no
        other slot uses are dropped."""
        refs, old = self._key_refs, self._slot_keys[s]
        for key in mine:
            refs[key] = refs.get(key, 0) + 1
        for key in old:
            left = refs.get(key, 0) - 1
            if left > 0:
                refs[key] = left
            else:  # the old adapter's copies, used by no other slot
                del refs[key]
                self._cache.pop(key, None)
        self._cache.update(keep)
        self._slot_keys[s] = mine

    def _set_facts(self, facts: PoolFacts) -> None:
        """The host values that follow from `facts` (the last step of `update` and `update_slot`), `signature`
        among them: everything a captured graph bakes in of this pool alone, a graph staying valid while it is
        unchanged (and while the same pools share a grouping: `scute.engine.cuda_graph.AdapterLayout`)."""
        self.group_key = None if self._joined == 0 else facts.groups
        self.facts = facts
        self.exact_delta, self.block_b, self.min_block = facts.exact_delta, facts.block_b, facts.min_block
        self.max_rank, self.kind_masks = facts.max_rank, facts.kind_masks
        self.signature = (self.h_width, _any_step_kinds(facts.kind_masks), self.exact_delta, self.block_b,
                          self.min_block, self.max_rank, self.shared_group, self.shared_a_of, self.shared_outs,
                          tuple(tuple(a.shape) for a in self.shared_a), self._owned)

    def _fill_shared(self, slots: Sequence[Sequence[Slots | None]], members: list[int], group: int) -> None:
        """The shared group's buffers. They are kept, and refilled in place, while their shapes stay (a captured
        graph holds their addresses: their shapes are in `signature`); the matrices are copied only when they
        change. The first pair's A and B are the adapters' own (views of VeRA's one pair: copies per pool would be
        34 MB a layer at Llama-3-8B sizes, 1.1 GB in all, outside the adapter budget), never written into (other
        adapters and later loads hold them); a later pair of the same shapes gets copies of the pool's own,
        refilled in place from then on (the switch to them is in `signature`: the graphs are captured again once).
        An A stays the view it is (a slice of VeRA's A, rows strided: cuBLAS reads it so); a B is contiguous."""
        column = [row[group] for row in slots]
        a_src: dict[tuple, Tensor] = {}  # the distinct A's (VeRA's q, k and v share one)
        for sl in column:
            if sl is not None and sl.A is not None:
                a_src.setdefault(storage_key(sl.A, "mat"), sl.A)
        a_keys = list(a_src)
        rank = next(iter(a_src.values())).shape[0]
        self.shared_a_of = shared_a_of(column)
        self.shared_outs = tuple(0 if a < 0 else o for a, o in zip(self.shared_a_of, self.out_features))
        src = tuple(a_keys) + tuple(None if sl is None or sl.B is None else storage_key(sl.B, "mat")
                                    for sl in column)
        if self._shared_src[:1] != (src,):
            new_a = list(a_src.values())
            new_b = [torch.zeros(1, rank, dtype=self.dtype, device=self.device) if sl is None or sl.B is None
                     else sl.B for sl in column]
            olds, news = self.shared_a + self.shared_b, new_a + new_b
            same = bool(self.shared_b) and len(olds) == len(news) and \
                all(o.shape == n.shape for o, n in zip(olds, news))
            if same:  # a buffer per A and per projection's B, even where two B views coincide (VeRA's k and v),
                # each refilled in place, so a graph never reads a buffer another projection took over
                bufs = [refill(old if self._owned else None, new, self.device, self.dtype)
                        for old, new in zip(olds, news)]
            else:
                bufs = [new.to(device=self.device, dtype=self.dtype) for new in new_a]
                bufs += [new.to(device=self.device, dtype=self.dtype).contiguous() for new in new_b]
            self.shared_a, self.shared_b, self._owned = bufs[:len(new_a)], bufs[len(new_a):], same
            self._shared_src = (src, column)  # the column keeps the sources alive: their keys stay theirs
        m = torch.ones(self.num_proj, self.num_slots, rank, device=self.device)
        for p, row in enumerate(slots):  # the members' m, gathered where they are (the device, when served)
            have = [s for s in members if row[s] is not None and row[s].m is not None]
            if have:
                m[p].index_copy_(0, host_to_device(have, torch.int64, self.device),
                                 torch.stack([row[s].m.to(self.device, torch.float32) for s in have]))
        self.shared_m = refill(self.shared_m, m, self.device, torch.float32)
        self.shared_group = group

    @torch.inference_mode(False)  # the pool's copies of tensors it does not serve as they are
    def _fill_column(self, slots: Sequence[Sequence[Slots | None]], s: int, group: int, shared: int, keep: dict,
                     mine: set) -> tuple[list[list[int]], int]:
        """Slot s's rows and its group's h width (`column_rows`), through the pool's copies."""
        return column_rows([row[s] for row in slots], [row[group] for row in slots], group == s != shared,
                           lambda x, kind: self._dev(x, kind, keep, mine))


@lru_cache(maxsize=1024)
def _any_step_kinds(masks: StepKinds) -> tuple[bool, ...]:
    """`step_kinds(masks, None)` as a tuple (a pool's `signature`): worked out once per masks, which pools of one
    kind share."""
    return tuple(step_kinds(masks, None))
