"""FourierFT (sparse Fourier spectrum of ΔW).

PEFT forward (eval): ``y = W0 x + b0 + ΔW x``, ``ΔW = scaling · Re(ifft2(S))``, S [out, in] zero except n
entries ``S[p_k, q_k] = c_k`` (`fourierft_spectrum` [n]); the positions are not saved but drawn again:
``randperm(out·in, Generator().manual_seed(random_loc_seed))[:n]``, ``p = idx // in``, ``q = idx % in``.
Normal form, exact real factorization of rank 2n:
``ΔW[a, b] = scaling/(out·in) · Σ_k c_k (cos(2π a p_k/out) cos(2π b q_k/in) − sin(2π a p_k/out) sin(2π b q_k/in))``
→ ``A = [cos; sin](2π b q_k/in)`` [2n, in], ``B = scaling/(out·in) · [c ⊙ cos, −c ⊙ sin](2π a p_k/out)``.
When 2n ≥ min(in, out) the dense ΔW (full rank, `dense.full_rank_slots`) is cheaper and is served instead.
PEFT itself computes ΔW in float32/complex64 even for a float64 model (≈1e-7 relative); Scute computes in the
model's adapter dtype (float64 for float64), so it matches PEFT run with float64 as the default dtype.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.methods.dense import full_rank_slots
from scute.adapters.registry import register_method
from scute.ops.slots import Slots


def phases(index: Tensor, pos: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    """2π (index·pos mod n)/n as [len(index), len(pos)], reduced in integers first (exact angles)."""
    return (2 * math.pi / n) * ((index[:, None] * pos[None, :]) % n).to(dtype)


@register_method("FOURIERFT", keys=("fourierft_spectrum",))
def convert_fourierft(layer: LayerCheckpoint) -> Slots:
    cfg, i, o = layer.config, layer.in_features, layer.out_features
    c = layer.tensor("fourierft_spectrum")
    n = c.shape[0]
    if c.dim() != 1 or n > i * o:
        raise layer.error(f"fourierft_spectrum has shape {tuple(c.shape)}: needs [n] with n ≤ out·in = {i * o}")
    g = torch.Generator().manual_seed(int(cfg.get("random_loc_seed", 777)))
    idx = torch.randperm(o * i, generator=g)[:n]
    p, q = idx // i, idx % i
    col, row = phases(torch.arange(i), q, i, c.dtype), phases(torch.arange(o), p, o, c.dtype)  # [in, n], [out, n]
    A = torch.cat([col.cos().T, col.sin().T])
    B = (float(cfg.get("scaling", 150.0)) / (o * i)) * torch.cat([c * row.cos(), -c * row.sin()], dim=1)
    if 2 * n >= min(i, o):
        return full_rank_slots(layer, B @ A)
    return Slots(i, o, A=A, B=B)
