"""Read a PEFT checkpoint folder, and PEFT's rules for which modules an adapter config targets.

A PEFT folder holds ``adapter_config.json`` and ``adapter_model.safetensors``. This is the boundary: a missing,
unreadable or corrupt file, a config without a method, a pickle the caller did not allow, each raises
`AdapterError` naming the folder and the fix. `scute.adapters.conversion` validates the tensors against the base
model and converts them; inside Scute the slots are trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

LAYER_PREFIX = "base_model.model."
GLOBAL_PREFIX = "base_model."
SAFETENSORS = "adapter_model.safetensors"
PICKLE = "adapter_model.bin"
CONFIG = "adapter_config.json"


class AdapterError(ValueError):
    """A PEFT adapter that cannot be served; the message names the adapter, the module and the problem."""


@dataclass
class AdapterCheckpoint:
    """The raw contents of a PEFT folder: its config and its tensors (keys as PEFT saved them)."""

    path: str
    config: dict
    tensors: dict[str, Tensor]
    identity: str  # sha256 of the config and weight files: changes whenever the adapter does

    @property
    def peft_type(self) -> str:
        return str(self.config.get("peft_type", "")).upper()

    def error(self, problem: str, module: str | None = None) -> AdapterError:
        where = f" module {module}" if module else ""
        return AdapterError(f"adapter {self.path} ({self.peft_type or '?'}){where}: {problem}")


def read_checkpoint(path: str | os.PathLike, allow_pickle: bool = False) -> AdapterCheckpoint:
    """Read a PEFT adapter folder. Pickled ``adapter_model.bin`` files are refused unless `allow_pickle`
    (then loaded with ``torch.load(weights_only=True)``)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise AdapterError(f"adapter {path}: no such folder (expected a PEFT folder with {CONFIG})")
    cfg_file = os.path.join(path, CONFIG)
    if not os.path.isfile(cfg_file):
        raise AdapterError(f"adapter {path}: missing {CONFIG} (not a PEFT adapter folder?)")
    try:
        with open(cfg_file, "rb") as f:
            cfg_bytes = f.read()
        config = json.loads(cfg_bytes)
    except (OSError, ValueError) as e:
        raise AdapterError(f"adapter {path}: cannot read {cfg_file}: {e}") from e
    if not isinstance(config, dict) or "peft_type" not in config:
        raise AdapterError(f"adapter {path}: {cfg_file} has no 'peft_type'")
    digest = hashlib.sha256(cfg_bytes)
    st_file, bin_file = os.path.join(path, SAFETENSORS), os.path.join(path, PICKLE)
    if os.path.isfile(st_file):
        tensors = _load_safetensors(path, st_file, digest)
    elif os.path.isfile(bin_file):
        if not allow_pickle:
            raise AdapterError(
                f"adapter {path}: only a pickled {PICKLE} was found; pickles can run code when loaded. "
                f"Convert it to {SAFETENSORS}, or pass allow_pickle=True if you trust its source"
            )
        with open(bin_file, "rb") as f:
            digest.update(f.read())
        try:
            tensors = torch.load(bin_file, map_location="cpu", weights_only=True)
        except Exception as e:
            raise AdapterError(f"adapter {path}: cannot read {bin_file}: {e}") from e
    else:
        raise AdapterError(f"adapter {path}: missing {SAFETENSORS}")
    return AdapterCheckpoint(path, config, tensors, digest.hexdigest())


def _load_safetensors(path: str, file: str, digest) -> dict[str, Tensor]:
    from safetensors.torch import load

    try:
        with open(file, "rb") as f:
            data = f.read()
        digest.update(data)
        return load(data)
    except Exception as e:  # safetensors raises its own error types for corrupt or truncated files
        raise AdapterError(f"adapter {path}: {file} is corrupt or truncated ({e})") from e


def pattern_value(patterns: Mapping[str, object] | None, name: str, default):
    """Resolve PEFT's `rank_pattern` / `alpha_pattern` for module `name`: first matching key wins."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def matches_module_list(spec, name: str) -> bool:
    """PEFT's target matching: a string is a full regex match, a list matches exact names or ``.suffix``."""
    if spec is None:
        return False
    if isinstance(spec, str):
        return re.fullmatch(spec, name) is not None
    return name in spec or any(name.endswith(f".{key}") for key in spec)


def is_targeted(config: Mapping, name: str) -> bool:
    """Whether PEFT would adapt module `name` under `config` (target/exclude modules, layers_to_transform)."""
    if matches_module_list(config.get("exclude_modules"), name):
        return False
    targets = config.get("target_modules")
    if targets == "all-linear" or not matches_module_list(targets, name):
        return False
    layers = config.get("layers_to_transform")
    if isinstance(targets, str) or layers is None or layers == []:
        return True
    patterns = config.get("layers_pattern") or [None]
    for pattern in [patterns] if isinstance(patterns, str) else patterns:
        regex = r".*?\.[^.]*\.(?P<idx>\d+)\." if pattern is None else rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\."
        if match := re.match(regex, name):
            idx = int(match.group("idx"))
            return idx == layers if isinstance(layers, int) else idx in layers
    return False
