"""A slot's rows of a `SlotPool` table, built on the host as Python lists, and the same rows prepared ahead.

The table layout (`F_*` fields, `HAS_*` flags) is the kernels' contract (`scute.ops.kernels.common`). `column_rows`
builds slot s's rows [P][NUM_FIELDS] from its slots in each projection, through the pool's `dev` (its device copy
of a tensor). `prepare_column` builds them off the step loop (the adapter loader, as it stages an adapter): for a
column whose tensors are already as the pool serves them, the rows depend on the column alone, either as its own
group's (a slot of its own) or as a member's of another slot's group (slots of shared matrices, VeRA's: the
group's low-rank fields are at its representative's rows), so a placement then only applies them
(`SlotPool.update_slot`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from scute.ops.groups import SlotFacts, slot_facts, storage_key
from scute.ops.slots import Slots

# Table fields (int64 each). Group fields (A, B, ranks, h offsets) are read at the group's representative slot,
# slot fields (flags, F_ROT, vectors, T) at the slot.
(F_A, F_ARANK, F_AHOFF, F_B, F_BLD, F_RANK, F_BHOFF, F_ROT,
 F_FLAGS, F_O, F_O2, F_C, F_V, F_M, F_T, F_TB, F_TBN, F_TBB) = range(18)
NUM_FIELDS = 18
# Bits of F_FLAGS: which per-slot vectors are live; HAS_LR: the slot's group has a low-rank part (copied from it).
HAS_O, HAS_O2, HAS_C, HAS_V, HAS_M, HAS_T, HAS_TB, HAS_LR = 1, 2, 4, 8, 16, 32, 64, 128
_VECTORS = (("o", F_O, HAS_O), ("o2", F_O2, HAS_O2), ("c", F_C, HAS_C), ("v", F_V, HAS_V), ("m", F_M, HAS_M),
            ("t", F_T, HAS_T))

Dev = Callable[[Tensor, str], Tensor]  # the pool's copy of a tensor as kind 'vec', 'mat' or 'matB' (`SlotPool._dev`)
Then = Callable[[Callable[[], None]], None]  # runs work that reads tensors' values once they are in place


def at_once(fn: Callable[[], None]) -> None:
    """The `Then` of tensors whose values are in place (or queued on the current stream): runs `fn` at once."""
    fn()


class PreparedColumn(NamedTuple):
    """One column's rows computed ahead (`prepare_column`): valid for the pool `pool` and the slots whose ids are
    `ids`, placed as their own group, or, for a column of shared matrices (``facts.share_key`` set: `member`),
    as a member of another slot's group."""

    pool: object
    ids: tuple[int, ...]
    rows: list[list[int]]
    width: int  # the group's rank rows of h
    keep: dict[tuple, tuple[Tensor, Tensor]]  # the copies the rows point to, by storage key (the tensors themselves)
    facts: SlotFacts

    @property
    def member(self) -> bool:
        """Rows of a member of another slot's group (no group fields), else of its own group's."""
        return self.facts.share_key is not None


