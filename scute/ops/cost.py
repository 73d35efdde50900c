"""The byte model: what one adapted layer call must move through device memory, and the time that takes.

A layer call (``P`` projections of one input, see `scute.ops.triton_ops`) moves, at the least:

* base: each weight ``W_p`` (and bias) once, the input read and the base output written once per GEMM;
* adapters: each *active* group's live tensors once — A (once even when several projections or several adapters
  share it), B per projection, each active slot's vectors (``o, o2, c, v, m, t``, float32) and T blocks;
* extra activation passes: the pre-pass (read x, write x' per projection), the shrink (read the adapter tokens'
  x, write the split-K partials of h), the delta (read them once, write d: float32 or the model's dtype, see
  `SlotPool.delta_dtype`), the epilogue (read d, read and write the adapter tokens' rows of z);
* the pool's shared group (`scute.ops.pool`), when the step has a token of it: A x on cuBLAS reads every
  token's x and writes h for every token; per projection, its members' rows of h and m are read, m ⊙ h written
  and read again (above `shared_fused_tokens` tokens: below, the GEMM forms it), and their rows of d written (and
  read by the epilogue).

The model is of a call that knows the step's slots (`scute_linears_triton`'s ``active_slots``): passes that no
token of the step needs do not run. Which passes run, their launches and their split-K factor are the call's
`Plan` (`scute.ops.plan`), the value the launcher itself runs, so the model cannot drift from it.

Predicted time = bytes / bandwidth + launches × launch latency, with both constants *measured* on the machine
(a device-to-device copy; a graph of empty kernels), never fitted to the results they predict.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from scute.ops.groups import needs_expand, pool_facts, slot_storages, storage_key
from scute.ops.launch import tile_tokens
from scute.ops.meta import max_tiles
from scute.ops.plan import SharedPlan, plan
from scute.ops.slots import Slots

VEC_BYTES = 4  # the pool keeps slot vectors in float32
_DEVICE = torch.device("cpu")  # the plans' device: it sizes only the multi-token delta's persistent grid


@dataclass
class CallBytes:
    """Bytes of one layer call by kind, and its kernel launches."""

    weights: int = 0  # base weights and biases
    adapters: int = 0  # live adapter tensors of the active adapters (shared ones once)
    activations: int = 0  # inputs, outputs and the extra passes
    launches: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.adapters + self.activations

    def seconds(self, bandwidth: float, launch_latency: float = 0.0) -> float:
        """Predicted time at `bandwidth` bytes/s, plus `launch_latency` s per kernel (0: bytes only)."""
        return self.total / bandwidth + self.launches * launch_latency

    def __add__(self, other: CallBytes) -> CallBytes:
        return CallBytes(self.weights + other.weights, self.adapters + other.adapters,
                         self.activations + other.activations, self.launches + other.launches)


def layer_call_bytes(slots: Sequence[Sequence[Slots | None]], in_features: int, out_features: Sequence[int],
                     token_slots: Sequence[int], elem: int = 2, bias: bool = False, merged: bool = False) -> CallBytes:
    """Bytes of one call of `scute_linears_triton` (``slots[p][s]``; tokens' slots, −1 = base; `elem` bytes
    per activation/weight element; `merged`: merged weights given), counting what the kernels must read and
    write at the least. Its passes and launches are the call's `Plan` (`scute.ops.plan`)."""
    n_tok, n_proj = len(token_slots), len(out_features)
    facts = pool_facts(slots, out_features)
    block_m = tile_tokens(n_tok)
    passes = plan(facts, n_tok, in_features, max_tiles(n_tok, len(slots[0]), block_m), _DEVICE, set(token_slots),
                  merged, block_m=block_m)
    cost = CallBytes(launches=passes.launches())
    cost.weights = sum(o * in_features * elem + (o * elem if bias else 0) for o in out_features)
    cost.activations = sum(n_tok * (in_features + o) * elem for o in out_features)
    active = sorted({s for s in token_slots if s >= 0})
    live = {s: [row[s] for row in slots] for s in active if any(row[s] is not None for row in slots)}
    if passes.input_transform is not None:
        cost.activations += n_tok * in_features * elem * (1 + n_proj)
    seen: set = set()
    for column in live.values():
        cost.adapters += _slot_bytes(column, seen, elem)
    groups, shared = facts.groups, facts.shared_group
    fold = passes.fold
    d_elem = 4 if facts.exact_delta and fold is None else elem  # the delta's dtype (the fold's: the output's)
    if passes.lowrank is not None:
        width = _h_width({s: col for s, col in live.items() if groups[s] != shared})
        lowrank_tokens = sum(1 for s in token_slots if s in live and groups[s] != shared
                             and any(sl is not None and sl.A is not None for sl in live[s]))
        h_passes = 2 * passes.lowrank.split_k  # each split's partial written, then read once (by the delta, or
        # by the shrink's sum)
        delta = (1 if fold else 2) * sum(out_features) * d_elem  # written; read by the epilogue (folded: below)
        cost.activations += lowrank_tokens * (in_features * elem + h_passes * width * 4 + delta)
    if fold is not None:  # each GEMM that adds deltas reads its whole buffer (every token writes its rows)
        cost.activations += n_tok * sum(o for o, add in zip(out_features, fold.adds) if add) * elem
    if passes.shared is not None:
        members = sum(1 for s in token_slots if s >= 0 and groups[s] == shared)
        cost.activations += _shared_group_bytes([row[shared] for row in slots], in_features, out_features, members,
                                                n_tok, elem, d_elem, passes.shared)
    if passes.epilogue is not None:
        expand = {s for s, col in live.items() if any(needs_expand(sl) for sl in col)}
        cost.activations += sum(1 for s in token_slots if s in expand) * sum(2 * o * elem for o in out_features)
    return cost


