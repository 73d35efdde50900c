"""LoKr (low-rank Kronecker product).

PEFT forward (eval): ``y = W0 x + b0 + s · kron(W1, W2) x``, ``s = α/r`` per layer (`rank_pattern` /
`alpha_pattern`; r is not inferable from the tensors when both factors are full). W1 [a, c] and W2 [b', d] are
stored full (`lokr_w1`, `lokr_w2`) or as products (`lokr_w1_a @ lokr_w1_b`, `lokr_w2_a @ lokr_w2_b`), with
``a·b' = out`` and ``c·d = in``. Normal form, exact: with any factorizations ``W1 = U1 V1``, ``W2 = U2 V2`` (a full
factor uses the identity on its thinner side), ``A = kron(V1, V2)``, ``B = s · kron(U1, U2)``; the rank is
rank(U1)·rank(U2), which can be large (a full 64×64 W1 on a 4096 layer: rank 512 or more).
"""

from __future__ import annotations

import torch
from torch import Tensor

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.registry import SavedShapes, register_method
from scute.adapters.targeting import pattern_value
from scute.ops.slots import Slots

KEYS = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")


def factorization(dimension: int, factor: int = -1) -> tuple[int, int]:
    """PEFT's split of `dimension` into m ≤ n with m·n = dimension (m = factor if it divides, else near √)."""
    if factor > 0 and dimension % factor == 0:
        return factor, dimension // factor
    factor = dimension if factor == -1 else factor
    m, n = 1, dimension
    while m < n:
        new_m = m + 1
        while dimension % new_m:
            new_m += 1
        new_n = dimension // new_m
        if new_m + new_n > m + n or new_m > factor:
            break
        m, n = new_m, new_n
    return (n, m) if m > n else (m, n)


def factor_pair(layer: LayerCheckpoint, name: str, rows: int, cols: int) -> tuple[Tensor, Tensor]:
    """(U, V) with U V = the stored factor `name` ("w1" or "w2") of shape [rows, cols]."""
    if layer.has(f"lokr_{name}"):
        W = layer.tensor(f"lokr_{name}", (rows, cols))
        if rows <= cols:
            return torch.eye(rows, dtype=W.dtype), W
        return W, torch.eye(cols, dtype=W.dtype)
    a = layer.tensor(f"lokr_{name}_a")
    k = a.shape[-1]
    return layer.tensor(f"lokr_{name}_a", (rows, k)), layer.tensor(f"lokr_{name}_b", (k, cols))


def lokr_shape(s: SavedShapes) -> tuple[int, int]:
    """(out, in) = the Kronecker product of the two factors' shapes, each saved whole or as a product."""
    def factor(name: str) -> tuple[int, int]:
        if f"lokr_{name}" in s.tensors:
            return s.tensors[f"lokr_{name}"]
        return s.tensors[f"lokr_{name}_a"][0], s.tensors[f"lokr_{name}_b"][1]

    (o1, i1), (o2, i2) = factor("w1"), factor("w2")
    return o1 * o2, i1 * i2


@register_method("LOKR", keys=KEYS, shapes=lokr_shape)
def convert_lokr(layer: LayerCheckpoint) -> Slots:
    if layer.has("lokr_t2"):
        raise layer.error("lokr_t2 (use_effective_conv2d) is for convolutions: Scute serves linear layers")
    cfg, i, o = layer.config, layer.in_features, layer.out_features
    r = int(pattern_value(cfg.get("rank_pattern"), layer.name, cfg.get("r", 8)))
    alpha = pattern_value(cfg.get("alpha_pattern"), layer.name, cfg.get("alpha", 8))
    f = int(cfg.get("decompose_factor", -1))
    (out_l, out_k), (in_m, in_n) = factorization(o, f), factorization(i, f)
    U1, V1 = factor_pair(layer, "w1", out_l, in_m)
    U2, V2 = factor_pair(layer, "w2", out_k, in_n)
    return Slots(i, o, A=torch.kron(V1, V2), B=torch.kron(U1, U2), scale=alpha / r)
