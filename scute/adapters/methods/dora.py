"""DoRA (`use_dora=True` in a LoRA checkpoint; registered through `lora.py`).

PEFT forward (eval): ``y = g ⊙ (W0 x + s·B A x) + b0`` with ``g = m / ‖W0 + s·B A‖`` (one norm per output row,
over the inputs): the base bias is *not* rescaled. Normal form: ``o = g``, ``c = (1 − g) ⊙ b0``, ``v = g``
(folded into B at load with s). The norm uses the same W0 the server holds.
"""

from __future__ import annotations

import torch
from torch import Tensor

from scute.adapters.checkpoint import LayerCheckpoint
from scute.adapters.slots import Slots


def dora_slots(layer: LayerCheckpoint, A: Tensor, B: Tensor, s: float) -> Slots:
    magnitude = layer.tensor("lora_magnitude_vector", (layer.out_features,))
    norm = torch.linalg.norm(layer.weight + s * (B @ A), dim=1)
    g = magnitude / norm
    c = None if layer.bias is None else (1 - g) * layer.bias
    return Slots(layer.in_features, layer.out_features, A=A, B=B, v=g, scale=s, o=g, c=c)
