"""`ScuteLinear`: an `nn.Linear` whose tokens each run through their own adapter's normal form; `LinearGroup`:
sibling `ScuteLinear`s that read one input (q/k/v, gate/up), served by one op call on the Triton path when the
model's forward calls the group (`project`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scute.ops.slots import Slots
from scute.model.context import get_forward_context
from scute.ops import (
    SlotPool,
    merged_gemm,
    scute_linears_deferred,
    scute_linears_triton,
    triton_enabled,
)
from scute.ops.cpu import LowRankStack, scute_linear_cpu
from scute.ops.launch import LaunchResources
from scute.ops.pool import Placement
from scute.ops.reference import acc_dtype

MAX_GROUP = 3  # projections per op call: the delta and epilogue kernels serve at most 3


class ScuteLinear(nn.Module):
    """Replaces one `nn.Linear` of the base model; keeps its `weight` and `bias` parameters (same names, same
    storage), plus `max_adapters` adapter slots. Slot ``i`` holds the folded `Slots` of the adapter loaded
    there, or None if that adapter does not adapt this layer (its tokens then get the base output).

    Forward: the token slots come from the forward context; tokens with slot −1, or whose slot is empty here,
    get exactly ``F.linear(x, weight, bias)``. On CUDA the Triton kernels run, reading the slots from a
    `SlotPool` (device tables, non-persistent: rebuilt from the slots, never saved in a state dict); elsewhere
    `scute_linear_cpu` (the reference op with the batch's low-rank parts in two GEMMs, from a `LowRankStack`
    of the slots, rebuilt after `set_slot`). `set_slot` updates the pool's tables in place: a captured CUDA
    graph stays valid while ``pool.signature`` is unchanged (re-capture when it changes, e.g. on the first OFT
    adapter of a layer).

    A member of a `LinearGroup` (``group``, set by the group) called by itself computes alone; `project` serves
    the whole group in one call. Its own pool is built only if it ever computes alone. `resources`: what the
    model's layer calls share (`LaunchResources`, made by `swap_linears`); a layer made alone makes its own.
    """

    def __init__(self, base: nn.Linear, max_adapters: int, resources: LaunchResources | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.slots: list[Slots | None] = [None] * max_adapters
        self.num_filled = 0
        self.pool: SlotPool | None = None
        self.group: LinearGroup | None = None
        self.stack: LowRankStack | None = None  # the CPU path's stacked low-rank parts, rebuilt after set_slot
        self.version = 0  # bumped as a change of its slots takes effect; caches of what they imply compare it
        self.shard = None  # tensor parallelism: this rank's `scute.model.tp.Shard` of the layer, set by the loader
        self.resources = resources if resources is not None else LaunchResources()

    def set_slot(self, index: int, slots: Slots | None, placement: Placement | None = None) -> None:
        """Put an adapter's slots in slot `index` (None empties it); on a sharded layer, slots of the full layer,
        of which this rank keeps its share. The pools that read this layer follow (its own, its group's), within
        `placement` if given (`SlotPool.update_slot`)."""
        self.assign(index, slots, placement)
        if self.group is not None:
            self.group.update_pool(index, placement)

    def assign(self, index: int, slots: Slots | None, placement: Placement | None = None) -> None:
        """`set_slot` but for the group's pool, which `LinearGroup.set_slot` updates once for all members."""
        if slots is not None and self.shard is not None:
            slots = self.shard.slots(slots)
        if slots is not None and (slots.in_features, slots.out_features) != (self.in_features, self.out_features):
            raise ValueError(
                f"slots for a {slots.in_features}->{slots.out_features} layer do not fit "
                f"{self.in_features}->{self.out_features}"
            )
        filled = self.num_filled + (slots is not None) - (self.slots[index] is not None)
        self.slots[index] = slots if slots is None or slots.scale == 1.0 else slots.folded()
        # plain attributes, set past `nn.Module.__setattr__` (its checks cost more than the rest of a placement);
        # within a placement the version changes when the placement takes effect (`scute.model.hf.placing`)
        vars(self).update(num_filled=filled, version=self.version + (placement is None), stack=None)
        if placement is not None:
            placement.touched.append(self)
        if self.pool is not None:
            self.pool.update_slot([self.slots], index, placement)

    def forward(self, x: Tensor) -> Tensor:
        y = self.forward_alone(x)
        return y if self.shard is None else self.shard.reduce(y)

    def forward_alone(self, x: Tensor) -> Tensor:
        """This projection by itself, whatever its group."""
        if self.num_filled == 0:  # no adapter touches this layer: the plain GEMM, no metadata needed
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, self.in_features)
        ctx = get_forward_context()
        token_slots = ctx.adapter_slots(flat.shape[0])
        if triton_enabled(flat):
            y = self._triton(flat, defer=False)[0][0]
        else:  # the grouping of tokens by slot is the same for every layer: computed once per forward
            rows = ctx.slot_rows(flat.shape[0])
            dtype = acc_dtype(flat.dtype)
            if self.stack is None or self.stack.a.dtype != dtype or self.stack.a.device != flat.device:
                self.stack = LowRankStack.build(self.slots, dtype, flat.device)
            y = scute_linear_cpu(flat, self.weight, self.bias, self.slots, token_slots, self.stack, rows)
        return y.view(*x.shape[:-1], self.out_features)

    def deferred(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """`forward`, its plain low-rank delta left for the consumer to add (`scute_linears_deferred`): (z, d),
        d None when z is complete (no deferral: off the Triton path, on a sharded layer, or other slots)."""
        if self.num_filled == 0 or self.shard is not None or torch.compiler.is_compiling() or not triton_enabled(x):
            return self(x), None
        (z,), (d,) = self._triton(x.reshape(-1, self.in_features), defer=True)
        return z.view(*x.shape[:-1], self.out_features), d

    def _triton(self, flat: Tensor, defer: bool) -> tuple[list[Tensor], list[Tensor | None]]:
        """`scute_linears_deferred` (`defer`) or `scute_linears_triton` over this layer's own pool."""
        ctx = get_forward_context()
        pool = self.pool = pool_for(self.pool, flat, [self])
        args = (flat, [self.weight], [self.bias], pool, ctx.lora_meta(flat.shape[0], pool.slot_group, pool.group_key),
                self.resources)
        if defer:
            return scute_linears_deferred(*args, active_slots=ctx.active_adapter_slots)
        return scute_linears_triton(*args, active_slots=ctx.active_adapter_slots), [None]

    def extra_repr(self) -> str:
        filled = self.num_filled
        group = "" if self.group is None else f", group={self.group.name}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"adapters={filled}/{len(self.slots)}{group}")


class LinearGroup:
    """Sibling `ScuteLinear`s with one input and one slot count (vLLM's packed modules: ``qkv_proj`` = q/k/v,
    ``gate_up_proj`` = gate/up); each keeps its own parameters, views of one merged weight, and the group adds one
    `SlotPool` of all of them.

    ``group(x)`` computes every member's output for `x`: on the Triton path in one `scute_linears_triton` call
    (one launch per kernel instead of one per projection, VeRA's shared A multiplied once; a group with no adapter
    in any slot is one GEMM over the merged weight), elsewhere (the CPU reference, torch.compile) each member alone.
    The forwards of `scute.model.layers` call it through `project`; a model whose forward calls the members one by
    one gets each computed alone, which is exact too.
    """

    def __init__(self, name: str, members: Sequence[ScuteLinear]) -> None:
        if not 2 <= len(members) <= MAX_GROUP:
            raise ValueError(f"a LinearGroup has 2 to {MAX_GROUP} members, got {len(members)}")
        if len({(m.in_features, len(m.slots)) for m in members}) != 1:
            raise ValueError(f"{name}: members must share in_features and their number of slots")
        if any(m.group is not None for m in members):
            raise ValueError(f"{name}: a ScuteLinear belongs to one group at most")
        self.name, self.members = name, list(members)
        self.in_features = members[0].in_features
        self.out_features = [m.out_features for m in members]
        self.pool: SlotPool | None = None
        for m in members:
            m.group = self
        self.weight, self.bias = _merge_parameters(self.members)

    def merged(self) -> tuple[Tensor, Tensor | None] | None:
        """The members' weights and biases as one matrix and vector (each member's parameter a row slice of them),
        or None if a member's parameter no longer is one (the model was moved or cast after the swap)."""
        w_elem, offset = self.weight.element_size(), 0
        for m in self.members:
            if m.weight.data_ptr() != self.weight.data_ptr() + offset * self.in_features * w_elem:
                return None
            if m.bias is not None and m.bias.data_ptr() != self.bias.data_ptr() + offset * self.bias.element_size():
                return None
            offset += m.out_features
        return self.weight, self.bias

    def serves(self, x: Tensor) -> bool:
        """Whether one call serves the group: on the Triton path, outside torch.compile (kept simple: each member's
        own pool, built before tracing, serves a traced graph)."""
        if torch.compiler.is_compiling() or not triton_enabled(x):
            return False
        return any(m.num_filled for m in self.members) or self.merged() is not None

    def __call__(self, x: Tensor) -> list[Tensor]:
        """Every member's output for `x` (shapes ``(*x.shape[:-1], out_p)``)."""
        if not self.serves(x):
            return [m.forward_alone(x) for m in self.members]
        return self._call(x, defer=False)[0]

    def deferred(self, x: Tensor) -> tuple[list[Tensor], list[Tensor | None]]:
        """`__call__`, each output's plain low-rank delta left for the consumer to add (`ScuteLinear.deferred`)."""
        if not self.serves(x) or any(m.shard is not None for m in self.members):
            return self(x), [None] * len(self.members)
        return self._call(x, defer=True)

    def _call(self, x: Tensor, defer: bool) -> tuple[list[Tensor], list[Tensor | None]]:
        """The members' outputs (and, if `defer`, their deferred deltas) from one call over the group's pool, or
        one GEMM."""
        flat = x.reshape(-1, self.in_features)
        merged, none = self.merged(), [None] * len(self.members)
        if merged is not None and not any(m.num_filled for m in self.members):  # no adapter: the one GEMM
            ys, ds = merged_gemm(flat, *merged, self.out_features), none
        else:
            ctx = get_forward_context()
            pool = self.pool = pool_for(self.pool, flat, self.members)
            args = (flat, [m.weight for m in self.members], [m.bias for m in self.members], pool,
                    ctx.lora_meta(flat.shape[0], pool.slot_group, pool.group_key), self.members[0].resources)
            kw = dict(active_slots=ctx.active_adapter_slots, merged=merged)
            ys, ds = scute_linears_deferred(*args, **kw) if defer else (scute_linears_triton(*args, **kw), none)
        return [y.view(*x.shape[:-1], y.shape[-1]) for y in ys], ds

    def set_slot(self, index: int, member_slots: Sequence[Slots | None], placement: Placement | None = None) -> None:
        """Slot `index` of every member at once (``member_slots[i]`` for member i), the group's pool updated once;
        `placement` as for `ScuteLinear.set_slot`."""
        for member, slots in zip(self.members, member_slots, strict=True):
            member.assign(index, slots, placement)
        self.update_pool(index, placement)

    def update_pool(self, index: int, placement: Placement | None = None) -> None:
        """Called by a member's `set_slot` of slot `index`: the pool follows every member's slots."""
        if self.pool is not None:
            self.pool.update_slot([m.slots for m in self.members], index, placement)


@torch.no_grad()
def _merge_parameters(members: Sequence[ScuteLinear]) -> tuple[Tensor, Tensor | None]:
    """Concatenate the members' weights (and biases) along the outputs and make each member's parameter a view
    of its rows, so that one GEMM computes every member's base output with no copy of the weights. A member
    without a bias gets zeros in the merged bias (its own stays None)."""
    weight = torch.cat([m.weight for m in members])
    bias = None
    if any(m.bias is not None for m in members):
        bias = torch.cat([m.bias if m.bias is not None else weight.new_zeros(m.out_features) for m in members])
    offset = 0
    for m in members:
        rows = slice(offset, offset + m.out_features)
        m.weight = nn.Parameter(weight[rows], requires_grad=m.weight.requires_grad)
        if m.bias is not None:
            m.bias = nn.Parameter(bias[rows], requires_grad=m.bias.requires_grad)
        offset += m.out_features
    return weight, bias


def project(x: Tensor, *linears: nn.Module) -> list[Tensor]:
    """``[linear(x) for linear in linears]``, in one call when they are exactly the members of one `LinearGroup`."""
    group = getattr(linears[0], "group", None)
    if group is not None and list(linears) == group.members:
        return group(x)
    return [linear(x) for linear in linears]


def project_deferred(x: Tensor, *linears: nn.Module) -> tuple[list[Tensor], list[Tensor | None]]:
    """`project`, each output with its deferred plain low-rank delta (None: the output is complete), for a
    consumer that adds it (`scute.ops.elementwise`). A module that is not a `ScuteLinear` gives its output."""
    group = getattr(linears[0], "group", None)
    if group is not None and list(linears) == group.members:
        return group.deferred(x)
    outs = [lin.deferred(x) if isinstance(lin, ScuteLinear) else (lin(x), None) for lin in linears]
    return [z for z, _ in outs], [d for _, d in outs]


def pool_for(pool: SlotPool | None, x: Tensor, linears: Sequence[ScuteLinear]) -> SlotPool:
    """`pool`, or a new pool of `linears`' slots if it is missing or on another device / dtype than `x`: built on
    the first forward on a device (before any graph capture: the engine warms up first), kept up to date by
    `set_slot` afterwards."""
    if pool is None or pool.device != x.device or pool.dtype != x.dtype:
        pool = SlotPool(x.shape[-1], [m.out_features for m in linears], len(linears[0].slots), x.device, x.dtype)
        pool.update([m.slots for m in linears])
    return pool
