"""AdaLoRA (SVD-form LoRA with adaptive rank).

PEFT forward (eval): ``y = W0 x + b0 + (α / (init_r + 1e-5)) · B (E ⊙ (A x))`` with ``α = lora_alpha`` (or
``init_r`` if ≤ 0). The saved tensors are already pruned to the layer's final rank r' (`rank_pattern`), but PEFT
keeps dividing by ``init_r + 1e-5`` (the resize copies the old rank number back). Normal form: A, ``m = E``, B
with the scalar; E folds into A and the scalar into B at load.
"""

from __future__ import annotations

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.registry import register_method
from scute.ops.slots import Slots


@register_method("ADALORA", keys=("lora_A", "lora_B", "lora_E"),
                 shapes=lambda s: (s.tensors["lora_B"][0], s.tensors["lora_A"][1]))
def convert_adalora(layer: LayerCheckpoint) -> Slots:
    cfg, i, o = layer.config, layer.in_features, layer.out_features
    init_r = int(cfg.get("init_r", 12))
    alpha = cfg.get("lora_alpha", 8)
    A = layer.tensor("lora_A")
    r = A.shape[0]
    A = layer.tensor("lora_A", (r, i))
    B = layer.tensor("lora_B", (o, r))
    E = layer.tensor("lora_E", (r, 1))[:, 0]
    scale = (alpha if alpha > 0 else float(init_r)) / (init_r + 1e-5)
    return Slots(i, o, A=A, m=E, B=B, scale=scale)
