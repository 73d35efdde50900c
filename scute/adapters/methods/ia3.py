"""(IA)³.

PEFT forward (eval): output-side targets ``y = l ⊙ (W0 x + b0)`` (the bias is scaled too); feed-forward
targets (`feedforward_modules`) ``y = W0 (l ⊙ x) + b0``. Normal form: ``o = l`` or ``T = diag(l)``, both live.
"""

from __future__ import annotations

import re

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.registry import register_method
from scute.ops.slots import Slots


def is_feedforward(config, name: str) -> bool:
    """PEFT's rule: a string is a full regex match; a list entry matches with a raw ``endswith``."""
    spec = config.get("feedforward_modules") or []
    if isinstance(spec, str):
        return re.fullmatch(spec, name) is not None
    return any(name.endswith(key) for key in spec)


@register_method("IA3", keys=("ia3_l",), on_device=True)
def convert_ia3(layer: LayerCheckpoint) -> Slots:
    i, o = layer.in_features, layer.out_features
    if is_feedforward(layer.config, layer.name):
        return Slots(i, o, t=layer.tensor("ia3_l", (1, i))[0])
    return Slots(i, o, o=layer.tensor("ia3_l", (o, 1))[:, 0])
