"""Small helpers shared by the engine's files."""

from __future__ import annotations

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
