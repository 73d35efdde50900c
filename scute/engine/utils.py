"""Small helpers shared by the engine's files."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def host_to_device(values: list, dtype: torch.dtype, device: torch.device, out: Tensor | None = None) -> Tensor:
    """One host-to-device copy of a Python list. On CUDA the host tensor is pinned and the copy asynchronous,
    so building a step's inputs never waits for the GPU. `out`: a preallocated buffer to copy into (its
    first len(values) entries; returned as that slice), so tensors can live at fixed addresses."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    if out is not None:
        dst = out[: host.shape[0]] if host.dim() == 1 else out[: host.shape[0], : host.shape[1]]
        dst.copy_(host, non_blocking=True)
        return dst
    return host.to(device, non_blocking=True)


def tokenize(tokenizer, vocab_size: int, prompt: str | Sequence[int]) -> list[int]:
    """A prompt's token ids (text through `tokenizer`); raises ValueError for an empty prompt or an id outside
    the vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer: pass tokenizer= to Engine, or token ids")
        ids = list(tokenizer(prompt)["input_ids"])
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("empty prompt")
    if bad := [t for t in ids if not 0 <= t < vocab_size]:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return ids


def is_token_ids(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(t, int) for t in x)


def per_prompt(value, n: int, what: str, single) -> list:
    """`value` once per prompt: repeated if it is None or one `single`, else checked to have n entries."""
    if value is None or isinstance(value, single):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"{what} has {len(values)} entries for {n} prompts: give one per prompt, or one for all")
    return values
