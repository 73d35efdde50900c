"""Any adapter Scute serves -> a PEFT LoRA checkpoint of a given rank: the baseline a LoRA-only server needs.

Per adapted layer the normal form is one affine map ``y = W_eff x + b_eff``. Its change from the base,
``ΔW = W_eff − W0`` (the *whole* map: IA3, OFT and DoRA change the base path, not only add a delta) is written
as ``B·A`` by a truncated SVD, keeping the `rank` largest singular triplets: the best rank-R approximation in
Frobenius and spectral norm (from the factors when ΔW is a low-rank product, `factored_svd`, else through its Gram
matrix, `gram_svd`). It is exact when ΔW has rank ≤ R: a LoRA stays itself, VeRA is exact at its own
rank. ``Δb = b_eff − b0`` (IA3 on a biased layer) fits LoRA only as ``lora_bias``; with ``bias="drop"`` it is
left out and counted in the error. Every layer gets the same rank R (``lora_alpha = R``, so PEFT's scale is 1);
layers narrower than R are zero-padded, as a LoRA server pads every adapter to its maximum rank anyway.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from scute.adapters.adapter import Adapter
from scute.adapters.checkpoint import LAYER_PREFIX
from scute.ops.reference import rotate_pairs
from scute.ops.slots import Slots

BIAS_POLICIES = ("keep", "drop")


def effective_delta(slots: Slots, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """The layer's change under `slots`, in float64: ``(ΔW [out, in], Δb [out])`` with
    ``U(W0 T x + b0) + s·v ⊙ B(m ⊙ A x) = (W0 + ΔW) x + (b0 + Δb)`` for every x."""
    f64 = torch.float64
    w0 = weight.detach().to(f64)
    b0 = torch.zeros(w0.shape[0], dtype=f64, device=w0.device) if bias is None else bias.detach().to(f64)
    w = w0
    if slots.t is not None:
        w = w * slots.t.to(f64)[None, :]
    if slots.t_blocks is not None:  # chunk k of x becomes T_k x_k: columns of chunk k of W0 become W0_k T_k
        tb = slots.t_blocks.to(f64)
        b = tb.shape[-1]
        chunks = w.unflatten(1, (-1, b))  # [out, nb, b]
        w = torch.einsum("onj,nji->oni", chunks, tb.expand(chunks.shape[1], b, b)).flatten(1)
    w, b_eff = _epilogue(slots, w), _epilogue(slots, b0[:, None])[:, 0]
    if slots.c is not None:
        b_eff = b_eff + slots.c.to(f64)
    if slots.A is not None:
        B, A = low_rank_factors(slots)
        w = w + B @ A
    return w - w0, b_eff - b0


def _epilogue(slots: Slots, z: Tensor) -> Tensor:
    """The linear part of U (o, o2; not c) applied to the columns of z [out, k]."""
    f64 = torch.float64
    y = z * slots.o.to(f64)[:, None] if slots.o is not None else z
    if slots.o2 is not None:
        y = y + slots.o2.to(f64)[:, None] * rotate_pairs(z.T, slots.rot_group).T
    return y


def low_rank_factors(slots: Slots) -> tuple[Tensor, Tensor]:
    """(B' [out, r], A' [r, in]) in float64 with ``B'A' = s·diag(v)·B·diag(m)·A``."""
    f64 = torch.float64
    A, B = slots.A.to(f64), slots.B.to(f64) * slots.scale
    if slots.m is not None:
        A = slots.m.to(f64)[:, None] * A
    if slots.v is not None:
        B = slots.v.to(f64)[:, None] * B
    return B, A


def factored_svd(B: Tensor, A: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The thin SVD (U, S, Vh) of ``B A`` from its factors (B [out, r], A [r, in]): ``B = Qb Rb``, ``Aᵀ = Qa Ra``
    (QR), then the SVD of the small core ``Rb Raᵀ``; exact, O((out + in)·r²) where the SVD of B A itself is
    O(out·in·min(out, in)) (VeRA's rank-256 deltas of an 8B layer)."""
    Qb, Rb = torch.linalg.qr(B)
    Qa, Ra = torch.linalg.qr(A.T)
    Uc, S, Vch = torch.linalg.svd(Rb @ Ra.T)
    return Qb @ Uc, S, Vch @ Qa.T


