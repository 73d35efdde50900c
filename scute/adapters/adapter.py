"""`Adapter`: one loaded adapter, its folded slots per module, ready for the device slots of `ScuteLinear`.

It is what `load_adapter` returns and what the engine places, moves and keys its KV prefixes by (`identity`, a
content hash). aLoRA's per-token gate (`invocation_tokens`, `alora_start`) is part of it: the tensors are plain
LoRA, the gate says from which token on they apply.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from scute.ops.slots import Slots

# (storage address, device, dtype) -> (the source storage, its moved copy). Holding the source keeps it alive,
# so its address names no other tensor while the entry exists.
SharedMemo = dict[tuple, tuple[Tensor, Tensor]]


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
           memo: SharedMemo | None = None) -> Adapter:
        """A copy with every tensor moved to `device` and `dtype`. A shared slot's storage (VeRA's projections,
        read by many layers) is copied once and its views stay views of the copy, so the kernels still see one
        matrix. Pass the same `memo` to every call to share one copy across adapters too (the adapter manager
        does: a matrix shared by all its adapters reaches the device once)."""
        memo = {} if memo is None else memo

        def move_slots(s: Slots) -> Slots:
            return replace(s, **{k: _move_shared(x, dtype, device, memo) if k in s.shared
                                 else x.to(device=device, dtype=dtype) for k, x in s.tensors().items()})

        return replace(self, layers={n: move_slots(s) for n, s in self.layers.items()})

    def num_bytes(self) -> int:
        return sum(s.num_bytes() for s in self.layers.values())

    @property
    def invocation_tokens(self) -> tuple[int, ...] | None:
        """aLoRA's invocation tokens (the adapter applies from their last occurrence in a prompt on), else None."""
        tokens = self.config.get("alora_invocation_tokens")
        return tuple(int(t) for t in tokens) if tokens else None


def _move_shared(x: Tensor, dtype: torch.dtype | None, device: torch.device | str | None, memo: SharedMemo) -> Tensor:
    """`x` moved as a view of its whole storage, copied once per `memo`."""
    whole = torch.empty(0, dtype=x.dtype, device=x.device).set_(x.untyped_storage())
    key = (whole.data_ptr(), None if device is None else torch.device(device), dtype or x.dtype)
    if key not in memo:
        memo[key] = (whole, whole.to(device=device, dtype=dtype))
    return memo[key][1].as_strided(x.size(), x.stride(), x.storage_offset())


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
