"""PVeRA (probabilistic VeRA).

PEFT forward (eval): ``(μ, logvar) = chunk₂(λ_d ⊙ (A_s[:, :in] x))``, ``y = W0 x + b0 + λ_b ⊙ (B_s[:out] z)`` with
``z = μ`` — or, with `sample_at_inference`, ``z = μ + ε·exp(logvar/2)``, ε drawn at every forward (refused: no
deterministic form). A_s [2r, max_in] and B_s [max_out, r] are one model-level pair (`base_model.pvera_A/B`,
or regenerated like VeRA's: kaiming-uniform, A then B, CPU generator seeded with `projection_prng_key`).
Normal form, as VeRA: ``A = A_s[:r, :in]``, ``B = B_s[:out]`` shared, ``m = λ_d[:r]``, ``v = λ_b``, all live.
"""

from __future__ import annotations

import torch
from torch import Tensor

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.methods.dense import refuse
from scute.adapters.methods.vera import kaiming_uniform
from scute.adapters.registry import register_method
from scute.ops.slots import Slots


def shared_pair(layer: LayerCheckpoint, r: int) -> tuple[Tensor, Tensor]:
    """(A_s[:r], B_s): the μ half of the projections, once per adapter, interned across adapters."""
    if "pvera" not in layer.shared:
        max_out = max(o for o, _ in layer.layer_shapes.values())
        max_in = max(i for _, i in layer.layer_shapes.values())
        if "pvera_A" in layer.globals or "pvera_B" in layer.globals:
            A, B = layer.global_tensor("pvera_A"), layer.global_tensor("pvera_B")
        else:
            g = torch.Generator(device="cpu").manual_seed(int(layer.config.get("projection_prng_key", 0)))
            A, B = kaiming_uniform((2 * r, max_in), g), kaiming_uniform((max_out, r), g)
        if A.shape[0] != 2 * r or A.shape[1] < max_in or B.shape[1] != r or B.shape[0] < max_out:
            raise layer.error(f"shared projections pvera_A {tuple(A.shape)} / pvera_B {tuple(B.shape)} do not fit "
                              f"r={r} and the adapted layers (max in {max_in}, max out {max_out})")
        layer.shared["pvera"] = (layer.intern(A[:r].to(layer.dtype)), layer.intern(B.to(layer.dtype)))
    return layer.shared["pvera"]


@register_method("PVERA", keys=("pvera_lambda_b", "pvera_lambda_d"), global_keys=("pvera_A", "pvera_B"))
def convert_pvera(layer: LayerCheckpoint) -> Slots:
    if layer.config.get("sample_at_inference"):
        refuse(layer, "PVeRA with sample_at_inference=True adds random noise at every forward")
    r = int(layer.config.get("r", 256))
    A_s, B_s = shared_pair(layer, r)
    m = layer.tensor("pvera_lambda_d", (2 * r,))[:r]
    v = layer.tensor("pvera_lambda_b", (layer.out_features,))
    return Slots(layer.in_features, layer.out_features, A=A_s[:, : layer.in_features], m=m,
                 B=B_s[: layer.out_features], v=v, shared=frozenset({"A", "B"}))
