"""`AdapterManager`: loaded adapters in CPU memory, and the `max_adapters` device slots they are served from.

Two tiers. CPU: adapters named with `load` (kept until `unload`) and adapters loaded by path (an LRU cache of
`max_cpu_adapters`, keyed by the folder and its files' size and mtime, so an edited folder is read again).
Device: slot i of every `ScuteLinear` holds one adapter, keyed by its *content identity*; a slot in use by a
running request is pinned, an unused one keeps its adapter (a later request for it costs nothing) until the
least recently used is evicted for a new one.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import replace

import torch
from torch import nn

from scute.adapters import Adapter, AdapterError, load_adapter
from scute.adapters.adapter import SharedMemo
from scute.model.hf import place_adapter
from scute.model.linear import ScuteLinear


class AdapterManager:
    def __init__(
        self, model: nn.Module, linears: dict[str, ScuteLinear], max_adapters: int, max_adapter_rank: int,
        max_cpu_adapters: int, device: torch.device,
    ) -> None:
        self.model, self.linears, self.device = model, linears, device
        self.max_adapters, self.max_adapter_rank, self.max_cpu_adapters = max_adapters, max_adapter_rank, max_cpu_adapters
        self.named: dict[str, Adapter] = {}
        self._by_path: OrderedDict[tuple, Adapter] = OrderedDict()
        self._slots: list[str | None] = [None] * max_adapters  # identity held by each device slot
        self._refs: dict[str, int] = {}  # identity -> running requests using it
        self._unused: OrderedDict[str, None] = OrderedDict()  # placed, unused identities, LRU first
        self._moved: SharedMemo = {}  # shared matrices on the device, one copy for every adapter that reads them

    # ------------------------------------------------------------------ CPU tier
    def load(self, path: str | os.PathLike, name: str | None = None, **options: object) -> Adapter:
        """Read, validate and convert a PEFT folder (raises AdapterError / OSError); `options` as for
        `scute.adapters.load_adapter` (``dense``, the method's own)."""
        path = os.fspath(path)
        adapter = load_adapter(path, self.model, name, **options)  # on the CPU (W0 copied if a method needs it)
        rank = max((s.rank for s in adapter.layers.values()), default=0)
        if rank > self.max_adapter_rank:
            raise AdapterError(f"adapter {path} ({adapter.peft_type}) has rank {rank}, above max_adapter_rank="
                               f"{self.max_adapter_rank}: raise max_adapter_rank")
        return adapter

    def load_named(self, name: str, path: str | os.PathLike, **options: object) -> Adapter:
        self.named[name] = self.load(path, name, **options)
        return self.named[name]

    def unload(self, name: str) -> None:
        self.named.pop(name)

    def get_by_path(self, path: str | os.PathLike, name: str | None = None) -> Adapter:
        """An adapter by folder, from the CPU cache when its files are unchanged."""
        path = os.path.abspath(os.fspath(path))
        key = (path, _signature(path))
        if key in self._by_path:
            self._by_path.move_to_end(key)
            adapter = self._by_path[key]
            return adapter if name in (None, adapter.name) else replace(adapter, name=name)
        adapter = self.load(path, name)
        if self.max_cpu_adapters > 0:
            self._by_path[key] = adapter
            while len(self._by_path) > self.max_cpu_adapters:
                self._by_path.popitem(last=False)
        return adapter

    # ------------------------------------------------------------------ device slots
    @property
    def num_active(self) -> int:
        return len(self._refs)

    def can_activate(self, adapter: Adapter | None) -> bool:
        """Whether a request with this adapter can run now (the running requests' adapters take slots)."""
        return adapter is None or adapter.identity in self._refs or len(self._refs) < self.max_adapters

    def acquire(self, adapter: Adapter | None) -> int:
        """Pin the adapter in a device slot (placing it there if needed); returns the slot (−1 = base)."""
        if adapter is None:
            return -1
        ident = adapter.identity
        if ident in self._slots:
            self._unused.pop(ident, None)
        else:
            if None in self._slots:
                slot = self._slots.index(None)
            else:
                evicted, _ = self._unused.popitem(last=False)  # can_activate() guarantees one exists
                slot = self._slots.index(evicted)
            place_adapter(self.linears, slot, adapter.to(device=self.device, memo=self._moved))
            self._slots[slot] = ident
        self._refs[ident] = self._refs.get(ident, 0) + 1
        return self._slots.index(ident)

    def release(self, adapter: Adapter | None) -> None:
        if adapter is None:
            return
        ident = adapter.identity
        self._refs[ident] -= 1
        if self._refs[ident] == 0:
            del self._refs[ident]
            self._unused[ident] = None


def _signature(path: str) -> tuple:
    sig = []
    for file in ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"):
        try:
            st = os.stat(os.path.join(path, file))
            sig.append((file, st.st_size, st.st_mtime_ns))
        except OSError:
            pass
    return tuple(sig)
