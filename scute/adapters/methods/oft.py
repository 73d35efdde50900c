"""OFT (PEFT >= 0.14 layout).

PEFT forward (eval): x is cut into chunks of the block size b and chunk k becomes ``x_k @ R_k``; then
``y = W0 x_rot + b0``. R_k comes from the skew matrix Q_k (upper triangle stored in `oft_R.weight`) by the
Cayley map ``(I − Q)(I + Q)⁻¹``, or — PEFT's default — by its truncated Neumann series
``I + 2Q + 2Q² + … + Q^{k−1}``, which is reproduced term for term (it is *not* the exact map). COFT projects Q
first. Normal form: ``T = blockdiag(R_kᵀ)`` (one block if `block_share`), live.

A load converts every layer on W0's device, where each small op costs a kernel launch: the rotations of all the
adapter's layers of one block size are computed as one batch at its first layer (`rotations`: a dozen operations
and a copy per layer, where each layer took a dozen), Rᵀ directly from Qᵀ = −Q, and the skew index map, the
identity and the COFT radius are made once per block size and device.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import Tensor

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.registry import register_method
from scute.ops.slots import Slots


@lru_cache(maxsize=32)
def _skew_t_map(b: int, device: str) -> tuple[Tensor, Tensor]:
    """For the flattened [b·b] matrix Qᵀ: the index of each entry into ``[0, vec…]`` and its sign (int8)."""
    rows, cols = torch.triu_indices(b, b, 1)
    k = torch.arange(1, rows.numel() + 1)
    index, sign = torch.zeros(b, b, dtype=torch.long), torch.zeros(b, b, dtype=torch.int8)
    index[rows, cols], index[cols, rows] = k, k
    sign[rows, cols], sign[cols, rows] = -1, 1
    return index.flatten().to(device), sign.flatten().to(device)


@lru_cache(maxsize=32)
def _identity(b: int, dtype: torch.dtype, device: str) -> Tensor:
    return torch.eye(b, dtype=dtype, device=device)


@lru_cache(maxsize=32)
def _coft_radius(n: int, eps: float, device: str, default_dtype: torch.dtype) -> Tensor:
    """PEFT's expression, on the device; its dtype is the default dtype, hence that key."""
    return eps / torch.sqrt(torch.tensor(n, device=device))


def skew_t(vec: Tensor, b: int) -> Tensor:
    """[n, b(b−1)/2] upper triangles (row-major) of PEFT's skew matrices Q = S − Sᵀ -> [n, b, b] their
    transposes ``Qᵀ = Sᵀ − S``. Entries are exactly ±vec, zeros on the diagonal (int8 signs keep vec's dtype)."""
    index, sign = _skew_t_map(b, str(vec.device))
    padded = torch.nn.functional.pad(vec, (1, 0))  # entry 0 is the diagonal's zero
    return (padded.index_select(1, index) * sign).view(vec.shape[0], b, b)


def coft_project(Q: Tensor, eps: float, sizes: list[int]) -> Tensor:
    """COFT: blocks with ‖Q‖_F above eps/√n are scaled onto that radius (PEFT rounds the radius to float32), n the
    number of blocks of each layer of `sizes` (the blocks of several layers in one batch, in order).
    Elementwise given the norm, so ``coft_project(Qᵀ) == coft_project(Q)ᵀ`` exactly."""
    device, dtype = str(Q.device), torch.get_default_dtype()
    radius = torch.cat([_coft_radius(n, eps, device, dtype).expand(n) for n in sizes])[:, None, None]
    norm = torch.linalg.norm(Q, dim=(1, 2), keepdim=True)
    return torch.where(norm <= radius, Q, radius * (Q / norm))


