"""`AdapterLoader`: adapters read, converted and copied to the device on a thread of their own while steps run.

One daemon thread takes jobs from its own queue, one at a time in the order given, and settles each job's
`concurrent.futures.Future`; the engine thread looks at the futures between steps (`AdapterManager.poll`) and
never waits for one while anything can run. A synchronous load (`Engine.load_adapter`, from any thread) is a job
too, waited for (`call`): the staging buffers, the side stream and the memo of shared device matrices are the
loader thread's alone. On CUDA a job runs with a side stream of the loader's as its current
stream, so its copies (the adapter's tensors to the device, the base W0 a converter reads back) never queue
behind a step; `move` records an event behind the copies and waits for it, and the engine's stream waits for it
too before it reads the tensors (`Staged.use`), which also records them on that stream so that their memory is
not handed out again before the stream is done with them. Copies between the host and the device run through
two pinned buffers of the loader's (`Staging`), never from or to pageable memory. On the CPU a move is plain:
`Adapter.to` returns the tensors themselves.

The loader's Python (validation, conversion) shares the interpreter lock with the step loop. While a job runs,
the interpreter's thread switch interval is `switch_interval` (Python's default, 5 ms, would let a load keep the
lock that long while the step loop waits to launch its next step), then the process's own again once the last
job running in the process ends (`_SWITCH_INTERVAL`). Two threads that both run
Python still take the lock in turns, each at half speed; so while the step loop holds its turn (`Turns`: the host
work of a decode step launched behind the one in flight, whose outputs the requests wait for), the loader stops at
its next pause point (`Turns.pause`: between two layers it converts, moves or prepares), until the step loop
waits for the GPU or ends its turn; a step loop that did not wait `Turns.slice_s` gives it that long into the turn.
The threads that read a file for a load run little Python but take cores and memory bandwidth from the step
loop's host work: they read a part of it at a time, each once the step loop is off its turn (`Turns.gate`).
"""

from __future__ import annotations

import atexit
import math
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor

from scute.adapters import Adapter
from scute.adapters.adapter import Pause, SharedMemo, copy_to, no_pause, paused
from scute.adapters.safetensors_file import LEAF
from scute.engine.cuda_graph import CAPTURE_GUARD
from scute.engine.request import Request
from scute.ops.pool_rows import Then, at_once, copies_of
from scute.ops.sha256 import sha256_leaves


@dataclass(eq=False)
class PendingAdapter:
    """`Request.adapter` while the request's adapter folder is being read; `AdapterManager.ready` swaps in the
    loaded one."""

    name: str
    path: str
    key: tuple  # (folder, its files' signature): the CPU cache's key
    adapter: Adapter | None = None  # once loaded
    error: str | None = None  # once failed
    invocation_tokens = None  # unknown before the read: `ready` sets the request's aLoRA gate when it binds


@dataclass(eq=False)
class Load:
    """A load waiting requests asked for (`AdapterManager`): its source, and its future once given to the loader."""

    source: str | Adapter  # a folder to read, or an adapter on the CPU to copy to the device
    pending: PendingAdapter | None = None
    waiters: set[Request] = field(default_factory=set)
    future: Future | None = None  # None: queued
    asked: float = field(default_factory=time.perf_counter)  # when a request first asked for it


@dataclass(eq=False)
class Staged:
    """An adapter copied to the device by the loader, waiting for a slot."""

    adapter: Adapter
    event: torch.cuda.Event | None  # behind the copies (CUDA), None on the CPU
    prepared: dict = field(default_factory=dict)  # its rows in the slot pools, computed here (`prepare_adapter`)
    buffers: list[Tensor] = field(default_factory=list)  # a tensor of each of its buffers (`buffers_of`) and of
    # each copy its rows point to (`copies_of`)

    def use(self) -> Adapter:
        """The adapter, safe to read on the current stream (call on the thread that runs the steps)."""
        if self.event is not None:
            stream = torch.cuda.current_stream(self.buffers[0].device if self.buffers else None)
            stream.wait_event(self.event)
            for x in self.buffers:
                x.record_stream(stream)
        return self.adapter


