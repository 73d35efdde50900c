"""The normal form: one adapter on one linear layer, written as six slots.

    y = U( W0 · T(x) + b0 )  +  s · v ⊙ ( B · ( m ⊙ ( A · x ) ) )
    U(z) = o ⊙ z  +  o2 ⊙ rot_g(z)  +  c

A converter (one file per PEFT method) fills a `Slots` with what the checkpoint says, scalar `s` included;
`Slots.folded()` applies the exact folding rules of `docs/normal_form.md` once at load, so only the *live*
tensors reach the kernels. Tensors shared between adapters (VeRA's projections) are the same tensor objects in
every adapter that shares them, never copies; `shared` names those slots.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

TENSOR_SLOTS = ("t", "t_blocks", "o", "o2", "c", "A", "m", "B", "v")


@dataclass
class Slots:
    """One adapter on one `nn.Linear(in_features, out_features)` in normal form.

    Every slot is optional; an empty slot is the identity (T, o, m, v) or zero (c, low-rank delta).

    Attributes:
        t: [in] diagonal input transform on the base path (IA3 feed-forward).
        t_blocks: [nb, b, b] block-diagonal input transform: chunk k of x (size b) becomes
            ``t_blocks[k] @ x_k``; ``nb == 1`` means one block shared by every chunk (OFT block_share).
        o: [out] scale of the base output, bias included (IA3, DoRA's magnitude).
        o2, rot_group: [out] and g: adds ``o2 ⊙ rot_g(z)``, rot_g maps each group of g outputs
            ``[z1 | z2] -> [-z2 | z1]`` (RoAd).
        c: [out] additive output vector (bias corrections, LoRA's lora_bias).
        A: [r, in] down projection; m: [r] rank-space scale; B: [out, r] up projection; v: [out] delta scale.
        scale: the scalar s, folded away by `folded()`.
        shared: slot names whose tensors are shared between adapters ("A", "B"); they are never rewritten.
        merged: after `folded()`, the slots (and "s") that were folded into others at load.
    """

    in_features: int
    out_features: int
    t: Tensor | None = None
    t_blocks: Tensor | None = None
    o: Tensor | None = None
    o2: Tensor | None = None
    rot_group: int = 0
    c: Tensor | None = None
    A: Tensor | None = None
    m: Tensor | None = None
    B: Tensor | None = None
    v: Tensor | None = None
    scale: float = 1.0
    shared: frozenset[str] = field(default_factory=frozenset)
    merged: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ structure
    @property
    def rank(self) -> int:
        return 0 if self.A is None else self.A.shape[0]

    @property
    def live(self) -> tuple[str, ...]:
        """Slot names holding a tensor (after `folded()`: what the kernel reads per token)."""
        fields = self.__dict__  # a load asks each of its hundreds of layers several times
        return tuple([n for n in TENSOR_SLOTS if fields[n] is not None])

    def tensors(self) -> dict[str, Tensor]:
        fields = self.__dict__
        return {n: fields[n] for n in TENSOR_SLOTS if fields[n] is not None}

    def validate(self) -> None:
        """Raise ValueError if a slot's shape does not fit this layer (the message names the slot)."""
        i, o = self.in_features, self.out_features
        r = self.rank
        if self.A is None and (self.m is not None or self.v is not None):
            raise ValueError("slots m and v need A and B")
        want = {"t": (i,), "o": (o,), "o2": (o,), "c": (o,), "m": (r,), "v": (o,)}
        for name, shape in want.items():
            x = getattr(self, name)
            if x is not None and tuple(x.shape) != shape:
                raise ValueError(f"slot {name} has shape {tuple(x.shape)}, layer needs {shape}")
        if (self.A is None) != (self.B is None):
            raise ValueError("slots A and B must be given together")
        if self.A is not None and (self.A.dim() != 2 or self.A.shape[1] != i):
            raise ValueError(f"slot A has shape {tuple(self.A.shape)}, layer needs [r, {i}]")
        if self.B is not None and tuple(self.B.shape) != (o, r):
            raise ValueError(f"slot B has shape {tuple(self.B.shape)}, layer needs ({o}, {r})")
        if self.t_blocks is not None:
            nb, b, b2 = self.t_blocks.shape
            if b != b2 or i % b or nb not in (1, i // b):
                raise ValueError(f"slot t_blocks has shape {tuple(self.t_blocks.shape)}: needs [{i}//b or 1, b, b]")
        if (self.o2 is None) != (self.rot_group == 0):
            raise ValueError("slot o2 needs rot_group > 0 and vice versa")
        if self.rot_group and (self.rot_group % 2 or o % self.rot_group):
            raise ValueError(f"rot_group {self.rot_group} must be even and divide out_features {o}")

    # ------------------------------------------------------------------ folding
    def folded(self) -> Slots:
        """The same map with every foldable slot merged (exact algebra, once at load).

        Rules: ``B ← s·diag(v)·B`` if B is per-adapter; ``A ← diag(m)·A`` if A is per-adapter, else
        ``B ← B·diag(m)`` if B is; with B shared, s goes into v (or m). Shared tensors are never rewritten.
        """
        A, m, B, v, s = self.A, self.m, self.B, self.v, self.scale
        merged: list[str] = list(self.merged)
        if A is not None:
            a_shared, b_shared = "A" in self.shared, "B" in self.shared
            if not b_shared:
                B, v = (B * s if v is None else (s * v)[:, None] * B), None  # B * s: s * B's every element
                merged += ["s"] + (["v"] if self.v is not None else [])
            elif s != 1.0:
                if v is not None:
                    v = s * v
                else:
                    m = s * m if m is not None else torch.full((B.shape[1],), s, dtype=B.dtype, device=B.device)
                merged.append("s")
            if m is not None and not a_shared:
                A, m = m[:, None] * A, None
                merged.append("m")
            elif m is not None and not b_shared:
                B, m = B * m[None, :], None
                merged.append("m")
        return self.with_same_shapes(A=A, m=m, B=B, v=v, scale=1.0, merged=tuple(dict.fromkeys(merged)))

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> Slots:
        """A copy with every tensor moved. Shared tensors are copied like the others: to keep them shared, move
        the whole adapter (`scute.adapters.Adapter.to` copies each shared storage once)."""
        moved = {n: getattr(self, n).to(device=device, dtype=dtype) for n in self.live}
        return self.with_same_shapes(**moved)

    def with_same_shapes(self, **changes) -> Slots:
        """A copy with `changes`, which keep every slot's shape (a fold, a move): not validated again, and
        without `dataclasses.replace`'s field walk or `copy.copy`'s reduce protocol (a load makes one per adapted
        layer, hundreds)."""
        out = object.__new__(Slots)
        out.__dict__ = {**self.__dict__, **changes}
        return out

    def num_bytes(self, element_size: int | None = None) -> int:
        """Bytes of the per-adapter tensors (shared ones excluded), at `element_size` bytes per element if given."""
        total = 0
        for name, x in self.tensors().items():
            if name not in self.shared:
                total += x.numel() * (element_size or x.element_size())
        return total


def fold_layers(layers: Mapping[str, Slots], pause: Callable[[], None] = lambda: None) -> dict[str, Slots]:
    """``{name: slots.folded()}`` for an adapter's layers, with the commonest fold made for many layers at once:
    a per-adapter B scaled by s alone (LoRA's ``B ← s·B``) is multiplied by one call per distinct s, its dtype
    and device (`torch._foreach_mul`, 32 layers per call: a few launches on a GPU where each layer made its own).
    Elementwise the same product as `folded()`, so the same values; such a slot folded already (s merged, scale
    1) is kept as it is. `pause` is called every 32 layers looked at, before each such call and every 16 layers
    folded one by one."""
    alone: list[str] = []
    scaled: dict[tuple, list[str]] = {}
    out: dict[str, Slots] = {}
    for k, (name, sl) in enumerate(layers.items()):
        if k % 32 == 0:
            pause()
        if sl.A is not None and sl.m is None and sl.v is None and not sl.shared:
            if sl.scale == 1.0 and "s" in sl.merged:  # folded already (LoRA folded in the serving dtype)
                out[name] = sl
            else:
                scaled.setdefault((sl.scale, sl.B.dtype, sl.B.device), []).append(name)
        else:
            alone.append(name)
    for k, name in enumerate(alone):
        if k % 16 == 0:
            pause()
        out[name] = layers[name].folded()
    for (s, _, _), names in scaled.items():
        for i in range(0, len(names), 32):  # a call holds the interpreter lock: 32 layers at a time, then a pause
            pause()
            chunk = names[i:i + 32]
            for name, B in zip(chunk, torch._foreach_mul([layers[n].B for n in chunk], s)):
                sl = layers[name]
                merged = sl.merged if "s" in sl.merged else (*sl.merged, "s")
                out[name] = sl.with_same_shapes(B=B, scale=1.0, merged=merged)
    return {name: out[name] for name in layers}