def _shared_group_bytes(column: list[Slots | None], in_features: int, out_features: Sequence[int], members: int,
                        n_tok: int, elem: int, d_elem: int, passes: SharedPlan) -> int:
    """Activation bytes of the shared group's passes (`scute.ops.shared_delta.lora_delta_shared_`): `column` its
    representative's slots, `members` (≥ 1) its tokens in the step; its matrices are in the adapters' bytes."""
    rank = next(sl.A.shape[0] for sl in column if sl is not None and sl.A is not None)
    outs = [o for sl, o in zip(column, out_features) if sl is not None and sl.A is not None]
    h_all = passes.products * n_tok * (in_features + rank) * elem  # A x for every token: x read, h written
    # per member and projection: h and m (float32) read; with the scale pass, m ⊙ h written for the GEMM to read
    h_rows = members * len(outs) * rank * ((3 if passes.scale else 1) * elem + VEC_BYTES)
    return h_all + h_rows + members * sum(outs) * 2 * d_elem


def _slot_bytes(column: list[Slots | None], seen: set, elem: int) -> int:
    """Bytes of one active slot's live tensors over the projections; tensors in `seen` were counted already."""
    total = 0
    for sl in column:
        for key, n in ({} if sl is None else slot_storages(sl, elem)).items():
            if key not in seen:
                seen.add(key)
                total += n
    return total


def _h_width(live: dict[int, list[Slots | None]]) -> int:
    """The widest rank span a group needs in h (A shared by projections counted once)."""
    width = 0
    for column in live.values():
        keys = {storage_key(sl.A, "mat"): sl.rank for sl in column if sl is not None and sl.A is not None}
        width = max(width, sum(keys.values()))
    return width


def lora_floor_bytes(rank: int, in_features: int, out_features: int, num_adapters: int, elem: int = 2) -> int:
    """The LoRA delta's byte floor: each adapter's A and B read once (the activations are the base call's)."""
    return num_adapters * rank * (in_features + out_features) * elem

