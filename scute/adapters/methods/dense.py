"""Methods with no exact low-rank form: served as a dense per-adapter ΔW when the user asks, refused otherwise.

A dense ΔW [out, in] is written in the normal form as a full-rank pair of rank ``k = min(in, out)``: the identity
on the thinner side (one interned, *shared* tensor per size, so it costs nothing per adapter) and ΔW on the other
(``A = I, B = ΔW`` if in ≤ out, else ``A = ΔW, B = I``). Exact, but every adapter then moves in·out elements per
layer and the kernels do about twice the FLOPs of the base GEMM for its tokens: `scute explain` shows it. It is
an opt-in (``load_adapter(..., dense=True)``); without it the converter refuses, naming why no low-rank form
exists. Methods that cannot be served even densely (the output depends on the batch, on the hidden state, or on
random draws) are always refused.

HiRA (PEFT forward ``y = W0 x + b0 + (W0 ⊙ B A) x``) lives here: its delta is a Hadamard product with W0, which
has no shared-W0 low-rank form for r > 1 (nor for r = 1: ``diag(b) W0 diag(a)`` needs a second pass through W0).
"""

from __future__ import annotations

import torch
from torch import Tensor

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.registry import register_method
from scute.ops.slots import Slots


def full_rank_slots(layer: LayerCheckpoint, delta: Tensor, c: Tensor | None = None) -> Slots:
    """ΔW [out, in] as exact slots of rank min(in, out), the identity side shared (see the module docstring)."""
    i, o = layer.in_features, layer.out_features
    eye = layer.intern(torch.eye(min(i, o), dtype=delta.dtype))
    if i <= o:
        return Slots(i, o, A=eye, B=delta, c=c, shared=frozenset({"A"}))
    return Slots(i, o, A=delta, B=eye, c=c, shared=frozenset({"B"}))


def require_dense(layer: LayerCheckpoint, why: str) -> None:
    """Refuse unless the user opted into dense serving; `why` says why there is no low-rank form."""
    if not layer.dense:
        kib = layer.in_features * layer.out_features * 2 / 1024
        raise layer.error(
            f"{why}. It is exact only as a dense per-adapter ΔW ({layer.out_features}×{layer.in_features}, "
            f"{kib:,.0f} KiB per layer per adapter in bf16); pass dense=True to load_adapter to serve it that way"
        )


def refuse(layer: LayerCheckpoint, why: str) -> None:
    raise layer.error(f"cannot be served: {why}")


@register_method("HIRA", keys=("hira_A", "hira_B"), shapes=lambda s: (s.tensors["hira_B"][0], s.tensors["hira_A"][1]))
def convert_hira(layer: LayerCheckpoint) -> Slots:
    require_dense(layer, "HiRA's delta W0 ⊙ (B A) is a Hadamard product with the base weight: no low-rank form "
                         "over a shared W0")
    A = layer.tensor("hira_A")
    r = A.shape[0]
    A = layer.tensor("hira_A", (r, layer.in_features))
    B = layer.tensor("hira_B", (layer.out_features, r))
    return full_rank_slots(layer, layer.weight * (B @ A))


@register_method("LILY", keys=("lily_A.weight", "lily_B.weight", "lily_router.weight"), served=False)
def convert_lily(layer: LayerCheckpoint) -> Slots:
    refuse(layer, "Lily mixes its up-projections with router weights averaged over all tokens of the batch, so "
                  "a request's output depends on the other requests batched with it")

