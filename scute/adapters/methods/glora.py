"""GLoRA (generalized LoRA).

PEFT forward (eval): ``y = (W0 + W0 ⊙ A + B) x + b0 + b0 ⊙ D + E + W0 C`` (the bias terms only on a biased layer),
each of A, B ("config_A_B"), C ("config_C") and D, E ("config_D_E") a low-rank product (`.Xd @ .Xu`), a vector
(`.X`), a scalar (`.X` [1]) or absent (a saved zero buffer `.zeros`). Normal form:
* A a vector or scalar a: ``W0 ⊙ A = diag(a) W0`` → ``o = 1 + a`` on the base output (bias included, corrected in c);
* B a vector or scalar b (broadcast over the inputs): ``B x = b · Σ x`` → rank 1, ``A' = 1ᵀ`` (shared),
  ``B' = b``;
* ``c = b0 ⊙ D + E + W0 C − a ⊙ b0``.
With A a low-rank product (config_A_B="lora", PEFT's default) ``W0 ⊙ (Xd Xu)`` has no low-rank form over a shared
W0 (it is W0 masked by a rank-r matrix): served only as the dense ΔW ``W0 ⊙ A + B`` (opt-in, `dense.py`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.methods.dense import full_rank_slots, require_dense
from scute.adapters.registry import register_method
from scute.ops.slots import Slots

KEYS = tuple(f"glora_{p}.{k}" for p in "ABCDE" for k in ("Xd", "Xu", "X", "zeros"))


def path(layer: LayerCheckpoint, name: str) -> Tensor | None:
    """The value of GLoRA path `name`: a product, a vector/scalar, a zero buffer, or None if not saved."""
    key = f"glora_{name}"
    if layer.has(f"{key}.Xd"):
        return layer.tensor(f"{key}.Xd") @ layer.tensor(f"{key}.Xu")
    for leaf in ("X", "zeros"):
        if layer.has(f"{key}.{leaf}"):
            return layer.tensor(f"{key}.{leaf}")
    return None


@register_method("GLORA", keys=KEYS)
def convert_glora(layer: LayerCheckpoint) -> Slots:
    i, o, W0, b0 = layer.in_features, layer.out_features, layer.weight, layer.bias
    A, B, C, D, E = (path(layer, n) for n in "ABCDE")
    if A is None or B is None:
        raise layer.error("GLoRA checkpoints save glora_A and glora_B for every layer (a value or a zero buffer)")
    c = None
    if b0 is not None:  # PEFT adds the bias terms only on a biased layer
        c = torch.zeros_like(b0)
        for term in (None if D is None else b0 * D.reshape(-1), E, None if C is None else W0 @ C.reshape(i)):
            c = c if term is None else c + term.reshape(-1)
    if layer.config.get("config_A_B", "lora") in ("vector", "constant"):
        ones = torch.ones(o, dtype=W0.dtype)
        a, b = ones * A.reshape(-1), ones * B.reshape(-1)
        c = None if c is None else c - a * b0
        ones_in = layer.intern(torch.ones(1, i, dtype=W0.dtype))  # the same for every adapter: shared
        return Slots(i, o, o=1 + a, A=ones_in, B=b[:, None], c=c, shared=frozenset({"A"}))
    delta = W0 * A.reshape(o, i) + B.reshape(o, i)  # "lora": products; "none": zero buffers
    if not delta.count_nonzero():
        return Slots(i, o, c=c)
    require_dense(layer, "GLoRA with config_A_B='lora' scales the base weight elementwise by a low-rank matrix "
                         "(W0 ⊙ Xd Xu): no low-rank form over a shared W0")
    return full_rank_slots(layer, delta, c=c)
