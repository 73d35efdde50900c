"""Super-Tuning (a sparse support of trained weight entries, with an optional LoRA: "Supra").

PEFT forward (eval): ``y = (W0 + S) x + b0 + (α/r) · B A x`` where S [out, in] holds `supertuning_values` [n] at the
flat positions `supertuning_indices` [n] (row-major; PEFT picks the n largest |W0| entries at init and saves
them with ``save_precomputed_indices=True``, its default) and the LoRA part is present when ``r`` is set. S has
about (1 − sparsity)·in·out entries at positions set by the weights' magnitudes: high rank in general, so
Super-Tuning is served exactly as a dense per-adapter ΔW = S + (α/r) B A, with ``dense=True`` only.
"""

from __future__ import annotations

import torch

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.methods.dense import full_rank_slots, require_dense
from scute.adapters.registry import register_method
from scute.ops.slots import Slots


@register_method("SUPERTUNING", keys=("supertuning_values", "supertuning_indices", "supertuning_lora_A.weight",
                                      "supertuning_lora_B.weight"))
def convert_supertuning(layer: LayerCheckpoint) -> Slots:
    require_dense(layer, "Super-Tuning's delta is a sparse support of the largest base-weight entries: high rank "
                         "in general, no low-rank form")
    i, o = layer.in_features, layer.out_features
    n = layer.tensor("supertuning_values").shape[0]
    values = layer.tensor("supertuning_values", (n,))
    if not layer.has("supertuning_indices"):
        raise layer.error("save_precomputed_indices=False: the support's positions are not in the file (PEFT "
                          "re-selects them by a top-k of |W0| in the model's dtype, whose order among equal "
                          "magnitudes Scute cannot promise to reproduce); re-save the adapter with the default True")
    flat = layer.tensor("supertuning_indices", (n,)).round().long()
    if n and (flat.min() < 0 or flat.max() >= i * o):
        raise layer.error(f"supertuning_indices point outside the {o}×{i} weight")
    delta = torch.zeros(o * i, dtype=values.dtype).index_add_(0, flat, values).view(o, i)
    if layer.has("supertuning_lora_A.weight"):
        r = layer.tensor("supertuning_lora_A.weight").shape[0]
        a = layer.tensor("supertuning_lora_A.weight", (r, i))
        b = layer.tensor("supertuning_lora_B.weight", (o, r))
        delta += float(layer.config.get("lora_alpha", r)) / r * (b @ a)
    return full_rank_slots(layer, delta)
