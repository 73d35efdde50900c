"""PEANuT (parameter-efficient adaptation with a weight-aware neural tweaker).

PEFT forward (eval): ``y = W0 x + b0 + s · ΔW x`` with ``ΔW = (B_w g(W0ᵀ A_wᵀ))ᵀ`` where `peanut_A` A_w [r, out],
`peanut_B` B_w [out, r] and g a small residual network on the rows of ``Z = f(W0ᵀ A_wᵀ)`` [in, r] (f the
configured activation): ``depth`` encoders ``Z ← f(Z E_iᵀ)`` (each input kept as a residual), then ``depth``
decoders ``Z ← f(Z D_iᵀ) + residual`` in reverse order. PEFT recomputes it from W0 at every forward.

Normal form, exact rank r: ``A = Zᵀ`` [r, in] (computed once at load from the weight the server holds, in the
converter's dtype), ``B = s · B_w``.
"""

from __future__ import annotations

from transformers.activations import ACT2FN

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.registry import register_method
from scute.ops.slots import Slots

@register_method("PEANUT", keys=("peanut_A.weight", "peanut_B.weight", "peanut_encoders.*.weight",
                                 "peanut_decoders.*.weight"))
def convert_peanut(layer: LayerCheckpoint) -> Slots:
    i, o = layer.in_features, layer.out_features
    depth, act = int(layer.config.get("depth", 0)), layer.config.get("act_fn", "relu")
    if act not in ACT2FN:
        raise layer.error(f"act_fn {act!r} is not a transformers activation")
    if depth < 0:
        raise layer.error(f"depth {depth}: must be 0 or more")
    f = ACT2FN[act]
    r = layer.tensor("peanut_A.weight").shape[0]
    a = layer.tensor("peanut_A.weight", (r, o))
    b = layer.tensor("peanut_B.weight", (o, r))
    encoders = [layer.tensor(f"peanut_encoders.{k}.weight", (r, r)) for k in range(depth)]
    decoders = [layer.tensor(f"peanut_decoders.{k}.weight", (r, r)) for k in range(depth)]
    z = f(layer.weight.T @ a.T)  # [in, r]
    residuals = []
    for e in encoders:
        residuals.append(z)
        z = f(z @ e.T)
    for d, res in zip(decoders, reversed(residuals), strict=True):
        z = f(z @ d.T) + res
    return Slots(i, o, A=z.T.contiguous(), B=float(layer.config.get("scaling", 1.0)) * b)
