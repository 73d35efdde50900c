"""`scute explain`: what an adapter costs in the normal form, layer by layer, before anyone writes a kernel.

For every adapted layer: the slots the method's converter fills, those folded away at load and those that stay
live (with their shapes; ``*`` = shared between adapters), the rank, the bytes one adapter adds (live per-adapter
tensors: matrices at the serving dtype, vectors in float32 as the slot pool keeps them), the FLOPs per token of the
live slots (`docs/normal_form.md` §5), and the byte model's prediction (`scute.ops.cost`) of one layer call at a
batch of B tokens spread over N distinct adapters of this shape, against the base layer's call.

The base model only gives shapes (and which layers have a bias), from a built model, a local folder or GGUF file
read for its config only, or the adapter's own tensors (`scute.adapters.layer_shapes`).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from scute.adapters.checkpoint import AdapterError, read_checkpoint
from scute.adapters.conversion import convert_checkpoint, linear_modules
from scute.adapters.layer_shapes import StandIn, shapes_from_model, shapes_from_tensors
from scute.config import DTYPES
from scute.ops.cost import VEC_BYTES, layer_call_bytes
from scute.ops.slots import Slots

H200_BANDWIDTH = 4.2e12  # bytes/s: a device-to-device copy on the H200, read + write (docs/performance.md)
_SHORT_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}  # as the table names them


@dataclass
class LayerCost:
    """One adapted layer of one adapter. Byte and FLOP counts are per adapter and per token respectively."""

    name: str
    in_features: int
    out_features: int
    filled: tuple[str, ...]  # slots the converter filled ("s": a scalar), before folding
    merged: tuple[str, ...]  # folded into other slots at load
    live: dict[str, tuple[int, ...]]  # slot -> shape, read per token by the kernels
    shared: tuple[str, ...]  # live slots shared between adapters (read once per batch)
    rank: int
    adapter_bytes: int  # per adapter: live, non-shared tensors
    shared_bytes: int  # this layer's views of shared tensors (counted once per model in the totals)
    flops: int  # live-slot FLOPs per token (2 per multiply-add)
    base_flops: int  # the base GEMM's FLOPs per token
    seconds: float  # predicted adapter part of one layer call at the table's batch
    base_seconds: float  # predicted base layer call (no adapter tokens) at that batch

    @property
    def slots_text(self) -> str:
        return " ".join(f"{n}{'*' if n in self.shared else ''}[{'×'.join(map(str, s))}]"
                        for n, s in self.live.items())


@dataclass
class ExplainTable:
    """`explain`'s result: one `LayerCost` per adapted layer; `str()` renders the table."""

    adapter: str
    peft_type: str
    model: str
    batch: int
    adapters: int
    dtype: str
    bandwidth: float
    rows: list[LayerCost]
    shared_bytes: int  # shared tensors over the whole model, each once
    notes: list[str] = field(default_factory=list)

    @property
    def adapter_bytes(self) -> int:
        return sum(r.adapter_bytes for r in self.rows)

    @property
    def flops(self) -> int:
        return sum(r.flops for r in self.rows)

    @property
    def base_flops(self) -> int:
        return sum(r.base_flops for r in self.rows)

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.rows)

    @property
    def base_seconds(self) -> float:
        return sum(r.base_seconds for r in self.rows)

    def __str__(self) -> str:
        head = (f"{self.adapter} ({self.peft_type}) on {self.model}: {len(self.rows)} layers; "
                f"weights {self.dtype}, vectors fp32; predicted at batch {self.batch} over {self.adapters} distinct "
                f"adapters, {self.bandwidth / 1e12:.2f} TB/s")
        cols = ("layer", "out×in", "filled", "merged", "live", "rank", "bytes/adapter", "FLOPs/token",
                f"µs @B={self.batch}")
        lines = [cols]
        for n, group in _groups(self.rows):
            r = group[0]
            lines.append((r.name if n == 1 else f"{_pattern(r.name)} ×{n}", f"{r.out_features}×{r.in_features}",
                          " ".join(r.filled), " ".join(r.merged) or "-", r.slots_text, str(r.rank or "-"),
                          _size(r.adapter_bytes), f"{r.flops:,} ({_pct(r.flops, r.base_flops)})",
                          f"{r.seconds * 1e6:.3g} (+{_pct(r.seconds, r.base_seconds)})"))
        lines.append(("total", "", "", "", f"shared once per model: {_size(self.shared_bytes)}", "",
                      _size(self.adapter_bytes), f"{self.flops:,} ({_pct(self.flops, self.base_flops)})",
                      f"{self.seconds * 1e6:.3g} (+{_pct(self.seconds, self.base_seconds)})"))
        widths = [max(len(line[i]) for line in lines) for i in range(len(cols))]
        text = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
        text.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join([head, *text, *(f"note: {n}" for n in self.notes)])


