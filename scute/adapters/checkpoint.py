"""Read and validate PEFT checkpoint folders, and convert them into normal-form `Slots` per layer.

A PEFT folder holds ``adapter_config.json`` and ``adapter_model.safetensors``. Everything is validated here,
at the boundary: a missing or corrupt file, an unknown method, a tensor that is missing, extra, misshapen or
not finite, a module the base model lacks. Each problem raises `AdapterError` naming the file, the module and
the fix. Inside Scute the slots are trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch
from torch import Tensor, nn

from scute.adapters.registry import Method, get_method
from scute.adapters.slots import Slots
from scute.ops.reference import acc_dtype, rotate_pairs

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


# ---------------------------------------------------------------------------------------------- PEFT matching
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


# ---------------------------------------------------------------------------------------------- conversion
@dataclass
class LayerCheckpoint:
    """What a converter sees of one adapted layer: its tensors, the adapter's config and the base layer.

    Converters run on the CPU, in `dtype` — float32, or float64 for a float64 model — which is the dtype
    `tensor()` returns. `weight` is the base W0 [out, in], copied to the CPU in `dtype` on first use only (most
    methods never read it), and `bias` the bias the method expects (a bias trained with ``bias="all"`` replaces
    the base one). Write the method's math with this bias; the loader corrects for the base bias the server keeps.
    """

    name: str
    config: Mapping
    base: nn.Module = field(repr=False)  # the served linear layer: `weight` [out, in], `bias`
    bias: Tensor | None
    tensors: dict[str, Tensor]
    checkpoint: AdapterCheckpoint
    globals: dict[str, Tensor]
    layer_shapes: dict[str, tuple[int, int]]  # (out, in) of every layer this adapter adapts, in model order
    shared: dict = field(default_factory=dict)  # per-adapter cache for values shared by its layers
    used: set[str] = field(default_factory=set)
    dense: bool = False  # the user allows an exact dense per-adapter ΔW where no low-rank form exists
    task_id: int | None = None  # the task a per-task method (Poly) is served for

    @property
    def in_features(self) -> int:
        return self.base.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.base.weight.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return acc_dtype(self.base.weight.dtype)

    @cached_property
    def weight(self) -> Tensor:
        return self.base.weight.detach().to(device="cpu", dtype=self.dtype)

    def error(self, problem: str) -> AdapterError:
        return self.checkpoint.error(problem, self.name)

    def has(self, key: str) -> bool:
        return key in self.tensors

    def tensor(self, key: str, shape: tuple[int, ...] | None = None) -> Tensor:
        """The layer's tensor `key` in `dtype`; raises if it is missing or its shape is not `shape`."""
        if key not in self.tensors:
            raise self.error(f"missing tensor {key!r}")
        x = self.tensors[key]
        if shape is not None and tuple(x.shape) != tuple(shape):
            raise self.error(
                f"tensor {key!r} has shape {tuple(x.shape)}, the base layer needs {tuple(shape)} "
                f"(in_features={self.in_features}, out_features={self.out_features}): "
                "was this adapter trained for another model?"
            )
        self.used.add(key)
        return x.to(self.dtype)

    def global_tensor(self, key: str) -> Tensor:
        """A model-level tensor (saved as ``base_model.<key>``) in `dtype`."""
        if key not in self.globals:
            raise self.checkpoint.error(f"missing model-level tensor 'base_model.{key}'")
        return self.globals[key].to(self.dtype)


# Shared matrices by content. Kept for the life of the process (a view does not keep its base's Python object
# alive, so a weak map would forget them); it holds one entry per distinct VeRA (key, r, dims): a few MiB.
_INTERNED: dict[tuple, Tensor] = {}


def intern_shared(x: Tensor) -> Tensor:
    """Return one tensor per distinct content, so that adapters sharing a matrix share its storage."""
    x = x.contiguous()
    key = (x.dtype, tuple(x.shape), hashlib.sha256(x.cpu().view(torch.uint8).numpy().tobytes()).hexdigest())
    return _INTERNED.setdefault(key, x)


