"""BOFT (butterfly orthogonal fine-tuning).

PEFT forward (eval): ``y = s ⊙ (W0 Mᵀ x) + b0`` — the bias is *not* scaled — with ``M = B_{N−1} ··· B_1 B_0``,
``B_i = P_i · blockdiag(Q_{i,0}, …, Q_{i,D−1}) · P_iᵀ``, ``Q = (I − S)(I + S)⁻¹``, ``S = ½(R − Rᵀ)`` for each
stored b×b block R, and ``P_i`` the butterfly permutation of factor i (rebuilt, not saved; the identity when
N = 1). M is block-diagonal with blocks of ``L = b·2^(N−1)``, so the normal form is ``T = blocks of Mᵀ``,
``o = s``, ``c = (1 − s) ⊙ b0``, all live. PEFT without its CUDA extension (any CPU) forces N = 1; the general
N is implemented here all the same.
"""

from __future__ import annotations

import torch
from torch import Tensor

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.registry import register_method
from scute.ops.slots import Slots


def butterfly_perm(n: int, blocks: int, r: int, factors: int) -> Tensor:
    """PEFT's `block_butterfly_perm`: inside each of `blocks` blocks, chunks of r move evens first, then odds."""
    if factors == 0:
        return torch.arange(n)
    size = n // blocks
    starts = torch.cat((torch.arange(0, size // r, 2), torch.arange(1, size // r, 2)))
    order = (starts[:, None] * r + torch.arange(r)).flatten()
    return (torch.arange(0, n, size)[:, None] + order).flatten()


def cayley(R: Tensor) -> Tensor:
    """[k, b, b] parameters -> orthogonal blocks ``(I − S)(I + S)⁻¹``, S the skew part (PEFT's exact solve)."""
    S = 0.5 * (R - R.transpose(-2, -1))
    eye = torch.eye(R.shape[-1], dtype=R.dtype).expand_as(R)
    return torch.linalg.solve(eye + S, eye - S, left=False)


def butterfly_blocks(Q: Tensor, n: int) -> Tensor:
    """M = B_{N−1} ··· B_0 as its diagonal blocks [n/L, L, L], from Q [N, D, b, b] (D·b = n)."""
    N, D, b, _ = Q.shape
    L = b * 2 ** (N - 1)
    k, m = n // L, L // b  # big blocks, small blocks per big block
    eye = torch.eye(m, dtype=Q.dtype)
    M = None
    for i in range(N):
        # the permutation never leaves a big block and is the same in each: use its first block's part
        p = butterfly_perm(n, D // 2**i, b // 2, N - 1)[:L]
        diag = torch.einsum("kjab,jl->kjalb", Q[i].reshape(k, m, b, b), eye).reshape(k, L, L)
        Bi = diag[:, p][:, :, p]  # P · blockdiag · Pᵀ, with P[j, p[j]] = 1
        M = Bi if M is None else Bi @ M
    return M


@register_method("BOFT", keys=("boft_R", "boft_s"),  # R: [N, D, b, b] with D·b = in, s: [out, 1]
                 shapes=lambda s: (s.tensors["boft_s"][0], s.tensors["boft_R"][1] * s.tensors["boft_R"][2]))
def convert_boft(layer: LayerCheckpoint) -> Slots:
    i, o = layer.in_features, layer.out_features
    R = layer.tensor("boft_R")
    if R.dim() != 4 or R.shape[2] != R.shape[3] or R.shape[1] * R.shape[2] != i:
        raise layer.error(f"boft_R has shape {tuple(R.shape)}: needs [N, D, b, b] with D·b = in_features = {i}")
    N, D, b, _ = R.shape
    if N > 1 and (D % 2 ** (N - 1) or b % 2):
        raise layer.error(f"boft_R has shape {tuple(R.shape)}: {N} butterfly factors need D divisible by "
                          f"2^{N - 1} and an even block size")
    s = layer.tensor("boft_s", (o, 1))[:, 0]
    Q = cayley(R.reshape(N * D, b, b)).reshape(N, D, b, b)
    T = butterfly_blocks(Q, i).transpose(-2, -1).contiguous()
    c = None if layer.bias is None else (1 - s) * layer.bias
    return Slots(i, o, t_blocks=T, o=s, c=c)
