"""Load the base model (a Hugging Face folder, a GGUF file, or a built transformers model), route its
attention through Scute's paged attention, and swap its linear layers for `ScuteLinear`."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from scute.config import EngineConfig
from scute.model.attention import ATTENTION_NAME, register_attention
from scute.model.hf import swap_linears
from scute.model.layers import fuse_layers
from scute.model.linear import ScuteLinear
from scute.model.tp import attach_shards, shard_model


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object | None
    linears: dict[str, ScuteLinear]
    eos_token_ids: list[int]
    max_position_embeddings: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    adapter_base: nn.Module  # what adapters are converted against: the model, or the full layers of a sharded one


def load_model(model, tokenizer, config: EngineConfig, rank: int = 0) -> LoadedModel:
    """`model`: a folder with a transformers checkpoint, a ``.gguf`` file, or a built `PreTrainedModel`
    (taken over: its linear layers are swapped in place). `tokenizer` overrides the one found beside the
    weights; a built model without one can only take token-id prompts. With ``config.tensor_parallel_size``
    N > 1: rank `rank`'s share of a model given as a path (`scute.model.tp`), its KV heads N times fewer."""
    register_attention()
    device, dtype, world_size = config.torch_device(), config.torch_dtype(), config.tensor_parallel_size
    if isinstance(model, (str, os.PathLike)):
        model, found = _from_path(os.fspath(model), dtype)
        tokenizer = tokenizer if tokenizer is not None else found
    elif not isinstance(model, nn.Module):
        raise TypeError(f"model must be a folder, a .gguf file or a transformers model, got {type(model).__name__}")
    elif world_size > 1:
        raise ValueError(NEEDS_A_PATH)
    _check_supported(model)
    model.config._attn_implementation = ATTENTION_NAME  # set_attn_implementation() validates names per version
    shards, adapter_base = shard_model(model, rank, world_size) if world_size > 1 else ({}, model)
    model.to(device=device, dtype=dtype) if dtype is not None else model.to(device=device)
    model.eval().requires_grad_(False)
    linears = swap_linears(model, config.max_adapters)
    attach_shards(linears, shards)
    fuse_layers(model)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return LoadedModel(
        model=model, tokenizer=tokenizer, linears=linears, eos_token_ids=_eos_token_ids(model, tokenizer),
        max_position_embeddings=getattr(cfg, "max_position_embeddings", None) or 2048,
        num_layers=cfg.num_hidden_layers, num_kv_heads=(getattr(cfg, "num_key_value_heads", None)
                                                        or cfg.num_attention_heads) // world_size,
        head_dim=head_dim, dtype=next(model.parameters()).dtype, device=device, adapter_base=adapter_base,
    )


NEEDS_A_PATH = ("tensor_parallel_size > 1 needs the model as a path (a Hugging Face folder or a .gguf file), "
                "not a built model: every rank's process loads it from there; save it with save_pretrained")


def model_files(path: str) -> tuple[str, str | None]:
    """A base model's folder and its ``.gguf`` file (None: a Hugging Face folder), read from local files only
    (``local_files_only=True``: a folder whose config names a hub model, an adapter's base or a tokenizer's, is not
    fetched). Raises FileNotFoundError for no such folder or file, ValueError for a folder that is not a model's."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        return os.path.split(os.path.abspath(path))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model {path!r}: no such folder or .gguf file (Scute never downloads weights)")
    if not os.path.exists(os.path.join(path, "config.json")):
        adapter = os.path.exists(os.path.join(path, "adapter_config.json"))
        raise ValueError(f"model {path!r}: " + ("a PEFT adapter folder, not a base model: give the base model, and "
                                                "the adapter as an adapter of it" if adapter else
                                                "no config.json: not a Hugging Face model folder"))
    return path, None


def _from_path(path: str, dtype: torch.dtype | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"dtype": dtype or "auto", "attn_implementation": ATTENTION_NAME, "local_files_only": True}
    folder, file = model_files(path)
    if file is not None:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file, local_files_only=True)
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, **kwargs), tokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        tokenizer = None  # weights without a tokenizer: token-id prompts only
    return AutoModelForCausalLM.from_pretrained(path, **kwargs), tokenizer


def _check_supported(model: nn.Module) -> None:
    layers = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "head_dim")]
    if not layers or not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"{type(model).__name__} does not route its attention through transformers' AttentionInterface; "
            "Scute serves decoder models that do (Llama, Mistral, Qwen2, Qwen3, ...)"
        )


def _eos_token_ids(model: nn.Module, tokenizer) -> list[int]:
    """The ids that end generation, as transformers' `generate` takes them (generation config first)."""
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
