"""Read a PEFT checkpoint folder: its config and its weights, on the reader threads and to a device.

A PEFT folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (read by
`scute.adapters.safetensors_file`). This is the boundary: a missing, unreadable or corrupt file, a config without a
method, a pickle the caller did not allow, a tensor that is not finite, each raises `AdapterError` naming the folder
and the fix. `scute.adapters.conversion` validates the tensors against the base model and converts them; inside
Scute the slots are trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from concurrent.futures import wait
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import Tensor

from scute.adapters.safetensors_file import Digest, Layout, RunRead, read_back, read_safetensors

LAYER_PREFIX = "base_model.model."
GLOBAL_PREFIX = "base_model."
SAFETENSORS = "adapter_model.safetensors"
PICKLE = "adapter_model.bin"
CONFIG = "adapter_config.json"


class AdapterError(ValueError):
    """A PEFT adapter that cannot be served; the message names the adapter, the module and the problem."""


@dataclass
class Landing:
    """A file's floating tensors on a device before their values are (`AdapterCheckpoint.arriving`): ``dtype``,
    theirs, and what writes into them once the values are there (`then`; `AdapterCheckpoint.land` runs it)."""

    dtype: torch.dtype
    raw: Tensor  # the span's bytes on the device, filled by `land` (and `land_arrived`)
    after: list[Callable[[], None]] = field(default_factory=list)
    copied: list[tuple[int, int]] = field(default_factory=list)  # the file's byte ranges whose copies into `raw`
    # are queued already (`AdapterCheckpoint.land_arrived`)

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
    reading: list[RunRead] = field(default_factory=list)  # the reads into `data` still running
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

    def land_arrived(self) -> None:
        """The bytes of the reads that have ended copied to the tensors `arriving` made (non-blocking, on the
        current stream: a read's transfer runs while the others read), each once; once every read has ended,
        `land`. Without an `arriving`: nothing."""
        landing = self.landing
        if landing is None:
            return
        for read in self.reading:
            if read.done() and read.exception() is None and (read.start, read.end) not in landing.copied:
                self._copy_bytes(landing, read.start, read.end)
                landing.copied.append((read.start, read.end))
        if self.is_read:
            self.land()

    def land(self) -> None:
        """The values of the tensors `arriving` made put in place: the file's span copied there (non-blocking from
        pinned memory, on the current stream; of the bytes `land_arrived` copied, none again), its check for NaN
        and Inf queued behind the copy (`verify` reads it), then the work given to `Landing.then` run (queued too,
        on a GPU). Without an `arriving`: nothing."""
        landing, self.landing = self.landing, None
        if landing is None:
            return
        _, lo, hi = self.layout.span
        self.buffer  # noqa: B018 - every read ended (or its error raised)
        at = lo  # the span's bytes not copied yet: the gaps between the copied ranges, in order
        for a, b in sorted(landing.copied) + [(hi, hi)]:
            if a > at:
                self._copy_bytes(landing, at, a)
            at = max(at, b)
        self.digest.hash_span(landing.raw)
        raw = landing.raw.view(landing.dtype)
        self.finite = _finite_flags([raw]) if raw.is_cuda else torch.tensor(_finite([raw]))
        for fn in landing.after:
            fn()

    def verify(self) -> None:
        """After `land`: raises `AdapterError` naming the first tensor of the file that is not finite (one host
        sync, once the copy and its check are done)."""
        finite, self.finite = self.finite, None
        if finite is not None and not bool((read_back(finite) if finite.is_cuda else finite).all()):
            raise self.error(f"tensor {first_nonfinite(self.tensors)!r} has NaN or Inf values")

    def _copy_bytes(self, landing: Landing, start: int, end: int) -> None:
        """The file's bytes `start`..`end` (read) that lie in the span copied to their place in `landing.raw`."""
        _, lo, hi = self.layout.span
        a, b = max(start, lo), min(end, hi)
        if a < b:
            landing.raw[a - lo:b - lo].copy_(self.data[a:b], non_blocking=True)

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
                    gate: Callable[[], None] | None = None) -> AdapterCheckpoint:
    """Read a PEFT adapter folder. Pickled ``adapter_model.bin`` files are refused unless `allow_pickle`
    (then loaded with ``torch.load(weights_only=True)``). `pin_memory`: read the weights into pinned memory
    (for a CUDA target: `AdapterCheckpoint.tensors_on` then copies them without staging; keep neither the
    checkpoint nor views of its buffer, so that the memory is reused for the next file). Returns once a
    safetensors file's header is read: the rest is read on the reader threads while the caller works on the
    layout (`AdapterCheckpoint.arriving`); `AdapterCheckpoint.buffer` waits for it, and raises its error.
    `gate`: called by the reader threads between parts of the file (`read_safetensors`)."""
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
        data, layout, reading = _load_safetensors(path, st_file, digest, pin_memory, gate)
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


def _load_safetensors(path: str, file: str, digest: Digest, pin_memory: bool,
                      gate: Callable[[], None] | None) -> tuple[Tensor, Layout, list[RunRead]]:
    """The file's buffer, its header, and the reads of the rest still running (`read_safetensors`)."""
    try:
        return read_safetensors(file, pin_memory, digest, gate)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise _corrupt(path, file, e) from e


def _corrupt(path: str, file: str, e: Exception) -> AdapterError:
    """The error of a weights file that cannot be read as safetensors (at its header, or while the rest is read)."""
    return AdapterError(f"adapter {path}: {file} is corrupt or truncated ({e})")


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
            for i, ok in zip(group, read_back(_finite_flags([xs[i] for i in group])).tolist()):
                finite[i] = ok
    elif xs:  # min and max propagate NaN and show an Inf; ~50x faster than isfinite() on bf16 on the CPU
        finite = torch.isfinite(torch.stack([torch.stack(torch.aminmax(x)).double() for x in xs])).all(1).tolist()
    return finite


def _finite_flags(xs: list[Tensor]) -> Tensor:
    """Whether each tensor (on a GPU, floating, not empty, all of one dtype) is finite, as a bool tensor there:
    max |x| of all of them in one fused launch (NaN propagates), nothing waited for."""
    return torch.stack(torch._foreach_norm(xs, float("inf"))).isfinite()



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
