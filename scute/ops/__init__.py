"""Scute's ops. `scute_linear` runs one adapted linear layer for a batch of tokens with per-token adapters."""

from scute.ops.reference import scute_linear_ref

# The CPU and fallback path; the Triton kernels take over on CUDA once registered.
scute_linear = scute_linear_ref

__all__ = ["scute_linear", "scute_linear_ref"]
