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


def dora_slots(layer: LayerCheckpoint, A: Tensor, B: Tensor, s: float) -> Slots:
    magnitude = layer.tensor("lora_magnitude_vector", (layer.out_features,))
    # On the device that holds W0 (the served weight, read in float32 there): no copy of W0 to the CPU.
    w0 = layer.base.weight.detach()
    norm = torch.linalg.norm(w0.to(layer.dtype) + s * (B.to(w0.device) @ A.to(w0.device)), dim=1).cpu()
    g = magnitude / norm
    c = None if layer.bias is None else (1 - g) * layer.bias
    return Slots(layer.in_features, layer.out_features, A=A, B=B, v=g, scale=s, o=g, c=c)
