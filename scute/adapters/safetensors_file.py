"""A safetensors weights file read into one buffer: its header (`Layout`: each tensor's dtype, shape and place, and
the span its floating tensors tile), its tensors as views of the buffer (`TypedViews`), and the hash tree of its
bytes that makes an adapter's identity (`Digest`), hashed side by side with the read, on the reader threads or a
GPU. The file's errors are OSError and ValueError; `scute.adapters.checkpoint` names the adapter in them."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache, cached_property, lru_cache

import torch
from torch import Tensor

from scute.ops.sha256 import sha256_leaves, sha256_leaves_ref


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
            self._hashed = sha256_leaves(leaves, leaf, programs=HASH_PROGRAMS)
            return
        self.hash_on_readers(leaves)

    def hash_on_readers(self, leaves: Tensor) -> None:
        """Hash `leaves` (the span's whole leaves, on the CPU) with hashlib on the reader threads, a run each."""
        leaf, n = self.leaf, min(READERS, self.count)
        self._hashed = [_readers().submit(sha256_leaves_ref, leaves[k * self.count // n * leaf:
                                                                    (k + 1) * self.count // n * leaf], leaf)
                        for k in range(n)]

    def result(self) -> bytes:
        """The leaves' digests, concatenated (waits for them; hashes them from the buffer, read, if not begun)."""
        if self._hashed is None:
            self.hash(self.buffer[self.lo:])
        if isinstance(self._hashed, Tensor):
            with torch.cuda.stream(self._stream):
                return read_back(self._hashed).numpy().tobytes()
        return b"".join(part.result() for part in self._hashed)


# Bytes per leaf of the hash tree (`Digest`) of a file read for a GPU: small enough that a large file's leaves keep
# the GPU busy (a leaf is hashed serially), and few: 10,240 for a LoRA of the 8B shape.
LEAF = 8 << 10
# Programs of the hash kernel at most (`sha256_leaves`' `programs`); None: one per 32 leaves (320 for a LoRA of the
# 8B shape, on every SM, 0.4 ms on an H200). Fewer spread the hash over more of a step without taking less from it:
# a cap of 33 made the steps beside loads slower (docs/performance.md, "Loads while requests run").
HASH_PROGRAMS: int | None = None
# Bytes per chunk of a read (a multiple of `LEAF`), and per leaf of the hash tree of a file read for the CPU: files
# of a few chunks and more are read by several threads (`_readers`), each over its share of the chunks, then
# hashing their leaves outside the span while the conversion goes on (`bench/bench_adapter_load.py`:
# ``read_checkpoint_s``, the read and hash of a file).
CHUNK = 4 << 20
# Bytes a reader thread reads between two calls of a gate (`read_safetensors`): a few hundred µs of its read.
PART = 1 << 20
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
# Threads that read a file: 6, or all cores but two (left to the step loop and the loader, which run Python) where
# that is fewer. A read from the page cache is bound by the host's copy rate, which a few threads reach: on the
# H200 machine (16 cores) 14 threads read a LoRA's 84 MB no sooner than 6, and slowed the loader's Python beside
# them (the views of its tensors took 2-3x as long: `bench/profile_load.py --readers`).
READERS = max(1, min(6, (os.cpu_count() or 1) - 2))


@cache
def _readers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(READERS, thread_name_prefix="scute-read")


class RunRead(Future):
    """The read of bytes `start`..`end` of a file by a reader thread (`read_safetensors`): done once they are in
    the buffer."""

    def __init__(self, start: int, end: int) -> None:
        super().__init__()
        self.start, self.end = start, end


def read_safetensors(file: str, pin_memory: bool, digest: Digest,
                     gate: Callable[[], None] | None = None) -> tuple[Tensor, Layout, list[RunRead]]:
    """The safetensors file in one buffer, its header read (an 8-byte little-endian length n, then n bytes: parsed,
    `layout_of`) and the rest being read: the futures of those reads, which cover the file from the header's end
    on (none where it is all read). The leaves of the
    hash tree (`LEAF` bytes read into pinned memory, else `CHUNK`) are added to `digest` in order: those inside the
    span as `digest.span` (`SpanLeaves`: hashed where the caller copies the span), the others hashed once read. A
    file of a few chunks and more is read by up to `READERS` threads side by side, a task each over a run of the
    chunks: it reads them (one read call for all, as the file allows), says so, then hashes its leaves outside the
    span (the buffer is not written again) while the caller goes on. A task per thread, not per chunk: each task,
    each read call and each hash takes the interpreter lock when it ends, which the step loop then waits for.
    `gate`: a task reads its run `PART` bytes at a time instead, calling it before each (the engine's loader
    passes `Turns.gate`: the reads, which take cores and memory bandwidth from the step loop's host work, wait
    while the step loop holds its turn). The file is closed once every read has ended."""
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
        layout = layout_of(bytes(view[8:head]), size)
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
        reads = [RunRead(max(run[0], head), min(run[-1] + chunk, size)) for run in runs]
        lock = threading.Lock()

        def task(k: int) -> list[bytes]:
            nonlocal left
            error = None
            lo, hi = runs[k][0], reads[k].end  # the run's first chunk (its leaves), its read's end
            try:
                step = hi if gate is None else PART  # the run in one read call, or a part at a time behind the gate
                for a in range(reads[k].start, hi, step):
                    if gate is not None:
                        gate()
                    read(a, min(a + step, hi))
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
def layout_of(header: bytes, size: int) -> Layout:
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
    return Layout(tuple(entries), span_of(entries))


def span_of(entries: list[tuple[str, torch.dtype, tuple[int, ...], int]]) -> tuple[torch.dtype, int, int] | None:
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
    """A safetensors file's header, checked against the file's size (`layout_of`): each tensor's key, dtype, shape
    and first byte in the file, in the file's order; `span`: see `span_of`. ``splits``: what `scute.adapters.
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

def read_back(x: Tensor) -> Tensor:
    """`x` (on a GPU, small) on the CPU, once the work queued before it on the current stream is done: waited for
    with a stream synchronize first, so that the copy to pageable memory itself never waits for the GPU (such a
    copy is run under a lock of the CUDA driver that other threads' CUDA calls wait on: the step loop's launches,
    `scute.engine.adapter_loader.Staging`)."""
    torch.cuda.current_stream(x.device).synchronize()
    return x.cpu()


@lru_cache(maxsize=1024)
def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape`, kept per shape (a load makes hundreds of views of a few
    shapes)."""
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(stride[::-1])
