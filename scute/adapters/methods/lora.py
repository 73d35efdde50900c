"""LoRA (incl. rsLoRA, rank/alpha patterns, lora_bias, bias="all"/"lora_only") and, with `use_dora`, DoRA.

PEFT forward (eval): ``y = W0 x + b0 + s·(B (A x) + b_B)``, ``s = α/r`` (rsLoRA: ``α/√r``), per-layer r and α
from `rank_pattern` / `alpha_pattern`. Normal form: A, B with s (folded into B at load), ``c = s·b_B``. A plain
LoRA adapter (no bias, DoRA or variant) is converted all layers at once (`convert_plain_lora`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from scute.adapters.adapter import Pause, paused
from scute.adapters.checkpoint import Landing
from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.methods.dora import dora_slots
from scute.adapters.methods.lora_variants import REFUSED, TRAINING_ONLY_KEYS, lora_factors
from scute.adapters.registry import SavedShapes, register_method
from scute.adapters.targeting import pattern_value
from scute.ops.reference import acc_dtype
from scute.ops.slots import Slots

KEYS = ("lora_A.weight", "lora_B.weight", "lora_B.bias", "lora_magnitude_vector") + TRAINING_ONLY_KEYS


def lora_scale(config: Mapping, name: str) -> tuple[int, float]:
    """(r, s) of module `name`, resolving PEFT's rank_pattern / alpha_pattern by module name."""
    r = int(pattern_value(config.get("rank_pattern"), name, config["r"]))
    alpha = pattern_value(config.get("alpha_pattern"), name, config.get("lora_alpha", 8))
    return r, alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def lora_shape(s: SavedShapes) -> tuple[int, int] | None:
    """(out, in) from B [out, r] and A [r, in]; BD-LoRA's blocked factors do not fix them."""
    if s.config.get("use_bdlora"):
        return None
    return s.tensors["lora_B.weight"][0], s.tensors["lora_A.weight"][1]


def convert_plain_lora(config: Mapping, layers: Mapping[str, Mapping[str, Tensor]], modules: Mapping[str, nn.Module],
                       served: Landing | None, pause: Pause) -> dict[str, Slots] | None:
    """Every layer of a plain LoRA adapter at once (`register_method`'s ``whole``): the slots `convert_lora` makes
    (A, B and s of each layer), with a few lookups a layer where the per-layer path builds a `LayerCheckpoint` and
    runs the variants' checks (a few ms of an adapter of 224 layers). Tensors given in the serving dtype (a bf16
    file served in bf16: `served`, their values landing later) are folded where they are instead, ``B ← s·B`` in
    place once they land (a float32 product rounded once to that dtype: the value that folding in float32 and
    casting gives), so the layers are served as the file's views, with no float32 copy, fold or pack. None for
    any other adapter: DoRA, a variant (`lora_variants.py`), a bias (``lora_bias``, ``bias="all"``), tensors of
    other shapes or dtypes; `convert_lora` converts those, or says why it refuses them. `pause` every 16 layers
    checked and every 32 made."""
    if "r" not in config or any(config.get(key) for key in ("use_dora", "use_bdlora", *REFUSED)) or not layers:
        return None
    found, read, weights = [], set(), set()
    uniform = not config.get("rank_pattern") and not config.get("alpha_pattern")
    r, s = lora_scale(config, "") if uniform else (0, 0.0)
    for k, (name, tensors) in enumerate(layers.items()):
        if k % 16 == 0:
            pause()
        A, B, weight = tensors.get("lora_A.weight"), tensors.get("lora_B.weight"), modules[name].weight
        if len(tensors) != 2 or A is None or B is None:
            return None
        if not uniform:
            r, s = lora_scale(config, name)
        o, i = weight.shape
        if A.shape != (r, i) or B.shape != (o, r):
            return None
        read |= {A.dtype, B.dtype}
        weights.add(weight.dtype)
        found.append((name, i, o, r, A, B, s))
    accs = {acc_dtype(dtype) for dtype in weights}
    like: dict[tuple, Slots] = {}  # a slot per shape, validated; the others are made from it, of its shapes

    def slots(i: int, o: int, r: int, A: Tensor, B: Tensor, **fields) -> Slots:
        first = like.get((i, o, r))
        if first is None:
            first = like[i, o, r] = Slots(i, o, A=A, B=B, **fields)
        return first.with_same_shapes(A=A, B=B, **fields)

    if served is not None and read == {served.dtype} and accs == {acc_dtype(served.dtype)}:
        served.then(lambda: _fold_in_place(found, pause))  # B·s in acc, rounded once to the dtype
        return {n: slots(i, o, r, A, B, merged=("s",)) for n, i, o, r, A, B, _ in paused(found, pause, 32)}
    if len(accs) != 1 or read != accs:  # not in the converter dtype (`LayerCheckpoint.dtype`): the per-layer path
        return None
    return {n: slots(i, o, r, A, B, scale=s) for n, i, o, r, A, B, s in paused(found, pause, 32)}


def _fold_in_place(found: list[tuple], pause: Pause) -> None:
    """Each layer's B multiplied by its s where it is, in float32 (on a GPU one `torch._foreach_mul_` per distinct
    s and 32 layers; on the CPU, whose foreach rounds s to the tensors' dtype first, each alone), `pause` every 32
    layers."""
    by_scale: dict[float, list[Tensor]] = {}
    for *_, B, s in found:
        by_scale.setdefault(s, []).append(B)
    for s, Bs in by_scale.items():
        for k in range(0, len(Bs), 32):
            pause()
            if Bs[k].is_cuda:
                torch._foreach_mul_(Bs[k:k + 32], s)
            else:
                for B in Bs[k:k + 32]:
                    B.mul_(s)


@register_method("LORA", keys=KEYS, shapes=lora_shape, on_device=True, whole=convert_plain_lora)
def convert_lora(layer: LayerCheckpoint) -> Slots:
    r, s = lora_scale(layer.config, layer.name)
    A, B = lora_factors(layer, r)  # variants sharing peft_type LORA: see lora_variants.py
    if layer.config.get("use_dora"):
        return dora_slots(layer, A, B, s)
    c = s * layer.tensor("lora_B.bias", (layer.out_features,)) if layer.has("lora_B.bias") else None
    return Slots(layer.in_features, layer.out_features, A=A, B=B, c=c, scale=s)
