"""Surgery on a transformers model: swap its linear layers for `ScuteLinear` and place adapters in slots."""

from __future__ import annotations

from torch import nn

from scute.adapters.checkpoint import Adapter
from scute.model.linear import ScuteLinear


def swap_linears(model: nn.Module, max_adapters: int) -> dict[str, ScuteLinear]:
    """Replace every `nn.Linear` of `model` in place by a `ScuteLinear` sharing its parameters.

    Returns the new modules by qualified name (the names PEFT checkpoints use, minus ``base_model.model.``).
    """
    names = [name for name, m in model.named_modules() if type(m) is nn.Linear]
    swapped = {}
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        swapped[name] = ScuteLinear(getattr(parent, child), max_adapters)
        setattr(parent, child, swapped[name])
    return swapped


def place_adapter(linears: dict[str, ScuteLinear], index: int, adapter: Adapter | None) -> None:
    """Put `adapter`'s slots in slot `index` of every layer (layers it does not adapt get None);
    None empties the slot."""
    layers = {} if adapter is None else adapter.layers
    if missing := set(layers) - set(linears):
        raise ValueError(f"adapter {adapter.name!r} adapts {sorted(missing)[0]}, which is not a ScuteLinear here")
    for name, linear in linears.items():
        linear.set_slot(index, layers.get(name))
