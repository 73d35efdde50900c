"""RandLoRA.

PEFT forward (eval), with one shared pair of random bases A_s [r, 1, D_min] and B_s [D_max, NB, r] (saved as
``base_model.randlora_A/B``, and again under every layer), per layer ``nb = ⌈min(in, out) / r⌉`` bases and
trainable λ [r, nb], γ [nb, min(in, out)], s = randlora_alpha / r:

    Â = (λ[:, :, None] · A_s[:, :nb, :min] · γ[None]).flatten(0, 1)     [r·nb, min]   (rows ordered (i, j))
    B̂ = B_s[:max, :nb, :].flatten(1)                                    [max, nb·r]   (columns ordered (j, i))
    in ≤ out:  y = W0 x + b0 + s · B̂ (Â x)          in > out:  y = W0 x + b0 + s · Âᵀ (B̂ᵀ x)

(PEFT contracts Â's rows with B̂'s columns position by position, whatever their index order; so does Scute.)
Normal form: an exact LoRA of rank r·nb ≥ min(in, out) — the per-adapter factor (Â, or Âᵀ) on one side, the
shared basis (B̂, or B̂ᵀ) on the other, interned so adapters with the same bases share it. Full rank: each adapter
moves about min(in, out)² elements per layer (`scute explain` shows it), still no more than a dense ΔW.
"""

from __future__ import annotations

from torch import Tensor

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.registry import register_method
from scute.ops.slots import Slots


def _basis(layer: LayerCheckpoint, key: str) -> Tensor:
    """A shared basis: the layer's copy if saved there (PEFT saves one per layer), else the model-level one."""
    if layer.has(key):
        return layer.tensor(key)
    if layer.config.get("save_projection") is False:
        raise layer.error("save_projection=False: PEFT draws RandLoRA's bases in bf16 or fp16 depending on the "
                          "hardware, so they cannot be regenerated exactly; re-save with save_projection=True")
    return layer.global_tensor(key)


@register_method("RANDLORA", keys=("randlora_lambda", "randlora_gamma", "randlora_A", "randlora_B"),
                 global_keys=("randlora_A", "randlora_B"))
def convert_randlora(layer: LayerCheckpoint) -> Slots:
    i, o = layer.in_features, layer.out_features
    lo, hi = min(i, o), max(i, o)
    r = int(layer.config["r"])
    nb = -(-lo // r)
    lam = layer.tensor("randlora_lambda", (r, nb))
    gamma = layer.tensor("randlora_gamma", (nb, lo))
    a_s, b_s = _basis(layer, "randlora_A"), _basis(layer, "randlora_B")
    if a_s.dim() != 3 or a_s.shape[0] != r or a_s.shape[2] < lo:
        raise layer.error(f"basis randlora_A has shape {tuple(a_s.shape)}; this layer needs [{r}, ·, ≥{lo}]")
    if b_s.dim() != 3 or b_s.shape[0] < hi or b_s.shape[1] < nb or b_s.shape[2] != r:
        raise layer.error(f"basis randlora_B has shape {tuple(b_s.shape)}; this layer needs [≥{hi}, ≥{nb}, {r}]")
    a_hat = (lam[:, :, None] * a_s[:, :nb, :lo] * gamma[None]).flatten(0, 1)  # [r·nb, lo]
    b_hat = b_s[:hi, :nb, :].flatten(1)  # [hi, nb·r]
    scale = float(layer.config["randlora_alpha"]) / r
    if i <= o:
        return Slots(i, o, A=a_hat, B=layer.intern(b_hat), scale=scale, shared=frozenset({"B"}))
    return Slots(i, o, A=layer.intern(b_hat.T), B=a_hat.T.contiguous(), scale=scale, shared=frozenset({"A"}))