def buffers_of(adapter: Adapter, pause: Pause = no_pause) -> list[Tensor]:
    """One tensor of each buffer the adapter's tensors are views of (a packed adapter: one, and its shared
    matrices'): found on the loader thread, so that `Staged.use` on the step loop walks a few, not hundreds;
    `pause` every 32 layers."""
    tensors = (x for s in paused(adapter.layers.values(), pause, 32) for x in s.tensors().values())
    return list({x.untyped_storage().data_ptr(): x for x in tensors}.values())


class Staging:
    """Two pinned host buffers of `nbytes` through which the loader's copies between the host and a CUDA device run,
    chunk by chunk (`copy`). A copy from or to pageable memory is run by the CUDA driver under a lock that stalls
    every other thread's CUDA calls (the step loop's launches) until it ends; through pinned memory each chunk is a
    DMA that the other threads' calls run beside, and its host side a memcpy that releases the interpreter lock.
    Allocated once, with the loader: allocating pinned memory takes that lock too. One thread at a time (the
    loader's)."""

    def __init__(self, nbytes: int = 16 << 20) -> None:
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.events = [torch.cuda.Event(), torch.cuda.Event()]  # each buffer's last DMA, on the current stream

    def copy(self, buffer: Tensor, device: torch.device) -> Tensor:
        """`buffer` (contiguous) copied to `device`, across host and device; a copy to the CPU has landed on
        return, one to the device is ordered on the current stream."""
        out = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
        src, dst, size = buffer.view(torch.uint8), out.view(torch.uint8), self.buffers[0].numel()
        spans = [(a, min(a + size, src.numel())) for a in range(0, src.numel(), size)]
        (self._to_host if device.type == "cpu" else self._to_device)(src, dst, spans)
        return out

    def _to_host(self, src: Tensor, dst: Tensor, spans: list[tuple[int, int]]) -> None:
        if spans:
            self._dma(src, 0, *spans[0])
        for k, (a, b) in enumerate(spans):
            if k + 1 < len(spans):  # the next chunk's DMA runs while this one is copied out
                self._dma(src, (k + 1) % 2, *spans[k + 1])
            self.events[k % 2].synchronize()
            dst[a:b].copy_(self.buffers[k % 2][: b - a])

    def _dma(self, src: Tensor, i: int, a: int, b: int) -> None:
        self.buffers[i][: b - a].copy_(src[a:b], non_blocking=True)
        self.events[i].record()

    def _to_device(self, src: Tensor, dst: Tensor, spans: list[tuple[int, int]]) -> None:
        for k, (a, b) in enumerate(spans):  # this chunk's memcpy runs while the one before is in its DMA
            self.events[k % 2].synchronize()
            self.buffers[k % 2][: b - a].copy_(src[a:b])
            dst[a:b].copy_(self.buffers[k % 2][: b - a], non_blocking=True)
            self.events[k % 2].record()


