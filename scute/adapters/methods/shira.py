"""SHiRA (sparse high-rank adapters).

PEFT forward (eval): ``y = (W0 + ΔW) x + b0`` with ΔW [out, in] sparse: `shira_weight` [n] at the positions
`shira_indices` [2, n] (rows, then columns; n = r·(in + out), a random mask drawn at init and saved), scaling 1.
A sparse matrix of that many entries is high rank in general: no low-rank form, so SHiRA is served exactly as a
dense per-adapter ΔW, with ``dense=True`` only.
"""

from __future__ import annotations

import torch

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.methods.dense import full_rank_slots, require_dense
from scute.adapters.registry import register_method
from scute.ops.slots import Slots


@register_method("SHIRA", keys=("shira_weight", "shira_indices"))
def convert_shira(layer: LayerCheckpoint) -> Slots:
    require_dense(layer, "SHiRA's delta is a sparse matrix of r·(in + out) trained entries: high rank in general, "
                         "no low-rank form")
    n = layer.tensor("shira_weight").shape[0]
    values = layer.tensor("shira_weight", (n,))
    rows, cols = layer.tensor("shira_indices", (2, n)).round().long()
    if n and (rows.min() < 0 or cols.min() < 0 or rows.max() >= layer.out_features or cols.max() >= layer.in_features):
        raise layer.error(f"shira_indices point outside the {layer.out_features}×{layer.in_features} weight")
    delta = torch.zeros(layer.out_features, layer.in_features, dtype=values.dtype)
    return full_rank_slots(layer, delta.index_put_((rows, cols), values, accumulate=True))
