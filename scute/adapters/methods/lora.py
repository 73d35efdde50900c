"""LoRA (incl. rsLoRA, rank/alpha patterns, lora_bias, bias="all"/"lora_only") and, with `use_dora`, DoRA.

PEFT forward (eval): ``y = W0 x + b0 + s·(B (A x) + b_B)``, ``s = α/r`` (rsLoRA: ``α/√r``), per-layer r and α
from `rank_pattern` / `alpha_pattern`. Normal form: A, B with s (folded into B at load), ``c = s·b_B``.
"""

from __future__ import annotations

import math

from scute.adapters.checkpoint import pattern_value
from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.methods.dora import dora_slots
from scute.adapters.methods.lora_variants import TRAINING_ONLY_KEYS, lora_factors
from scute.adapters.registry import SavedShapes, register_method
from scute.ops.slots import Slots

KEYS = ("lora_A.weight", "lora_B.weight", "lora_B.bias", "lora_magnitude_vector") + TRAINING_ONLY_KEYS


def lora_scale(layer: LayerCheckpoint) -> tuple[int, float]:
    """(r, s) of this layer, resolving PEFT's rank_pattern / alpha_pattern by module name."""
    cfg = layer.config
    r = int(pattern_value(cfg.get("rank_pattern"), layer.name, cfg["r"]))
    alpha = pattern_value(cfg.get("alpha_pattern"), layer.name, cfg.get("lora_alpha", 8))
    return r, alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def lora_shape(s: SavedShapes) -> tuple[int, int] | None:
    """(out, in) from B [out, r] and A [r, in]; BD-LoRA's blocked factors do not fix them."""
    if s.config.get("use_bdlora"):
        return None
    return s.tensors["lora_B.weight"][0], s.tensors["lora_A.weight"][1]


@register_method("LORA", keys=KEYS, shapes=lora_shape, on_device=True)
def convert_lora(layer: LayerCheckpoint) -> Slots:
    r, s = lora_scale(layer)
    A, B = lora_factors(layer, r)  # variants sharing peft_type LORA: see lora_variants.py
    if layer.config.get("use_dora"):
        return dora_slots(layer, A, B, s)
    c = s * layer.tensor("lora_B.bias", (layer.out_features,)) if layer.has("lora_B.bias") else None
    return Slots(layer.in_features, layer.out_features, A=A, B=B, c=c, scale=s)