class Turns:
    """The step loop's turn at the interpreter lock. Inside `step_loop` another thread's `pause` waits (at most
    `max_pause` seconds) until the step loop waits (`waiting`) or leaves its turn. If the step loop's last wait
    lasted less than `slice_s`, that thread first runs on through its pause points until `slice_s` past the last
    one it went on from: a step loop that never waits for the GPU (a small model's, host-bound) gives a load that
    much of every step, where a wait at every pause point would make a load of a few hundred pause points last as
    many steps. One that waits for the GPU gives the loader its wait, and shares the host work that bounds the
    step once the GPU is done with the loader only up to the loader's next pause point. Outside a turn, and on
    the step loop's own thread, `pause` returns at once. `gate` holds other threads (the readers of a file) while
    the step loop holds its turn, without a slice."""

    max_pause: float = 0.05  # seconds; 0: the loader never pauses
    slice_s: float = 5e-4  # seconds the loader runs into a turn after a shorter wait, at most one pause point more

    def __init__(self) -> None:
        self.idle: Callable[[], object] = lambda: None  # run at a pause point while the step loop waits (below)
        self._free = threading.Event()  # set: the loader may run
        self._free.set()
        self._holder: int | None = None  # the thread in `step_loop`
        self._went_on = -math.inf  # when the pausing thread last went on (perf_counter)
        self._waited = 0.0  # seconds the step loop's last wait lasted

    @contextmanager
    def step_loop(self) -> Iterator[None]:
        self._holder = threading.get_ident()
        self._free.clear()
        try:
            yield
        finally:
            self._free.set()

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """The step loop waits (for the GPU, for a load): the loader runs meanwhile."""
        held, start = not self._free.is_set(), time.perf_counter()
        self._free.set()
        try:
            yield
        finally:
            if held:
                self._free.clear()
                self._waited = time.perf_counter() - start

    def gate(self) -> None:
        """Where another thread's work that runs little Python but takes cores and memory bandwidth from the step
        loop's host work (the reader threads' reads of a file, `scute.adapters.safetensors_file.read_safetensors`)
        goes on: at once outside the step loop's turn, else once the step loop waits (for the GPU) or leaves its
        turn, or after `max_pause`. Any thread but the step loop's."""
        if not self._free.is_set():
            self._free.wait(self.max_pause)

    def pause(self) -> None:
        """A pause point of the loader's work: waits while the step loop holds its turn, once its slice is spent;
        runs `idle` where the step loop does not hold it (the engine's garbage collections due: those of the
        loader's allocations, made small and often while the GPU runs, never at once inside a step's host work)."""
        CAPTURE_GUARD.pause()
        if threading.get_ident() == self._holder:
            return
        held = not self._free.is_set()
        if held and self._waited < self.slice_s and time.perf_counter() - self._went_on < self.slice_s:
            return  # within its slice: the step loop's wait gave it less, and it went on less than `slice_s` ago
        if held:
            with CAPTURE_GUARD.released():  # a capture of the step loop's may run while this waits
                self._free.wait(self.max_pause)
        if self._free.is_set():
            self.idle()
        self._went_on = time.perf_counter()


