"""Scute's ops: one adapted linear layer for a batch of tokens, each with its own adapter (or none).

Two implementations of the same semantics: `scute_linear_ref` (PyTorch, any device; the CPU path) and the
Triton kernels (`scute_linear_triton`, CUDA), which read the layer's adapters from a `SlotPool` and the step's
token order from a `LoraMeta`. `triton_enabled` says which one a tensor gets.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import Tensor

from scute.ops.launch import LaunchResources
from scute.ops.meta import LoraMeta, build_lora_meta
from scute.ops.pool import SlotPool
from scute.ops.reference import scute_linear_ref
from scute.ops.triton_ops import merged_gemm, scute_linear_triton, scute_linears_deferred, scute_linears_triton

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# Looked up, not imported: importing triton fixes its interpreter mode, which the CPU kernel tests set later.
_HAVE_TRITON = importlib.util.find_spec("triton") is not None


def triton_enabled(x: Tensor) -> bool:
    """True if the Triton kernels serve `x`: CUDA tensors of a 16/32-bit float dtype; CPU tensors only under
    ``SCUTE_TRITON_CPU=1`` (with ``TRITON_INTERPRET=1``: the kernel tests)."""
    if not _HAVE_TRITON or x.dtype not in _TRITON_DTYPES:
        return False
    return x.is_cuda or (x.device.type == "cpu" and triton_on_cpu())


def triton_on_cpu() -> bool:
    """Whether the Triton kernels also serve CPU tensors (``SCUTE_TRITON_CPU=1``, with ``TRITON_INTERPRET=1``:
    the kernel tests, and the benches that time the host's part of a GPU path on a CPU)."""
    return _HAVE_TRITON and os.environ.get("SCUTE_TRITON_CPU") == "1"


__all__ = ["LaunchResources", "LoraMeta", "SlotPool", "build_lora_meta", "merged_gemm", "scute_linear_ref",
           "scute_linear_triton", "scute_linears_deferred", "scute_linears_triton", "triton_enabled", "triton_on_cpu"]
