"""The CPU serving path: the reference op with the low-rank part of every adapter of a batch in two GEMMs.

`scute_linear_ref` loops over the distinct adapters of a batch: about ten small tensor ops per adapter per layer,
which on a CPU cost more than the arithmetic (a 12-token forward of a SmolLM2-sized model with five LoRAs spent
half its time there). Here the low-rank parts are stacked once per layer (`LowRankStack`: A with m folded into
its rows, B with v and s folded into its rows) and a batch runs

    h = x[rows] @ A_stackᵀ            every low-rank token against every active adapter's rank columns
    h = h ⊙ [column's slot == token's slot]
    d = h @ B_stackᵀ

then the per-slot epilogue vectors (o, o2, c) and input transforms as in the reference. The masked product does
(active adapters) times the low-rank arithmetic, so `scute_linear_cpu` batches the active slots of smallest rank
while that stays within the base GEMM's work (and only if that makes at least MIN_BATCHED slots) and runs the
others through the reference loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from scute.ops.reference import epilogue_ref, input_transform_ref, output_vectors, slot_rows
from scute.ops.slots import Slots

# Batching pays from three slots on: five r=8 LoRAs per layer take 1.8-2.0x less adapter time batched
# (bench/bench_cpu_forward.py), the demo's two r=8 slots per layer (LoRA, DoRA) ran 5-9% slower end to end
# (bench/bench_cpu_engine.py): the gathers, mask and scatter cost about what the loop's ops for two slots do.
MIN_BATCHED = 3


@dataclass
class LowRankStack:
    """The low-rank parts of one layer's slots, stacked (float32, or float64 for float64 layers).

    a [R, in]: the rows of every slot's m ⊙ A; b [out, R]: the columns of every slot's s · v ⊙ B;
    spans[slot] = (first column, rank); columns of slots without A are absent. A copy: the CPU path holds each
    adapter's low-rank tensors twice (the slots' and these, in float32).
    """

    a: Tensor
    b: Tensor
    spans: dict[int, tuple[int, int]]
    _columns: dict = field(default_factory=dict, repr=False)

    def columns(self, active: tuple[int, ...], device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """The stacked A rows and B columns of the `active` slots, in that order, and each column's slot (cached
        per set of active slots: a decode step usually has the previous step's)."""
        hit = self._columns.get(active)
        if hit is None:
            cols = torch.cat([torch.arange(self.spans[a][0], sum(self.spans[a]), device=device) for a in active])
            owner = torch.cat([torch.full((self.spans[a][1],), a, device=device) for a in active])
            if cols.shape[0] == self.a.shape[0] and bool((cols[1:] > cols[:-1]).all()):
                hit = (self.a, self.b, owner)  # every slot, in stack order: no copy
            else:
                hit = (self.a[cols], self.b[:, cols], owner)
            if len(self._columns) >= 16:
                self._columns.clear()
            self._columns[active] = hit
        return hit

    @staticmethod
    def build(slots: Sequence[Slots | None], dtype: torch.dtype, device: torch.device) -> LowRankStack:
        a, b, spans, start = [], [], {}, 0
        for i, s in enumerate(slots):
            if s is None or s.A is None:
                continue
            ai, bi = s.A.to(device, dtype), s.B.to(device, dtype) * s.scale
            if s.m is not None:
                ai = ai * s.m.to(device, dtype)[:, None]
            if s.v is not None:
                bi = bi * s.v.to(device, dtype)[:, None]
            a.append(ai)
            b.append(bi)
            spans[i] = (start, s.rank)
            start += s.rank
        if not a:
            empty = torch.empty(0, dtype=dtype, device=device)
            return LowRankStack(empty, empty, {})
        return LowRankStack(torch.cat(a), torch.cat(b, dim=1), spans)


def scute_linear_cpu(x: Tensor, weight: Tensor, bias: Tensor | None, slots: Sequence[Slots | None],
                     token_slots: Tensor, stack: LowRankStack, rows: dict[int, Tensor] | None = None) -> Tensor:
    """`scute_linear_ref` with the batch's low-rank parts in two GEMMs (see the module doc).

    Semantics: those of `scute.ops.reference.scute_linear_ref` (equal up to float rounding: m, v and s are
    applied to the weights instead of the activations). Shapes: as there; `stack` = ``LowRankStack.build(slots,
    acc_dtype(x.dtype), x.device)`` for these very slots. Rows of base tokens and empty slots are exactly F.linear.
    """
    rows = slot_rows(token_slots) if rows is None else rows
    z = F.linear(input_transform_ref(x, slots, token_slots, rows), weight, bias)
    # Batch the low-rank slots of smallest rank while the masked product stays within the base GEMM's work;
    # wider ones (a VeRA r=256 next to r=8 LoRAs) and epilogue-only slots go through the reference loop.
    budget, lowrank = x.shape[1] * z.shape[1] / (x.shape[1] + z.shape[1]), []
    for a in sorted((a for a in rows if a in stack.spans), key=lambda a: stack.spans[a][1]):
        if stack.spans[a][1] > budget:
            break
        lowrank.append(a)
        budget -= stack.spans[a][1]
    if len(lowrank) < MIN_BATCHED:
        lowrank = []
    z = epilogue_ref(z, x, slots, token_slots, {a: idx for a, idx in rows.items() if a not in lowrank})
    if not lowrank:
        return z
    idx = torch.cat([rows[a] for a in lowrank])
    a_cols, b_cols, owner = stack.columns(tuple(lowrank), x.device)
    h = x[idx].to(a_cols.dtype) @ a_cols.T
    h = h * (owner[None, :] == token_slots[idx][:, None])
    y = z[idx].to(a_cols.dtype)
    if any(slots[a].o is not None or slots[a].o2 is not None or slots[a].c is not None for a in lowrank):
        segments = y.split([rows[a].shape[0] for a in lowrank])  # idx is the slots' rows, in `lowrank` order
        y = torch.cat([output_vectors(seg, slots[a]) for a, seg in zip(lowrank, segments)])
    z[idx] = (y + h @ b_cols.T).to(z.dtype)
    return z