class AdapterLoader:
    switch_interval: float | None = 2e-4  # seconds, while a job runs (module docstring); None: left as it is

    def __init__(self, device: torch.device, dtype: torch.dtype | None = None,
                 prepare: Callable[[Adapter, Pause, Then], dict] | None = None) -> None:
        """`dtype`: the device slots' matrices (vectors stay float32); `prepare`: an adapter's rows in the slot
        pools, computed as it is staged so that its placement on the step loop only applies them (called with
        the adapter, `Turns.pause` and what runs work on its values once they are in place: `stage`)."""
        self.device, self.dtype, self.prepare = device, dtype, prepare
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._pending = 0  # jobs given and not finished
        self._finished = 0  # jobs finished so far
        self._num_threads = torch.get_num_threads()  # the engine thread's: converters compute as they would there
        self.turns = Turns()
        # made here, before steps run (its pinned allocation would stall them), where a CUDA device is
        cuda = device.type == "cuda" and torch.cuda.is_available()
        self._staging = Staging() if cuda else None
        self._stream = torch.cuda.Stream(device) if cuda else None  # the side stream the jobs run on
        if cuda:  # the hash kernel of a file's leaves compiled now: compiling in a load would stall the steps
            sha256_leaves(torch.zeros(LEAF, dtype=torch.uint8, device=device), LEAF)

    def reserve(self, nbytes: int) -> None:
        """Take `nbytes` of device memory for what the loader allocates (the adapters' device copies) from the
        device now, before steps run: allocated on the loader's stream and freed at once, the caching allocator
        keeps it as one free segment of that stream's, which the loads' allocations are then cut from. Allocated
        while steps run, each copy's memory would be a cudaMalloc of its own, which holds a lock of the CUDA driver
        that the step loop's launches wait for (the engine reserves its adapter budget, once the KV cache and
        the graphs have theirs: the caching allocator's cache is emptied there). On the CPU, or where the device
        cannot give it in one piece: nothing (the loads then allocate as they go)."""
        if self._stream is not None and nbytes > 0:
            with torch.cuda.stream(self._stream):
                try:
                    torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                except torch.OutOfMemoryError:
                    pass

    def submit(self, fn: Callable, *args) -> Future:
        """Run ``fn(*args)`` on the loader thread after the jobs given before, from a pause point (`Turns.pause`);
        its future holds the result or the exception."""
        future: Future = Future()
        with self._cond:
            self._pending += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="scute-adapter-loader", daemon=True)
            self._thread.start()
            atexit.register(_finish_at_exit, weakref.ref(self))
        self._jobs.put((future, fn, args))
        return future

    def call(self, fn: Callable, *args) -> object:
        """``fn(*args)`` on the loader thread, after the jobs given before, waited for: its result, or its error
        raised here. Called inside a job (on the loader thread itself), it runs there at once."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        return self.submit(fn, *args).result()

    def drop(self, *objects: object) -> None:
        """Let go of `objects` on the loader thread, at a pause point (while the step loop waits for the GPU): an
        adapter of the CPU tier whose last reference this was frees its host memory there. That is an munmap of
        its buffer (milliseconds for the 84 MB of a LoRA of the 8B shape: `bench/bench_turns.py`), which on the step
        loop (a CPU tier's eviction, `AdapterManager.poll`) would stall the step for as long. The caller keeps no
        reference of its own."""
        self.submit(list.clear, list(objects))

    def transfer(self, buffer: Tensor, device: torch.device) -> Tensor:
        """`buffer` copied to `device`, through the `Staging` buffers where it crosses between host and device."""
        return copy_to(buffer, device) if buffer.device.type == device.type else self._staging.copy(buffer, device)

    @property
    def matrix_dtype(self) -> torch.dtype | None:
        """The dtype the device copies hold matrices in (`to_device`): the serving dtype on a GPU, None (as
        converted) on the CPU."""
        return self.dtype if self.device.type == "cuda" else None

    def to_device(self, adapter: Adapter, memo: SharedMemo) -> Adapter:
        """`adapter` as the device slots hold it: on the device, matrices in the serving dtype, vectors in float32,
        copied as one buffer (`Adapter.to`; `memo` as there). On the CPU the tensors themselves."""
        if self.device.type != "cuda":
            return adapter.to(device=self.device, memo=memo, pause=self.turns.pause)
        return adapter.to(self.dtype, self.device, memo, vector_dtype=torch.float32, transfer=self.transfer,
                          pause=self.turns.pause)

    def host_and_device(self, adapter: Adapter, memo: SharedMemo) -> tuple[Adapter, Adapter | None]:
        """A converted adapter as the CPU tier keeps it, and its device copy if the conversion made one
        (`device_copy`, then `host_copy`); one converted on the CPU is kept as it is (None: `move` copies it)."""
        on_device = self.device_copy(adapter, memo)
        return (adapter, None) if on_device is None else (self.host_copy(on_device, memo), on_device)

    def device_copy(self, adapter: Adapter, memo: SharedMemo) -> Adapter | None:
        """The device copy of an adapter converted on the GPU (where W0 is), cast there to the serving dtype; None
        for one converted on the CPU."""
        if not any(x.is_cuda for s in adapter.layers.values() for x in s.tensors().values()):
            return None
        return self.to_device(adapter, memo)

    def host_copy(self, adapter: Adapter, memo: SharedMemo) -> Adapter:
        """The CPU tier's copy of a device copy, in pageable memory (through the `Staging` buffers, landed on
        return). Nothing the CPU tier keeps is pinned: allocating pinned memory holds a lock of the CUDA driver
        that stalls the step loop's CUDA calls for as long as the pages take to pin, and memory kept would be
        allocated anew for every load."""
        return adapter.to(device="cpu", memo=memo, transfer=self.transfer, pause=self.turns.pause)

    def move(self, adapter: Adapter, memo: SharedMemo) -> Staged:
        """`adapter` copied to the device (a job's last part, on the loader thread); `memo` as for `Adapter.to`."""
        return self.stage(self.to_device(adapter, memo))

    def stage(self, moved: Adapter, finish: Callable[[], Adapter] | None = None,
              pause: Pause | None = None, then: Then = at_once) -> Staged:
        """An adapter on the device, once the work queued for it on this thread's stream is done, with its rows
        in the slot pools (`prepare`, with the copies they need made: a B padded to a rank multiple of 8). `finish`:
        the rows are prepared from `moved` before its values are there (`scute.adapters.AdapterLoad.arriving`),
        and the adapter staged is what `finish` then returns (the same slots, its values in place); `then` runs
        work that reads the values once they are (`AdapterLoad.then`; default: at once). `pause`: the
        preparation's pause points, and one before it (default `Turns.pause`)."""
        pause = pause or self.turns.pause
        pause()  # between the conversion's last pause point and the rows' first (the warm-up's key comes first)
        prepared = {} if self.prepare is None else self.prepare(moved, pause, then)
        cuda = self.device.type == "cuda"
        buffers = buffers_of(moved, pause) if cuda else []  # before `finish`: its slots are these, and the walk
        # runs while the values land, not after
        if finish is not None:
            moved = finish()
        if not cuda:
            return Staged(moved, None, prepared)
        event = torch.cuda.Event()
        event.record()  # on the loader's side stream, the current one of this thread
        event.synchronize()
        return Staged(moved, event, prepared, buffers + copies_of(prepared))

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every job given so far has finished (tests; shutdown); False on timeout."""
        with self._cond, self.turns.waiting():
            return self._cond.wait_for(lambda: self._pending == 0, timeout)

    def wait_any(self, timeout: float) -> None:
        """Wait until one more job finishes, the loader is idle, or `timeout` seconds pass."""
        with self._cond, self.turns.waiting():
            finished = self._finished
            self._cond.wait_for(lambda: self._finished != finished or self._pending == 0, timeout)

    def _run(self) -> None:
        torch.set_num_threads(self._num_threads)
        stream = self._stream
        while True:
            future, fn, args = self._jobs.get()
            try:
                with torch.cuda.stream(stream) if stream is not None else nullcontext(), CAPTURE_GUARD.job(), \
                        _SWITCH_INTERVAL.during(self.switch_interval):
                    self.turns.pause()  # a job begins at a pause point: its read's threads start in the step
                    result = fn(*args)  # loop's wait, not in its turn
            except BaseException as e:  # noqa: BLE001 - the job's error, raised where its future is read
                future.set_exception(e)
            else:
                future.set_result(result)
            with self._cond:
                self._pending -= 1
                self._finished += 1
                self._cond.notify_all()


class _SwitchInterval:
    """The interpreter's thread switch interval while any loader's job runs (`AdapterLoader.switch_interval`), for
    the process: the first job in saves the interval it finds, the last one out restores it (two engines' jobs
    overlap)."""

    def __init__(self) -> None:
        self._lock, self._jobs, self._saved = threading.Lock(), 0, 0.0

    @contextmanager
    def during(self, seconds: float | None) -> Iterator[None]:
        if seconds is None:
            yield
            return
        with self._lock:
            if self._jobs == 0:
                self._saved = sys.getswitchinterval()
            self._jobs += 1
            sys.setswitchinterval(seconds)
        try:
            yield
        finally:
            with self._lock:
                self._jobs -= 1
                if self._jobs == 0:
                    sys.setswitchinterval(self._saved)


_SWITCH_INTERVAL = _SwitchInterval()


def _finish_at_exit(ref: weakref.ref) -> None:
    """At exit, a loader still alive finishes the jobs given to it (at most 60 s): its daemon thread stopped inside
    a call into torch as the interpreter ends (a load, a CPU tier's copy) aborts the process ("terminate called
    without an active exception")."""
    loader = ref()
    if loader is not None:
        loader.wait_idle(60)
