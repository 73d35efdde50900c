"""`AdapterManager`: loaded adapters in CPU memory, the `max_adapters` device slots they are served from, and
the loads and placements that fill both off the step loop.

Two tiers. CPU: adapters named with `load_named` (kept until `unload`) and adapters loaded by path (an LRU of
`max_cpu_adapters`, keyed by the folder and its files' size and mtime, so an edited folder is read again). Device:
slot i of every `ScuteLinear` holds one adapter, keyed by its *content identity*; a slot in use by a running
request is pinned, an unused one keeps its adapter until the least recently used is evicted for a new one.

Loads. A request's adapter is *ready* when its placement in a device slot has ended. The loader thread
(`AdapterLoader`) reads, validates and converts a folder not in the CPU cache (the request meanwhile holds a
`PendingAdapter`; on a GPU the methods that can convert there, where W0 is, the CPU tier then keeping a pageable
copy, made by a job of its own once the adapter is staged) and copies every adapter to the device, matrices in the
serving dtype: it is *staged*. The scheduler asks
for a load on arrival (`prefetch`) and when it finds a request not ready (`ready`: it waits, others pass it);
loads start in the arrival order of the earliest request waiting for each, at most `MAX_PREFETCH` in progress or
staged at once. `ready` gives a staged adapter a slot and begins its placement, which the engine advances while
the device runs the step in flight (`place`, `Placer`); `acquire` pins a placed adapter for a request. The
engine takes the loader's results between steps (`poll`): a failed load finishes the requests waiting for it,
alone, with the message the synchronous load raises. `load_named` (and `get_by_path`) wait for their load, a job
of the loader's like the others, and raise its error to the caller.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import os
import time
import warnings
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace

import torch
from torch import nn

from scute.adapters import Adapter, AdapterError, AdapterLoad, read_checkpoint, start_load
from scute.adapters.adapter import Interned, SharedMemo
from scute.adapters.checkpoint import files_signature
from scute.adapters.conversion import ModelLayers, folder_name
from scute.engine.adapter_loader import AdapterLoader, Load, PendingAdapter, Staged
from scute.engine.adapter_memory import AdapterMemory
from scute.engine.adapter_placer import Placer
from scute.engine.request import Request, RequestStatus
from scute.model.hf import layer_pools, prepare_adapter
from scute.model.linear import ScuteLinear
from scute.model.warmup import warm_kernels
from scute.ops.pool_rows import Then

MAX_PREFETCH = 4  # adapter loads in progress or staged on the device (waiting for a slot), at most


class AdapterManager:
    def __init__(
        self, model: nn.Module, linears: dict[str, ScuteLinear], max_adapters: int, max_adapter_rank: int,
        max_cpu_adapters: int, device: torch.device, check: Callable[[Adapter], None] | None = None,
        memory_bytes: int | None = None,
    ) -> None:
        """`check`: a further test of every adapter to serve, raising AdapterError (its requests fail alone);
        `memory_bytes`: the device memory the slots' adapters may hold (`AdapterMemory`; None: no limit)."""
        self.model, self.linears, self.device, self.check = model, linears, device, check
        self.model_layers = ModelLayers.of(model)  # what each load reads of the model, walked once
        self.max_adapters, self.max_adapter_rank = max_adapters, max_adapter_rank
        self.max_cpu_adapters = max_cpu_adapters
        self.named: dict[str, Adapter] = {}
        self._by_path: OrderedDict[tuple, Adapter] = OrderedDict()
        self._slot_of: dict[str, int] = {}  # identity -> the device slot holding it
        self._free_slots = list(range(max_adapters))  # heap of the empty slots
        self._refs: dict[str, int] = {}  # identity -> running requests using it
        self._unused: OrderedDict[str, None] = OrderedDict()  # placed, unused identities, LRU first
        self._moved: SharedMemo = {}  # shared matrices on the device, one copy for every adapter (loader thread)
        self._interned: Interned = {}  # shared matrices by content: every adapter loaded here shares them
        self.dtype = next((m.weight.dtype for m in linears.values()), torch.float32)  # the device slots' matrices
        # the token counts the engine steps at (set by it): staging an adapter of a new kind compiles the kernel
        # variants its placement will run, on the loader (`warm_kernels`; `_warmed`: the kinds done)
        self.warm_tokens: tuple[int, ...] = ()
        self._warmed: set = set()
        self._units = list(layer_pools(linears))  # the pools' layers: warm-up, prepared rows, placements
        self.loader = AdapterLoader(device, self.dtype, prepare=self._prepare)
        self.memory = AdapterMemory(memory_bytes, self.dtype)
        self._loads: dict[tuple, Load] = {}  # ("path", folder, signature) or ("move", identity) -> its load
        self._queue: list[tuple[int, int, tuple]] = []  # heap of (arrival of a waiting request, seq, load key)
        self._seq = itertools.count()
        self._started: list[tuple] = []  # keys of the loads given to the loader, not polled yet
        self._staged: dict[str, tuple[Staged, set[Request]]] = {}  # identity -> device copy, requests waiting
        self.placer = Placer(linears, self._units)  # the placements `ready` began, advanced by `place`
        self._placing: set[str] = set()  # identities in a slot whose placement has not ended
        self._failed: list[tuple[Request, str]] = []
        self._host_copies: list[tuple[tuple, Adapter, Future]] = []  # (CPU cache key, device copy, its host copy)
        # bumped whenever a request not ready may have become so (a load or a placement ended, a load failed): a
        # request `ready` refused needs asking again only after that (`Scheduler`)
        self.version = 0
        self.evictions = {"device": 0, "cpu": 0}  # adapters let go of, by tier
        self._asked: dict[str, float] = {}  # identity of a staged or placing adapter -> when its load was asked for
        self._load_seconds: deque[float] = deque(maxlen=4096)  # asked -> placed, since `take_load_seconds`

    def _prepare(self, adapter: Adapter, pause: Callable[[], None], then: Then) -> dict:
        """What the loader does for an adapter it stages, after the copy: the kernel variants its placement needs
        compiled (`warm_kernels`), its rows in the slot pools (`prepare_adapter`; `then` as there). A warm-up out of
        device memory (its calls hold one step's activations beside the step loop's) fails nothing: the kernels
        then compile where the steps first need them."""
        try:
            warm_kernels(self._units, adapter, self.warm_tokens, self._warmed, pause)
        except torch.OutOfMemoryError:
            warnings.warn("scute: no device memory to compile an adapter's kernels on the adapter loader; they "
                          "compile on the first steps that need them (stalling those steps)", stacklevel=1)
        return prepare_adapter(self._units, adapter, pause, then)

    # ------------------------------------------------------------------ CPU tier
    def load(self, path: str | os.PathLike, name: str | None = None, **options: object) -> Adapter:
        """Read, validate and convert a PEFT folder (raises AdapterError / OSError) for the CPU tier; `options` as
        for `scute.adapters.load_adapter` (``dense``, the method's own)."""
        return self._load(path, name, **options)[0]

    def _load(self, path: str | os.PathLike, name: str | None = None, **options) -> tuple[Adapter, Adapter | None]:
        """(the CPU tier's adapter, its device copy or None): `AdapterLoader.host_and_device`, run as a job of the
        loader's and waited for here (its error raised here). The loader's staging buffers, stream and memo of
        shared matrices are its own: a load on the caller's thread (a server's runtime load, on a worker thread)
        beside a background load would copy through the same staging buffers at once."""
        return self.loader.call(functools.partial(self._load_job, path, name, **options))

    def _load_job(self, path: str | os.PathLike, name: str | None, **options) -> tuple[Adapter, Adapter | None]:
        """`_load` on the loader: the folder read, validated and converted (on the GPU for the methods that
        convert where W0 is), then as the CPU tier keeps it and its device copy."""
        converted = self._checked(self._start_load(path, name, **options).finish())
        return self.loader.host_and_device(converted, self._moved)

    def _start_load(self, path: str | os.PathLike, name: str | None = None, **options) -> AdapterLoad:
        """`start_load` of a folder (its values may still be landing), its rank checked."""
        path, turns = os.fspath(path), self.loader.turns
        load = start_load(path, self.model_layers, name, interned=self._interned, pause=turns.pause,
                          dtype=self.loader.matrix_dtype, read_gate=turns.gate, **options)
        rank = max((s.rank for s in load.layers.values()), default=0)
        if rank > self.max_adapter_rank:
            raise AdapterError(f"adapter {path} ({load.checkpoint.peft_type}) has rank {rank}, above "
                               f"max_adapter_rank={self.max_adapter_rank}: raise max_adapter_rank")
        return load

    def _checked(self, adapter: Adapter) -> Adapter:
        if self.check is not None:
            self.check(adapter)
        return adapter

    def load_named(self, name: str, path: str | os.PathLike, **options: object) -> Adapter:
        self.named[name] = self.load(path, name, **options)
        return self.named[name]

    def unload(self, name: str) -> None:
        del self.named[name]

    def get_by_path(self, path: str | os.PathLike, name: str | None = None) -> Adapter:
        """An adapter by folder, from the CPU cache when its files are unchanged, else read here."""
        path = os.path.abspath(os.fspath(path))
        key = (path, files_signature(path))
        return self._cached(key, name) or self._cache(key, self.load(path, name))

    def lookup(self, path: str | os.PathLike, name: str | None = None) -> Adapter | PendingAdapter:
        """An adapter by folder without reading it on this thread: from the CPU cache when its files are
        unchanged, else a `PendingAdapter` that the loader fills. A folder without adapter files raises at once."""
        path = os.path.abspath(os.fspath(path))
        key = (path, files_signature(path))
        if cached := self._cached(key, name):
            return cached
        if not key[1]:  # nothing to read: the read fails at once, with its own message
            read_checkpoint(path)
        load = self._loads.setdefault(("path", *key), Load(path, PendingAdapter(folder_name(path), path, key)))
        return load.pending

    def _cached(self, key: tuple, name: str | None) -> Adapter | None:
        self._poll_host_copies()
        adapter = self._by_path.get(key)
        if adapter is None:
            return None
        self._by_path.move_to_end(key)
        return adapter if name in (None, adapter.name) else replace(adapter, name=name)

    def _cache(self, key: tuple, adapter: Adapter) -> Adapter:
        if self.max_cpu_adapters > 0:
            self._by_path[key] = adapter
            while len(self._by_path) > self.max_cpu_adapters:
                self.loader.drop(self._by_path.popitem(last=False)[1])  # its host memory freed off this thread
                self.evictions["cpu"] += 1
        return adapter

    # ------------------------------------------------------------------ loads (the scheduler and the engine)
    def ready(self, req: Request) -> bool:
        """Whether a waiting request's adapter can be given a slot now: placed, or staged with no slot to be had
        (the scheduler then finds it cannot activate); if not, its load or its placement (`place`) is begun
        and False returned: the request waits for its adapter alone."""
        adapter = req.adapter
        if isinstance(adapter, PendingAdapter):
            if adapter.adapter is None:
                if adapter.error is not None:
                    self._failed.append((req, adapter.error))
                else:
                    self._want(("path", *adapter.key), adapter.path, req)
                return False
            adapter = req.bind_adapter(adapter.adapter)
        if adapter is None or adapter.identity in self._slot_of:
            return adapter is None or adapter.identity not in self._placing
        if error := self.memory.too_large(adapter):
            self._failed.append((req, f"AdapterError: {error}"))
            return False
        if adapter.identity in self._staged:
            self._staged[adapter.identity][1].add(req)
            if not self.can_activate(adapter):
                return True
            self._begin(adapter)
            return False
        self._want(("move", adapter.identity), adapter, req)
        return False

    prefetch = ready  # on arrival: a cold adapter starts loading while the requests ahead of it run

    def _want(self, key: tuple, source: str | Adapter, req: Request) -> None:
        """`req` waits for the load of `key` (queued if new). A request asking again each step costs a lookup:
        loads start as others end (`poll`, `_begin`), not as requests ask."""
        load = self._loads.get(key)
        if load is None:
            load = self._loads[key] = Load(source)
        if req not in load.waiters:
            load.waiters.add(req)
            if load.future is None:
                heapq.heappush(self._queue, (req.arrival, next(self._seq), key))
            self._start()

    def _start(self) -> None:
        """Give queued loads to the loader, earliest waiting request first, while fewer than `MAX_PREFETCH` are
        in progress or staged. Staged copies and queued loads no waiting request wants any more are dropped."""
        for ident, (_, waiters) in list(self._staged.items()):
            if not any(r.status is RequestStatus.WAITING for r in waiters):
                del self._staged[ident]
                self._asked.pop(ident, None)
        while self._queue and len(self._started) + len(self._staged) < MAX_PREFETCH:
            _, _, key = heapq.heappop(self._queue)
            load = self._loads.get(key)
            if load is None or load.future is not None:
                continue
            if not any(r.status is RequestStatus.WAITING for r in load.waiters):
                del self._loads[key]
                continue
            load.future = self.loader.submit(self._job, load.source)
            self._started.append(key)

    def _job(self, source: str | Adapter) -> tuple[Adapter, Staged]:
        """One load, on the loader thread: a folder read and converted (or an adapter on the CPU: checked), moved
        to the device and staged. A folder converted on the GPU gives its device copy: the copy the CPU tier
        keeps is a job of its own that follows (`poll` asks for it), so that the adapter is servable first."""
        if isinstance(source, Adapter):
            adapter = self._checked(source)
            return adapter, self.loader.move(adapter, self._moved)
        load = self._start_load(source)
        if load.arriving:  # its slots are the file's own device copy: their rows are prepared while the read
            # ends and the values land (`AdapterLoad.landing`: each run of the file copied at a pause point as its
            # read ends, the rest queued at the first after the read)
            staged = self.loader.stage(load.adapter(""), lambda: self._checked(load.finish()),
                                       load.landing(self.loader.turns.pause), load.then)
            return staged.adapter, staged
        adapter = self._checked(load.finish())
        moved = self.loader.device_copy(adapter, self._moved)
        return (adapter, self.loader.move(adapter, self._moved)) if moved is None else (moved, self.loader.stage(moved))

    def _host_copy(self, key: tuple, adapter: Adapter) -> None:
        """The CPU cache holds a device copy under `key` (a folder converted on the GPU): ask the loader for the
        copy the CPU tier keeps, which replaces it there once made (`poll`). Until then the cache serves the
        device copy itself (placing it again copies nothing)."""
        if self._by_path.get(key) is adapter:
            self._host_copies.append((key, adapter, self.loader.submit(self.loader.host_copy, adapter, self._moved)))

    def _poll_host_copies(self) -> None:
        for item in [h for h in self._host_copies if h[2].done()]:
            self._host_copies.remove(item)
            key, adapter, future = item
            if self._by_path.get(key) is adapter:  # still cached: the host copy takes its place
                if future.exception() is None:
                    self._by_path[key] = future.result()
                else:  # read again when asked
                    del self._by_path[key]
            else:  # evicted meanwhile: the copy's host memory freed off this thread (its future holds it)
                self.loader.drop(item)

    def poll(self, finish: Callable[[Request], None]) -> list[Request]:
        """Take the loader's finished loads (the engine, between steps): a folder's adapter joins the CPU cache
        and its device copy is staged; each waiting request of a failed load is finished with the error (its
        type and message, as the synchronous load raises it), taken out of the queue by `finish`, and returned."""
        failed, self._failed = self._failed, []
        self._poll_host_copies()
        finished = [k for k in self._started if self._loads[k].future.done()]
        if finished or failed:
            self.version += 1
        for key in finished:
            self._started.remove(key)
            load = self._loads.pop(key)
            try:
                adapter, staged = load.future.result()
            except Exception as e:  # noqa: BLE001 - it fails the requests of this adapter, nothing else
                error = f"{type(e).__name__}: {e}"
                if load.pending is not None:
                    load.pending.error = error
                failed += [(r, error) for r in load.waiters]
                continue
            if load.pending is not None:
                load.pending.adapter = self._cache(load.pending.key, adapter)
                if adapter is staged.adapter and self.device.type != "cpu":  # converted on the GPU: the CPU
                    # cache got the device copy (`_job`); on the CPU the conversion is what the slot serves
                    self._host_copy(load.pending.key, adapter)
            if adapter.identity not in self._slot_of:  # else the copy is not needed: the slot still holds it
                self._staged.setdefault(adapter.identity, (staged, set()))[1].update(load.waiters)
                self._asked.setdefault(adapter.identity, load.asked)
        done = []
        for req, error in failed:
            if req.status is RequestStatus.WAITING:
                req.finish("error", error=error)
                finish(req)
                done.append(req)
        self._start()
        return done

    def wait_for_load(self, timeout: float = 0.05) -> bool:
        """When nothing can run: wait up to `timeout` seconds for a load to finish; whether one was in progress."""
        self._start()
        if not self._started:
            return False
        if not any(self._loads[k].future.done() for k in self._started):
            self.loader.wait_any(timeout)
        return True

    def place(self, more: Callable[[], bool] = lambda: True) -> bool:
        """Advance the placements `ready` began (the engine: after `schedule`): a slot pool's, then more while
        ``more()`` (the device still runs the step in flight: `Placer`); whether there were any. An adapter whose
        placement ends is ready: unused until a request acquires it."""
        if not self.placer.busy:
            return False
        for adapter in self.placer.run(more):
            self._placing.discard(adapter.identity)
            self.release(adapter)
            self.version += 1
            if (asked := self._asked.pop(adapter.identity, None)) is not None:
                self._load_seconds.append(time.perf_counter() - asked)
        return True

    def take_load_seconds(self) -> list[float]:
        """The seconds from a request asking for an adapter not in a device slot to the end of its placement (its
        read and conversion if the CPU tier lacked it, its copy to the device, the placement), of each placement
        ended since the last call (the most recent 4096)."""
        out = list(self._load_seconds)
        self._load_seconds.clear()
        return out

    @property
    def loads_in_progress(self) -> int:
        """Adapters asked for and not yet placed: on the loader, queued for a request still waiting, staged, or
        being placed."""
        queued = sum(load.future is not None or any(r.status is RequestStatus.WAITING for r in load.waiters)
                     for load in self._loads.values())
        return queued + len(self._staged) + len(self._placing)

    @property
    def cpu_adapters(self) -> int:
        """Adapters the CPU tier holds: named, and cached by folder."""
        return len(self.named) + len(self._by_path)

    # ------------------------------------------------------------------ device slots
    def can_activate(self, adapter: Adapter | None) -> bool:
        """Whether a request with this adapter can run now: the running requests' adapters keep their slots and
        their memory, the unused ones can be evicted."""
        return adapter is None or adapter.identity in self._refs or (
            len(self._refs) < self.max_adapters and self.memory.fits(adapter, self.memory.pinned))

    def slot_of(self, adapter: Adapter) -> int | None:
        """The device slot a placed adapter is served from (None: not in a slot, or its placement not ended)."""
        ident = adapter.identity
        return None if ident in self._placing else self._slot_of.get(ident)

    def acquire(self, adapter: Adapter | None) -> int:
        """Pin a placed adapter in its device slot for a request; returns the slot (−1 = base)."""
        if adapter is None:
            return -1
        ident = adapter.identity
        if ident not in self._slot_of or ident in self._placing:
            raise RuntimeError(f"adapter {adapter.name!r} is not in a device slot: acquire only a ready one")
        self._unused.pop(ident, None)
        self._refs[ident] = self._refs.get(ident, 0) + 1
        self.memory.pin(adapter)
        return self._slot_of[ident]

    def _begin(self, adapter: Adapter) -> None:
        """Give a staged adapter a slot, evicting unused adapters for memory, then for the slot (`can_activate`
        guarantees enough can be), and begin its placement; it counts as in use until the placement ends."""
        ident = adapter.identity
        staged, _ = self._staged.pop(ident)
        self._start()  # a load may take the staged copy's place
        emptied, shared = [], self.memory.storages(adapter).shared  # read once, kept for the asks below
        floor = self._group_floor(shared)
        while not self.memory.fits(adapter, self.memory.held):
            emptied.append(self._evict(floor))
        if not self._free_slots:
            self._evict(floor)
        slot = self._free_slot(self._group_floor(shared))  # again: an eviction may have taken the group's lowest
        for s in emptied:
            if s != slot:
                self.placer.add(s, None)
        self.placer.add(slot, staged)
        self._slot_of[ident] = slot
        self._placing.add(ident)
        self.memory.hold(adapter)
        self._refs[ident] = 1
        self.memory.pin(adapter)

    def _evict(self, floor: int = -1) -> int:
        """Empty the slot of the least recently used unused adapter, passing over those that represent a group of
        shared matrices (`_represents`) while another can go, and, while one above can, those at or below `floor`
        (the lowest slot of the group the adapter being placed will join: `_group_floor`); returns the slot."""
        keep = self._represents
        evicted = next((i for i in self._unused if self._slot_of[i] > floor and not keep(i)), None)
        if evicted is None:
            evicted = next((i for i in self._unused if not keep(i)), next(iter(self._unused)))
        del self._unused[evicted]
        slot = self._slot_of.pop(evicted)
        heapq.heappush(self._free_slots, slot)
        self.memory.drop(evicted)
        self.evictions["device"] += 1
        return slot

    def _group_floor(self, shared: dict[tuple, int]) -> int:
        """The lowest slot of the adapters in the slots that hold the shared matrices `shared` (an adapter's
        `Storages.shared`: VeRA's pair), the slot that represents their group in every pool; −1 if none does, or
        `shared` is empty."""
        if not shared:
            return -1
        key = next(iter(shared))
        return min((self._slot_of[i] for i, st in self.memory.held.members.items() if key in st.shared), default=-1)

    def _free_slot(self, lowest: int = -1) -> int:
        """Take the lowest empty slot above `lowest` (the `_group_floor` of an adapter of shared matrices that
        adapters in the slots hold: below, its slot would represent their group, which regroups every member as
        `_represents` says) where there is one, else the lowest."""
        if lowest < 0:
            return heapq.heappop(self._free_slots)
        above = [s for s in self._free_slots if s > lowest]
        if not above:
            return heapq.heappop(self._free_slots)
        slot = min(above)
        self._free_slots.remove(slot)
        heapq.heapify(self._free_slots)
        return slot

    def _represents(self, identity: str) -> bool:
        """Whether the adapter holds shared storages (VeRA's pair) in the lowest slot of two or more adapters that
        hold them: in every pool its slot represents their group, so emptying it regroups every member, rebuilds
        each pool's table (a pass over all its slots) and changes the pools' signatures (the graphs are captured
        again), where emptying a member's slot costs each pool that slot alone. An adapter alone with its
        matrices has no members to regroup: it goes in its turn."""
        held = self.memory.held
        shared = held.members[identity].shared
        if not shared or held.holders(next(iter(shared))) < 2:
            return False
        return self._group_floor(shared) == self._slot_of[identity]

    def release(self, adapter: Adapter | None) -> None:
        if adapter is None:
            return
        ident = adapter.identity
        self._refs[ident] -= 1
        if self._refs[ident] == 0:
            del self._refs[ident]
            self._unused[ident] = None
            self.memory.unpin(ident)
