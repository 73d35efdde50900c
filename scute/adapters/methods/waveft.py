"""WaveFT (wavelet fine-tuning).

PEFT forward (eval): ``y = W0 x + b0 + ΔW x`` with ΔW [out, in] rebuilt from `waveft_spectrum` [n] (n free per
layer: `n_frequency`, its pattern or the proportional allocation; read from the tensor):

* positions: not saved. PEFT regenerates them from `random_loc_seed` on every load: the first n entries of
  ``torch.randperm(out·in)`` drawn from a CPU generator seeded with it, read row-major (``p // in, p mod in``);
  the same seed for every layer. Regenerated here the same way (a CPU permutation: reproducible for a given
  torch version).
* ``use_idwt=False``: ``ΔW = s · S`` with S [out, in] the spectrum scattered at those positions, s = `scaling`.
* ``use_idwt=True`` (default): S is scattered into a zero [H, W] grid, ``H = out + L − 2`` (+1 if odd),
  ``W = in + L − 2`` (+1 if odd), L the wavelet's filter length, at the offset ``((H − out)//2, (W − in)//2)``;
  its quadrants ``[[S11, S12], [S21, S22]]`` (each [H/2, W/2]) are one level of a 2-D inverse DWT, the product
  of two 1-D syntheses, ``P_f[y, k] = f[y + p − 2k]`` (``p = (2L − 3)//2`` cropped at both ends, f the low-pass
  reconstruction filter ``g0`` or the high-pass ``g1[k] = (−1)^k g0[L−1−k]``):

      ΔW = s · crop( P_g0 S11 Q_g0ᵀ + P_g1 S12 Q_g0ᵀ + P_g0 S21 Q_g1ᵀ + P_g1 S22 Q_g1ᵀ )

  (the top-right quadrant is the one with the high-pass *rows*), P on the rows, Q on the columns, and ``crop``
  the centred [out, in] window. g0 is the Daubechies filter ``dbN`` (L = 2N, ``db1`` the Haar one), computed
  here by spectral factorization at 50 digits (the minimum-phase root of each pair, normalised to ``Σ g0 = √2``):
  PEFT's table (from PyWavelets) to the last bit except db3, whose tabulated values are up to 3.6e-12 off.
* dtype: PEFT computes ΔW in the spectrum's dtype (float64 on a float64 base); so does this converter.

A wavelet-domain sparse spectrum gives a full-rank ΔW in general: no low-rank form, so WaveFT is served exactly as
a dense per-adapter ΔW, with ``dense=True`` only. PEFT's symlet (``symN``) and coiflet (``coifN``) families are
refused: their filters are tabulated, not derived here, and not verified.
"""

from __future__ import annotations

import functools
import re

import torch
from torch import Tensor

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.methods.dense import full_rank_slots, require_dense
from scute.adapters.registry import register_method
from scute.ops.slots import Slots

MAX_DB = 10  # PEFT's WaveFT layer knows db1..db10 (its config accepts up to db38 but the layer fails past db10)


@functools.cache
def daubechies(n: int) -> tuple[float, ...]:
    """The dbN low-pass reconstruction filter g0 (length 2N, PyWavelets' order), by spectral factorization.

    ``|m0(ω)|² = cos^{2N}(ω/2) · P(sin²(ω/2))`` with ``P(y) = Σ_{k<N} C(N−1+k, k) yᵏ``; each root y of P gives
    the pair z, 1/z with ``z + 1/z = 2 − 4y``: keep the one inside the unit circle, then
    ``g0 ∝ (1 + z⁻¹)^N · Π (1 − z_k z⁻¹)``, real, scaled to ``Σ g0 = √2``."""
    import mpmath  # a dependency of sympy, itself one of torch's

    with mpmath.workdps(50):
        poly = [mpmath.mpf(1)]  # ascending coefficients in z⁻¹
        def mul(p, q):
            out = [mpmath.mpc(0)] * (len(p) + len(q) - 1)
            for i, a in enumerate(p):
                for j, b in enumerate(q):
                    out[i + j] += a * b
            return out
        for _ in range(n):
            poly = mul(poly, [1, 1])
        if n > 1:
            # P's coefficients, highest degree first, for polyroots
            coeffs = [mpmath.binomial(n - 1 + k, k) for k in range(n - 1, -1, -1)]
            for y in mpmath.polyroots(coeffs, maxsteps=200, extraprec=200):
                b = 2 - 4 * y
                disc = mpmath.sqrt(b * b - 4)
                z = min(((b + disc) / 2, (b - disc) / 2), key=abs)
                poly = mul(poly, [1, -z])
        total = sum(poly)
        g0 = [mpmath.re(c / total) * mpmath.sqrt(2) for c in poly]
        return tuple(float(c) for c in g0)


