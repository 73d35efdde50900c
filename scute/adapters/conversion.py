"""Convert a PEFT checkpoint into normal-form `Slots` per layer, validated against the base model.

`convert_checkpoint` groups the checkpoint's tensors by module with the method's registered keys, refuses what
does not fit (an unknown method or load option, a tensor that is missing, extra, misshapen or not finite, a
module the base model lacks, a targeted module without tensors) and calls the method's converter once per
layer with a `LayerCheckpoint`; a bias trained with ``bias="all"`` becomes an exact ``c`` correction for any
method. `load_adapter` = read + convert + fold into an `Adapter`. Each problem raises `AdapterError` naming the
adapter, the module and the fix.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch
from torch import Tensor, nn

from scute.adapters.adapter import Adapter, Interned, Pause, no_pause, paused
from scute.adapters.checkpoint import (
    GLOBAL_PREFIX,
    LAYER_PREFIX,
    AdapterCheckpoint,
    AdapterError,
    cast_together,
    read_checkpoint,
)
from scute.adapters.registry import Method, get_method, methods_with_option
from scute.adapters.targeting import is_targeted, targeted_modules
from scute.ops.reference import acc_dtype, rotate_pairs
from scute.ops.slots import Slots, fold_layers


@dataclass
class LayerCheckpoint:
    """What a converter sees of one adapted layer: its tensors, the adapter's config and the base layer.

    Converters run on `device` — the CPU, or the device that holds the base model for a method registered with
    ``on_device=True`` — in `dtype` — float32, or float64 for a float64 model — which is the dtype `tensor()`
    returns. `weight` is the base W0 [out, in] on `device` in `dtype`, made on first use only (most methods never
    read it), and `bias` the bias the method expects (a bias trained with ``bias="all"`` replaces
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
    options: Mapping[str, object] = field(default_factory=dict)  # the method's own load options, as given
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where the converter computes
    interned: Interned = field(default_factory=dict)  # the shared matrices of the adapters loaded together
    # every adapted layer's tensors by module name, this one's among them: for a converter that computes something
    # for all layers at once (OFT's rotations, a few batched kernels instead of a few per layer), kept in `shared`
    peers: Mapping[str, Mapping[str, Tensor]] = field(default_factory=dict, repr=False)

    @cached_property
    def in_features(self) -> int:
        return self.base.weight.shape[1]

    @cached_property
    def out_features(self) -> int:
        return self.base.weight.shape[0]

    @cached_property
    def dtype(self) -> torch.dtype:
        return acc_dtype(self.base.weight.dtype)

    @cached_property
    def weight(self) -> Tensor:
        return self.base.weight.detach().to(device=self.device, dtype=self.dtype)

    def error(self, problem: str) -> AdapterError:
        return self.checkpoint.error(problem, self.name)

    def intern(self, x: Tensor) -> Tensor:
        """`x` as the one tensor of its content among the adapters loaded with this table (`intern_shared`): a
        matrix every adapter of a kind holds alike (VeRA's projections) is then one storage, on the device too."""
        return intern_shared(x, self.interned)

    def _global(self, key: str) -> Tensor:
        """The model-level tensor `key` (saved as ``base_model.<key>``) as the file has it; raises if missing."""
        if key not in self.globals:
            raise self.checkpoint.error(f"missing model-level tensor 'base_model.{key}'")
        return self.globals[key]

    def global_shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._global(key).shape)

    def interned_global(self, key: str) -> Tensor:
        """`global_tensor(key)`, interned: found among the adapters' by the file's content before it is cast, so
        that a matrix every adapter of a kind saves alike (VeRA's projections) is cast once, not at every load."""
        read = intern_shared(self._global(key), self.interned)  # the table keeps it: its address names it
        cast = self.interned.setdefault(("cast", read.data_ptr(), self.dtype), [])
        if not cast:
            cast.append(self.intern(read.to(self.dtype)))
        return cast[0]

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
        return x if x.dtype == self.dtype else x.to(self.dtype)

    def global_tensor(self, key: str) -> Tensor:
        """A model-level tensor (saved as ``base_model.<key>``) in `dtype`."""
        return self._global(key).to(self.dtype)


