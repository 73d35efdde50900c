"""OFT (PEFT >= 0.14 layout).

PEFT forward (eval): x is cut into chunks of the block size b and chunk k becomes ``x_k @ R_k``; then
``y = W0 x_rot + b0``. R_k comes from the skew matrix Q_k (upper triangle stored in `oft_R.weight`) by the
Cayley map ``(I − Q)(I + Q)⁻¹``, or — PEFT's default — by its truncated Neumann series
``I + 2Q + 2Q² + … + Q^{k−1}``, which is reproduced term for term (it is *not* the exact map). COFT projects Q
first. Normal form: ``T = blockdiag(R_kᵀ)`` (one block if `block_share`), live.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.registry import register_method
from scute.ops.slots import Slots


def skew(vec: Tensor, b: int) -> Tensor:
    """[n, b(b−1)/2] upper triangles (row-major) -> [n, b, b] skew-symmetric matrices."""
    rows, cols = torch.triu_indices(b, b, 1, device=vec.device)
    S = vec.new_zeros(vec.shape[0], b, b)
    S[:, rows, cols] = vec
    return S - S.transpose(-2, -1)


def coft_project(Q: Tensor, eps: float) -> Tensor:
    """COFT: blocks with ‖Q‖_F above eps/√n are scaled onto that radius (PEFT rounds the radius to float32)."""
    radius = eps / torch.sqrt(torch.tensor(Q.shape[0], device=Q.device))
    norm = torch.linalg.norm(Q, dim=(1, 2), keepdim=True)
    return torch.where(norm <= radius, Q, radius * (Q / norm))


def cayley(Q: Tensor, neumann_terms: int | None) -> Tensor:
    """R from Q: the exact Cayley map if `neumann_terms` is None, else PEFT's truncated series."""
    eye = torch.eye(Q.shape[-1], dtype=Q.dtype, device=Q.device).expand_as(Q)
    if neumann_terms is None:
        return torch.linalg.solve(eye + Q, eye - Q, left=False)
    R = torch.add(eye, Q, alpha=2) if neumann_terms > 1 else eye.clone()  # 2 Q is exact: R + 2 Q, one rounding
    if neumann_terms > 2:
        power = Q @ Q
        R.add_(power, alpha=2)
        for _ in range(3, neumann_terms - 1):
            power = power @ Q
            R.add_(power, alpha=2)
        R.add_(power @ Q)
    return R


@register_method("OFT", keys=("oft_R.weight",), on_device=True)
def convert_oft(layer: LayerCheckpoint) -> Slots:
    cfg = layer.config
    if "oft_block_size" not in cfg:
        raise layer.error("OFT checkpoints from PEFT < 0.14 (no oft_block_size in the config) are not supported")
    vec = layer.tensor("oft_R.weight")
    n_stored, n = vec.shape if vec.dim() == 2 else (0, 0)
    b = round((1 + math.sqrt(1 + 8 * n)) / 2)
    if b < 2 or b * (b - 1) // 2 != n or layer.in_features % b:
        raise layer.error(f"oft_R.weight has shape {tuple(vec.shape)}: no block size divides "
                          f"in_features={layer.in_features} (adapter trained for another model?)")
    if n_stored != (1 if cfg.get("block_share") else layer.in_features // b):
        raise layer.error(f"oft_R.weight has {n_stored} blocks of size {b}; in_features={layer.in_features}")
    Q = skew(vec, b)
    if cfg.get("coft"):
        Q = coft_project(Q, float(cfg.get("eps", 6e-5)))
    terms = int(cfg.get("num_cayley_neumann_terms", 5)) if cfg.get("use_cayley_neumann", True) else None
    R = cayley(Q, terms)
    return Slots(layer.in_features, layer.out_features, t_blocks=R.transpose(-2, -1).contiguous())