def explain(adapter: str | os.PathLike, model: nn.Module | str | None = None, *, batch: int = 64,
            adapters: int | None = None, dtype: str = "bf16", bandwidth: float = H200_BANDWIDTH,
            dense: bool = False) -> ExplainTable:
    """Explain the PEFT folder `adapter` on `model` (a module, a local HF folder or GGUF file, or None: shapes
    from the adapter's tensors). `batch` tokens over `adapters` distinct adapters (default: one per token);
    `dtype` of the served weights (any of `scute.config.DTYPES`' spellings); `dense` as in `load_adapter`. Raises
    ValueError for numbers or a dtype that describe no batch."""
    if batch < 1:
        raise ValueError(f"batch: at least 1 token, not {batch}")
    if adapters is not None and not 1 <= adapters <= batch:
        raise ValueError(f"adapters: 1 to batch ({batch}) distinct adapters, not {adapters}")
    if not bandwidth > 0:
        raise ValueError(f"bandwidth: bytes per second, more than 0, not {bandwidth}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: one of {sorted(DTYPES)}, not {dtype!r}")
    ckpt = read_checkpoint(adapter)
    notes: list[str] = []
    no_bias = False
    if isinstance(model, nn.Module):
        modules, model_name = linear_modules(model), type(model).__name__
    else:
        shapes = shapes_from_model(model) if model is not None else shapes_from_tensors(ckpt)
        modules = {n: StandIn(o, i, b) for n, (o, i, b) in shapes.items()}
        model_name = os.path.basename(os.path.normpath(os.fspath(model))) if model else "shapes from the adapter"
        no_bias = model is None
    dtype, elem, n_adapters = _SHORT_NAMES[DTYPES[dtype]], DTYPES[dtype].itemsize, adapters or batch
    layers = convert_checkpoint(ckpt, modules, dense=dense)
    rows, seen = [], {}
    for name, slots in layers.items():
        rows.append(_layer_cost(name, slots, modules[name].bias is not None, elem, batch, n_adapters, bandwidth))
        for n, x in slots.folded().tensors().items():
            if n in slots.shared:
                seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes() // x.element_size() * elem
    if no_bias and any("o" in r.live for r in rows):
        notes.append("no --model: base biases assumed absent, so a bias correction c (DoRA, BOFT) is not counted")
    if any(r.rank >= min(r.in_features, r.out_features) for r in rows):
        notes.append("rank ≥ min(in, out) on some layers: a full-rank delta, dearer than merging into a dense weight")
    return ExplainTable(os.fspath(adapter), ckpt.peft_type, model_name, batch, n_adapters, dtype, bandwidth, rows,
                        sum(seen.values()), notes)


