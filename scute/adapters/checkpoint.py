"""Read a PEFT checkpoint folder, and PEFT's rules for which modules an adapter config targets.

A PEFT folder holds ``adapter_config.json`` and ``adapter_model.safetensors``. This is the boundary: a missing,
unreadable or corrupt file, a config without a method, a pickle the caller did not allow, each raises
`AdapterError` naming the folder and the fix. `scute.adapters.conversion` validates the tensors against the base
model and converts them; inside Scute the slots are trusted.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import cache, cached_property, lru_cache

import torch
from torch import Tensor

from scute.ops.sha256 import sha256_leaves, sha256_leaves_ref

LAYER_PREFIX = "base_model.model."
GLOBAL_PREFIX = "base_model."
SAFETENSORS = "adapter_model.safetensors"
PICKLE = "adapter_model.bin"
CONFIG = "adapter_config.json"


class AdapterError(ValueError):
    """A PEFT adapter that cannot be served; the message names the adapter, the module and the problem."""


class Digest:
    """The sha256 of a PEFT folder's files: of the config's bytes, then of the sha256 of each leaf of the weights
    file in order (a hash tree). Its leaves are `LEAF` bytes for a file read into pinned memory (for a GPU: those
    inside its span are hashed there, `SpanLeaves`), `CHUNK` bytes for one read for the CPU (hashlib's call per
    leaf, each taking the interpreter lock back, makes 8 KB leaves ~15x slower on 14 host threads:
    `bench/bench_leaf_hash.py`); an engine reads every adapter one way, so its identities compare. The leaves are
    hashed side by side while the caller goes on, on the reader threads (`_readers`; hashlib releases the
    interpreter lock) or the GPU; `hexdigest` waits for them."""

    def __init__(self, config: bytes) -> None:
        self._sha = hashlib.sha256(config)
        self._parts: list = []  # leaf digests, concatenated: bytes, or what gives them (`result()`)
        self.span: SpanLeaves | None = None

    def add(self, *parts) -> None:
        self._parts += parts

    def hash_span(self, span: Tensor) -> None:
        """The span's leaves hashed from `span`, the file's bytes from the span's first (`SpanLeaves.hash`)."""
        if self.span is not None:
            self.span.hash(span)

    def hexdigest(self) -> str:
        for part in self._parts:
            self._sha.update(part if isinstance(part, bytes) else part.result())
        self._parts = []
        return self._sha.hexdigest()


