"""PEFT's rules for which modules an adapter config targets, and its per-module rank and alpha patterns."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from functools import lru_cache


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


TARGETING = ("target_modules", "exclude_modules", "layers_to_transform", "layers_pattern")  # what `is_targeted` reads


def targeted_modules(config: Mapping, names: tuple[str, ...]) -> frozenset[str]:
    """The `names` PEFT would adapt under `config` (`is_targeted`; a config as read from JSON). Kept by the
    config's targeting entries: a server's adapters of one kind target the same modules, found once."""
    return _targeted(json.dumps([config.get(k) for k in TARGETING]), names)


@lru_cache(maxsize=64)
def _targeted(targeting: str, names: tuple[str, ...]) -> frozenset[str]:
    config = dict(zip(TARGETING, json.loads(targeting)))
    return frozenset(n for n in names if is_targeted(config, n))


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