def gram_svd(dW: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The thin SVD (U, S, Vh) of dW [out, in] through its smaller Gram matrix G = M Mᵀ (M = dW, or dWᵀ when in <
    out): G = Q Λ Qᵀ (eigh), then QᵀM = S Vh, its rows' norms the singular values, sorted descending (to rounding
    where they are above ~1e-4 of the largest, smaller ones to ~1e-8 of it; √λ would lose those entirely).
    U S Vh = Q Qᵀ M = M, and keeping k triplets projects M onto G's top-k eigenvectors: the best rank-k
    approximation, whose error is the tail of S (the singular vectors taken from QᵀM lose orthogonality as
    eps / σ², the product does not). Two GEMMs and an eigh of min(out, in)² instead of an SVD of out x in."""
    wide = dW.shape[0] <= dW.shape[1]
    M = dW if wide else dW.T
    _, Q = torch.linalg.eigh(M @ M.T)
    P = Q.T @ M
    S, order = P.norm(dim=1).sort(descending=True)
    Q, P = Q[:, order], P[order]
    R = P / torch.where(S > 0, S, 1)[:, None]  # a zero row stays zero
    return (Q, S, R) if wide else (R.T, S, Q.T)


def _base_path_changed(slots: Slots) -> bool:
    return any(getattr(slots, n) is not None for n in ("t", "t_blocks", "o", "o2"))


@dataclass
class LayerConversion:
    """One layer as a rank-`rank` LoRA: ``ΔW ≈ B A`` and its error."""

    name: str
    in_features: int
    out_features: int
    A: Tensor  # [rank, in] float64 (zero rows past the layer's kept rank)
    B: Tensor  # [out, rank] float64
    bias: Tensor | None  # Δb, written as lora_B.bias; None if zero or dropped
    delta_norm: float  # ‖ΔW‖_F
    error_norm: float  # ‖ΔW − B A‖_F
    bias_norm: float  # ‖Δb‖
    bias_error_norm: float  # ‖Δb‖ if dropped, else 0
    delta_rank: int  # numerical rank of ΔW (singular values above 1e-12 of the largest), or the factor rank
    method: str  # "factors" (the adapter's own factors, exact) or "svd"
    exact_elems: int  # elements of the exact adapter's live per-layer tensors (shared ones excluded)

    @property
    def rel_error(self) -> float:
        """‖ΔW − B A‖_F / ‖ΔW‖_F: the fraction of the layer's weight change that the LoRA misses."""
        return self.error_norm / self.delta_norm if self.delta_norm else 0.0

    @property
    def exact(self) -> bool:
        return self.error_norm <= 1e-9 * max(self.delta_norm, 1e-300) and self.bias_error_norm == 0.0