def _is_linear(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return isinstance(w, Tensor) and w.dim() == 2 and not isinstance(module, nn.Embedding) and not _is_conv1d(module)


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' GPT-2-style `Conv1D`: a linear layer whose weight is stored [in, out] (PEFT: fan_in_fan_out)."""
    return type(module).__name__ == "Conv1D"


def linear_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The model's linear layers by qualified name (plain `nn.Linear` or Scute's `ScuteLinear`)."""
    return {name: m for name, m in model.named_modules() if _is_linear(m)}


def convert_checkpoint(
    ckpt: AdapterCheckpoint, modules: Mapping[str, nn.Module], dense: bool = False, task_id: int | None = None
) -> dict[str, Slots]:
    """Convert a checkpoint into unfolded `Slots` per module name, validating it against the base `modules`
    (name -> a linear layer with `weight` [out, in] and `bias`). `dense`, `task_id`: see `load_adapter`."""
    try:
        method = get_method(ckpt.peft_type)
    except KeyError as e:
        raise ckpt.error(e.args[0]) from None
    groups, globals_ = _group_keys(ckpt, method, modules)
    for key, x in ckpt.tensors.items():
        if x.is_floating_point() and not torch.isfinite(x).all():
            raise ckpt.error(f"tensor {key!r} has NaN or Inf values")
    expected = {n for n in modules if is_targeted(ckpt.config, n)}
    if missing := sorted(expected - set(groups), key=list(modules).index):
        if not method.tensorless_targets:
            raise ckpt.error(f"the config targets {missing[0]} but the file has no tensors for it "
                             f"({len(missing)} such modules)")
        groups.update({n: {} for n in missing})
    shared: dict = {}
    shapes = {n: tuple(modules[n].weight.shape) for n in sorted(groups, key=list(modules).index)}
    out: dict[str, Slots] = {}
    for name in sorted(groups, key=list(modules).index):  # model order: the first problem reported is the first
        tensors, base = groups[name], modules[name]
        dtype = acc_dtype(base.weight.dtype)
        b0 = None if base.bias is None else base.bias.detach().to(device="cpu", dtype=dtype)
        trained_bias = tensors.pop("base_layer.bias", tensors.pop("bias", None))
        bias = b0 if trained_bias is None else trained_bias.to(dtype)
        if bias is not None and tuple(bias.shape) != (shapes[name][0],):
            raise ckpt.error(f"trained bias has shape {tuple(bias.shape)}, layer needs ({shapes[name][0]},)", name)
        layer = LayerCheckpoint(name, ckpt.config, base, bias, tensors, ckpt, globals_, shapes, shared, dense=dense,
                                task_id=task_id)
        if tensors or (method.tensorless_targets and name in expected):  # method tensors, or derived from globals
            try:
                slots = method.convert(layer)
            except AdapterError:
                raise
            except ValueError as e:  # a slot that does not fit the layer
                raise layer.error(str(e)) from e
        else:  # only a trained bias (bias="all" on a layer the method does not adapt)
            slots = Slots(layer.in_features, layer.out_features)
        if extra := sorted(set(tensors) - layer.used):
            raise layer.error(f"unexpected tensor {extra[0]!r} for {ckpt.peft_type} with this config")
        out[name] = _correct_bias(slots, b0, bias)
    return out


def _names_pattern(names: tuple[str, ...]) -> str:
    """A regex alternation of key names, where ``*`` stands for one dotted segment (``adamss_A.*``)."""
    return "|".join(re.escape(n).replace(r"\*", r"[^.]+") for n in names) or "(?!)"


def _group_keys(ckpt: AdapterCheckpoint, method: Method, modules: Mapping[str, nn.Module]):
    """Split checkpoint keys into per-module tensors (suffix -> tensor) and global tensors (name -> tensor)."""
    # module.suffix with the shortest module, i.e. the longest suffix ("base_layer.bias" before "bias")
    layer_key = re.compile(rf"(.+?)\.({_names_pattern(method.keys + ('base_layer.bias', 'bias'))})")
    global_key = re.compile(_names_pattern(method.global_keys))
    groups: dict[str, dict[str, Tensor]] = {}
    globals_: dict[str, Tensor] = {}
    for key, x in ckpt.tensors.items():
        if key.startswith(GLOBAL_PREFIX) and global_key.fullmatch(key[len(GLOBAL_PREFIX):]):
            globals_[key[len(GLOBAL_PREFIX):]] = x
            continue
        rel = key[len(LAYER_PREFIX):] if key.startswith(LAYER_PREFIX) else key
        if ".modules_to_save." in rel or ".trainable_tokens_" in rel:
            raise ckpt.error(
                f"tensor {key!r} is a fully trained module copy (modules_to_save / trainable tokens): Scute serves "
                "adapters of linear layers only; merge it into the base model instead"
            )
        match = layer_key.fullmatch(rel)
        if match is None:
            raise ckpt.error(f"unexpected tensor {key!r}: not a {ckpt.peft_type} tensor")
        module, suffix = match.groups()
        if module not in modules:
            if suffix == "bias":
                raise ckpt.error(
                    f"tensor {key!r} is a trained bias of {module}, which is not a linear layer "
                    "(bias='all'?): Scute serves adapters of linear layers only"
                )
            raise ckpt.error(
                f"tensor {key!r} is for module {module}, which the base model has no linear layer named: "
                "was this adapter trained for another model?"
            )
        groups.setdefault(module, {})[suffix] = x
    return groups, globals_


def _correct_bias(slots: Slots, b0: Tensor | None, bias: Tensor | None) -> Slots:
    """The server adds the base bias b0; a method written with another bias b gets ``c += U(b - b0)``."""
    if bias is None or (b0 is not None and torch.equal(bias, b0)):
        return slots
    delta = bias if b0 is None else bias - b0
    fix = delta * slots.o if slots.o is not None else delta
    if slots.o2 is not None:
        fix = fix + slots.o2 * rotate_pairs(delta, slots.rot_group)
    return replace(slots, c=fix if slots.c is None else slots.c + fix)


# ---------------------------------------------------------------------------------------------- adapters
@dataclass
class Adapter:
    """One loaded adapter: its folded slots per module, ready to be placed in `ScuteLinear` slots."""

    name: str
    path: str
    peft_type: str
    config: dict
    identity: str
    layers: dict[str, Slots]

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> Adapter:
        """Move every tensor; a tensor shared by several layers stays shared."""
        memo: dict[int, Tensor] = {}  # storage address -> moved storage: shared matrices move once, stay shared

        def move(x: Tensor) -> Tensor:
            key = x.untyped_storage().data_ptr()
            if key not in memo:
                whole = torch.empty(0, dtype=x.dtype, device=x.device).set_(x.untyped_storage())
                memo[key] = whole.to(device=device, dtype=dtype)
            return memo[key].as_strided(x.size(), x.stride(), x.storage_offset())

        def move_slots(s: Slots) -> Slots:
            return replace(s, **{k: move(x) if k in s.shared else x.to(device=device, dtype=dtype)
                                 for k, x in s.tensors().items()})

        layers = {n: move_slots(s) for n, s in self.layers.items()}
        return replace(self, layers=layers)

    def num_bytes(self) -> int:
        return sum(s.num_bytes() for s in self.layers.values())

    @property
    def invocation_tokens(self) -> tuple[int, ...] | None:
        """aLoRA's invocation tokens (the adapter applies from their last occurrence in a prompt on), else None."""
        tokens = self.config.get("alora_invocation_tokens")
        return tuple(int(t) for t in tokens) if tokens else None


