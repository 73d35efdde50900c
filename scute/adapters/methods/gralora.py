"""GraLoRA (granular low-rank adaptation), with its optional hybrid LoRA.

PEFT forward (eval, dropout the identity), for ``k = gralora_k``, rank ``r`` (divisible by k, ``s = r / k``), the
input split into k chunks ``x_n`` of ``d = in / k`` and the output into k chunks ``y_j`` of ``D = out / k``;
``gralora_A`` [k, d, r], ``gralora_B`` [k, r, D] and the scale ``σ = alpha / (r + hybrid_r)``:

    h_n      = gralora_A[n]ᵀ x_n                                    [r]   (the rank of chunk n, read as k groups of s)
    y_j      = Σ_n Σ_q h_n[j·s + q] · gralora_B[j, n·s + q, :]       [D]   (group j of every h_n feeds output chunk j)
    y        = W0 x + b0 + σ · ([y_0 | … | y_{k−1}] + B_h A_h x)    (B_h A_h: the hybrid LoRA, if hybrid_r > 0)

So output chunk j reads input chunk n through the rank-s product
``ΔW[j, n] = gralora_B[j, n·s:(n+1)·s, :]ᵀ · gralora_A[n, :, j·s:(j+1)·s]ᵀ`` — k×k sub-blocks of rank s, k·r in all.

Normal form: an exact LoRA of rank ``R = k·r + hybrid_r`` with ``s = σ``, rank index ``n·r + c`` for chunk n's
rank c (then the hybrid ranks):

    A [R, in]:  A[n·r + c, n·d:(n+1)·d] = gralora_A[n, :, c]                  (block diagonal)
    B [out, R]: B[j·D:(j+1)·D, n·r + j·s + q] = gralora_B[j, n·s + q, :]        (rank n·r + c feeds chunk j = c // s)
    A[k·r:] = gralora_A_general.weight,  B[:, k·r:] = gralora_B_general.weight

The factors are stored dense (k·r rows of A and columns of B, each with in/k or out/k non-zeros): k times the
parameters PEFT trains, exactly the same map. A trained bias (``bias="all"``/``"gralora_only"``) is the loader's
generic ``base_layer.bias`` correction. No config option of PEFT's GraLoRA changes the eval forward beyond these
(``fan_in_fan_out`` is refused by the loader for every method; there is no rank or alpha pattern).
"""

from __future__ import annotations

import torch

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.registry import register_method
from scute.ops.slots import Slots


def _int_option(layer: LayerCheckpoint, key: str, default: int, minimum: int) -> int:
    value = layer.config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise layer.error(f"{key}={value!r} in adapter_config.json: PEFT's GraLoRA needs an integer ≥ {minimum}")
    return value


@register_method("GRALORA", keys=("gralora_A", "gralora_B", "gralora_A_general.weight",
                                  "gralora_B_general.weight"))
def convert_gralora(layer: LayerCheckpoint) -> Slots:
    i, o = layer.in_features, layer.out_features
    r = _int_option(layer, "r", 32, 1)
    k = _int_option(layer, "gralora_k", 2, 1)
    hybrid = _int_option(layer, "hybrid_r", 0, 0)
    if r % k:
        raise layer.error(f"r={r} is not divisible by gralora_k={k} (PEFT's GraLoRA requires it)")
    if i % k or o % k:
        raise layer.error(f"gralora_k={k} does not divide in_features={i} and out_features={o} "
                          "(PEFT's GraLoRA requires it)")
    d, D, s = i // k, o // k, r // k
    a = layer.tensor("gralora_A", (k, d, r))
    b = layer.tensor("gralora_B", (k, r, D))

    A = torch.zeros(k * r + hybrid, i, dtype=a.dtype)
    B = torch.zeros(o, k * r + hybrid, dtype=b.dtype)
    for n in range(k):  # input chunk n: its r ranks, the j-th group of s feeding output chunk j
        A[n * r:(n + 1) * r, n * d:(n + 1) * d] = a[n].T
        for j in range(k):
            B[j * D:(j + 1) * D, n * r + j * s:n * r + (j + 1) * s] = b[j, n * s:(n + 1) * s, :].T
    if hybrid:
        A[k * r:] = layer.tensor("gralora_A_general.weight", (hybrid, i))
        B[:, k * r:] = layer.tensor("gralora_B_general.weight", (o, hybrid))
    elif layer.has("gralora_A_general.weight") or layer.has("gralora_B_general.weight"):
        raise layer.error("the file has hybrid LoRA tensors (gralora_*_general) but the config has hybrid_r=0")

    alpha = layer.config.get("alpha", 64)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise layer.error(f"alpha={alpha!r} in adapter_config.json is not a number")
    return Slots(i, o, A=A, B=B, scale=alpha / (r + hybrid))