def served(x: Tensor, kind: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `x` is its own copy in a pool on `device` of matrix `dtype`: the dtype the kind is served in,
    contiguous, B's rank a multiple of 8, 16-byte aligned (checked without a computing call into torch)."""
    return (x.device == device and x.dtype == (torch.float32 if kind == "vec" else dtype) and x.is_contiguous()
            and (kind != "matB" or x.shape[1] % 8 == 0) and x.data_ptr() % 16 == 0)


def column_rows(column: Sequence[Slots | None], group_column: Sequence[Slots | None], own_group: bool,
                dev: Dev) -> tuple[list[list[int]], int]:
    """Slot s's rows [P][NUM_FIELDS] from its slots in each projection (`column`): its own fields; its group's
    low-rank fields if it represents a group outside the shared one (`own_group`); HAS_LR where its group (whose
    representative's column is `group_column`) has a low-rank part. Returns them and the group's h width (0 unless
    `own_group`)."""
    rows = [[0] * NUM_FIELDS for _ in column]
    for row, sl, rep in zip(rows, column, group_column):
        if sl is not None:
            fill_slot(row, sl, dev)
        if rep is not None and rep.A is not None:
            row[F_FLAGS] |= HAS_LR
    return rows, fill_group(rows, column, dev) if own_group else 0


def fill_slot(row: list[int], sl: Slots, dev: Dev) -> None:
    if sl.scale != 1.0:
        raise ValueError("the slot pool needs folded slots (scale 1): call Slots.folded() first")
    f = sl.__dict__  # the fields, read without an attribute lookup each (as `slot_facts` does)
    flags, row[F_ROT] = 0, f["rot_group"]
    for name, field, bit in _VECTORS:
        x = f[name]
        if x is not None:
            row[field], flags = dev(x, "vec").data_ptr(), flags | bit
    if f["t_blocks"] is not None:
        tb = dev(f["t_blocks"], "mat")
        row[F_TB], row[F_TBN], row[F_TBB] = tb.data_ptr(), tb.shape[0], tb.shape[-1]
        flags |= HAS_TB
    row[F_FLAGS] = flags


def fill_group(rows: list[list[int]], column: Sequence[Slots | None], dev: Dev) -> int:
    """Low-rank fields of one group (rows [P][NUM_FIELDS] at the representative); returns its h width."""
    width, seen = 0, {}
    for row, sl in zip(rows, column):
        if sl is None or sl.A is None:
            continue
        r, a_key = sl.A.shape[0], storage_key(sl.A, "mat")
        b = dev(sl.B, "matB")
        row[F_B], row[F_BLD], row[F_RANK] = b.data_ptr(), b.shape[1], r
        if a_key in seen:  # the same A as an earlier projection (VeRA's shared A): multiply once
            row[F_BHOFF] = seen[a_key]
            continue
        row[F_A], row[F_ARANK] = dev(sl.A, "mat").data_ptr(), r
        row[F_AHOFF] = row[F_BHOFF] = seen[a_key] = width
        width += r
    return width


class _NotServed(Exception):
    pass


def prepare_column(pool, column: Sequence[Slots | None], then: Then | None = None) -> PreparedColumn | None:
    """`column`'s rows in `pool`, computed from the column alone (no state of the pool but its device, dtype and
    size is read: any thread may call it): as its own group, or for slots of shared matrices (VeRA's) as a member
    of the group of slots holding the same ones (whose representative has A in the same projections: HAS_LR as
    its own); None where a tensor is not as the pool serves it (its copy is the pool's to make). With `then`, a B
    on the pool's device and in its dtype that is not as served (its rank not a multiple of 8, mostly) gets its
    copy here (`padded_like`), kept with the rows, its values copied by work given to `then` (the caller's values
    may not have landed yet)."""
    if len(column) != pool.num_proj:
        return None
    facts = slot_facts(column)
    keep: dict[tuple, tuple[Tensor, Tensor]] = {}

    def dev(x: Tensor, kind: str) -> Tensor:
        key = storage_key(x, kind)
        if key in keep:
            return keep[key][1]
        if served(x, kind, pool.device, pool.dtype):
            y = x
        elif then is not None and kind == "matB" and x.device == pool.device and x.dtype == pool.dtype:
            y = padded_like(x)
        else:
            raise _NotServed
        keep[key] = (x, y)
        return y

    try:
        rows, width = column_rows(column, column, facts.share_key is None, dev)
    except _NotServed:
        return None
    for x, y in keep.values():
        if y is not x:  # the padded copies' values, once the rows are known to be the column's
            then(functools.partial(_copy_into, y, x))
    return PreparedColumn(pool, tuple(map(id, column)), rows, width, keep, facts)


@torch.inference_mode(False)  # a pool's copy, kept by it: a normal tensor (`SlotPool`)
def padded_like(b: Tensor) -> Tensor:
    """The buffer of B [out, r] as a pool serves it when r is not a multiple of 8: [out, r rounded up to 8], zeros
    (the kernels read each row's rank values as 16-byte vectors; past r they must read zeros); `_copy_into` fills
    it."""
    return b.new_zeros(b.shape[0], b.shape[1] + -b.shape[1] % 8)


def _copy_into(padded: Tensor, b: Tensor) -> None:
    padded[:, : b.shape[1]].copy_(b)


def copies_of(prepared: dict[object, PreparedColumn]) -> list[Tensor]:
    """The copies prepared columns made (`padded_like`), besides the tensors they serve as they are."""
    return [y for col in prepared.values() for x, y in col.keep.values() if y is not x]