def convert_layer(name: str, slots: Slots, weight: Tensor, bias: Tensor | None, rank: int,
                  bias_policy: str = "keep", cache: dict | None = None) -> LayerConversion:
    """One layer's normal form -> rank-`rank` LoRA factors (see the module docstring). `cache` (a dict kept
    by the caller) holds the layer's delta and SVD, to convert one adapter at several ranks."""
    out_f, in_f = weight.shape
    cache = {} if cache is None else cache
    if "delta" not in cache:
        cache["delta"] = effective_delta(slots, weight, bias)
    dW, db = cache["delta"]
    b_ref = 1.0 if bias is None else max(bias.detach().double().norm().item(), 1e-300)
    db_norm = db.norm().item()
    has_bias = db_norm > 1e-9 * b_ref  # DoRA's (1 − g)⊙b0 correction cancels to rounding
    delta_norm = dW.norm().item()
    A = torch.zeros(rank, in_f, dtype=torch.float64, device=dW.device)
    B = torch.zeros(out_f, rank, dtype=torch.float64, device=dW.device)
    if slots.A is not None and not _base_path_changed(slots) and slots.rank <= rank:
        Bf, Af = low_rank_factors(slots)  # already ΔW = B'A' at rank ≤ R: exact without an SVD
        k, method = slots.rank, "factors"
        B[:, :k], A[:k] = Bf, Af
        error = (dW - B @ A).norm().item()
    else:
        if "svd" not in cache:
            low_rank = slots.A is not None and not _base_path_changed(slots)  # ΔW = B'A' of rank r above `rank`
            cache["svd"] = factored_svd(*low_rank_factors(slots)) if low_rank else gram_svd(dW)
        U, S, Vh = cache["svd"]
        k, method = min(rank, S.numel()), "svd"
        root = S[:k].sqrt()
        B[:, :k], A[:k] = U[:, :k] * root, root[:, None] * Vh[:k]
        error = S[k:].square().sum().sqrt().item()
        k = int((S > 1e-12 * S[0]).sum()) if S.numel() and S[0] > 0 else 0
    keep = has_bias and bias_policy == "keep"
    return LayerConversion(
        name, in_f, out_f, A, B, db if keep else None, delta_norm, error, db_norm if has_bias else 0.0,
        db_norm if has_bias and not keep else 0.0, k, method, slots.num_bytes(element_size=1),
    )


@dataclass
class LoraConversion:
    """A whole adapter as a rank-`rank` PEFT LoRA."""

    source: str
    peft_type: str
    rank: int
    layers: dict[str, LayerConversion]
    shared_elems: int = 0  # elements the exact adapter shares between layers (VeRA's pair), counted once
    notes: list[str] = field(default_factory=list)

    @property
    def rel_error(self) -> float:
        """Whole-model weight error: sqrt(Σ‖ΔW − BA‖²) / sqrt(Σ‖ΔW‖²) over every adapted layer."""
        num = sum(l.error_norm ** 2 + l.bias_error_norm ** 2 for l in self.layers.values())
        den = sum(l.delta_norm ** 2 + l.bias_norm ** 2 for l in self.layers.values())
        return (num / den) ** 0.5 if den else 0.0

    @property
    def lora_bias(self) -> bool:
        return any(l.bias is not None for l in self.layers.values())

    def exact_bytes(self, element_size: int = 4) -> int:
        """Bytes of the exact adapter's live tensors as Scute serves them (shared matrices counted once)."""
        return element_size * (sum(l.exact_elems for l in self.layers.values()) + self.shared_elems)

    def lora_bytes(self, element_size: int = 4) -> int:
        """Bytes of the LoRA checkpoint's tensors (what a LoRA server holds per adapter, before its own padding)."""
        per = sum(l.A.numel() + l.B.numel() + (l.out_features if self.lora_bias else 0)
                  for l in self.layers.values())
        return element_size * per


