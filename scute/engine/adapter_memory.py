"""`AdapterMemory`: the device bytes of the adapters the slots hold, against the `adapter_memory_bytes` budget.

An adapter's bytes are those of its distinct tensor storages as the device holds them (matrices in the serving
dtype, vectors in float32, as `AdapterLoader` moves them); a storage several adapters share (VeRA's projection
pair, one tensor per content) counts once for all of them. `AdapterManager` lets a request run only if its
adapter fits beside the running requests' (`pinned`), then evicts unused adapters from the slots until it fits
beside the rest (`held`); an adapter that cannot fit alone fails its requests. Both checks
cost the number of storages the adapter may share (`StorageUnion` keeps the resident ones' union as they come
and go): a request pinning a LoRA adapter costs the host no more than one with a VeRA adapter of a few storages,
whatever the number of its layers.
The budget bounds the slots' adapters; the copies staged for waiting requests (at most `MAX_PREFETCH`) come on
top, and the default budget has room for them.
"""

from __future__ import annotations

import sys
import weakref
from typing import NamedTuple

import torch

from scute.adapters import Adapter
from scute.config import EngineConfig
from scute.model.linear import ScuteLinear
from scute.model.loader import LoadedModel
from scute.ops.groups import slot_storages

DEFAULT_RANK = 16  # the default budget: room for LoRA adapters of this rank on every adapted layer...
DEFAULT_SHARE = 0.1  # ...at most this share of the device's memory


class Storages(NamedTuple):
    """An adapter's distinct storages on the device: `own`, the bytes of those no other adapter holds (every
    tensor not named in `Slots.shared`: loaded for this adapter alone); `shared`, by `storage_key`, those that
    other adapters may hold too (`Slots.shared`: VeRA's pair), with their bytes."""

    own: int
    shared: dict[tuple, int]

    @property
    def total(self) -> int:
        return self.own + sum(self.shared.values())


def adapter_storages(adapter: Adapter, matrix_bytes: int) -> Storages:
    """The adapter's distinct storages (each counted once) and their bytes on the device (`matrix_bytes` per
    element of a matrix, 4 per element of a vector)."""
    own: dict[tuple, int] = {}
    shared: dict[tuple, int] = {}
    for sl in adapter.layers.values():
        shared.update(slot_storages(sl, matrix_bytes, sl.shared))
        own.update(slot_storages(sl, matrix_bytes, set(sl.live) - sl.shared))
    return Storages(sum(own.values()), shared)


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


class StorageUnion:
    """The storages of a set of adapters (by identity), each counted once, and their bytes, kept as adapters
    join and leave: an adapter's own storages as one number, the shared ones counted by reference."""

    def __init__(self) -> None:
        self.members: dict[str, Storages] = {}
        self._refs: dict[tuple, int] = {}
        self.bytes = 0

    def add(self, identity: str, storages: Storages) -> None:
        if identity in self.members:
            return
        self.members[identity] = storages
        self.bytes += storages.own
        for key, n in storages.shared.items():
            self.bytes += n if key not in self._refs else 0
            self._refs[key] = self._refs.get(key, 0) + 1

    def remove(self, identity: str) -> None:
        storages = self.members.pop(identity, None)
        if storages is None:
            return
        self.bytes -= storages.own
        for key, n in storages.shared.items():
            self._refs[key] -= 1
            if not self._refs[key]:
                del self._refs[key]
                self.bytes -= n

    def holders(self, key: tuple) -> int:
        """How many members hold the shared storage `key`."""
        return self._refs.get(key, 0)

    def extra(self, storages: Storages) -> int:
        """The bytes `storages` would add to the union."""
        return storages.own + sum(n for key, n in storages.shared.items() if key not in self._refs)


class AdapterMemory:
    """The adapters in device slots (`held`) and those of running requests (`pinned`, a subset) against
    `budget` (None: no limit)."""

    def __init__(self, budget: int | None, dtype: torch.dtype) -> None:
        self.budget, self.matrix_bytes = budget, dtype.itemsize
        self.held, self.pinned = StorageUnion(), StorageUnion()
        self._totals: dict[str, int] = {}  # identity -> its bytes alone (a number per adapter ever asked about)
        # the last adapter asked about that is not held (a weak reference: a copy dropped is not kept alive here)
        self._last: tuple[weakref.ref, Storages] | None = None

    def storages(self, adapter: Adapter) -> Storages:
        """The adapter's storages: a held one's as held, else read from its tensors (a walk of every one of them),
        kept for the next ask (an adapter being placed is asked about at each eviction that makes it room)."""
        held = self.held.members.get(adapter.identity)
        if held is not None:
            return held
        if self._last is None or self._last[0]() is not adapter:  # the object: another copy has other storages
            self._last = (weakref.ref(adapter), adapter_storages(adapter, self.matrix_bytes))
        return self._last[1]

    def total(self, adapter: Adapter) -> int:
        if adapter.identity not in self._totals:
            self._totals[adapter.identity] = self.storages(adapter).total
        return self._totals[adapter.identity]

    def too_large(self, adapter: Adapter) -> str | None:
        """Why `adapter` can never be placed (larger than the whole budget), or None."""
        if self.budget is None or self.total(adapter) <= self.budget:
            return None
        return (f"adapter {adapter.name!r} needs {self.total(adapter) / 2**20:.1f} MiB of device memory, more "
                f"than adapter_memory_bytes ({self.budget / 2**20:.1f} MiB): raise adapter_memory_bytes")

    def fits(self, adapter: Adapter, beside: StorageUnion) -> bool:
        """Whether `adapter` fits in the budget beside the adapters of `beside` (`pinned`: the running requests',
        the others can be evicted; `held`: every adapter in the slots)."""
        if self.budget is None or beside.bytes + self.total(adapter) <= self.budget:
            return True
        return beside.bytes + beside.extra(self.storages(adapter)) <= self.budget

    def capacity(self, adapter: Adapter, slots: int) -> int:
        """How many distinct adapters of `adapter`'s size fit at once, at most `slots`: the budget less the
        storages they would share (VeRA's pair: once for all), over the bytes each holds alone."""
        if self.budget is None:
            return slots
        storages = self.storages(adapter)
        return max(0, min(slots, (self.budget - sum(storages.shared.values())) // max(storages.own, 1)))

    def used(self) -> int:
        """The bytes of the adapters in the slots, shared storages once."""
        return self.held.bytes

    def hold(self, adapter: Adapter) -> None:
        self.held.add(adapter.identity, self.storages(adapter))

    def pin(self, adapter: Adapter) -> None:
        self.pinned.add(adapter.identity, self.storages(adapter))

    def unpin(self, identity: str) -> None:
        self.pinned.remove(identity)

    def drop(self, identity: str) -> None:
        self.held.remove(identity)