def cayley(Q: Tensor, neumann_terms: int | None) -> Tensor:
    """R from a batch of skew matrices Q [n, b, b]: the exact Cayley map ``(I − Q)(I + Q)⁻¹`` if `neumann_terms`
    is None, else PEFT's truncated series ``I + 2Q + 2Q² + … + 2Q^{t−2} + Q^{t−1}`` (t = `neumann_terms`, summed
    in that order).

    Called with PEFT's Qᵀ it gives PEFT's Rᵀ, with no transpose of the series: each power is ``Q @ Q^{k−1}``, the
    transpose of PEFT's ``Q^{k−1} @ Q`` (the same products summed in the same order: bit for bit where a batched
    product rounds each matrix as a product alone would, as on the CPU). The exact map is PEFT's own solve on −Q
    (then PEFT's Q), transposed: a strided view, copied by the caller.
    """
    eye = _identity(Q.shape[-1], Q.dtype, str(Q.device))
    if neumann_terms is None:
        return torch.linalg.solve(eye - Q, eye + Q, left=False).mT
    if neumann_terms <= 1:
        return eye.repeat(Q.shape[0], 1, 1)
    R = torch.add(eye, Q, alpha=2)  # 2 Q is exact: I + 2 Q, one rounding
    if neumann_terms > 2:
        power = Q @ Q
        R.add_(power, alpha=2)
        for _ in range(3, neumann_terms - 1):
            power = Q @ power
            R.add_(power, alpha=2)
        R.add_(Q @ power)
    return R


def _block(vec: Tensor, in_features: int, block_share: bool) -> tuple[int, str | None]:
    """The block size b of a layer's ``oft_R.weight`` [n_blocks, b(b−1)/2], and what is wrong with its shape for a
    layer of `in_features` inputs (None: nothing)."""
    n_stored, n = vec.shape if vec.dim() == 2 else (0, 0)
    b = round((1 + math.sqrt(1 + 8 * n)) / 2)
    if b < 2 or b * (b - 1) // 2 != n or in_features % b:
        return b, (f"oft_R.weight has shape {tuple(vec.shape)}: no block size divides in_features={in_features} "
                   "(adapter trained for another model?)")
    if n_stored != (1 if block_share else in_features // b):
        return b, f"oft_R.weight has {n_stored} blocks of size {b}; in_features={in_features}"
    return b, None


def rotations(vecs: list[Tensor], b: int, config: dict) -> list[Tensor]:
    """Rᵀ [n_i, b, b] from each ``oft_R.weight`` [n_i, b(b−1)/2] of `vecs` (one block size), computed as one batch:
    COFT's radius is each layer's own (eps/√n_i, PEFT's float32 expression), each block's map its own."""
    Qt, sizes = skew_t(torch.cat(vecs), b), [v.shape[0] for v in vecs]
    if config.get("coft"):
        Qt = coft_project(Qt, float(config.get("eps", 6e-5)), sizes)
    terms = int(config.get("num_cayley_neumann_terms", 5)) if config.get("use_cayley_neumann", True) else None
    Rt = cayley(Qt, terms)  # = Rᵀ, see `cayley`
    return [r.clone(memory_format=torch.contiguous_format) for r in Rt.split(sizes)]


def _adapter_rotations(layer: LayerCheckpoint) -> dict[str, Tensor]:
    """Rᵀ of every layer of the adapter whose ``oft_R.weight`` has a valid shape, by module name, computed at its
    first layer (a batch per block size: a few kernels for the adapter instead of ten or so per layer, each a
    launch from Python on the GPU) and kept in ``layer.shared``. A layer whose tensor has another shape is left
    out: its own conversion refuses it."""
    done = layer.shared.get("oft_rotations")
    if done is None:
        share = bool(layer.config.get("block_share"))
        by_block: dict[int, list[tuple[str, Tensor]]] = {}
        for name, tensors in layer.peers.items():
            if (vec := tensors.get("oft_R.weight")) is None:
                continue
            b, problem = _block(vec, layer.layer_shapes[name][1], share)
            if problem is None:
                by_block.setdefault(b, []).append((name, vec if vec.dtype == layer.dtype else vec.to(layer.dtype)))
        done = layer.shared["oft_rotations"] = {}
        for b, members in by_block.items():
            done.update(zip([name for name, _ in members], rotations([v for _, v in members], b, layer.config)))
    return done


@register_method("OFT", keys=("oft_R.weight",), on_device=True)
def convert_oft(layer: LayerCheckpoint) -> Slots:
    cfg = layer.config
    if "oft_block_size" not in cfg:
        raise layer.error("OFT checkpoints from PEFT < 0.14 (no oft_block_size in the config) are not supported")
    vec = layer.tensor("oft_R.weight")
    b, problem = _block(vec, layer.in_features, bool(cfg.get("block_share")))
    if problem is not None:
        raise layer.error(problem)
    Rt = _adapter_rotations(layer).get(layer.name)
    if Rt is None:  # a layer checkpoint made without its peers (not by `convert_checkpoint`): converted alone
        Rt = rotations([vec], b, cfg)[0]
    return Slots(layer.in_features, layer.out_features, t_blocks=Rt)
