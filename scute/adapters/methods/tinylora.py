"""TinyLoRA (LoRA-XS factors of W0 mixed by a tiny trained vector through fixed random r×r projections).

PEFT forward (eval, dropout off), per adapted linear layer with index k (its position among the adapter's target
layers in model order):

    R = Σ_i v_g[i] · P[i]                       P = tinylora_P [u, r, r]: N(0, 1/r), CPU generator seeded
                                                 projection_seed + k; v_g = base_model.tinylora_v.<g> [u]
    y = W0 x + b0 + B (R (A x))                 A = tinylora_A [r, in], B = tinylora_B [out, r]: the frozen
                                                 truncated SVD of W0 (√S on each side), saved with the adapter

with r = min(config r, in, out), no scaling, and g the layer's weight-tying group: with N target layers,
``n_g = max(1, round(N · (1 − weight_tying)))``, ``size = max(1, N // n_g)``, ``g = min(k // size, n_g − 1)``
(weight_tying = 0: g = k, one v per layer).

Normal form: an exact rank-r LoRA ``ΔW = B · (R A)``, R folded into the factor on the narrower side: for
out ≤ in, ``A = tinylora_A`` (shared, interned: every TinyLoRA adapter of the same base and r has the same SVD
factor) and ``B = tinylora_B · R`` per adapter [out, r]; for out > in, ``A = R · tinylora_A`` per adapter
[r, in] and ``B = tinylora_B`` shared. s, m, v, T, U are empty.

The factors are read from the checkpoint, never recomputed from W0 (PEFT's float32 SVD). P must be saved
(`save_projection=True`, PEFT's default): `torch.normal` on the CPU draws different floats under its AVX2 and
default kernels (measured: up to ~5e-7 absolute, 1e-4 relative, whenever u·r² ≥ 16), so P cannot be regenerated
exactly. k is the layer's position in model order (the order the loader converts layers in); the saved P is
checked against the draw for seed + k, so a layer order that is not PEFT's is refused rather than served with
another layer's v.
"""

from __future__ import annotations

import torch
from torch import Tensor

from scute.adapters.checkpoint import LAYER_PREFIX
from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.registry import register_method
from scute.ops.slots import Slots

# v is saved as numbered model-level tensors base_model.tinylora_v.<group>; the registry takes a fixed tuple


def _layer_order(layer: LayerCheckpoint) -> dict[str, int]:
    """Position of each converted layer among the adapter's TinyLoRA layers, in the order the loader converts
    them (model order), recorded as the converter is called."""
    order = layer.shared.setdefault("tinylora_order", {})
    if layer.name not in order:
        order[layer.name] = len(order)
    return order


def _num_targets(layer: LayerCheckpoint) -> int:
    """N: the number of layers with TinyLoRA factors in the file (PEFT's target layers; a bias-only layer of
    bias="all" is not one)."""
    if "tinylora_n" not in layer.shared:
        suffix = ".tinylora_A"
        layer.shared["tinylora_n"] = sum(k.startswith(LAYER_PREFIX) and k.endswith(suffix)
                                         for k in layer.checkpoint.tensors)
    return layer.shared["tinylora_n"]


def group_of(k: int, n: int, weight_tying: float) -> tuple[int, int]:
    """(group of layer k, number of groups) for n target layers, as PEFT assigns them."""
    n_groups = max(1, round(n * (1.0 - weight_tying)))
    size = max(1, n // n_groups)
    return min(k // size, n_groups - 1), n_groups


def projection(seed: int, u: int, r: int) -> Tensor:
    """PEFT's draw of P for one layer (float32, CPU)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.normal(mean=0.0, std=1.0 / (r ** 0.5), size=(u, r, r), generator=g)


@register_method("TINYLORA", keys=("tinylora_A", "tinylora_B", "tinylora_P"), global_keys=("tinylora_v.*",))
def convert_tinylora(layer: LayerCheckpoint) -> Slots:
    cfg, i, o = layer.config, layer.in_features, layer.out_features
    if cfg.get("save_projection") is False or not layer.has("tinylora_P"):
        raise layer.error("save_projection=False is set: PEFT regenerates TinyLoRA's projections P with "
                          "torch.normal on the CPU, whose AVX2 and default kernels draw different floats, so P "
                          "cannot be reproduced exactly; re-save the adapter with save_projection=True (the default)")
    r = min(int(cfg.get("r", 2)), i, o)
    u = int(cfg.get("u", 64))
    A = layer.tensor("tinylora_A", (r, i))
    B = layer.tensor("tinylora_B", (o, r))
    P = layer.tensor("tinylora_P", (u, r, r))

    k, n = _layer_order(layer)[layer.name], _num_targets(layer)
    seed = int(cfg.get("projection_seed", 42)) + k
    drawn = projection(seed, u, r).to(P.dtype)
    if (P - drawn).abs().max() > 1e-2 * drawn.abs().max():
        raise layer.error(f"tinylora_P is not PEFT's draw for seed projection_seed + {k} (this layer's position "
                          "among the adapted layers in Scute's model order): the base model's module order differs "
                          "from the one PEFT trained on, so the layer's shared vector v cannot be identified")
    weight_tying = float(cfg.get("weight_tying", 0.0))
    g, n_groups = group_of(k, n, weight_tying)
    if "tinylora_v_count" not in layer.shared:
        layer.shared["tinylora_v_count"] = sum(key.startswith("tinylora_v.") for key in layer.globals)
    present = layer.shared["tinylora_v_count"]
    if present != n_groups:
        raise layer.error(f"the file has {present} tinylora_v vectors, but {n} target layers with "
                          f"weight_tying={weight_tying} make {n_groups} groups")
    v = layer.global_tensor(f"tinylora_v.{g}")
    if tuple(v.shape) != (u,):
        raise layer.error(f"tinylora_v.{g} has shape {tuple(v.shape)}, config u={u} needs ({u},)")

    R = torch.einsum("i,ijk->jk", v, P)  # [r, r]
    if o <= i:
        return Slots(i, o, A=layer.intern(A), B=B @ R, shared=frozenset({"A"}))
    return Slots(i, o, A=R @ A, B=layer.intern(B), shared=frozenset({"B"}))
