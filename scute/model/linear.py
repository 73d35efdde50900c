"""`ScuteLinear`: an `nn.Linear` whose tokens each run through their own adapter's normal form."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from scute.adapters.slots import Slots
from scute.engine.context import ForwardContext, get_forward_context
from scute.ops import LoraMeta, MetaCache, SlotPool, scute_linear_ref, scute_linear_triton, triton_enabled
from scute.ops.reference import slot_rows


class ScuteLinear(nn.Module):
    """Replaces one `nn.Linear` of the base model; keeps its `weight` and `bias` parameters (same names, same
    storage), plus `max_adapters` adapter slots. Slot ``i`` holds the folded `Slots` of the adapter loaded
    there, or None if that adapter does not adapt this layer (its tokens then get the base output).

    Forward: the token slots come from the forward context; tokens with slot −1, or whose slot is empty here,
    get exactly ``F.linear(x, weight, bias)``. On CUDA the Triton kernels run, reading the slots from a
    `SlotPool` (device tables, non-persistent: rebuilt from the slots, never saved in a state dict); elsewhere the
    PyTorch reference op. `set_slot` updates the pool's tables in place: a captured CUDA graph stays valid while
    ``pool.signature`` is unchanged (re-capture when it changes, e.g. on the first OFT adapter of a layer).
    """

    def __init__(self, base: nn.Linear, max_adapters: int) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.slots: list[Slots | None] = [None] * max_adapters
        self.num_filled = 0
        self.pool: SlotPool | None = None

    def set_slot(self, index: int, slots: Slots | None) -> None:
        if slots is not None and (slots.in_features, slots.out_features) != (self.in_features, self.out_features):
            raise ValueError(
                f"slots for a {slots.in_features}->{slots.out_features} layer do not fit "
                f"{self.in_features}->{self.out_features}"
            )
        self.slots[index] = slots if slots is None or slots.scale == 1.0 else slots.folded()
        self.num_filled = sum(s is not None for s in self.slots)
        if self.pool is not None:
            self.pool.update([self.slots])

    def forward(self, x: Tensor) -> Tensor:
        if self.num_filled == 0:  # no adapter touches this layer: the plain GEMM, no metadata needed
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, self.in_features)
        ctx = get_forward_context()
        token_slots = ctx.adapter_slots(flat.shape[0])
        if triton_enabled(flat):
            pool = self._pool_for(flat)
            y = scute_linear_triton(flat, self.weight, self.bias, pool, lora_meta(ctx, token_slots, pool))
        else:  # the grouping of tokens by slot is the same for every layer: computed once per forward
            rows = ctx.slot_rows.get(id(token_slots))
            if rows is None:
                rows = ctx.slot_rows[id(token_slots)] = slot_rows(token_slots)
            y = scute_linear_ref(flat, self.weight, self.bias, self.slots, token_slots, rows)
        return y.view(*x.shape[:-1], self.out_features)

    def _pool_for(self, x: Tensor) -> SlotPool:
        """The device pool, built on the first forward on a device (before any graph capture: the engine warms
        up first) and kept up to date by `set_slot` afterwards."""
        if self.pool is None or self.pool.device != x.device or self.pool.dtype != x.dtype:
            self.pool = SlotPool(self.in_features, (self.out_features,), len(self.slots), x.device, x.dtype)
            self.pool.update([self.slots])
        return self.pool

    def extra_repr(self) -> str:
        filled = self.num_filled
        return f"in_features={self.in_features}, out_features={self.out_features}, adapters={filled}/{len(self.slots)}"


def lora_meta(ctx: ForwardContext, token_slots: Tensor, pool: SlotPool) -> LoraMeta:
    """The step's token metadata for `pool`'s slot grouping: built by the first layer, shared by the rest."""
    if ctx.lora_meta is None:
        ctx.lora_meta = MetaCache()
    return ctx.lora_meta.get(token_slots, pool.slot_group, pool.group_key)