def synthesis(f: Tensor, n: int, crop: int) -> Tensor:
    """P [2n + L − 2 − 2·crop, n]: one 1-D synthesis step (upsample by 2, filter with f), `crop` cut at each end."""
    L = f.shape[0]
    rows = 2 * n + L - 2 - 2 * crop
    tap = torch.arange(rows)[:, None] + crop - 2 * torch.arange(n)[None, :]  # [y, k] -> y + crop − 2k
    P = f[tap.clamp(0, L - 1)]
    return torch.where((tap >= 0) & (tap < L), P, torch.zeros((), dtype=f.dtype))


def idwt_delta(grid: Tensor, g0: Tensor) -> Tensor:
    """One level of PEFT's 2-D inverse DWT of the [H, W] coefficient grid (quadrants as in the module docstring)."""
    L = g0.shape[0]
    g1 = g0.flip(0) * (-1.0) ** torch.arange(L, dtype=g0.dtype)
    crop = (2 * L - 3) // 2
    H, W = grid.shape
    h, w = H // 2, W // 2
    P0, P1 = synthesis(g0, h, crop), synthesis(g1, h, crop)
    Q0, Q1 = synthesis(g0, w, crop), synthesis(g1, w, crop)
    return (P0 @ grid[:h, :w] @ Q0.T + P1 @ grid[:h, w:] @ Q0.T
            + P0 @ grid[h:, :w] @ Q1.T + P1 @ grid[h:, w:] @ Q1.T)


@register_method("WAVEFT", keys=("waveft_spectrum",))
def convert_waveft(layer: LayerCheckpoint) -> Slots:
    require_dense(layer, "WaveFT's delta is the inverse wavelet transform of a sparse spectrum: full rank in "
                         "general, no low-rank form")
    i, o = layer.in_features, layer.out_features
    cfg = layer.config
    family = str(cfg.get("wavelet_family", "db1"))
    use_idwt = bool(cfg.get("use_idwt", True))
    match = re.fullmatch(r"db(\d+)", family)
    if use_idwt and not (match and 1 <= int(match.group(1)) <= MAX_DB):
        raise layer.error(f"wavelet_family={family!r} is not supported: Scute rebuilds the Daubechies filters "
                          f"db1..db{MAX_DB} (PEFT's layer knows no others); the symlet and coiflet ones are not")
    seed = cfg.get("random_loc_seed", 777)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise layer.error(f"random_loc_seed={seed!r}: WaveFT's coefficient positions are regenerated from this "
                          "integer seed (they are not saved)")
    scaling = float(cfg.get("scaling", 25.0))

    n = layer.tensor("waveft_spectrum").shape[0] if layer.tensor("waveft_spectrum").dim() == 1 else -1
    if not 0 < n <= o * i:
        raise layer.error(f"waveft_spectrum has shape {tuple(layer.tensor('waveft_spectrum').shape)}: expected "
                          f"[n] with 0 < n ≤ out·in = {o * i}")
    spectrum = layer.tensor("waveft_spectrum", (n,))
    flat = torch.randperm(o * i, generator=torch.Generator().manual_seed(seed))[:n]
    rows, cols = flat // i, flat % i

    if not use_idwt:
        delta = torch.zeros(o, i, dtype=spectrum.dtype)
        delta[rows, cols] = spectrum
        return full_rank_slots(layer, delta * scaling)

    g0 = torch.tensor(daubechies(int(match.group(1))), dtype=spectrum.dtype)
    L = g0.shape[0]
    H, W = o + L - 2, i + L - 2
    H, W = H + H % 2, W + W % 2
    grid = torch.zeros(H, W, dtype=spectrum.dtype)
    grid[rows + (H - o) // 2, cols + (W - i) // 2] = spectrum
    full = idwt_delta(grid, g0) * scaling
    r0, c0 = (full.shape[0] - o) // 2, (full.shape[1] - i) // 2
    if r0 < 0 or c0 < 0:  # cannot happen with H, W as above; kept as a guard on the shape arithmetic
        raise layer.error(f"the inverse wavelet transform gave {tuple(full.shape)}, smaller than {o}×{i}")
    return full_rank_slots(layer, full[r0:r0 + o, c0:c0 + i].contiguous())
