"""Base-layer shapes without the base model's weights, for `scute explain`.

From a local Hugging Face folder or GGUF file: its config only, the model built on the meta device (nothing is
downloaded, no weights are loaded). From the adapter alone: each method's registered shape rule reads (out, in)
off the shapes of its saved tensors, where they fix them (LoRA, DoRA, AdaLoRA, LoHa, LoKr, BOFT, VB-LoRA, DeLoRA,
HiRA); other methods need a base model.
"""

from __future__ import annotations

import os
import re

import torch

from scute.adapters.checkpoint import GLOBAL_PREFIX, LAYER_PREFIX, AdapterCheckpoint
from scute.adapters.conversion import checkpoint_method, linear_modules
from scute.adapters.registry import SavedShapes, ShapeRule


class StandIn:
    """A base layer with the right shape and bias presence; its values (a constant, no memory) do not matter to
    explain's counts."""

    def __init__(self, out_features: int, in_features: int, bias: bool) -> None:
        self.weight = torch.full((1, 1), in_features ** -0.5).expand(out_features, in_features)
        self.bias = torch.zeros(out_features) if bias else None


def shapes_from_model(model: str | os.PathLike) -> dict[str, tuple[int, int, bool]]:
    """(out, in, has bias) of every linear layer of a local HF folder or GGUF file, built on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = os.fspath(model)
    if path.endswith(".gguf") and os.path.isfile(path):
        config = AutoConfig.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path),
                                            local_files_only=True)
    elif os.path.isfile(os.path.join(path, "config.json")):
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    else:
        raise ValueError(f"--model {path}: not a local Hugging Face folder (config.json) nor a .gguf file")
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    return {n: (*m.weight.shape, m.bias is not None) for n, m in linear_modules(meta).items()}


def shapes_from_tensors(ckpt: AdapterCheckpoint) -> dict[str, tuple[int, int, bool]]:
    """Layer shapes the adapter's tensors determine, by the method's registered shape rule; raises if some
    layer's are not determined (pass a model then)."""
    method = checkpoint_method(ckpt)
    suffixes = sorted(method.keys + ("base_layer.bias",), key=len, reverse=True)
    groups: dict[str, dict[str, tuple[int, ...]]] = {}
    model_level = {}
    for key, x in ckpt.tensors.items():
        rel = key.removeprefix(LAYER_PREFIX)
        if suffix := next((s for s in suffixes if rel.endswith("." + s)), None):
            groups.setdefault(rel[: -len(suffix) - 1], {})[suffix] = tuple(x.shape)
        elif key.startswith(GLOBAL_PREFIX) and not key.startswith(LAYER_PREFIX):
            model_level[key.removeprefix(GLOBAL_PREFIX)] = tuple(x.shape)
    shapes, unknown = {}, []
    for module, t in groups.items():
        if dims := _saved_dims(method.shapes, SavedShapes(t, model_level, ckpt.config)):
            shapes[module] = (*dims, "base_layer.bias" in t)
        else:
            unknown.append(module)
    shapes = dict(sorted(shapes.items(), key=_natural))  # the checkpoint's order is alphabetical
    if unknown:
        raise ValueError(f"the tensors of {ckpt.peft_type} adapter {ckpt.path} do not determine the shape of "
                         f"{unknown[0]} ({len(unknown)} such layers): pass --model (a local HF folder or .gguf file)")
    return shapes


def _saved_dims(rule: ShapeRule | None, saved: SavedShapes) -> tuple[int, int] | None:
    """(out, in) by the method's shape rule; None without a rule or where a tensor it needs is not saved."""
    try:
        return None if rule is None else rule(saved)
    except KeyError:
        return None


def _natural(item: tuple[str, object]) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", item[0])]
