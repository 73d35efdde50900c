"""DeLoRA (decoupled low-rank adaptation).

PEFT forward (eval): ``y = W0 x + b0 + B diag(m) A diag(w) x`` with ``m_i = (λ/r) / (‖A_i,:‖ ‖B_:,i‖)`` (both
norms clamped at 1e-4) and ``w`` the column norms of the base weight that PEFT saved at init
(`delora_w_norm`). Normal form: ``A' = A diag(w)`` (folded here), ``m`` (folded into A at load), B.
"""

from __future__ import annotations

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.registry import register_method
from scute.ops.slots import Slots


@register_method("DELORA", keys=("delora_A", "delora_B", "delora_lambda", "delora_w_norm"),
                 shapes=lambda s: (s.tensors["delora_B"][0], s.tensors["delora_A"][1]))
def convert_delora(layer: LayerCheckpoint) -> Slots:
    i, o = layer.in_features, layer.out_features
    r = layer.tensor("delora_A").shape[0]
    A = layer.tensor("delora_A", (r, i))
    B = layer.tensor("delora_B", (o, r))
    lam = layer.tensor("delora_lambda", (1,))
    w = layer.tensor("delora_w_norm", (i,))
    m = (lam / r) / (A.norm(dim=1).clamp(min=1e-4) * B.norm(dim=0).clamp(min=1e-4))
    return Slots(i, o, A=A * w, m=m, B=B)