def intern_shared(x: Tensor, table: Interned) -> Tensor:
    """The one tensor of `x`'s content in `table` (`x` itself, entered, if it is the first), so that adapters
    converted with one table share the storage of a matrix they share (VeRA's projections). Tensors are keyed by
    a hash of a sample of their elements (a few thousand: hashing all of a VeRA pair of the 8B shape, 29 MB,
    took a third of its load), and equal keys compared in full (`torch.equal`): the match is exact."""
    flat = x.reshape(-1)
    sample = flat[:: max(1, flat.numel() // 4096)].contiguous().cpu()
    key = (x.dtype, tuple(x.shape), x.device, hashlib.sha256(sample.view(torch.uint8).numpy().tobytes()).digest())
    same = table.setdefault(key, [])
    for y in same:
        if torch.equal(x, y):
            return y
    if not x.is_contiguous() or x.untyped_storage().nbytes() != x.numel() * x.element_size():
        x = x.clone(memory_format=torch.contiguous_format)  # its own storage, not a view of the file read
    same.append(x)
    return x


def _is_linear(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return isinstance(w, Tensor) and w.dim() == 2 and not isinstance(module, nn.Embedding) and not _is_conv1d(module)


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' GPT-2-style `Conv1D`: a linear layer whose weight is stored [in, out] (PEFT: fan_in_fan_out)."""
    return type(module).__name__ == "Conv1D"


def linear_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The model's linear layers by qualified name (plain `nn.Linear` or Scute's `ScuteLinear`)."""
    return ModelLayers.of(model).linears


@dataclass(frozen=True)
class ModelLayers:
    """What a load reads of the base model's structure: its linear layers by qualified name, in model order, and
    the names of its GPT-2-style `Conv1D` layers (refused). Walking a model's modules takes a few milliseconds of
    Python: a caller that loads many adapters into one model makes this once (`of`) and passes it instead."""

    linears: dict[str, nn.Module]
    conv1d: tuple[str, ...]

    @classmethod
    def of(cls, model: nn.Module) -> ModelLayers:
        named = dict(model.named_modules())
        return cls({n: m for n, m in named.items() if _is_linear(m)}, tuple(n for n, m in named.items()
                                                                            if _is_conv1d(m)))


def convert_checkpoint(
    ckpt: AdapterCheckpoint, modules: Mapping[str, nn.Module], dense: bool = False, interned: Interned | None = None,
    pause: Pause = no_pause, dtype: torch.dtype | None = None, **options: object,
) -> dict[str, Slots]:
    """Convert a checkpoint into unfolded `Slots` per module name, validating it against the base `modules`
    (name -> a linear layer with `weight` [out, in] and `bias`). A method registered with ``on_device=True``
    converts where the base weights are (its slots are then there: W0 is never copied off its device), the
    others on the CPU. `dense`, `interned`, `pause`, `dtype`, `options`: see `load_adapter`. The slots of a
    plain LoRA file in the serving `dtype` are made before their values are there: ``ckpt.land()`` puts them
    there (queued, on a GPU), ``ckpt.verify()`` checks them (`start_load`)."""
    interned = {} if interned is None else interned
    method = checkpoint_method(ckpt, options)
    device = weights_device(modules) if method.on_device else torch.device("cpu")
    keys, globals_ = _group_keys(ckpt, _split_keys(ckpt, method), modules)  # refused before any copy
    pause()
    acc = acc_dtype(next((m.weight.dtype for m in modules.values()), torch.float32))
    whole = method.whole if not dense and not options else None  # all layers at once, where it takes the adapter
    span = None if ckpt.layout is None else ckpt.layout.span
    # a file in the serving dtype: `whole` gets it as read, in a copy of its own where the base weights are, whose
    # values land later (`AdapterCheckpoint.arriving`), and may fold into it
    served = whole is not None and span is not None and span[0] == dtype and ckpt.layout.floating_only
    tensors_here = ckpt.arriving(device, pause) if served else ckpt.tensors_on(device, acc, pause)  # checked finite
    expected = targeted_modules(ckpt.config, tuple(modules))
    order = {n: i for i, n in enumerate(modules)}  # model order: the first problem first
    groups = _layer_tensors(keys, tensors_here)
    pause()  # between the views' last pause point and the converter's first: a few passes over 448 tensors
    if missing := sorted(expected - set(groups), key=order.__getitem__):
        if not method.tensorless_targets:
            raise ckpt.error(f"the config targets {missing[0]} but the file has no tensors for it "
                             f"({len(missing)} such modules)")
        groups.update({n: {} for n in missing})
    in_order = sorted(groups, key=order.__getitem__)
    if whole is not None:
        slots = whole(ckpt.config, {n: groups[n] for n in in_order}, modules, ckpt.landing, pause)
        if slots is not None:
            return slots
        if served:  # the per-layer converters take the values, in the accumulation dtype
            ckpt.land()
            ckpt.verify()
            groups = {**{n: {} for n in in_order}, **_layer_tensors(keys, cast_together(tensors_here, acc))}
    shared: dict = {}
    shapes = {n: tuple(modules[n].weight.shape) for n in in_order}
    out: dict[str, Slots] = {}
    for name in paused(shapes, pause):
        tensors, base = groups[name], modules[name]
        layer_acc = acc_dtype(base.weight.dtype)
        b0 = None if base.bias is None else base.bias.detach().to(device=device, dtype=layer_acc)
        trained_bias = tensors.pop("base_layer.bias", tensors.pop("bias", None))
        bias = b0 if trained_bias is None else trained_bias.to(layer_acc)
        if bias is not None and tuple(bias.shape) != (shapes[name][0],):
            raise ckpt.error(f"trained bias has shape {tuple(bias.shape)}, layer needs ({shapes[name][0]},)", name)
        layer = LayerCheckpoint(name, ckpt.config, base, bias, tensors, ckpt, globals_, shapes, shared, dense=dense,
                                options=options, device=device, interned=interned, peers=groups)
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


def _layer_tensors(keys: list[tuple[str, str, str]], tensors: Mapping[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    """{module: {suffix: tensor}} from `_group_keys`' (module, suffix, key) triples."""
    groups: dict[str, dict[str, Tensor]] = {}
    for module, suffix, key in keys:
        groups.setdefault(module, {})[suffix] = tensors[key]
    return groups


def folder_name(path: str | os.PathLike) -> str:
    """An adapter's name by default: its folder's own name."""
    return os.path.basename(os.path.normpath(os.fspath(path)))


def checkpoint_method(ckpt: AdapterCheckpoint, options: Mapping[str, object] = {}) -> Method:
    """The registered method of `ckpt`, after checking that it takes every load option in `options`."""
    try:
        method = get_method(ckpt.peft_type)
    except KeyError as e:
        raise ckpt.error(e.args[0]) from None
    for key in options:
        if key not in method.options:
            owners = [t for t in methods_with_option(key) if t != method.peft_type]
            belongs = f" (an option of {', '.join(owners)})" if owners else ""
            takes = ", ".join(["dense"] + [f"{k} ({o.help})" for k, o in method.options.items()])
            raise ckpt.error(f"unknown load option {key!r}{belongs}; {method.peft_type} takes: {takes}")
    return method


def _names_pattern(names: tuple[str, ...]) -> str:
    """A regex alternation of key names, where ``*`` stands for one dotted segment (``adamss_A.*``)."""
    return "|".join(re.escape(n).replace(r"\*", r"[^.]+") for n in names) or "(?!)"


def weights_device(modules: Mapping[str, nn.Module]) -> torch.device:
    """The device of the base model's linear weights (the CPU for a model without any)."""
    return next((m.weight.device for m in modules.values()), torch.device("cpu"))


def _split_keys(ckpt: AdapterCheckpoint, method: Method) -> list[tuple]:
    """Each checkpoint key as ``("global", key, name)`` (a model-level tensor ``base_model.<name>``), ``("layer",
    key, module, suffix)`` (a tensor of a module's, by `method`'s key names) or ``("error", message)``, in the file's
    order. From the keys alone: a safetensors file's split is kept with its header (`Layout.splits`)."""
    layout = ckpt.layout
    memo, memo_key = None if layout is None else layout.splits, (ckpt.peft_type, method.keys, method.global_keys)
    if memo is not None and memo_key in memo:
        return memo[memo_key]
    # module.suffix with the shortest module, i.e. the longest suffix ("base_layer.bias" before "bias")
    layer_key = re.compile(rf"(.+?)\.({_names_pattern(method.keys + ('base_layer.bias', 'bias'))})")
    global_key = re.compile(_names_pattern(method.global_keys))
    out: list[tuple] = []
    for key in layout.keys if layout is not None else ckpt.tensors:
        if key.startswith(GLOBAL_PREFIX) and global_key.fullmatch(key[len(GLOBAL_PREFIX):]):
            out.append(("global", key, key[len(GLOBAL_PREFIX):]))
            continue
        rel = key[len(LAYER_PREFIX):] if key.startswith(LAYER_PREFIX) else key
        if ".modules_to_save." in rel or ".trainable_tokens_" in rel:
            out.append(("error", f"tensor {key!r} is a fully trained module copy (modules_to_save / trainable "
                                 "tokens): Scute serves adapters of linear layers only; merge it into the base "
                                 "model instead"))
        elif (match := layer_key.fullmatch(rel)) is None:
            out.append(("error", f"unexpected tensor {key!r}: not a {ckpt.peft_type} tensor"))
        else:
            out.append(("layer", key, *match.groups()))
    if memo is not None:
        memo[memo_key] = out
    return out


def _group_keys(ckpt: AdapterCheckpoint, split: list[tuple], modules: Mapping[str, nn.Module]):
    """The layer keys as (module, suffix, checkpoint key) and the global tensors (name -> tensor, on the CPU, as
    the file has them: a method casts those it uses, `LayerCheckpoint.global_tensor`), by `_split_keys`; raises
    for the first key that does not fit the method or the model."""
    keys: list[tuple[str, str, str]] = []
    globals_: dict[str, Tensor] = {}
    for entry in split:
        if entry[0] == "error":
            raise ckpt.error(entry[1])
        if entry[0] == "global":
            globals_[entry[2]] = ckpt.tensor(entry[1])
            continue
        _, key, module, suffix = entry
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
        keys.append((module, suffix, key))
    return keys, globals_


def _correct_bias(slots: Slots, b0: Tensor | None, bias: Tensor | None) -> Slots:
    """The server adds the base bias b0; a method written with another bias b gets ``c += U(b - b0)``. The base
    bias itself (a layer without a trained one) is recognized without comparing values, which on a GPU is a host
    sync per layer."""
    if bias is None or bias is b0 or (b0 is not None and torch.equal(bias, b0)):
        return slots
    delta = bias if b0 is None else bias - b0
    fix = delta * slots.o if slots.o is not None else delta
    if slots.o2 is not None:
        fix = fix + slots.o2 * rotate_pairs(delta, slots.rot_group)
    return replace(slots, c=fix if slots.c is None else slots.c + fix)


@dataclass(eq=False)
class AdapterLoad:
    """An adapter converted by `start_load`: its folded slots (``layers``), whose values may not be in place yet
    (``arriving``: a plain LoRA file in the serving dtype, served as the file's own copy where W0 is; its
    slots' shapes, dtypes and addresses are final). `finish` puts them there, checks them and gives the
    `Adapter`."""

    checkpoint: AdapterCheckpoint
    name: str
    suffix: str  # of the identity, for a variant of the checkpoint (a load option given)
    layers: dict[str, Slots]
    arriving: bool  # the file's values land at `land`

    def land(self) -> None:
        """The file's values put in place (`AdapterCheckpoint.land`): their transfer, check and fold queued on the
        GPU while the caller goes on (on the slot pools' rows); `finish` waits for the check."""
        self.checkpoint.land()

    def then(self, fn: Callable[[], None]) -> None:
        """Run `fn` (work that reads the slots' values: a copy of them) once the values are in place: at once if
        they are (or were never arriving), else after they land (`Landing.then`)."""
        landing = self.checkpoint.landing
        if landing is None:
            fn()
        else:
            landing.then(fn)

    def landing(self, pause: Pause) -> Pause:
        """`pause`, which at each pause point (before it waits there, and after) copies the values the file's read
        has put in memory since the last one to their place and, at the first after the read has ended, lands the
        rest (`AdapterCheckpoint.land_arrived`): work on the slots that reads no value (their rows in the slot
        pools) goes on through the read and the transfers, which run beside it, instead of waiting for the read
        before it starts; `finish` lands what no pause point did."""
        def paused() -> None:
            self.checkpoint.land_arrived()
            pause()
            self.checkpoint.land_arrived()
        return paused

    def adapter(self, identity: str) -> Adapter:
        """The adapter with `identity` (`finish`'s; before it, for work on its slots that reads no value)."""
        ckpt = self.checkpoint
        return Adapter(self.name, ckpt.path, ckpt.peft_type, ckpt.config, identity, self.layers)

    def finish(self) -> Adapter:
        """The adapter, its values in place and checked (`AdapterCheckpoint.land`, `verify`: raises `AdapterError`
        naming a tensor that is not finite) and its identity hashed."""
        self.checkpoint.land()
        self.checkpoint.verify()
        return self.adapter(self.checkpoint.identity + self.suffix)


def load_adapter(
    path: str | os.PathLike, model: nn.Module | ModelLayers, name: str | None = None, allow_pickle: bool = False,
    dense: bool = False, interned: Interned | None = None, pause: Pause = no_pause, dtype: torch.dtype | None = None,
    **options: object,
) -> Adapter:
    """Read the PEFT folder `path`, validate it against `model` (or its `ModelLayers`) and convert it into folded
    slots.

    `dense=True` lets methods without an exact low-rank form (HiRA, ...) be served exactly as a full-rank
    per-adapter ΔW (in·out elements per layer: see `scute explain`); without it they are refused, saying why.
    `interned`: a table of shared matrices (`intern_shared`) to convert with; adapters loaded with one table share
    the matrices they hold alike (VeRA's projections; the engine's adapter manager keeps one), each call without
    one has its own. `pause` is called before each layer is converted and folded (the engine's loader waits there
    while the step loop has its turn: `scute.engine.adapter_loader.Turns`).
    `dtype`: the dtype the caller serves the matrices in (the engine's on a GPU). Slots are converted in the
    accumulation dtype (float32 for a bf16 model) and folded there, and the caller casts them; a whole-adapter
    converter given a file in `dtype` may instead give its layers already folded in it, where the values
    are those the cast would give (LoRA: ``B ← s·B`` is one rounding of the float32 product either way), saving
    the float32 copies.
    `options`: the method's own load options (Poly's ``task_id``: one adapter per task); a name the method does
    not take raises, listing those it does. An option given selects one adapter of the checkpoint: it is named
    and identified apart (``poly@task1``). Methods that can convert where the base weights are do
    (`convert_checkpoint`); for weights on a GPU the file is read into pinned memory, then copied there at once.
    """
    return start_load(path, model, name, allow_pickle, dense, interned, pause, dtype, **options).finish()


def start_load(
    path: str | os.PathLike, model: nn.Module | ModelLayers, name: str | None = None, allow_pickle: bool = False,
    dense: bool = False, interned: Interned | None = None, pause: Pause = no_pause, dtype: torch.dtype | None = None,
    read_gate: Callable[[], None] | None = None, **options: object,
) -> AdapterLoad:
    """`load_adapter` up to its slots: the file's values may not be on the device yet (`AdapterLoad.arriving`),
    so that a caller can work on the slots (the engine's loader: their rows in the slot pools) while the GPU
    copies them; `AdapterLoad.finish` gives the adapter. `read_gate`: called by the threads that read the file
    between its parts (`read_checkpoint`); the other arguments as for `load_adapter`."""
    layers = model if isinstance(model, ModelLayers) else ModelLayers.of(model)
    modules = layers.linears
    ckpt = read_checkpoint(path, allow_pickle=allow_pickle, pin_memory=weights_device(modules).type == "cuda",
                           gate=read_gate)
    pause()
    if ckpt.config.get("fan_in_fan_out") or any(is_targeted(ckpt.config, n) for n in layers.conv1d):
        raise ckpt.error(
            "the adapter targets GPT-2-style Conv1D layers (fan_in_fan_out=True: weights stored [in, out]); "
            "Scute serves adapters of nn.Linear layers only"
        )
    method = checkpoint_method(ckpt, options)
    converted = convert_checkpoint(ckpt, modules, dense=dense, interned=interned, pause=pause, dtype=dtype,
                                   **options)
    folded = fold_layers(converted, pause)
    default, suffix = folder_name(path), ""
    for key, value in options.items():  # a variant of the checkpoint: its own device slot and KV prefixes
        if value is not None:
            suffix += method.options[key].suffix.format(value)
    return AdapterLoad(ckpt, name or default + suffix, suffix, folded, ckpt.landing is not None)
