"""Tensor parallelism of a loaded model: the model's own plan applied to its linear layers on one rank.

transformers declares how a model shards (`config.base_model_tp_plan`: q/k/v and gate/up "colwise", o and down
"rowwise"). `shard_model` applies it to the `nn.Linear` layers of one rank's copy of the model, before they are
swapped for `ScuteLinear` (so the merged q/k/v and gate/up weights are the concatenations of the rank's shards),
with `scute.ops.tp.shard_weight`: a column-parallel layer keeps its rank's rows (outputs), a row-parallel one its
rank's columns (inputs), its bias on rank 0 only. Each `ScuteLinear` then carries its `Shard`: `set_slot`
shards every adapter's folded slots with `shard_slots` (the adapters add no collective) and a row-parallel layer
sums its partial output over the ranks (one all-reduce). The attention of a rank has its share of the query and
KV heads (its q/k/v columns); embeddings, norms and the LM head are replicated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from scute.adapters import Adapter, AdapterError
from scute.model.linear import ScuteLinear
from scute.ops.slots import Slots
from scute.ops.tp import Kind, shard_slots, shard_weight

STYLES: dict[str, Kind] = {"colwise": "column", "rowwise": "row"}  # transformers' plan styles Scute shards


@dataclass(frozen=True)
class Shard:
    """One rank's share of a linear layer: `kind` (column / row parallel), the rank, the number of ranks and the
    full layer's features (the adapters' slots are converted for the full layer)."""

    kind: Kind
    rank: int
    world_size: int
    in_features: int
    out_features: int

    def slots(self, slots: Slots) -> Slots:
        """This rank's share of an adapter's slots on the full layer (`shard_slots`; ValueError if it has none)."""
        return shard_slots(slots, self.kind, self.rank, self.world_size)

    def reduce(self, y: Tensor) -> Tensor:
        """The layer's output from this rank's: a row-parallel layer's partial outputs summed over the ranks (in
        place, one all-reduce); a column-parallel layer's is its share already."""
        if self.kind == "row":
            dist.all_reduce(y)
        return y


def check_tp_size(config, world_size: int) -> None:
    """Raise ValueError unless `world_size` ranks can share the model of this transformers config: it needs a plan,
    and every rank a whole number of query heads, KV heads and MLP features."""
    if getattr(config, "base_model_tp_plan", None) is None:
        raise ValueError(f"{type(config).__name__} has no base_model_tp_plan: transformers does not say how to shard "
                         "this model, so Scute cannot run it with tensor_parallel_size > 1")
    heads = config.num_attention_heads
    sizes = {"num_attention_heads": heads, "num_key_value_heads": getattr(config, "num_key_value_heads", None)
             or heads, "intermediate_size": getattr(config, "intermediate_size", None)}
    for name, size in sizes.items():
        if size is not None and size % world_size:
            raise ValueError(f"tensor_parallel_size={world_size} does not divide the model's {name}={size}: each "
                             f"rank needs an equal share; use a tensor_parallel_size that divides {size}")


def parallel_kinds(model: nn.Module) -> dict[str, Kind]:
    """The linear layers the model's plan shards, by module name, with their kind. Raises ValueError for a linear
    layer the plan gives a style Scute does not shard, or a plan that matches no linear layer."""
    prefix = f"{model.base_model_prefix}." if getattr(model, "base_model_prefix", "") else ""
    plan = [(re.compile(re.escape(prefix + key).replace(r"\*", r"[^.]+")), style)
            for key, style in model.config.base_model_tp_plan.items()]
    kinds = {}
    for name, module in model.named_modules():
        style = next((s for pattern, s in plan if pattern.fullmatch(name)), None)
        if type(module) is not nn.Linear or style is None:
            continue  # not a linear layer (norms: replicated), or a linear layer the plan leaves whole
        if style not in STYLES:
            raise ValueError(f"{name}: the model's tp plan shards it as {style!r}; Scute shards linear layers "
                             f"{' or '.join(map(repr, STYLES))} only")
        kinds[name] = STYLES[style]
    if not kinds:
        raise ValueError(f"{type(model).__name__}: its tp plan matches none of its linear layers")
    return kinds


@torch.no_grad()
def shard_model(model: nn.Module, rank: int, world_size: int) -> tuple[dict[str, Shard], nn.Module]:
    """Shard the plan's `nn.Linear` layers of `model` in place for `rank` (each keeps a contiguous copy of its
    share, `shard_weight`); call before `swap_linears`. Returns the shards by module name, and a module holding
    every linear layer of the full model under the model's names (the full weights, on the device they were
    loaded on): what adapters are converted against, so that they are checked against the full shapes and a
    converter that reads W0 (DoRA's norm) sees all of it."""
    check_tp_size(model.config, world_size)
    kinds = parallel_kinds(model)
    full, shards = nn.Module(), {}
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        _add(full, name, _copy(module))
        if name not in kinds:
            continue
        shards[name] = Shard(kinds[name], rank, world_size, module.in_features, module.out_features)
        weight, bias = shard_weight(module.weight, module.bias, kinds[name], rank, world_size)
        module.weight = nn.Parameter(weight.clone(memory_format=torch.contiguous_format), requires_grad=False)
        module.bias = None if bias is None else nn.Parameter(bias.clone(), requires_grad=False)
        module.out_features, module.in_features = weight.shape
    return shards, full


def attach_shards(linears: dict[str, ScuteLinear], shards: dict[str, Shard]) -> None:
    """Give each swapped layer its `Shard`. A `LinearGroup` computes its members without their `reduce`, so none
    of them may be row-parallel (q/k/v, gate/up are column-parallel)."""
    for name, shard in shards.items():
        linears[name].shard = shard
    for name, lin in linears.items():
        if lin.group is not None and lin.shard is not None and lin.shard.kind == "row":
            raise ValueError(f"{name}: a member of group {lin.group.name} cannot be row-parallel")


def check_adapter(adapter: Adapter, linears: dict[str, ScuteLinear]) -> None:
    """Raise AdapterError if a sharded layer cannot hold its share of `adapter` (`shard_slots` refuses it)."""
    for name, slots in adapter.layers.items():
        shard = linears[name].shard if name in linears else None
        if shard is None:
            continue
        try:
            shard.slots(slots)
        except ValueError as e:
            raise AdapterError(f"adapter {adapter.name!r} ({adapter.peft_type}) cannot be served with "
                               f"tensor_parallel_size={shard.world_size}: {name}: {e}") from None


def _copy(module: nn.Linear) -> nn.Linear:
    """A new `nn.Linear` holding the same parameters (the original is sharded next)."""
    copy = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
    copy.weight, copy.bias = module.weight, module.bias
    return copy


def _add(root: nn.Module, name: str, module: nn.Module) -> None:
    *path, leaf = name.split(".")
    for part in path:
        if not hasattr(root, part):
            root.add_module(part, nn.Module())
        root = getattr(root, part)
    root.add_module(leaf, module)
