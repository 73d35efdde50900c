"""`AdapterMemory`: the device bytes of the adapters the slots hold, against the `adapter_memory_bytes` budget.

An adapter's bytes are those of its distinct tensor storages as the device holds them (matrices in the serving
dtype, vectors in float32, as `AdapterLoader` moves them); a storage several adapters share (VeRA's projection
pair, one tensor per content) counts once for all of them. `AdapterManager` asks `fits` before it gives an
adapter a slot and evicts unused adapters until it does; an adapter that cannot fit alone fails its requests.
The budget bounds the slots' adapters; the copies staged for waiting requests (at most `MAX_PREFETCH`) come on
top, and the default budget has room for them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch

from scute.adapters import Adapter
from scute.config import EngineConfig
from scute.model.linear import ScuteLinear
from scute.model.loader import LoadedModel
from scute.ops.groups import storage_key

DEFAULT_RANK = 16  # the default budget: room for LoRA adapters of this rank on every adapted layer...
DEFAULT_SHARE = 0.1  # ...at most this share of the device's memory


def adapter_storages(adapter: Adapter, matrix_bytes: int) -> dict[tuple, int]:
    """Each distinct storage of the adapter's live tensors and its bytes on the device (`matrix_bytes` per
    element of a matrix, 4 per element of a vector)."""
    out = {}
    for slots in adapter.layers.values():
        for x in slots.tensors().values():
            out[storage_key(x, "tensor")] = x.numel() * (matrix_bytes if x.dim() > 1 else 4)
    return out


def lora_bytes(linears: dict[str, ScuteLinear], rank: int, matrix_bytes: int) -> int:
    """The device bytes of one LoRA adapter of `rank` on every adapted layer (A and B of each)."""
    return sum(rank * (lin.in_features + lin.out_features) for lin in linears.values()) * matrix_bytes


def adapter_budget(config: EngineConfig, linears: dict[str, ScuteLinear], dtype: torch.dtype, device: torch.device,
                   staged: int) -> int | None:
    """`config.adapter_memory_bytes`; by default on a GPU `default_budget` for `max_adapters` + `staged`
    adapters, on the CPU None (no limit: the adapters live in host memory there)."""
    if config.adapter_memory_bytes is not None:
        return config.adapter_memory_bytes
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    return default_budget(linears, config.max_adapters + staged, dtype, total)


def default_budget(linears: dict[str, ScuteLinear], num_adapters: int, dtype: torch.dtype, device_memory: int) -> int:
    """Room for `num_adapters` LoRA adapters of rank `DEFAULT_RANK` on every adapted layer, at most
    `DEFAULT_SHARE` of the device's memory (thousands of slots for small adapters, IA3's or VeRA's, must not
    take the KV cache's memory: LoRA adapters beyond the share then take turns in the slots)."""
    return min(num_adapters * lora_bytes(linears, DEFAULT_RANK, dtype.itemsize), int(DEFAULT_SHARE * device_memory))


def log_budget(budget: int | None, loaded: LoadedModel) -> None:
    """On a GPU, the start-up log (stderr) of the budget: its size, and how many LoRA adapters of `DEFAULT_RANK`
    it holds."""
    if budget is None or loaded.device.type != "cuda":
        return
    room = budget // max(lora_bytes(loaded.linears, DEFAULT_RANK, loaded.dtype.itemsize), 1)
    print(f"scute: {budget / 2**30:.2f} GiB of device memory for adapters (about {room} LoRA adapters of rank "
          f"{DEFAULT_RANK} on every adapted layer; adapter_memory_bytes sets it)", file=sys.stderr)


class AdapterMemory:
    """The storages of the adapters in device slots, by adapter identity; `budget` None: no limit."""

    def __init__(self, budget: int | None, dtype: torch.dtype) -> None:
        self.budget, self.matrix_bytes = budget, dtype.itemsize
        self._held: dict[str, dict[tuple, int]] = {}

    def too_large(self, adapter: Adapter) -> str | None:
        """Why `adapter` can never be placed (larger than the whole budget), or None."""
        if self.budget is None:
            return None
        need = sum(adapter_storages(adapter, self.matrix_bytes).values())
        if need <= self.budget:
            return None
        return (f"adapter {adapter.name!r} needs {need / 2**20:.1f} MiB of device memory, more than "
                f"adapter_memory_bytes ({self.budget / 2**20:.1f} MiB): raise adapter_memory_bytes")

    def used(self, identities: Iterable[str] | None = None) -> int:
        """The bytes of the held adapters (or of those among `identities`), shared storages once."""
        keep = self._held if identities is None else {i: self._held[i] for i in identities if i in self._held}
        return sum({k: n for storages in keep.values() for k, n in storages.items()}.values())

    def fits(self, adapter: Adapter, beside: Iterable[str]) -> bool:
        """Whether `adapter` fits in the budget beside the held adapters among `beside`."""
        if self.budget is None:
            return True
        union = {k: n for i in beside if i in self._held for k, n in self._held[i].items()}
        union.update(adapter_storages(adapter, self.matrix_bytes))
        return sum(union.values()) <= self.budget

    def hold(self, adapter: Adapter) -> None:
        self._held[adapter.identity] = adapter_storages(adapter, self.matrix_bytes)

    def drop(self, identity: str) -> None:
        self._held.pop(identity, None)
