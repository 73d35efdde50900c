"""DoRA (`use_dora=True` in a LoRA checkpoint; registered through `lora.py`).

PEFT forward (eval): ``y = g ⊙ (W0 x + s·B A x) + b0`` with ``g = m / ‖W0 + s·B A‖`` (one norm per output row,
over the inputs): the base bias is *not* rescaled. Normal form: ``o = g``, ``c = (1 − g) ⊙ b0``, ``v = g``
(folded into B at load with s). The norm uses the same W0 the server holds.
"""

from __future__ import annotations

import torch
from torch import Tensor

from scute.adapters.conversion import LayerCheckpoint
from scute.ops.slots import Slots

# Elements of W0 + s·B A formed at once: on the CPU a few MiB, so the temporaries stay in cache and are not fresh
# pages each layer (whole-layer temporaries made it ~10x slower); on a GPU 256 MiB of float32, a whole layer of
# the 8B shape (three launches per layer, a bounded transient beside the KV cache).
CPU_CHUNK, GPU_CHUNK = 1 << 20, 1 << 26


def weight_norm(w0: Tensor, A: Tensor, B: Tensor, s: float, dtype: torch.dtype) -> Tensor:
    """‖W0 + s·B A‖ per output row, in `dtype`, computed on W0's device (W0 is never copied off it), a block of
    rows at a time; returned on W0's device."""
    A, B = A.to(w0.device), B.to(w0.device)
    rows = max(1, (GPU_CHUNK if w0.is_cuda else CPU_CHUNK) // w0.shape[1])
    norms = [torch.linalg.norm(w0[i:i + rows].to(dtype, copy=True).addmm_(B[i:i + rows], A, alpha=s), dim=1)
             for i in range(0, w0.shape[0], rows)]
    return norms[0] if len(norms) == 1 else torch.cat(norms)


def dora_slots(layer: LayerCheckpoint, A: Tensor, B: Tensor, s: float) -> Slots:
    magnitude = layer.tensor("lora_magnitude_vector", (layer.out_features,))
    g = magnitude / weight_norm(layer.base.weight.detach(), A, B, s, layer.dtype).to(magnitude.device)
    c = None if layer.bias is None else (1 - g) * layer.bias
    return Slots(layer.in_features, layer.out_features, A=A, B=B, v=g, scale=s, o=g, c=c)
