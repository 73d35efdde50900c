"""The method registry: `peft_type` -> a converter from a PEFT checkpoint layer to `Slots`.

Adding a method is one file in `scute/adapters/methods/` (every module there is imported, which registers it)::

    @register_method("IA3", keys=("ia3_l",))
    def convert_ia3(layer: LayerCheckpoint) -> Slots:
        ...

`keys` are the per-layer tensor names the method saves (after the module path), `global_keys` the
model-level ones (saved as ``base_model.<key>``, e.g. VeRA's shared projections); a ``*`` in a name stands for
one dotted segment, for numbered or named families (``adamss_A.*``, FRoD's ``frod_V.*`` per module category).
The loader groups a checkpoint's tensors by module with them, checks that every tensor is used, and hands each
adapted layer to the converter as a `LayerCheckpoint` (see `scute.adapters.conversion`). Optional: `shapes`, the
rule that reads a layer's (out, in) off its saved tensors (`scute explain` without a base model), and `options`,
the load options the method takes beyond the generic ``dense`` (Poly's ``task_id``), and `whole`, a converter of
all of an adapter's layers at once for the adapters it recognizes (the same `Slots` as the per-layer converter's,
with fewer Python calls: plain LoRA).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scute.adapters.conversion import LayerCheckpoint
    from scute.ops.slots import Slots

Converter = Callable[["LayerCheckpoint"], "Slots"]
# (config, each adapted layer's tensors by module name in model order, in the converter dtype, the base layers by
# name, a `Landing` where the tensors are a file in the serving dtype (`Landing.dtype`) (as read: views of a copy
# of their own where the base weights are, whose values land later: it may write into them in work given to
# `Landing.then`) else None, `Pause`) -> every layer's slots, or None where the adapter is not one it converts (then the per-layer
# converter runs)
WholeConverter = Callable[..., "dict[str, Slots] | None"]


@dataclass(frozen=True)
class SavedShapes:
    """What a shape rule sees of one layer of a checkpoint: the shapes of its tensors (by key, as registered), of
    the model-level tensors (by key, without ``base_model.``) and the adapter config."""

    tensors: Mapping[str, tuple[int, ...]]
    globals: Mapping[str, tuple[int, ...]]
    config: Mapping


# (out_features, in_features) of the layer, or None where the saved tensors do not fix them; a KeyError (a
# tensor the rule needs is not saved for this layer) counts as None.
ShapeRule = Callable[[SavedShapes], "tuple[int, int] | None"]


@dataclass(frozen=True)
class LoadOption:
    """A load option a method takes (``load_adapter(..., <name>=value)``). It selects one adapter out of the
    checkpoint, so the loaded adapter's name and identity get `suffix` formatted with the value (``"@task{}"``:
    two tasks of one Poly checkpoint are two adapters, with their own device slots and KV prefixes)."""

    help: str
    suffix: str


@dataclass(frozen=True)
class Method:
    peft_type: str
    convert: Converter
    keys: tuple[str, ...]
    global_keys: tuple[str, ...] = ()
    served: bool = True  # False: registered only to refuse its checkpoints with the reason (Lily)
    tensorless_targets: bool = False  # a targeted layer may have no tensor (all derived from the global ones)
    shapes: ShapeRule | None = None
    options: Mapping[str, LoadOption] = field(default_factory=dict)
    on_device: bool = False  # the converter computes on the device its tensors and W0 are on (not only the CPU)
    whole: WholeConverter | None = None  # all layers at once, for the adapters it recognizes


_METHODS: dict[str, Method] = {}

# PEFT types Scute does not serve, and why (docs/normal_form.md §6 has the math behind each reason).
_PROMPT = "it adds virtual tokens or prefix key/values, not adapters of linear layers"
_MERGE = "it trains {}, not adapters of linear layers: merge it into the base model"
NOT_SERVED = {
    **dict.fromkeys(("PROMPT_TUNING", "MULTITASK_PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING", "ADAPTION_PROMPT",
                     "CPT", "CARTRIDGE"), _PROMPT),
    "LN_TUNING": _MERGE.format("LayerNorm parameters"),
    "TRAINABLE_TOKENS": _MERGE.format("embedding rows"),
    "SHADOW": "it is not an adapter of linear layers",
    "XLORA": "it gates its LoRAs by the hidden states of an extra forward pass: no static form per token",
}


def register_method(
    peft_type: str, *, keys: tuple[str, ...], global_keys: tuple[str, ...] = (), served: bool = True,
    tensorless_targets: bool = False, shapes: ShapeRule | None = None, options: Mapping[str, LoadOption] = {},
    on_device: bool = False, whole: WholeConverter | None = None,
) -> Callable[[Converter], Converter]:
    """Register `convert` as the converter of PEFT checkpoints whose `peft_type` is `peft_type`; ``served=False``
    for a method whose converter always refuses (with the reason): it is then not listed as supported.
    ``tensorless_targets``: the converter is also called for targeted layers the file has no tensor for (a
    method that can derive a layer from its global tensors: UniLoRA saved without its indices). `shapes`: the
    layer shape its saved tensors determine (see `ShapeRule`); `options`: its load options by name, which the
    converter reads from ``layer.options``. ``on_device``: the converter makes every tensor it creates on
    ``layer.device`` (where its tensors and ``layer.weight`` are), so it may run on the base model's device;
    otherwise it runs on the CPU. `whole`: every layer's slots at once (see `WholeConverter`; loads without
    ``dense`` or options), exactly those the per-layer converter makes (or those folded in the serving dtype,
    where that gives the values its cast would: `load_adapter`'s ``dtype``), for the adapters it takes: None
    for the others and for any the per-layer converter would refuse (which then says why)."""

    def wrap(convert: Converter) -> Converter:
        if peft_type in _METHODS:
            raise ValueError(f"a converter for peft_type {peft_type!r} is already registered")
        _METHODS[peft_type] = Method(peft_type, convert, tuple(keys), tuple(global_keys), served, tensorless_targets,
                                     shapes, dict(options), on_device, whole)
        return convert

    return wrap


def get_method(peft_type: str) -> Method:
    _load_builtin_methods()
    try:
        return _METHODS[peft_type]
    except KeyError:
        why = f": {NOT_SERVED[peft_type]}" if peft_type in NOT_SERVED else ""
        raise KeyError(
            f"peft_type {peft_type!r} is not supported{why}; supported: {', '.join(supported_methods())}"
        ) from None


def supported_methods() -> list[str]:
    """The PEFT types Scute serves (some, like HiRA, only with ``load_adapter(..., dense=True)``)."""
    _load_builtin_methods()
    return sorted(t for t, m in _METHODS.items() if m.served)


def methods_with_option(name: str) -> list[str]:
    """The PEFT types that take load option `name` (for errors that say where an option belongs)."""
    _load_builtin_methods()
    return sorted(t for t, m in _METHODS.items() if name in m.options)


@functools.cache
def _load_builtin_methods() -> None:
    """Import every module of `scute.adapters.methods` (each registers its methods when imported). Lazy: the
    method modules import this one."""
    from scute.adapters import methods

    for info in pkgutil.iter_modules(methods.__path__):
        importlib.import_module(f"{methods.__name__}.{info.name}")
