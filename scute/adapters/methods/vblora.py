"""VB-LoRA (LoRA factors mixed from a shared vector bank).

PEFT forward (eval): ``y = W0 x + b0 + B (A x)``, no scale. Each length-L sub-vector of A and B is a top-k mixture
of the model-level bank ``base_model.vblora_vector_bank`` [V, L]: ``Σ_top-k softmax(ℓ_top-k) · bank[idx]``,
from logits `vblora_logits_A` [r, in/L, V] and `vblora_logits_B` [out/L, r, V] — or, saved with
`save_only_topk_weights`, from `*_topk_indices` and the first k−1 `*_topk_weights` (the last is 1 − their sum).
``A = mix(ℓ_A).reshape(r, in)``, ``B = mix(ℓ_B).transpose(1, 2).reshape(out, r)``. Normal form: A, B
materialized at load (per adapter).
"""

from __future__ import annotations

import torch
from torch import Tensor

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.registry import SavedShapes, register_method
from scute.ops.slots import Slots

LOGITS = ("vblora_logits_A", "vblora_logits_B")
KEYS = LOGITS + tuple(f"{k}_topk_{part}" for k in LOGITS for part in ("indices", "weights"))


def mix(layer: LayerCheckpoint, key: str, bank: Tensor, topk: int) -> Tensor:
    """The bank mixture of logits `key`: [..., L]."""
    if layer.has(f"{key}_topk_indices"):
        idx = layer.tensor(f"{key}_topk_indices").round().long()  # small integers: exact in any float dtype
        w = layer.tensor(f"{key}_topk_weights", (*idx.shape[:-1], idx.shape[-1] - 1))
        w = torch.cat([w, 1 - w.sum(-1, keepdim=True)], dim=-1)
    else:
        top, idx = layer.tensor(key).topk(topk, dim=-1)
        w = torch.softmax(top, dim=-1)
    if idx.max() >= bank.shape[0] or idx.min() < 0:
        raise layer.error(f"{key} indexes past the vector bank ({bank.shape[0]} vectors)")
    return (w.unsqueeze(-1) * bank[idx]).sum(-2)


def vblora_shape(s: SavedShapes) -> tuple[int, int]:
    """(out, in) from the logits' sub-vector counts times the bank's vector length."""
    def logits(name: str) -> tuple[int, ...]:
        t = s.tensors
        return t[name] if name in t else t[f"{name}_topk_indices"]

    length = s.globals["vblora_vector_bank"][1]
    return logits("vblora_logits_B")[0] * length, logits("vblora_logits_A")[1] * length


@register_method("VBLORA", keys=KEYS, global_keys=("vblora_vector_bank",), shapes=vblora_shape)
def convert_vblora(layer: LayerCheckpoint) -> Slots:
    cfg, i, o = layer.config, layer.in_features, layer.out_features
    bank = layer.global_tensor("vblora_vector_bank")
    L, topk = bank.shape[1], int(cfg.get("topk", 2))
    if i % L or o % L:
        raise layer.error(f"vector length {L} must divide in_features {i} and out_features {o}")
    A = mix(layer, "vblora_logits_A", bank, topk)
    B = mix(layer, "vblora_logits_B", bank, topk)
    r = A.shape[0]
    if A.shape != (r, i // L, L) or B.shape != (o // L, r, L):
        raise layer.error(f"VB-LoRA logits give A {tuple(A.shape)} and B {tuple(B.shape)}: the layer needs "
                          f"[r, {i // L}, {L}] and [{o // L}, r, {L}]")
    return Slots(i, o, A=A.reshape(r, i), B=B.transpose(1, 2).reshape(o, r))
