"""`Adapter`: one loaded adapter, its folded slots per module, ready for the device slots of `ScuteLinear`.

It is what `load_adapter` returns and what the engine places, moves and keys its KV prefixes by (`identity`, a
content hash). aLoRA's per-token gate (`invocation_tokens`, `alora_start`) is part of it: the tensors are plain
LoRA, the gate says from which token on they apply.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import torch
from torch import Tensor

from scute.adapters.safetensors_file import TypedViews, contiguous_strides
from scute.ops.slots import Slots

# (storage address, device, dtype) -> (the source storage, its moved copy). Holding the source keeps it alive,
# so its address names no other tensor while the entry exists.
SharedMemo = dict[tuple, tuple[Tensor, Tensor]]
Interned = dict[tuple, list[Tensor]]  # shared matrices by content: (dtype, shape, device, sample hash) -> the tensors
# of that key, each of its own content (`intern_shared`); and ("cast", address, dtype) -> [the interned cast] of an
# interned file tensor (`LayerCheckpoint.interned_global`)
Transfer = Callable[[Tensor, torch.device], Tensor]  # a contiguous buffer copied to a device, on the current stream
Pause = Callable[[], None]  # called between the layers a long load works through (the engine's loader: its turns)
T = TypeVar("T")


def no_pause() -> None:
    """The `Pause` of a load nothing else waits for."""


def paused(items: Iterable[T], pause: Pause, every: int = 1) -> Iterator[T]:
    """`items`, with ``pause()`` before every `every`-th one (the first included)."""
    for i, item in enumerate(items):
        if i % every == 0:
            pause()
        yield item


def copy_to(buffer: Tensor, device: torch.device) -> Tensor:
    """`buffer` copied to `device` by `Tensor.to` (non-blocking from pinned memory: the caller synchronizes before
    the host reads a copy to the CPU)."""
    return buffer.to(device, non_blocking=buffer.is_pinned())


@dataclass
class Adapter:
    """One loaded adapter: its folded slots per module, ready to be placed in `ScuteLinear` slots."""

    name: str
    path: str
    peft_type: str
    config: dict
    identity: str
    layers: dict[str, Slots]

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
           memo: SharedMemo | None = None, vector_dtype: torch.dtype | None = None,
           transfer: Transfer = copy_to, pause: Pause = no_pause) -> Adapter:
        """A copy with every tensor moved to `device` and `dtype` (vectors to `vector_dtype` if given: the
        device slots keep matrices in the serving dtype, vectors in float32). A shared slot's storage (VeRA's
        projections, read by many layers) is copied once and its views stay views of the copy, so the kernels
        still see one matrix. Pass the same `memo` to every call to share one copy across adapters too (the adapter
        manager does: a matrix shared by all its adapters reaches the device once). The other tensors are copied
        as one buffer (`pack`); `transfer` copies each buffer that changes device (the engine's loader copies
        through pinned staging buffers); `pause` is called between layers and tensors. An adapter whose tensors
        are all where and as asked, none shared, is returned itself."""
        memo = {} if memo is None else memo
        device = None if device is None else torch.device(device)
        slots = [(n, s, s.tensors()) for n, s in paused(self.layers.items(), pause, 16)]
        own = [x for _, s, tensors in slots for k, x in tensors.items() if k not in s.shared]
        dtypes = [(vector_dtype or dtype) if x.dim() == 1 else dtype for x in own]
        packed = pack(own, dtypes, device, transfer, pause)
        if all(not s.shared for _, s, _ in slots) and all(p is x for p, x in zip(packed, own)):
            return self  # every tensor is where and as asked (LoRA folded in the serving dtype)
        moved = iter(packed)  # in the order of `own`, which the walk repeats
        layers = {n: s.with_same_shapes(**{k: _move_shared(x, dtype, device, memo, transfer) if k in s.shared
                                           else next(moved) for k, x in tensors.items()})
                  for n, s, tensors in paused(slots, pause, 16)}
        return replace(self, layers=layers)

    def num_bytes(self) -> int:
        return sum(s.num_bytes() for s in self.layers.values())

    @property
    def invocation_tokens(self) -> tuple[int, ...] | None:
        """aLoRA's invocation tokens (the adapter applies from their last occurrence in a prompt on), else None."""
        tokens = self.config.get("alora_invocation_tokens")
        return tuple(int(t) for t in tokens) if tokens else None


def _is_on(x: Tensor, device: torch.device | None) -> bool:
    """Whether `x` is on `device` (None: anywhere; a device without an index: any of its type)."""
    return device is None or x.device == device or (x.device.type == device.type and device.index is None)


