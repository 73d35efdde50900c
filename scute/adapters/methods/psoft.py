"""PSOFT (orthogonal fine-tuning in the principal subspace).

PEFT forward (eval, dropout off), per adapted `nn.Linear`:

    y = W0 x + b0 + s · B (R − I) A x,        s = psoft_alpha / r

* A [r, in] and B [out, r] are **not saved** (non-persistent buffers): PEFT rebuilds them whenever it builds the
  layer, at `get_peft_model` and at load, from an SVD of W0 **in float32 whatever the model dtype**:
  ``W0.float() = U S Vᵀ``, the top r triplets, ``S' = S[:r] / s`` (float32) and
  ``psoft_init`` (default): ``A = Vᵀ[:r]``, ``B = U[:, :r] · diag(S')``;
  ``pissa_init``: ``A = diag(√S') Vᵀ[:r]``, ``B = U[:, :r] · diag(√S')``.
  `psoft_svd="full"` is ``torch.linalg.svd(W, full_matrices=False)``; `"lowrank"` is
  ``torch.svd_lowrank(W, q=r, niter=psoft_svd_lowrank_niter)`` with the CPU generator seeded by the config's
  `random_seed` (a config without `random_seed`, from a PEFT that did not seed it, drew from whatever RNG state
  PEFT had when it built the layer: refused).
* R [r, r] from `psoft_R.weight`: with `psoft_orth` the upper triangle of a skew matrix Q and
  ``R = (I + Q)(I − Q)⁻¹`` (exact solve), or with `use_cayley_neumann` PEFT's truncated series for
  t = num_cayley_neumann_terms: ``I + 2(Q + … + Q^k) + Q^{k+1}`` with k = max(2, t − 2) for t ≥ 3 (so t = 3 and
  t = 4 are both I + 2Q + 2Q² + Q³), I + 2Q for t = 2, I for t = 1; Q first scaled by
  ``eps / (‖Q‖_F + 1e−12)`` when ``‖Q‖_F > cayley_neumann_eps``. Without `psoft_orth` R is the saved [r, r]
  weight as is. Then the magnitudes: ``R ← diag(vector_b) R diag(vector_a)`` (each only if saved:
  `psoft_mag_b`, `psoft_mag_a`).

Normal form: an exact rank-r LoRA, **A' = (R − I) A** [r, in], **B** [out, r], **s**; no m, v, c, T or U
(`folded()` puts s into B at load).

Not sign-invariant. Flipping the sign of singular pair i (``A_i → −A_i``, ``B_:,i → −B_:,i``) turns ``R − I``
into ``D (R − I) D``, which flips R's off-diagonal entries in row and column i: R was trained in *the* basis
PEFT's SVD returned, so Scute reproduces PEFT's exact call (same function, float32, same W0, on the CPU where
converters run) rather than any sign-invariant quantity. This matches PEFT loading the adapter on the CPU. An
adapter trained on a GPU was trained against cuSOLVER's singular vectors, whose signs (and, for (near-)equal
singular values, whose basis of that subspace) LAPACK need not reproduce, and with `lowrank` against CUDA's random
draws, which are not the CPU's for the same seed; PEFT itself then computes a different function when it loads
that adapter on a CPU. Nothing in the checkpoint tells which basis R was trained in.
"""

from __future__ import annotations

import torch
from torch import Tensor

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.registry import register_method
from scute.ops.slots import Slots

KEYS = ("psoft_R.weight", "psoft_R.vector_a", "psoft_R.vector_b")


