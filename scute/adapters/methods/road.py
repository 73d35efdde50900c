"""RoAd (2D rotation adaptation).

PEFT forward (eval), on the base output ``z = W0 x + b0`` (bias included): ``y = f ⊙ z + h ⊙ rot_g(z)``, where
rot_g maps each group of g = `group_size` outputs ``[z1 | z2] -> [−z2 | z1]`` and (θ, α = `road_theta`,
`road_alpha`): road_1 — [out/2], each group's g/2 values reused for both halves, ``f = α cos θ``, ``h = α sin θ``;
road_2 — [out], elementwise; road_4 — [2·out], per group ``f = α[0] cos θ[0]``, ``h = α[1] sin θ[1]``.
Normal form: the epilogue's pair rotation ``o = f``, ``o2 = h``, ``rot_group = g``, live.
"""

from __future__ import annotations

from torch import Tensor

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.registry import register_method
from scute.ops.slots import Slots

SIZES = {"road_1": 0.5, "road_2": 1, "road_4": 2}  # stored values per output


def road_vectors(variant: str, g: int, theta: Tensor, alpha: Tensor) -> tuple[Tensor, Tensor]:
    """(f, h) [out] as PEFT's `_prepare_cols` builds them."""
    if variant == "road_1":
        theta = theta.reshape(-1, g // 2).repeat_interleave(2, dim=0).flatten()
        alpha = alpha.reshape(-1, g // 2).repeat_interleave(2, dim=0).flatten()
    if variant in ("road_1", "road_2"):
        return alpha * theta.cos(), alpha * theta.sin()
    theta, alpha = theta.reshape(-1, 2, g), alpha.reshape(-1, 2, g)
    return (alpha[:, 0] * theta[:, 0].cos()).flatten(), (alpha[:, 1] * theta[:, 1].sin()).flatten()


@register_method("ROAD", keys=("road_theta", "road_alpha"))
def convert_road(layer: LayerCheckpoint) -> Slots:
    i, o = layer.in_features, layer.out_features
    variant, g = layer.config.get("variant", "road_1"), int(layer.config.get("group_size", 64))
    if variant not in SIZES:
        raise layer.error(f"unknown RoAd variant {variant!r} (PEFT has {', '.join(SIZES)})")
    if g % 2 or o % g:
        raise layer.error(f"group_size {g} must be even and divide out_features {o}")
    size = int(SIZES[variant] * o)
    f, h = road_vectors(variant, g, layer.tensor("road_theta", (size,)), layer.tensor("road_alpha", (size,)))
    return Slots(i, o, o=f, o2=h, rot_group=g)