class SpanLeaves:
    """The leaves of a weights file that lie whole inside its span (`Layout.span`: its floating tensors, nearly
    all of its bytes), hashed side by side where the caller puts the span (`hash`). A file read into pinned memory
    (for a GPU) has them hashed on a GPU by one kernel (`scute.ops.sha256`): the caller's copy there queued ahead of
    it, or (a conversion on the CPU) a copy of its own from the pinned buffer; the host's sha256 of a large file
    would end well after its read, and take the cores and the interpreter lock from the step loop meanwhile. A
    file read for the CPU has them hashed on the reader threads. If no caller did by `result`, from the file's
    buffer then."""

    def __init__(self, buffer: Tensor, lo: int, first: int, count: int, leaf: int) -> None:
        self.buffer, self.lo, self.first, self.count = buffer, lo, first, count  # leaves first.. (in the file)
        self.leaf = leaf  # bytes per leaf
        self._hashed: Tensor | list[Future] | None = None
        self._stream = None  # the CUDA stream the kernel was queued on

    def hash(self, span: Tensor) -> None:
        """Hash the leaves from `span` (uint8, the file's bytes from the span's first, on any device), once."""
        if self._hashed is not None:
            return
        leaf, start = self.leaf, self.first * self.leaf - self.lo
        leaves = span[start:start + self.count * leaf]
        if not leaves.is_cuda and self.buffer.is_pinned():  # from the pinned buffer to the current GPU
            file_leaves = self.buffer[self.first * leaf:(self.first + self.count) * leaf]
            leaves = file_leaves.to(torch.cuda.current_device(), non_blocking=True)
        if leaves.is_cuda:
            self._stream = torch.cuda.current_stream(leaves.device)
            self._hashed = sha256_leaves(leaves, leaf)
            return
        n = min(READERS, self.count)
        self._hashed = [_readers().submit(sha256_leaves_ref, leaves[k * self.count // n * leaf:
                                                                    (k + 1) * self.count // n * leaf], leaf)
                        for k in range(n)]

    def result(self) -> bytes:
        """The leaves' digests, concatenated (waits for them; hashes them from the buffer, read, if not begun)."""
        if self._hashed is None:
            self.hash(self.buffer[self.lo:])
        if isinstance(self._hashed, Tensor):
            with torch.cuda.stream(self._stream):
                return _read_back(self._hashed).numpy().tobytes()
        return b"".join(part.result() for part in self._hashed)


@dataclass
class Landing:
    """A file's floating tensors on a device before their values are (`AdapterCheckpoint.arriving`): ``dtype``,
    theirs, and what writes into them once the values are there (`then`; `AdapterCheckpoint.land` runs it)."""

    dtype: torch.dtype
    raw: Tensor  # the span's bytes on the device, filled by `land`
    after: list[Callable[[], None]] = field(default_factory=list)

    def then(self, fn: Callable[[], None]) -> None:
        """Run `fn` (work on the tensors' values: an in-place fold) once the values are there, in the order given."""
        self.after.append(fn)


@dataclass
class AdapterCheckpoint:
    """The raw contents of a PEFT folder: its config and its tensors (keys as PEFT saved them)."""

    path: str
    config: dict
    digest: Digest  # of the config and weight files: `identity`
    data: Tensor | None = None  # the weights file's buffer (uint8), of a safetensors file: `buffer` once read
    layout: Layout | None = None  # its header
    reading: list[Future] = field(default_factory=list)  # the reads into `data` still running
    loaded: dict[str, Tensor] | None = None  # the tensors of a pickled file
    landing: Landing | None = None  # tensors made on a device before their values (`arriving`)
    finite: Tensor | None = None  # whether the values `land` put in place are finite, not yet read (`verify`)

    @property
    def buffer(self) -> Tensor | None:
        """The weights file as read (uint8), of a safetensors file: waits for its read (`read_checkpoint` returns
        once the header is read; the rest is read while the caller goes on), raising `AdapterError` if it failed."""
        if self.reading:
            wait(self.reading)
            try:
                for read in self.reading:
                    read.result()
            except (OSError, ValueError) as e:
                raise _corrupt(self.path, os.path.join(self.path, SAFETENSORS), e) from e
            self.reading = []
        return self.data

    @property
    def is_read(self) -> bool:
        """Whether the weights file's read has ended (`buffer` then returns without waiting)."""
        return all(f.done() for f in self.reading)

    @cached_property
    def tensors(self) -> dict[str, Tensor]:
        """The tensors as read, on the CPU: views of `buffer` (made on first use: a load that converts on the GPU
        never makes them)."""
        return self.loaded if self.layout is None else self.layout.views(self.buffer)

    def tensor(self, key: str) -> Tensor:
        """The tensor `key` as read, on the CPU, without making every tensor's view (`tensors`)."""
        if self.layout is None or "tensors" in self.__dict__:
            return self.tensors[key]
        return self.layout.view(self.buffer, key)

    @cached_property
    def identity(self) -> str:
        """sha256 of the config and weight files: changes whenever the adapter does (waits for the hashing)."""
        self.buffer  # noqa: B018 - the read first: its error, where it failed
        return self.digest.hexdigest()

    @property
    def peft_type(self) -> str:
        return str(self.config.get("peft_type", "")).upper()

    def error(self, problem: str, module: str | None = None) -> AdapterError:
        where = f" module {module}" if module else ""
        return AdapterError(f"adapter {self.path} ({self.peft_type or '?'}){where}: {problem}")

    def tensors_on(self, device: torch.device, dtype: torch.dtype | None = None,
                   pause: Callable[[], None] = lambda: None) -> dict[str, Tensor]:
        """The tensors on `device`, floating ones in `dtype` (None: as read), after checking that every floating
        one is finite as read (raises `AdapterError` naming the first that is not). A file whose floating tensors
        tile one span of it (`Layout.span`: the usual PEFT file) has that span copied there (one transfer,
        non-blocking from pinned memory, on the current stream; on a GPU into a buffer of its own, which the
        tensors as read are then views of: the caller may write into them), checked and cast as that span, and
        each tensor is then one view of the cast span (`pause` is called every `Layout.PAUSE_EVERY` views); any
        other's are moved, checked (`first_nonfinite`) and cast (`cast_together`) as they are. On the CPU, a
        pinned buffer is first copied to pageable memory: what a converter returns from the tensors may be kept
        for long (the CPU tier), and pinned memory kept is pinned memory allocated again for the next file, whose
        allocation holds a lock of the CUDA driver that stalls every other thread's CUDA calls (the step loop's
        launches) while it runs; a pinned buffer released is reused for the next file instead."""
        span = None if self.layout is None else self.layout.span
        if span is None:
            tensors = self._moved(device)
            if (bad := first_nonfinite(tensors)) is not None:
                raise self.error(f"tensor {bad!r} has NaN or Inf values")
            return tensors if dtype is None else cast_together(tensors, dtype)
        read_dtype, lo, hi = span
        raw = self._buffer_on(device, lo, hi)  # the span alone (on a GPU a copy of its own)
        self.digest.hash_span(raw)  # queued before any write into it
        raw = raw.view(read_dtype)
        cast = raw if dtype is None or dtype == read_dtype else raw.to(dtype)
        if not _finite([raw])[0]:  # one host sync, with the cast already queued
            raise self.error(f"tensor {first_nonfinite(self.tensors)!r} has NaN or Inf values")
        rest = self.buffer if self.layout.floating_only else self._buffer_on(device)  # for the other tensors
        return self.layout.views(rest, cast, pause)

    def arriving(self, device: torch.device, pause: Callable[[], None] = lambda: None) -> dict[str, Tensor]:
        """The tensors on `device` as read, before their values are there: views of a buffer of their own there (as
        `tensors_on` makes them), which `land` fills (and `verify` then checks); meanwhile the caller works on what
        does not read the values (their shapes, dtypes and addresses: a conversion's structure; after `land`, on
        the slot pools' rows while the GPU copies). Writes into them go through `landing.then`. For a file whose
        tensors are all floating and tile one span (`Layout.span`, `Layout.floating_only`: the usual PEFT file)."""
        if self.layout is None or self.layout.span is None or not self.layout.floating_only:
            raise ValueError("arriving: a safetensors file whose tensors are all floating and tile one span")
        read_dtype, lo, hi = self.layout.span
        raw = torch.empty(hi - lo, dtype=torch.uint8, device=device)
        self.landing = Landing(read_dtype, raw)
        return self.layout.views(self.data, raw.view(read_dtype), pause)  # floating: none is a view of `data`

    def land(self) -> None:
        """The values of the tensors `arriving` made put in place: the file's span copied there (non-blocking from
        pinned memory, on the current stream), its check for NaN and Inf queued behind the copy (`verify` reads
        it), then the work given to `Landing.then` run (queued too, on a GPU). Without an `arriving`: nothing."""
        landing, self.landing = self.landing, None
        if landing is None:
            return
        _, lo, hi = self.layout.span
        landing.raw.copy_(self.buffer[lo:hi], non_blocking=True)
        self.digest.hash_span(landing.raw)
        raw = landing.raw.view(landing.dtype)
        self.finite = _finite_flags([raw]) if raw.is_cuda else torch.tensor(_finite([raw]))
        for fn in landing.after:
            fn()

    def verify(self) -> None:
        """After `land`: raises `AdapterError` naming the first tensor of the file that is not finite (one host
        sync, once the copy and its check are done)."""
        finite, self.finite = self.finite, None
        if finite is not None and not bool((_read_back(finite) if finite.is_cuda else finite).all()):
            raise self.error(f"tensor {first_nonfinite(self.tensors)!r} has NaN or Inf values")

    def _buffer_on(self, device: torch.device, lo: int = 0, hi: int | None = None) -> Tensor:
        """Bytes `lo:hi` of the weights file's buffer on `device`: a pageable copy for the CPU where the buffer is
        pinned, else a view of it; on a GPU a copy in a buffer of its own (which starts aligned)."""
        part = self.buffer[lo:hi]
        if device.type == "cpu":
            return part if not part.is_pinned() else torch.empty_like(part).copy_(part)
        return part.to(device, non_blocking=True)

    def _moved(self, device: torch.device) -> dict[str, Tensor]:
        """The tensors on `device` as read: views of one copy of the buffer (`_buffer_on`); a pickled file's
        tensors each copied alone."""
        if self.layout is None:
            return self.tensors if device.type == "cpu" else {k: x.to(device) for k, x in self.tensors.items()}
        return self.layout.views(self._buffer_on(device))


def files_signature(path: str | os.PathLike) -> tuple:
    """(file, size, mtime) of each checkpoint file of a PEFT folder that exists: a cache key that changes
    whenever one of them is written."""
    sig = []
    for file in (CONFIG, SAFETENSORS, PICKLE):
        try:
            st = os.stat(os.path.join(path, file))
        except OSError:
            continue
        sig.append((file, st.st_size, st.st_mtime_ns))
    return tuple(sig)


def read_checkpoint(path: str | os.PathLike, allow_pickle: bool = False, pin_memory: bool = False,
                    ) -> AdapterCheckpoint:
    """Read a PEFT adapter folder. Pickled ``adapter_model.bin`` files are refused unless `allow_pickle`
    (then loaded with ``torch.load(weights_only=True)``). `pin_memory`: read the weights into pinned memory
    (for a CUDA target: `AdapterCheckpoint.tensors_on` then copies them without staging; keep neither the
    checkpoint nor views of its buffer, so that the memory is reused for the next file). Returns once a
    safetensors file's header is read: the rest is read on the reader threads while the caller works on the
    layout (`AdapterCheckpoint.arriving`); `AdapterCheckpoint.buffer` waits for it, and raises its error."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise AdapterError(f"adapter {path}: no such folder (expected a PEFT folder with {CONFIG})")
    cfg_file = os.path.join(path, CONFIG)
    if not os.path.isfile(cfg_file):
        raise AdapterError(f"adapter {path}: missing {CONFIG} (not a PEFT adapter folder?)")
    try:
        with open(cfg_file, "rb") as f:
            cfg_bytes = f.read()
        config = json.loads(cfg_bytes)
    except (OSError, ValueError) as e:
        raise AdapterError(f"adapter {path}: cannot read {cfg_file}: {e}") from e
    if not isinstance(config, dict) or "peft_type" not in config:
        raise AdapterError(f"adapter {path}: {cfg_file} has no 'peft_type'")
    digest = Digest(cfg_bytes)
    st_file, bin_file = os.path.join(path, SAFETENSORS), os.path.join(path, PICKLE)
    if os.path.isfile(st_file):
        data, layout, reading = _load_safetensors(path, st_file, digest, pin_memory)
        return AdapterCheckpoint(path, config, digest, data, layout, reading=reading)
    elif os.path.isfile(bin_file):
        if not allow_pickle:
            raise AdapterError(
                f"adapter {path}: only a pickled {PICKLE} was found; pickles can run code when loaded. "
                f"Convert it to {SAFETENSORS}, or pass allow_pickle=True if you trust its source"
            )
        with open(bin_file, "rb") as f:
            digest.add(hashlib.sha256(f.read()).digest())
        try:
            tensors = torch.load(bin_file, map_location="cpu", weights_only=True)
        except Exception as e:
            raise AdapterError(f"adapter {path}: cannot read {bin_file}: {e}") from e
        return AdapterCheckpoint(path, config, digest, loaded=tensors)
    raise AdapterError(f"adapter {path}: missing {SAFETENSORS}")


# Bytes per leaf of the hash tree (`Digest`) of a file read for a GPU: small enough that a large file's leaves keep
# the GPU busy (a leaf is hashed serially), and few: 10,240 for a LoRA of the 8B shape.
LEAF = 8 << 10
# Bytes per chunk of a read (a multiple of `LEAF`), and per leaf of the hash tree of a file read for the CPU: files
# of a few chunks and more are read by several threads (`_readers`), each over its share of the chunks, then
# hashing their leaves outside the span while the conversion goes on (`bench/bench_adapter_load.py`:
# ``read_checkpoint_s``, the read and hash of a file).
CHUNK = 4 << 20
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
# Threads that read a file: all cores but two (left to the step loop and the loader, which run Python), at most 16
# (the reads and the hashing release the interpreter lock).
READERS = max(1, min(16, (os.cpu_count() or 1) - 2))


@cache
def _readers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(READERS, thread_name_prefix="scute-read")


def _load_safetensors(path: str, file: str, digest: Digest, pin_memory: bool,
                      ) -> tuple[Tensor, Layout, list[Future]]:
    """The file's buffer, its header, and the reads of the rest still running (`_read`)."""
    try:
        return _read(file, pin_memory, digest)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise _corrupt(path, file, e) from e


def _corrupt(path: str, file: str, e: Exception) -> AdapterError:
    """The error of a weights file that cannot be read as safetensors (at its header, or while the rest is read)."""
    return AdapterError(f"adapter {path}: {file} is corrupt or truncated ({e})")


def _read(file: str, pin_memory: bool, digest: Digest) -> tuple[Tensor, Layout, list[Future]]:
    """The safetensors file in one buffer, its header read (an 8-byte little-endian length n, then n bytes: parsed,
    `_layout`) and the rest being read: the futures of those reads (none where it is all read). The leaves of the
    hash tree (`LEAF` bytes read into pinned memory, else `CHUNK`) are added to `digest` in order: those inside the
    span as `digest.span` (`SpanLeaves`: hashed where the caller copies the span), the others hashed once read. A
    file of a few chunks and more is read by up to `READERS` threads side by side, a task each over a run of the
    chunks: it reads them (one read call for all, as the file allows), says so, then hashes its leaves outside the
    span (the buffer is not written again) while the caller goes on. A task per thread, not per chunk: each task,
    each read call and each hash takes the interpreter lock when it ends, which the step loop then waits for. The
    file is closed once every read has ended."""
    fd = os.open(file, os.O_RDONLY)
    left, handed = 0, False  # the reader tasks still reading, once the file is handed to them (the last closes it)
    try:
        size = os.fstat(fd).st_size
        buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pin_memory)
        view = memoryview(buffer.numpy())

        def read(start: int, end: int) -> None:
            pos = start
            while pos < end:
                got = os.preadv(fd, [view[pos:end]], pos)
                if got == 0:
                    raise ValueError(f"the file ended at byte {pos} while reading it ({size} bytes)")
                pos += got

        if size < 8:
            raise ValueError(f"{size} bytes: too short for a safetensors header")
        read(0, 8)
        head = 8 + int.from_bytes(view[:8], "little")
        if head > size:
            raise ValueError(f"the header claims {head - 8} bytes, the file has {size}")
        read(8, head)
        layout = _layout(bytes(view[8:head]), size)
        leaf = LEAF if pin_memory else CHUNK
        first = end = 0  # the leaves inside the span: first..end (none: every leaf is after them)
        if layout.span is not None and layout.span[2] // leaf > -(-layout.span[1] // leaf):
            first, end = -(-layout.span[1] // leaf), layout.span[2] // leaf
            digest.span = SpanLeaves(buffer, layout.span[1], first, end - first, leaf)
        spanned = [] if digest.span is None else [digest.span]

        def sha(a: int, b: int) -> list[bytes]:
            """The digests of leaves a..b before the span's and of those after it."""
            return [sha256_leaves_ref(view[a * leaf:min(b, first) * leaf], leaf),
                    sha256_leaves_ref(view[max(a, end) * leaf:b * leaf], leaf)]

        chunk = max(leaf, CHUNK // leaf * leaf)
        starts = range(0, size, chunk)
        if len(starts) <= 2:
            read(head, size)
            before, after = sha(0, -(-size // leaf))
            digest.add(before, *spanned, after)
            return buffer, layout, []
        n = min(READERS, len(starts))
        runs = [starts[k * len(starts) // n:(k + 1) * len(starts) // n] for k in range(n)]
        reads, lock = [Future() for _ in runs], threading.Lock()

        def task(k: int) -> list[bytes]:
            nonlocal left
            error = None
            lo, hi = runs[k][0], min(runs[k][-1] + chunk, size)
            try:
                read(max(lo, head), hi)
            except BaseException as e:  # noqa: BLE001 - raised where the read is waited for
                error = e
            with lock:
                left -= 1
                if left == 0:
                    os.close(fd)
            if error is not None:
                reads[k].set_exception(error)
                raise error
            reads[k].set_result(None)
            return sha(lo // leaf, -(-hi // leaf))

        left, handed = n, True
        hashes = [_readers().submit(task, k) for k in range(n)]
    finally:
        if not handed:
            os.close(fd)
    digest.add(*(_Nth(hashed, 0) for hashed in hashes), *spanned, *(_Nth(hashed, 1) for hashed in hashes))
    return buffer, layout, reads


class _Nth:
    """Item `i` of a future's list, as a future of its own (`Digest.add`)."""

    def __init__(self, future: Future, i: int) -> None:
        self.future, self.i = future, i

    def result(self) -> bytes:
        return self.future.result()[self.i]


@lru_cache(maxsize=64)
def _layout(header: bytes, size: int) -> Layout:
    """The safetensors format: an 8-byte little-endian header length, a JSON header (per tensor its dtype, shape
    and byte range after the header), the data. Every range is checked against the file's `size`. Kept by the
    header's bytes: a server's adapters of one kind and shape have the same header, parsed once."""
    info = json.loads(header)
    info.pop("__metadata__", None)
    base, entries = 8 + len(header), []
    for key, t in info.items():
        dtype, shape, (begin, end) = _DTYPES[t["dtype"]], tuple(t["shape"]), t["data_offsets"]
        nbytes = math.prod(shape) * dtype.itemsize
        if begin < 0 or end - begin != nbytes or base + end > size:
            raise ValueError(f"tensor {key!r} ({t['dtype']} {list(shape)}) has bytes {begin}..{end} of "
                             f"{size - base}")
        entries.append((key, dtype, shape, base + begin))
    return Layout(tuple(entries), _span(entries))


def _span(entries: list[tuple[str, torch.dtype, tuple[int, ...], int]]) -> tuple[torch.dtype, int, int] | None:
    """(dtype, first byte, end byte) of the file's floating tensors when they are all of one dtype, aligned, and
    cover that range exactly, none overlapping; else None."""
    floating = sorted((start, start + math.prod(shape) * dtype.itemsize, dtype)
                      for _, dtype, shape, start in entries if dtype.is_floating_point)
    if not floating or len({d for _, _, d in floating}) > 1 or any(a % d.itemsize for a, _, d in floating):
        return None
    if any(end != start for (_, end, _), (start, _, _) in zip(floating, floating[1:])):
        return None
    return floating[0][2], floating[0][0], floating[-1][1]


@dataclass(eq=False)
class Layout:
    """A safetensors file's header, checked against the file's size (`_layout`): each tensor's key, dtype, shape
    and first byte in the file, in the file's order; `span`: see `_span`. ``splits``: what `scute.adapters.
    conversion` derives from the keys alone, per method, kept with the header that has them."""

    PAUSE_EVERY = 64  # views `views` makes between two calls of its `pause`

    entries: tuple[tuple[str, torch.dtype, tuple[int, ...], int], ...]
    span: tuple[torch.dtype, int, int] | None
    splits: dict = field(default_factory=dict)

    @cached_property
    def keys(self) -> tuple[str, ...]:
        return tuple(key for key, *_ in self.entries)

    def views(self, buffer: Tensor, cast: Tensor | None = None,
              pause: Callable[[], None] = lambda: None) -> dict[str, Tensor]:
        """The tensors as views of `buffer` (the file as read, or a copy of it), in the file's order, a run of them
        (`runs`) made by two calls into torch (one view of all, split: a LoRA file's 448 tensors in 28 calls);
        a tensor whose start is not aligned to its dtype gets its own aligned copy. `cast`: the `span` of the
        buffer cast to another dtype (`AdapterCheckpoint.tensors_on`): the floating tensors are views of it.
        `pause` before the first run and before each run that begins `PAUSE_EVERY` views or more after it."""
        typed, out, made, paused = TypedViews(buffer), {}, 0, -self.PAUSE_EVERY
        lo, first = (self.span[1], cast.storage_offset()) if cast is not None else (0, 0)
        for keys, dtype, shape, start, step in self.runs:
            if made - paused >= self.PAUSE_EVERY:
                pause()
                paused = made
            on_cast = cast is not None and dtype.is_floating_point
            strides, size = contiguous_strides(shape), dtype.itemsize
            if len(keys) == 1:
                out[keys[0]] = cast.as_strided(shape, strides, first + (start - lo) // size) if on_cast \
                    else _view(typed, dtype, shape, start)
            else:
                shapes, steps = (len(keys), *shape), (step // size, *strides)
                run = cast.as_strided(shapes, steps, first + (start - lo) // size) if on_cast \
                    else typed.at(dtype, start // size, shapes, steps)
                out.update(zip(keys, run.unbind(0)))
            made += len(keys)
        return {key: out[key] for key in self.keys}

    @cached_property
    def runs(self) -> tuple[tuple[tuple[str, ...], torch.dtype, tuple[int, ...], int, int], ...]:
        """The entries as runs (keys, dtype, shape, first byte, bytes from one start to the next): tensors of one
        dtype and shape whose keys differ only in their numbers (one projection's tensor in every layer) and whose
        starts step evenly through the file, aligned to their dtype; any other entry a run of its own (step 0)."""
        groups: dict[tuple, list[tuple[int, str]]] = {}
        for key, dtype, shape, start in self.entries:
            groups.setdefault((dtype, shape, re.sub(r"\d+", "#", key)), []).append((start, key))
        runs = []
        for (dtype, shape, _), members in groups.items():
            members.sort()
            starts = [start for start, _ in members]
            step = starts[1] - starts[0] if len(starts) > 1 else 0
            if step > 0 and (starts[0] % dtype.itemsize, step % dtype.itemsize) == (0, 0) \
                    and all(b - a == step for a, b in zip(starts, starts[1:])):
                runs.append((tuple(key for _, key in members), dtype, shape, starts[0], step))
            else:
                runs += [((key,), dtype, shape, start, 0) for start, key in members]
        return tuple(runs)

    @cached_property
    def floating_only(self) -> bool:
        """Every tensor is floating (then a `span`'s views are all of them)."""
        return all(dtype.is_floating_point for _, dtype, _, _ in self.entries)

    def view(self, buffer: Tensor, key: str) -> Tensor:
        """The tensor `key` as a view of `buffer` (as `views` makes it), without making the others'."""
        _, dtype, shape, start = self._entry[key]
        return _view(TypedViews(buffer), dtype, shape, start)

    @cached_property
    def _entry(self) -> dict[str, tuple[str, torch.dtype, tuple[int, ...], int]]:
        return {entry[0]: entry for entry in self.entries}


def _view(typed: TypedViews, dtype: torch.dtype, shape: tuple[int, ...], start: int) -> Tensor:
    """The tensor of `dtype` and `shape` at byte `start` of `typed`'s buffer: a view, or where `start` is not
    aligned to the dtype its own aligned copy."""
    if start % dtype.itemsize == 0:
        return typed.at(dtype, start // dtype.itemsize, shape, contiguous_strides(shape))
    return typed.buffer[start:start + math.prod(shape) * dtype.itemsize].clone().view(dtype).view(shape)


class TypedViews:
    """Views of one byte buffer (uint8, storage offset 0) in any dtype, each made by one call into torch (a view of
    the buffer per dtype, then `as_strided`): a file's few hundred tensors, and their copies' views, cost a few
    hundred calls instead of two or three times as many."""

    def __init__(self, buffer: Tensor) -> None:
        self.buffer, self._typed = buffer, {}

    def at(self, dtype: torch.dtype, offset: int, shape, stride) -> Tensor:
        """The view in `dtype` at element `offset` of that dtype (its storage offset), `shape` and `stride`."""
        typed = self._typed.get(dtype)
        if typed is None:
            n = self.buffer.numel()
            typed = self._typed[dtype] = self.buffer[: n - n % dtype.itemsize].view(dtype)
        return typed.as_strided(shape, stride, offset)

    def like(self, x: Tensor) -> Tensor:
        """The view at `x`'s storage offset, shape and strides (the buffer a copy of the storage `x` views)."""
        return self.at(x.dtype, x.storage_offset(), x.shape, x.stride())


@lru_cache(maxsize=1024)
def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape`, kept per shape (a load makes hundreds of views of a few
    shapes)."""
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(stride[::-1])


def first_nonfinite(tensors: Mapping[str, Tensor]) -> str | None:
    """The first key whose floating tensor holds a NaN or an Inf, with one host sync for all of them (per dtype).
    A file's tensors that tile one span of its buffer are checked as that span, one operation for all of them."""
    keys = [k for k, x in tensors.items() if x.is_floating_point() and x.numel()]
    units = []  # (a tensor to check, the keys it holds)
    for group, span in _spans({k: tensors[k] for k in keys}):
        if span is not None and _tiles(span, [tensors[k] for k in group]):
            units.append((span, group))
        else:
            units += [(tensors[k], [k]) for k in group]
    bad = [group for (_, group), ok in zip(units, _finite([x for x, _ in units])) if not ok]
    bad = {k for group in bad for k, ok in zip(group, _finite([tensors[k] for k in group])) if not ok}  # which
    return next((k for k in keys if k in bad), None)


def _finite(xs: list[Tensor]) -> list[bool]:
    """Whether each tensor (floating, not empty) is finite, with one host sync per dtype."""
    finite = [True] * len(xs)
    if xs and xs[0].is_cuda:  # one fused launch per dtype (`_finite_flags`)
        for dtype in {x.dtype for x in xs}:
            group = [i for i, x in enumerate(xs) if x.dtype == dtype]
            for i, ok in zip(group, _read_back(_finite_flags([xs[i] for i in group])).tolist()):
                finite[i] = ok
    elif xs:  # min and max propagate NaN and show an Inf; ~50x faster than isfinite() on bf16 on the CPU
        finite = torch.isfinite(torch.stack([torch.stack(torch.aminmax(x)).double() for x in xs])).all(1).tolist()
    return finite


def _finite_flags(xs: list[Tensor]) -> Tensor:
    """Whether each tensor (on a GPU, floating, not empty, all of one dtype) is finite, as a bool tensor there:
    max |x| of all of them in one fused launch (NaN propagates), nothing waited for."""
    return torch.stack(torch._foreach_norm(xs, float("inf"))).isfinite()


def _read_back(x: Tensor) -> Tensor:
    """`x` (on a GPU, small) on the CPU, once the work queued before it on the current stream is done: waited for
    with a stream synchronize first, so that the copy to pageable memory itself never waits for the GPU (such a
    copy is run under a lock of the CUDA driver that other threads' CUDA calls wait on: the step loop's launches,
    `scute.engine.adapter_loader.Staging`)."""
    torch.cuda.current_stream(x.device).synchronize()
    return x.cpu()


def _spans(tensors: Mapping[str, Tensor]) -> list[tuple[list[str], Tensor | None]]:
    """The keys of contiguous tensors in one dtype on one storage (a file's: views of its buffer), grouped, and the
    span of that storage from the first one's start to the last one's end (None for a tensor alone)."""
    groups: dict[tuple, list[str]] = {}
    for k, x in tensors.items():
        groups.setdefault((x.untyped_storage().data_ptr(), x.dtype) if x.is_contiguous() else (k,), []).append(k)
    out = []
    for keys in groups.values():
        xs = [tensors[k] for k in keys]
        lo, hi = min(x.storage_offset() for x in xs), max(x.storage_offset() + x.numel() for x in xs)
        out.append((keys, None if len(xs) == 1 else torch.empty(0, dtype=xs[0].dtype, device=xs[0].device).set_(
            xs[0].untyped_storage(), lo, (hi - lo,))))
    return out


def _tiles(span: Tensor, xs: list[Tensor]) -> bool:
    """Whether `xs` cover `span` exactly, none overlapping: then it holds their elements and nothing else."""
    ends = sorted((x.storage_offset(), x.storage_offset() + x.numel()) for x in xs)
    return all(a == b for (_, b), (a, _) in zip(ends, ends[1:])) and ends[-1][1] - ends[0][0] == span.numel()


def cast_together(tensors: Mapping[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    """`tensors` with every floating one in `dtype`. Views of one storage in one dtype (a file's tensors) are cast
    as one span of it, one operation where one per tensor would be hundreds, and come back as views of the cast
    span; any other tensor is cast alone."""
    out = dict(tensors)
    floating = {k: x for k, x in tensors.items() if x.is_floating_point() and x.dtype != dtype}
    for keys, span in _spans(floating):
        if span is None:
            out[keys[0]] = tensors[keys[0]].to(dtype)
            continue
        cast, lo = span.to(dtype), span.storage_offset()
        for k in keys:
            x = tensors[k]
            out[k] = cast.as_strided(x.shape, x.stride(), x.storage_offset() - lo)
    return out


def pattern_value(patterns: Mapping[str, object] | None, name: str, default):
    """Resolve PEFT's `rank_pattern` / `alpha_pattern` for module `name`: first matching key wins."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def matches_module_list(spec, name: str) -> bool:
    """PEFT's target matching: a string is a full regex match, a list matches exact names or ``.suffix``."""
    if spec is None:
        return False
    if isinstance(spec, str):
        return re.fullmatch(spec, name) is not None
    return name in spec or any(name.endswith(f".{key}") for key in spec)


TARGETING = ("target_modules", "exclude_modules", "layers_to_transform", "layers_pattern")  # what `is_targeted` reads


def targeted_modules(config: Mapping, names: tuple[str, ...]) -> frozenset[str]:
    """The `names` PEFT would adapt under `config` (`is_targeted`; a config as read from JSON). Kept by the
    config's targeting entries: a server's adapters of one kind target the same modules, found once."""
    return _targeted(json.dumps([config.get(k) for k in TARGETING]), names)


@lru_cache(maxsize=64)
def _targeted(targeting: str, names: tuple[str, ...]) -> frozenset[str]:
    config = dict(zip(TARGETING, json.loads(targeting)))
    return frozenset(n for n in names if is_targeted(config, n))


def is_targeted(config: Mapping, name: str) -> bool:
    """Whether PEFT would adapt module `name` under `config` (target/exclude modules, layers_to_transform)."""
    if matches_module_list(config.get("exclude_modules"), name):
        return False
    targets = config.get("target_modules")
    if targets == "all-linear" or not matches_module_list(targets, name):
        return False
    layers = config.get("layers_to_transform")
    if isinstance(targets, str) or layers is None or layers == []:
        return True
    patterns = config.get("layers_pattern") or [None]
    for pattern in [patterns] if isinstance(patterns, str) else patterns:
        regex = r".*?\.[^.]*\.(?P<idx>\d+)\." if pattern is None else rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\."
        if match := re.match(regex, name):
            idx = int(match.group("idx"))
            return idx == layers if isinstance(layers, int) else idx in layers
    return False