def principal_factors(layer: LayerCheckpoint, r: int, scaling: float) -> tuple[Tensor, Tensor]:
    """PEFT's frozen A [r, in] and B [out, r], rebuilt from W0 in float32 and returned in the layer's dtype."""
    cfg = layer.config
    W = layer.weight.float()  # PEFT: base weight -> float32, whatever the model dtype
    mode = cfg.get("psoft_svd", "full")
    if mode == "full":
        U, S, Vh = torch.linalg.svd(W, full_matrices=False)
        left, sv, right = U[:, :r], S[:r], Vh[:r]
    elif mode == "lowrank":
        if "random_seed" not in cfg:
            raise layer.error(
                "psoft_svd='lowrank' is set without random_seed: torch.svd_lowrank's random projection was drawn "
                "from the global RNG state PEFT happened to have when it built this layer, so A and B cannot be "
                "rebuilt; retrain with psoft_svd='full' or with a PEFT version that saves random_seed"
            )
        with torch.random.fork_rng(devices=[]):  # only the CPU generator is seeded (and restored): CUDA untouched
            torch.random.default_generator.manual_seed(int(cfg["random_seed"]))
            U, S, V = torch.svd_lowrank(W, q=r, niter=int(cfg.get("psoft_svd_lowrank_niter", 10)))
        left, sv, right = U[:, :r], S[:r], V[:, :r].T
    else:
        raise layer.error(f"psoft_svd={mode!r} is set: PEFT knows only 'full' and 'lowrank'")
    scaled = sv / scaling  # float32, as PEFT divides
    init = cfg.get("ab_svd_init", "psoft_init")
    if init == "psoft_init":
        A, B = right, left * scaled  # U·diag(S') column by column (one exact product per entry)
    elif init == "pissa_init":
        root = torch.sqrt(scaled)
        A, B = root[:, None] * right, left * root
    else:
        raise layer.error(f"ab_svd_init={init!r} is set: PEFT knows only 'psoft_init' and 'pissa_init'")
    return A.to(layer.dtype), B.to(layer.dtype)


def neumann_cayley(Q: Tensor, terms: int) -> Tensor:
    """PEFT's truncated Cayley–Neumann polynomial for (I + Q)(I − Q)⁻¹ with `terms` terms (see module doc)."""
    R = torch.eye(Q.shape[0], dtype=Q.dtype)
    if terms >= 2:
        R = R + 2 * Q
    if terms >= 3:
        power = Q @ Q
        R = R + 2 * power
        for _ in range(terms - 4):  # 2Q³ … 2Q^{t−2}
            power = power @ Q
            R = R + 2 * power
        R = R + power @ Q  # the last power, coefficient 1
    return R


def rotation(layer: LayerCheckpoint, r: int) -> Tensor:
    """PEFT's R [r, r] (`OrthLayer.get_matrix`), magnitudes included, in the layer's dtype."""
    cfg = layer.config
    if cfg.get("psoft_orth", True):
        params = layer.tensor(KEYS[0], (r * (r - 1) // 2,))
        rows, cols = torch.triu_indices(r, r, 1)
        Q = params.new_zeros(r, r)
        Q[rows, cols] = params
        Q = Q - Q.T
        if cfg.get("use_cayley_neumann", False):
            terms = int(cfg.get("num_cayley_neumann_terms", 5))
            if terms < 1:
                raise layer.error(f"num_cayley_neumann_terms={terms} is set: PEFT needs a positive number")
            eps = cfg.get("cayley_neumann_eps")
            if eps is not None:
                norm = torch.linalg.norm(Q, ord="fro")
                if norm > eps:
                    Q = Q * (eps / (norm + 1e-12))
            R = neumann_cayley(Q, terms)
        else:
            eye = torch.eye(r, dtype=Q.dtype)
            R = torch.linalg.solve(eye - Q, eye + Q, left=False)  # (I + Q)(I − Q)⁻¹; I − Q is invertible
    else:
        R = layer.tensor(KEYS[0], (r, r))
    if cfg.get("psoft_mag_b", True):
        R = layer.tensor(KEYS[2], (r,))[:, None] * R
    if cfg.get("psoft_mag_a", True):
        R = R * layer.tensor(KEYS[1], (r,))[None, :]
    return R


@register_method("PSOFT", keys=KEYS)
def convert_psoft(layer: LayerCheckpoint) -> Slots:
    i, o = layer.in_features, layer.out_features
    cfg = layer.config
    r = int(cfg.get("r", 32))
    if not 0 < r <= min(i, o):
        raise layer.error(f"r={r} does not fit this layer: PEFT needs 0 < r ≤ min(in, out) = {min(i, o)}")
    scaling = cfg.get("psoft_alpha", 32) / r
    if scaling == 0:
        raise layer.error("psoft_alpha=0 is set: PEFT divides the singular values by psoft_alpha / r")
    R = rotation(layer, r)
    A, B = principal_factors(layer, r, scaling)
    A = (R - torch.eye(r, dtype=R.dtype)) @ A
    if not (torch.isfinite(A).all() and torch.isfinite(B).all()):
        raise layer.error(f"the rebuilt factors are not finite (ab_svd_init={cfg.get('ab_svd_init')!r}, "
                          f"psoft_alpha={cfg.get('psoft_alpha')!r}): PEFT's own output is NaN or Inf here")
    return Slots(i, o, A=A, B=B, scale=scaling)