def _layer_cost(name: str, slots: Slots, bias: bool, elem: int, batch: int, n: int, bandwidth: float) -> LayerCost:
    live = slots.folded()
    i, o, r = slots.in_features, slots.out_features, live.rank
    filled = slots.live + (("s",) if slots.scale != 1.0 else ())
    per_adapter = sum(x.numel() * (VEC_BYTES if x.dim() == 1 else elem)
                      for k, x in live.tensors().items() if k not in live.shared)
    shared = sum(x.numel() * elem for k, x in live.tensors().items() if k in live.shared)
    flops = _flops(live)
    ghosts = [_ghost(live) for _ in range(n)]  # n distinct adapters of this shape (shared tensors stay shared)
    tokens = [t % n for t in range(batch)]
    with_adapters = layer_call_bytes([ghosts], i, [o], tokens, elem, bias)
    base = layer_call_bytes([ghosts], i, [o], [-1] * batch, elem, bias)
    merged = tuple(m for m in live.merged if m in filled)  # folded() also lists a scale of 1
    return LayerCost(name, i, o, filled, merged, {k: tuple(x.shape) for k, x in live.tensors().items()},
                     tuple(k for k in live.live if k in live.shared), r, per_adapter, shared, flops, 2 * i * o,
                     (with_adapters.total - base.total) / bandwidth, base.seconds(bandwidth))


def _flops(s: Slots) -> int:
    """FLOPs per token of the live slots (normal_form.md §5; 2 per multiply-add)."""
    i, o, r = s.in_features, s.out_features, s.rank
    f = i if s.t is not None else 0
    f += 2 * i * s.t_blocks.shape[-1] if s.t_blocks is not None else 0
    f += o * ((s.o is not None) + 2 * (s.o2 is not None) + (s.c is not None) + (s.v is not None))
    if s.A is not None:
        f += 2 * r * i + (r if s.m is not None else 0) + 2 * r * o + o
    return f


def _ghost(s: Slots) -> Slots:
    """A stand-in with the same shapes and sharing but its own (zero-byte) storage per non-shared tensor."""
    return replace(s, **{k: torch.zeros(1, dtype=x.dtype).expand(x.shape)
                         for k, x in s.tensors().items() if k not in s.shared})


def _groups(rows: Sequence[LayerCost]) -> list[tuple[int, list[LayerCost]]]:
    """Consecutive-or-not rows equal but for the layer index, grouped (a 32-layer model prints 7 lines)."""
    out: dict[tuple, list[LayerCost]] = {}
    for r in rows:
        key = (_pattern(r.name), r.in_features, r.out_features, r.filled, r.merged, r.slots_text, r.adapter_bytes,
               r.flops, round(r.seconds, 15))
        out.setdefault(key, []).append(r)
    return [(len(g), g) for g in out.values()]


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", name)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return ""


def _pct(x: float, base: float) -> str:
    return f"{100 * x / base:.2f}%" if base else "-"


def explain_main(argv: Sequence[str] | None = None) -> int:
    """The `scute explain ADAPTER [--model BASE]` command; returns the exit status."""
    p = argparse.ArgumentParser(prog="scute explain", description=__doc__.split("\n\n")[0])
    p.add_argument("adapter", help="a PEFT adapter folder (adapter_config.json + adapter_model.safetensors)")
    p.add_argument("--model", help="the base model: a local Hugging Face folder or .gguf file (read for shapes "
                                   "only); default: shapes from the adapter's tensors")
    p.add_argument("--batch", type=int, default=64, help="tokens per step for the predicted cost (default 64)")
    p.add_argument("--adapters", type=int, help="distinct adapters among those tokens (default: one per token)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="served weight dtype (bf16 or bfloat16, ...)")
    p.add_argument("--bandwidth", type=float, default=H200_BANDWIDTH, help="bytes/s (default: H200, 4.2e12)")
    p.add_argument("--dense", action="store_true", help="serve methods with no low-rank form as dense ΔW")
    args = p.parse_args(argv)
    try:
        table = explain(args.adapter, args.model, batch=args.batch, adapters=args.adapters, dtype=args.dtype,
                        bandwidth=args.bandwidth, dense=args.dense)
    except (AdapterError, ValueError, OSError) as e:
        print(f"scute explain: {e}", file=sys.stderr)
        return 2
    print(table)
    return 0


if __name__ == "__main__":  # python -m scute.adapters.explain ADAPTER [--model BASE]
    raise SystemExit(explain_main())