def _move_shared(x: Tensor, dtype: torch.dtype | None, device: torch.device | None, memo: SharedMemo,
                 transfer: Transfer) -> Tensor:
    """`x` moved as a view of its whole storage, copied once per `memo`."""
    whole = torch.empty(0, dtype=x.dtype, device=x.device).set_(x.untyped_storage())
    key = (whole.data_ptr(), device, dtype or x.dtype)
    if key not in memo:
        moved = whole if device is None or device == whole.device else transfer(whole, device)
        memo[key] = (whole, moved.to(dtype=dtype))
    return memo[key][1].as_strided(x.size(), x.stride(), x.storage_offset())


ALIGN = 256  # bytes: every tensor of a packed buffer starts aligned (the kernels need 16)
PAUSE_EVERY = 64  # views a pack makes between two pauses (~0.2 ms of the interpreter's time)


def pack(xs: Sequence[Tensor], dtypes: Sequence[torch.dtype | None], device: torch.device | None,
         transfer: Transfer = copy_to, pause: Pause = no_pause) -> list[Tensor]:
    """`xs` on `device` in `dtypes` (None: unchanged), as views of one new buffer filled with one `transfer` (a
    few hundred tensors move as one copy instead of a few hundred). Tensors already there are returned as they
    are; views of one buffer already in their dtypes (a packed adapter) move as one copy of that buffer.
    `pause` is called every `PAUSE_EVERY` views made."""
    dtypes = [d or x.dtype for x, d in zip(xs, dtypes)]
    device = device or (xs[0].device if xs else None)
    if all(_is_on(x, device) and x.dtype == d for x, d in zip(xs, dtypes)):
        return list(xs)
    sources = {x.device for x in xs}
    if all(x.dtype == d for x, d in zip(xs, dtypes)) and _packed(xs):  # a packed buffer: copy it whole
        whole = torch.empty(0, dtype=torch.uint8, device=xs[0].device).set_(xs[0].untyped_storage())
        views = TypedViews(transfer(whole, device))
        return [views.like(x) for x in paused(xs, pause, PAUSE_EVERY)]
    if len(sources) != 1:
        return [x.to(device=device, dtype=d) for x, d in zip(xs, dtypes)]
    offsets, total = [], 0
    for x, d in zip(xs, dtypes):
        offsets.append(total)
        total += -(-x.numel() * d.itemsize // ALIGN) * ALIGN
    src = sources.pop()  # packed where the tensors are, then one transfer
    buf = TypedViews(torch.empty(total, dtype=torch.uint8, device=src))
    packed = [buf.at(d, off // d.itemsize, x.shape, contiguous_strides(x.shape))
              for x, off, d in paused(zip(xs, offsets, dtypes), pause, PAUSE_EVERY)]
    kinds: dict[tuple, list[int]] = {}  # one call per pair of dtypes (one fused launch on a GPU) for hundreds
    for i, (x, d) in enumerate(zip(xs, dtypes)):
        kinds.setdefault((x.dtype, d), []).append(i)
    for group in kinds.values():
        torch._foreach_copy_([packed[i] for i in group], [xs[i] for i in group])
    if src == device or device.type == src.type == "cuda" and device.index is None:
        return packed
    moved = TypedViews(transfer(buf.buffer, device))
    return [moved.like(p) for p in paused(packed, pause, PAUSE_EVERY)]


def _packed(xs: Sequence[Tensor]) -> bool:
    """Whether `xs` are views of one storage they fill but for alignment (a packed adapter's)."""
    storage = xs[0].untyped_storage()
    if any(x.untyped_storage().data_ptr() != storage.data_ptr() for x in xs):
        return False
    return storage.nbytes() <= 2 * sum(x.numel() * x.element_size() for x in xs) + ALIGN * len(xs)


def alora_start(input_ids: Sequence[int], invocation_tokens: Sequence[int]) -> int | None:
    """aLoRA's gate for one prompt: the position of the first token the LoRA applies to (the start of the last
    occurrence of the invocation tokens; every later token, generated ones included, is adapted too), or None if
    they do not occur (then no token is: PEFT's `calculate_alora_offsets`)."""
    ids, inv = list(input_ids), list(invocation_tokens)
    starts = [s for s in range(len(ids) - len(inv) + 1) if ids[s:s + len(inv)] == inv]
    return starts[-1] if starts else None


def alora_active(input_ids: Sequence[int], invocation_tokens: Sequence[int]) -> list[bool]:
    """aLoRA's gate for each token of one sequence (see `alora_start`)."""
    start = alora_start(input_ids, invocation_tokens)
    return [start is not None and t >= start for t in range(len(input_ids))]
