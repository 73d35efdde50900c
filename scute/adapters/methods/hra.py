"""HRA (Householder reflection adaptation).

PEFT forward (eval): ``y = W0 H x + b0`` with ``H = (I − 2u_0u_0ᵀ) ··· (I − 2u_{r−1}u_{r−1}ᵀ)`` (columns of
`hra_u` normalized), or with `apply_GS` ``H = I − 2QQᵀ``, Q the Gram–Schmidt orthonormalization of `hra_u`.
Normal form, exact rank r: the compact WY form ``H = I − Û T Ûᵀ`` (T upper triangular, ``T_kk = 2``,
``T[:k, k] = −2 T[:k, :k] Û[:, :k]ᵀ û_k``; GS: ``T = 2I``) gives ``A = Ûᵀ``, ``B = −W0 Û T``. B depends on W0 and
is computed once at load from the weight the server holds.
"""

from __future__ import annotations

import torch
from torch import Tensor

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.registry import register_method
from scute.ops.slots import Slots


def gram_schmidt(U: Tensor) -> Tensor:
    """PEFT's classical Gram–Schmidt, column by column in the same order."""
    cols = [U[:, 0] / U[:, 0].norm()]
    for i in range(1, U.shape[1]):
        u = U[:, i]
        for q in cols:
            u = u - (q @ u) * q
        cols.append(u / u.norm())
    return torch.stack(cols, dim=1)


def compact_wy(Q: Tensor) -> Tensor:
    """T with ``Π_k (I − 2 q_k q_kᵀ) = I − Q T Qᵀ`` (unit columns q_k, product in column order)."""
    r = Q.shape[1]
    T = Q.new_zeros(r, r)
    for k in range(r):
        T[k, k] = 2
        T[:k, k] = -2 * T[:k, :k] @ (Q[:, :k].T @ Q[:, k])
    return T


@register_method("HRA", keys=("hra_u",))
def convert_hra(layer: LayerCheckpoint) -> Slots:
    U = layer.tensor("hra_u")
    if U.dim() != 2 or U.shape[0] != layer.in_features:
        raise layer.error(f"hra_u has shape {tuple(U.shape)}, the layer needs [{layer.in_features}, r]")
    if layer.config.get("apply_GS"):
        Q = gram_schmidt(U)
        T = 2 * torch.eye(U.shape[1], dtype=U.dtype)
    else:
        Q = U / U.norm(dim=0)
        T = compact_wy(Q)
    return Slots(layer.in_features, layer.out_features, A=Q.T.contiguous(), B=-(layer.weight @ Q) @ T)
