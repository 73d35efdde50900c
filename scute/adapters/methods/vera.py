"""VeRA.

PEFT forward (eval): ``y = W0 x + b0 + λ_b ⊙ (B_s[:out] (λ_d ⊙ (A_s[:, :in] x)))`` with one pair of random
projections A_s [r, max_in], B_s [max_out, r] shared by every layer. Normal form: A, B *shared* (views of one
model-level pair, itself shared by every adapter with the same projections), ``m = λ_d``, ``v = λ_b``, all live.
The pair is read from the checkpoint (`save_projection=True`) or regenerated bit-exactly from
`projection_prng_key` as PEFT draws it: A first, then B, kaiming-uniform, float32, CPU generator, with max dims
over all the adapter's layers.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.registry import register_method
from scute.ops.slots import Slots


def kaiming_uniform(shape: tuple[int, int], generator: torch.Generator) -> Tensor:
    bound = math.sqrt(3.0) * math.sqrt(2) / math.sqrt(shape[1])
    return torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)


def shared_projections(layer: LayerCheckpoint) -> tuple[Tensor, Tensor]:
    """The adapter's (A_s, B_s), computed once per adapter and interned across adapters."""
    if "vera" not in layer.shared:
        r = int(layer.config["r"])
        max_out = max(o for o, _ in layer.layer_shapes.values())
        max_in = max(i for _, i in layer.layer_shapes.values())
        if "vera_A" in layer.globals or "vera_B" in layer.globals:
            A, B = layer.global_shape("vera_A"), layer.global_shape("vera_B")
            if A[0] != r or A[1] < max_in or B[1] != r or B[0] < max_out:
                raise layer.error(
                    f"shared projections vera_A {A} / vera_B {B} do not fit r={r} "
                    f"and the adapted layers (max in {max_in}, max out {max_out})"
                )
            A, B = layer.interned_global("vera_A"), layer.interned_global("vera_B")
        else:
            g = torch.Generator(device="cpu").manual_seed(int(layer.config.get("projection_prng_key", 0)))
            A = kaiming_uniform((r, max_in), g)
            B = kaiming_uniform((max_out, r), g)
            A, B = layer.intern(A.to(layer.dtype)), layer.intern(B.to(layer.dtype))
        layer.shared["vera"] = (A, B)
    return layer.shared["vera"]


@register_method("VERA", keys=("vera_lambda_b", "vera_lambda_d"), global_keys=("vera_A", "vera_B"))
def convert_vera(layer: LayerCheckpoint) -> Slots:
    A_s, B_s = shared_projections(layer)
    r = A_s.shape[0]
    m = layer.tensor("vera_lambda_d", (r,))
    v = layer.tensor("vera_lambda_b", (layer.out_features,))
    A, B = A_s[:, : layer.in_features], B_s[: layer.out_features]
    return Slots(layer.in_features, layer.out_features, A=A, m=m, B=B, v=v, shared=frozenset({"A", "B"}))
