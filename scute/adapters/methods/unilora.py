"""Uni-LoRA (every LoRA entry of every layer is one scaled entry of a single trained vector θ).

PEFT forward (eval, dropout off), with θ = base_model.unilora_theta_d [d] (one vector for the whole adapter):

    A = θ[I_A] ⊙ S_A      I_A = unilora_indices_A [r, in] (integers in [0, d)), S_A = unilora_scales_A [r, in]
    B = θ[I_B] ⊙ S_B      I_B = unilora_indices_B [out, r],                     S_B = unilora_scales_B [out, r]
    y = W0 x + b0 + B (A x)                                   no scaling

The indices are a balanced shuffle of [0, d) over the flattened LoRA entries of all adapted layers (model order;
per layer A then B, numpy's PCG64 seeded with proj_seed) and ``S = 1/√count(index)`` over the whole adapter
(float32, cast to the model dtype): `regenerate_indices` reproduces them.

Normal form: an exact rank-r LoRA, ``A = θ[I_A] ⊙ S_A`` and ``B = θ[I_B] ⊙ S_B`` materialized per adapter at load
(the gathers are exact; the product is PEFT's own elementwise one). s, m, v, T, U are empty; nothing is shared.

With `save_indices=True` the indices and scales are read from the file. With `save_indices=False` (PEFT's
default) the file holds θ alone: the method is registered with ``tensorless_targets``, so the loader calls the
converter for every targeted layer anyway, and `regenerate_indices` rebuilds all of them once per adapter from
the targeted layers' shapes in the base model's order, as PEFT does at load.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.registry import register_method
from scute.adapters.targeting import is_targeted
from scute.ops.slots import Slots

KEYS = ("unilora_indices_A", "unilora_indices_B", "unilora_scales_A", "unilora_scales_B")


def balanced_indices(count: int, d: int, seed: int) -> Tensor:
    """The UniLoRA index stream: each of [0, d) ⌊count/d⌋ times, plus count mod d distinct extras drawn without
    replacement, all shuffled, by numpy's default_rng(seed) (PCG64: the same on every platform)."""
    rng = np.random.default_rng(seed)
    stream = np.repeat(np.arange(d), count // d)
    if count % d:
        stream = np.concatenate([stream, rng.choice(d, size=count % d, replace=False)])
    rng.shuffle(stream)
    return torch.as_tensor(stream, dtype=torch.long)


def regenerate_indices(shapes: Sequence[tuple[int, int]], r: int, d: int, seed: int
                       ) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """(I_A, I_B, S_A, S_B) for each adapted layer, given their (out, in) in model order; scales in float32."""
    total = sum(r * (i + o) for o, i in shapes)
    stream = balanced_indices(total, d, seed)
    counts = torch.bincount(stream, minlength=d)
    inv = torch.zeros(d, dtype=torch.float32)
    inv[counts > 0] = counts[counts > 0].float().rsqrt()
    out, at = [], 0
    for o, i in shapes:
        ia = stream[at: at + r * i].view(r, i)
        ib = stream[at + r * i: at + r * (i + o)].view(o, r)
        at += r * (i + o)
        out.append((ia, ib, inv[ia], inv[ib]))
    return out


def _indices(layer: LayerCheckpoint, key: str, shape: tuple[int, int], d: int) -> Tensor:
    layer.tensor(key, shape)  # validates the shape, marks the tensor read
    idx = layer.tensors[key]
    if idx.is_floating_point() or idx.is_complex():
        raise layer.error(f"{key} has dtype {idx.dtype}: PEFT saves integer indices")
    if idx.numel() and (idx.min() < 0 or idx.max() >= d):
        raise layer.error(f"{key} indexes past unilora_theta_d ({d} entries)")
    return idx.long()


def _regenerated(layer: LayerCheckpoint, r: int, d: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """This layer's (I_A, I_B, S_A, S_B), rebuilt with every targeted layer's (once per adapter)."""
    if "unilora_indices" not in layer.shared:
        names = [n for n in layer.layer_shapes if is_targeted(layer.config, n)]
        seed = int(layer.config.get("proj_seed", 42))
        layer.shared["unilora_indices"] = dict(zip(names, regenerate_indices(
            [layer.layer_shapes[n] for n in names], r, d, seed), strict=True))
    return layer.shared["unilora_indices"][layer.name]


@register_method("UNILORA", keys=KEYS, global_keys=("unilora_theta_d",), tensorless_targets=True)
def convert_unilora(layer: LayerCheckpoint) -> Slots:
    cfg, i, o = layer.config, layer.in_features, layer.out_features
    r = int(cfg.get("r", 4))
    theta = layer.global_tensor("unilora_theta_d")
    d = theta.shape[0]
    if theta.dim() != 1 or d != int(cfg.get("theta_d_length", d)):
        raise layer.error(f"unilora_theta_d has shape {tuple(theta.shape)}, config theta_d_length="
                          f"{cfg.get('theta_d_length')} needs ({cfg.get('theta_d_length')},)")
    if any(layer.has(k) for k in KEYS):
        ia = _indices(layer, "unilora_indices_A", (r, i), d)
        ib = _indices(layer, "unilora_indices_B", (o, r), d)
        sa = layer.tensor("unilora_scales_A", (r, i))
        sb = layer.tensor("unilora_scales_B", (o, r))
    else:  # saved without its indices (save_indices=False): rebuilt as PEFT rebuilds them
        ia, ib, sa, sb = _regenerated(layer, r, d)
        sa, sb = sa.to(layer.dtype), sb.to(layer.dtype)
    return Slots(i, o, A=theta[ia] * sa, B=theta[ib] * sb)
