"""Surgery on a transformers model: swap its linear layers for `ScuteLinear` and place adapters in slots."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from torch import nn

from scute.adapters import Adapter
from scute.adapters.adapter import Pause, no_pause, paused
from scute.model.linear import LinearGroup, ScuteLinear
from scute.ops.launch import LaunchResources
from scute.ops.pool import Placement, SlotPool
from scute.ops.pool_rows import PreparedColumn, Then, prepare_column

# vLLM's packed_modules_mapping: sibling projections that read one input, served by one op call.
PACKED_MODULES_MAPPING = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def swap_linears(model: nn.Module, max_adapters: int,
                 packed_modules_mapping: Mapping[str, Sequence[str]] = PACKED_MODULES_MAPPING,
                 ) -> dict[str, ScuteLinear]:
    """Replace every `nn.Linear` of `model` in place by a `ScuteLinear` sharing its parameters, and tie the
    siblings one entry of `packed_modules_mapping` names under one parent (all present, one ``in_features``)
    into a `LinearGroup`; ``{}`` groups nothing. Every new module shares one `LaunchResources`.

    Returns the new modules by qualified name (the names PEFT checkpoints use, minus ``base_model.model.``).
    """
    names = [name for name, m in model.named_modules() if type(m) is nn.Linear]
    swapped, resources = {}, LaunchResources()
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        swapped[name] = ScuteLinear(getattr(parent, child), max_adapters, resources)
        setattr(parent, child, swapped[name])
    for parent_name in dict.fromkeys(name.rpartition(".")[0] for name in names):
        prefix = f"{parent_name}." if parent_name else ""
        for packed, children in packed_modules_mapping.items():
            members = [swapped.get(prefix + child) for child in children]
            if all(m is not None for m in members) and len({m.in_features for m in members}) == 1:
                LinearGroup(packed, members)
    return swapped


def place_adapter(linears: dict[str, ScuteLinear], index: int, adapter: Adapter | None,
                  prepared: dict[SlotPool, PreparedColumn] | None = None, units: Sequence[tuple] | None = None,
                  ) -> None:
    """Put `adapter`'s slots in slot `index` of every layer (layers it does not adapt get None); None empties the
    slot. `prepared`: its rows computed ahead for the pools (`prepare_adapter`), taken where they still apply;
    `units`: as for `placing`."""
    for _ in placing(linears, index, adapter, prepared, units):
        pass


def placing(linears: dict[str, ScuteLinear], index: int, adapter: Adapter | None,
            prepared: dict[SlotPool, PreparedColumn] | None = None, units: Sequence[tuple] | None = None,
            ) -> Iterator[None]:
    """`place_adapter` a slot pool at a time, yielding after each: steps may run between two as long as no token
    uses slot `index` until it is exhausted. What it did takes effect at its end, at once: every pool's device
    rows in one copy (`Placement`), and the layers' versions, which CUDA graphs follow; or after a pool whose
    signature or grouping of other slots changed, before any step (`Placement.resigned`). `units`: the
    `layer_pools` of `linears`, if the caller keeps them (they change only with the model)."""
    layers = {} if adapter is None else adapter.layers
    if missing := set(layers) - set(linears):
        raise ValueError(f"adapter {adapter.name!r} adapts {min(missing)}, which is not a ScuteLinear here")
    placement = Placement(prepared)
    for linear, group, names in layer_pools(linears) if units is None else units:
        if group is None:
            linear.set_slot(index, layers.get(names[0]), placement)
        else:  # each group once, its pool updated once for all its members
            group.set_slot(index, [layers.get(n) for n in names], placement)
        if placement.resigned:
            _apply(placement)
            placement = Placement(prepared)
        yield
    _apply(placement)


def _apply(placement: Placement) -> None:
    placement.writes.flush()
    for linear in placement.touched:
        vars(linear)["version"] += 1  # past `nn.Module.__setattr__`, as `ScuteLinear.assign` sets it


def prepare_adapter(units: Sequence[tuple], adapter: Adapter, pause: Pause = no_pause,
                    then: Then | None = None) -> dict[SlotPool, PreparedColumn]:
    """`adapter`'s rows in the pools that exist now, computed from the adapter alone (`prepare_column`; the
    adapter loader's thread calls it as it stages a copy, so that the placement on the step loop only applies
    them; `pause` before each pool; `then`: as for `prepare_column`). `units`: the model's `layer_pools`, walked
    once by the caller. Pools built or replaced later are placed as usual."""
    prepared = {}

    def add(pool: SlotPool | None, column: list) -> None:
        if pool is not None and (ready := prepare_column(pool, column, then)) is not None:
            prepared[pool] = ready

    for linear, group, names in paused(units, pause):
        if group is None:  # its own pool (a group it belongs to without all its members here is left alone)
            add(linear.pool, [adapter.layers.get(names[0])])
        else:
            add(group.pool, [adapter.layers.get(n) for n in names])
            for member, name in zip(group.members, names):
                add(member.pool, [adapter.layers.get(name)])
    return prepared


def layer_pools(linears: dict[str, ScuteLinear]):
    """(linear, its group or None, the names of the group's members or its own) for each layer that owns a pool
    update: a group once (at its first member), a layer outside a complete group alone."""
    names = {id(linear): name for name, linear in linears.items()}
    seen = set()
    for name, linear in linears.items():
        group = linear.group
        if group is None or any(id(m) not in names for m in group.members):
            yield linear, None, [name]
        elif id(group) not in seen:
            seen.add(id(group))
            yield linear, group, [names[id(m)] for m in group.members]
