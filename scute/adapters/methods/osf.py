"""OSF (orthogonal subspace fine-tuning).

PEFT splits W0 by a float32 SVD, ``W0 = U S Vᵀ``, into its top-k part (frozen) and the rest, whose factors
(U_low, S_low, V_low; k = min(in, out) − rank of the rest) are trained. The checkpoint saves only the trained
factors; the initial ones (U0, S0, V0: the same SVD's last triplets) are recomputed from W0 at load. Forward:

    y = W0 x + b0 + [U_low ⊙ S_low, −U0 ⊙ S0] · [V_low; V0] x

Normal form: an exact LoRA of rank 2·(min(in, out) − k), ``A = [V_low; V0]``, ``B = [U_low S_low, −U0 S0]``. The
product U0 S0 V0 does not depend on the SVD's sign choices; Scute recomputes it exactly as PEFT does (float32 SVD
of W0, cast to the model's dtype). Near full rank with PEFT's default k = min / 2 (`scute explain` shows it).
"""

from __future__ import annotations

import torch

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.registry import register_method
from scute.ops.slots import Slots

KEYS = ("osf_svd_params.U_low", "osf_svd_params.S_low", "osf_svd_params.V_low")


@register_method("OSF", keys=KEYS)
def convert_osf(layer: LayerCheckpoint) -> Slots:
    i, o = layer.in_features, layer.out_features
    s_low = layer.tensor(KEYS[1])
    r = s_low.shape[0]
    if s_low.dim() != 1 or not 0 < r <= min(i, o):
        raise layer.error(f"tensor {KEYS[1]!r} has shape {tuple(s_low.shape)}; this layer needs (r,), r ≤ {min(i, o)}")
    u_low, v_low = layer.tensor(KEYS[0], (o, r)), layer.tensor(KEYS[2], (r, i))
    u, s, vt = torch.linalg.svd(layer.weight.float(), full_matrices=False)  # PEFT's decomposition, in float32
    u0, s0, v0 = (t.to(layer.dtype) for t in (u[:, -r:], s[-r:], vt[-r:]))
    return Slots(i, o, A=torch.cat([v_low, v0]), B=torch.cat([u_low * s_low, -(u0 * s0)], dim=1))
