"""`ScuteLinear`: an `nn.Linear` whose tokens each run through their own adapter's normal form."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from scute.adapters.slots import Slots
from scute.engine.context import get_forward_context
from scute.ops import scute_linear


class ScuteLinear(nn.Module):
    """Replaces one `nn.Linear` of the base model; keeps its `weight` and `bias` parameters (same names, same
    storage), plus `max_adapters` adapter slots. Slot ``i`` holds the folded `Slots` of the adapter loaded
    there, or None if that adapter does not adapt this layer (its tokens then get the base output).

    Forward: the token slots come from the forward context; tokens with slot −1, or whose slot is empty here,
    get exactly ``F.linear(x, weight, bias)``.
    """

    def __init__(self, base: nn.Linear, max_adapters: int) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.slots: list[Slots | None] = [None] * max_adapters
        self.num_filled = 0

    def set_slot(self, index: int, slots: Slots | None) -> None:
        if slots is not None and (slots.in_features, slots.out_features) != (self.in_features, self.out_features):
            raise ValueError(
                f"slots for a {slots.in_features}->{slots.out_features} layer do not fit "
                f"{self.in_features}->{self.out_features}"
            )
        self.slots[index] = slots
        self.num_filled = sum(s is not None for s in self.slots)

    def forward(self, x: Tensor) -> Tensor:
        if self.num_filled == 0:  # no adapter touches this layer: the plain GEMM, no metadata needed
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, self.in_features)
        token_slots = get_forward_context().adapter_slots(flat.shape[0])
        y = scute_linear(flat, self.weight, self.bias, self.slots, token_slots)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        filled = self.num_filled
        return f"in_features={self.in_features}, out_features={self.out_features}, adapters={filled}/{len(self.slots)}"