def convert_adapter(adapter: Adapter, model: nn.Module, rank: int, bias_policy: str = "keep",
                    cache: dict | None = None) -> LoraConversion:
    """Convert a loaded adapter (its slots were computed from `model`'s weights) into a rank-`rank` LoRA.
    Pass the same `cache` dict to convert one adapter at several ranks with one SVD per layer."""
    if rank < 1:
        raise ValueError(f"rank must be at least 1, got {rank}")
    if bias_policy not in BIAS_POLICIES:
        raise ValueError(f"bias policy {bias_policy!r}: use one of {', '.join(BIAS_POLICIES)}")
    if adapter.invocation_tokens is not None:
        raise ValueError(f"{adapter.path}: an aLoRA adapter is already a LoRA (its gate, the invocation tokens, "
                         "is not part of a LoRA conversion): serve it as it is")
    modules = dict(model.named_modules())
    layers = {}
    for name, slots in adapter.layers.items():
        base = modules[name]
        layer_cache = None if cache is None else cache.setdefault(name, {})
        here = slots.to(device=base.weight.device)  # where W0 is (VeRA's slots are built on the CPU)
        layers[name] = convert_layer(name, here, base.weight, base.bias, rank, bias_policy, layer_cache)
    shared = {}
    for slots in adapter.layers.values():
        for slot in slots.shared:
            x = getattr(slots, slot)
            shared[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes() // x.element_size()
    method = "DORA" if adapter.peft_type == "LORA" and adapter.config.get("use_dora") else adapter.peft_type
    conv = LoraConversion(adapter.path, method, rank, layers, sum(shared.values()))
    dropped = [l.name for l in layers.values() if l.bias_error_norm]
    if dropped:
        conv.notes.append(f"bias change of {len(dropped)} layers dropped (bias='drop'): counted in the error")
    elif conv.lora_bias:
        conv.notes.append("bias change written as lora_bias (PEFT serves it; LoRA servers without lora_bias do not)")
    return conv


def as_adapter(conv: LoraConversion, dtype: torch.dtype = torch.float32) -> Adapter:
    """The conversion as a loaded Scute adapter (plain LoRA slots), to serve or compare without a file."""
    layers = {}
    for name, l in conv.layers.items():
        c = None if l.bias is None else l.bias.to(dtype)
        layers[name] = Slots(l.in_features, l.out_features, A=l.A.to(dtype), B=l.B.to(dtype), c=c)
    return Adapter(f"{os.path.basename(conv.source)}-lora-r{conv.rank}", conv.source, "LORA", {}, "", layers)


def target_modules(names: list[str], model: nn.Module) -> list[str] | str:
    """PEFT `target_modules` adapting exactly `names`: their leaf names if that selects no other linear
    layer of `model`, else a full-match regex of the names."""
    leaves = sorted({n.rpartition(".")[2] for n in names})
    linear = [n for n, m in model.named_modules() if isinstance(getattr(m, "weight", None), Tensor)
              and m.weight.dim() == 2 and not isinstance(m, nn.Embedding)]
    selected = {n for n in linear if n.rpartition(".")[2] in leaves}
    if selected == set(names):
        return leaves
    return "|".join(sorted(n.replace(".", r"\.") for n in names))


def save_lora(conv: LoraConversion, model: nn.Module, out_dir: str, dtype: torch.dtype = torch.float32,
              base_model_name_or_path: str | None = None) -> str:
    """Write `conv` as a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) that PEFT and
    vLLM load; returns `out_dir`. A `scute_conversion.json` beside them records the per-layer errors."""
    from peft import LoraConfig

    os.makedirs(out_dir, exist_ok=True)
    tensors = {}
    for name, layer in conv.layers.items():
        key = LAYER_PREFIX + name
        tensors[f"{key}.lora_A.weight"] = layer.A.to(dtype).contiguous()
        tensors[f"{key}.lora_B.weight"] = layer.B.to(dtype).contiguous()
        if conv.lora_bias:
            bias = layer.bias if layer.bias is not None else torch.zeros(layer.out_features, dtype=torch.float64)
            tensors[f"{key}.lora_B.bias"] = bias.to(dtype).contiguous()
    config = LoraConfig(
        r=conv.rank, lora_alpha=conv.rank, lora_dropout=0.0, bias="none", lora_bias=conv.lora_bias,
        target_modules=target_modules(list(conv.layers), model), task_type="CAUSAL_LM", inference_mode=True,
        base_model_name_or_path=base_model_name_or_path,
    )
    config.save_pretrained(out_dir)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "scute_conversion.json"), "w") as f:
        json.dump(conversion_report(conv), f, indent=1)
    return out_dir


def conversion_report(conv: LoraConversion) -> dict:
    """The conversion's figures as plain data (JSON)."""
    return {
        "source": conv.source, "peft_type": conv.peft_type, "rank": conv.rank, "rel_error": conv.rel_error,
        "exact_bytes_fp32": conv.exact_bytes(4), "lora_bytes_fp32": conv.lora_bytes(4), "notes": conv.notes,
        "layers": {n: {"in_features": l.in_features, "out_features": l.out_features, "rel_error": l.rel_error,
                           "delta_rank": l.delta_rank, "method": l.method, "bias_norm": l.bias_norm,
                           "bias_dropped": bool(l.bias_error_norm), "exact_elems": l.exact_elems}
                   for n, l in conv.layers.items()},
    }
