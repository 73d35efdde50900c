"""C3A (circular convolution adaptation).

PEFT forward (eval): ``y = W0 x + b0 + C(x) / in`` where C is a block-circular convolution: x split into ``in/b``
blocks of b, output block m is ``Σ_n x_n ⊛ w_{m,n}`` with `c3a_kernel` [out/b, in/b, b] (PEFT computes it with
FFTs in float32). As a matrix: ``ΔW[m·b + k, n·b + l] = w_{m,n}[(l − k) mod b] / in`` — block-circulant, full rank
in general, so it has no low-rank form: served exactly as a dense per-adapter ΔW, with ``dense=True`` only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.methods.dense import full_rank_slots, require_dense
from scute.adapters.registry import register_method
from scute.ops.slots import Slots


def block_circulant(kernel: Tensor) -> Tensor:
    """The matrix [m·b, n·b] of the block-circular convolution with `kernel` [m, n, b] (see the module docstring)."""
    m, n, b = kernel.shape
    k = torch.arange(b)
    shift = (k[None, :] - k[:, None]) % b  # [k, l] -> (l − k) mod b
    return kernel[:, :, shift].permute(0, 2, 1, 3).reshape(m * b, n * b)


@register_method("C3A", keys=("c3a_kernel",))
def convert_c3a(layer: LayerCheckpoint) -> Slots:
    require_dense(layer, "C3A's delta is block-circulant: full rank in general, no low-rank form")
    kernel = layer.tensor("c3a_kernel")
    b = kernel.shape[-1] if kernel.dim() == 3 else 0
    if b == 0 or layer.in_features % b or layer.out_features % b:
        raise layer.error(f"c3a_kernel has shape {tuple(kernel.shape)}: expected [out/b, in/b, b] with b dividing "
                          f"in ({layer.in_features}) and out ({layer.out_features})")
    kernel = layer.tensor("c3a_kernel", (layer.out_features // b, layer.in_features // b, b))
    return full_rank_slots(layer, block_circulant(kernel) / layer.in_features)