def load_adapter(
    path: str | os.PathLike, model: nn.Module, name: str | None = None, allow_pickle: bool = False,
    dense: bool = False, task_id: int | None = None,
) -> Adapter:
    """Read the PEFT folder `path`, validate it against `model` and convert it into folded slots.

    `dense=True` lets methods without an exact low-rank form (HiRA, ...) be served exactly as a full-rank
    per-adapter ΔW (in·out elements per layer: see `scute explain`); without it they are refused, saying why.
    `task_id`: the task of a per-task method (Poly mixes its skills per task: one adapter per task); other
    methods refuse it.
    """
    ckpt = read_checkpoint(path, allow_pickle=allow_pickle)
    if ckpt.config.get("fan_in_fan_out") or any(_is_conv1d(m) and is_targeted(ckpt.config, n)
                                                for n, m in model.named_modules()):
        raise ckpt.error(
            "the adapter targets GPT-2-style Conv1D layers (fan_in_fan_out=True: weights stored [in, out]); "
            "Scute serves adapters of nn.Linear layers only"
        )
    if task_id is not None and ckpt.peft_type != "POLY":
        raise ckpt.error(f"task_id is for per-task methods (Poly); a {ckpt.peft_type} adapter has no tasks")
    layers = convert_checkpoint(ckpt, linear_modules(model), dense=dense, task_id=task_id)
    folded = {n: s.folded() for n, s in layers.items()}
    default, identity = os.path.basename(os.path.normpath(os.fspath(path))), ckpt.identity
    if task_id is not None:  # one task of a checkpoint is its own adapter: its own device slot and KV prefixes
        default, identity = f"{default}@task{task_id}", f"{identity}@task{task_id}"
    return Adapter(name or default, ckpt.path, ckpt.peft_type, ckpt.config, identity, folded)
