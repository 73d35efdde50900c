"""LoHa (low-rank Hadamard product).

PEFT forward (eval): ``y = W0 x + b0 + s · ((W1a W1b) ⊙ (W2a W2b)) x`` with ``s = α/r`` per layer
(`rank_pattern` / `alpha_pattern`), **rounded to float32** even in a float64 model (PEFT passes
``torch.tensor(α/r)``). Normal form, exact rank r²: the face-splitting product
``B[:, (i, j)] = W1a[:, i] ⊙ W2a[:, j]``, ``A[(i, j), :] = W1b[i, :] ⊙ W2b[j, :]``, s folded into B.
"""

from __future__ import annotations

import torch

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.registry import register_method
from scute.adapters.targeting import pattern_value
from scute.ops.slots import Slots

KEYS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2")


@register_method("LOHA", keys=KEYS, shapes=lambda s: (s.tensors["hada_w1_a"][0], s.tensors["hada_w1_b"][1]))
def convert_loha(layer: LayerCheckpoint) -> Slots:
    if layer.has("hada_t1") or layer.has("hada_t2"):
        raise layer.error("hada_t1/hada_t2 (use_effective_conv2d) are for convolutions: Scute serves linear layers")
    cfg, i, o = layer.config, layer.in_features, layer.out_features
    r = int(pattern_value(cfg.get("rank_pattern"), layer.name, cfg.get("r", 8)))
    alpha = pattern_value(cfg.get("alpha_pattern"), layer.name, cfg.get("alpha", 8))
    w1a, w2a = layer.tensor("hada_w1_a", (o, r)), layer.tensor("hada_w2_a", (o, r))
    w1b, w2b = layer.tensor("hada_w1_b", (r, i)), layer.tensor("hada_w2_b", (r, i))
    B = (w1a[:, :, None] * w2a[:, None, :]).reshape(o, r * r)
    A = (w1b[:, None, :] * w2b[None, :, :]).reshape(r * r, i)
    s = torch.tensor(alpha / r, dtype=torch.float32).item()  # PEFT's float32 rounding of the scale
    return Slots(i, o, A=A, B=B, scale=s)
