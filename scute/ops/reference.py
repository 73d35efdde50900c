"""PyTorch reference of Scute's ops: the exact math every kernel is tested against.

These run anywhere (CPU, CUDA, any float dtype) and are the CPU serving path. They loop over the *distinct
adapters* of a batch, never over tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from scute.ops.slots import Slots


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of the adapter path: float64 stays float64, everything else runs in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rotate_pairs(z: Tensor, group: int) -> Tensor:
    """rot_g: inside each group of `group` consecutive features, ``[z1 | z2] -> [-z2 | z1]`` (halves)."""
    zz = z.unflatten(-1, (-1, 2, group // 2))
    return torch.stack((-zz[..., 1, :], zz[..., 0, :]), dim=-2).flatten(-3)


def slot_rows(token_slots: Tensor) -> dict[int, Tensor]:
    """The rows of each adapter slot present in `token_slots` (ascending; slot −1 left out): one stable sort and
    one host sync. A forward computes it once per distinct `token_slots` and passes it to every layer's call."""
    present, counts = torch.unique(token_slots, return_counts=True)
    groups = torch.argsort(token_slots, stable=True).split(counts.tolist())
    return {a: rows for a, rows in zip(present.tolist(), groups) if a >= 0}


def input_transform_ref(
    x: Tensor, slots: Sequence[Slots | None], token_slots: Tensor, rows: dict[int, Tensor] | None = None
) -> Tensor:
    """Apply each token's input transform T (base path only).

    Semantics:
        x'[t] = t_a ⊙ x[t]                          if adapter a = token_slots[t] has a diagonal T
        x'[t]_k = t_blocks_a[k] @ x[t]_k             if it has a block-diagonal T (chunk k of size b)
        x'[t] = x[t]                                 otherwise (including token_slots[t] == -1)

    Shapes: x [T, in], token_slots [T] int (−1 = base), `rows` = ``slot_rows(token_slots)`` if the caller has
    it; returns x' [T, in] in x.dtype (a new tensor only if some token has a T slot).
    """
    out = x
    for a, idx in _active(slots, token_slots, rows, lambda s: s.t is not None or s.t_blocks is not None):
        s = slots[a]
        xa = x[idx].to(acc_dtype(x.dtype))
        if s.t is not None:
            xa = xa * s.t.to(xa.dtype)
        if s.t_blocks is not None:
            tb = s.t_blocks.to(xa.dtype)
            b = tb.shape[-1]
            chunks = xa.unflatten(-1, (-1, b))  # [n, nb_in, b]
            tb = tb.expand(chunks.shape[1], b, b)
            xa = torch.einsum("kij,nkj->nki", tb, chunks).flatten(-2)
        if out is x:
            out = x.clone()
        out[idx] = xa.to(x.dtype)
    return out


def output_vectors(z: Tensor, s: Slots) -> Tensor:
    """One slot's base-output epilogue U(z) = o ⊙ z + o2 ⊙ rot_g(z) + c (absent vectors: identity / zero), in
    z's dtype; z itself when the slot has none of them. Shapes: z [n, out]."""
    y = z * s.o.to(z.dtype) if s.o is not None else z
    if s.o2 is not None:
        y = y + s.o2.to(z.dtype) * rotate_pairs(z, s.rot_group)
    if s.c is not None:
        y = y + s.c.to(z.dtype)
    return y


def epilogue_ref(
    z: Tensor, x: Tensor, slots: Sequence[Slots | None], token_slots: Tensor, rows: dict[int, Tensor] | None = None
) -> Tensor:
    """Apply each token's epilogue and low-rank delta to the base output z (in place on rows with an adapter).

    Semantics:
        y[t] = o ⊙ z[t] + o2 ⊙ rot_g(z[t]) + c + s · v ⊙ (B (m ⊙ (A x[t])))   for a = token_slots[t] >= 0
        y[t] = z[t]                                                        for token_slots[t] == -1
    with empty slots as identity / zero. Computed in float32 (float64 for float64 inputs), stored in z.dtype.

    Shapes: z [T, out], x [T, in] (the raw input: A sees x, not T(x)), token_slots [T], `rows` as in
    `input_transform_ref`; returns z.
    """
    for a, idx in _active(slots, token_slots, rows, lambda s: True):
        s = slots[a]
        za = z[idx].to(acc_dtype(z.dtype))
        y = output_vectors(za, s)
        if s.A is not None:
            h = x[idx].to(za.dtype) @ s.A.to(za.dtype).T
            if s.m is not None:
                h = h * s.m.to(za.dtype)
            d = h @ s.B.to(za.dtype).T
            if s.v is not None:
                d = d * s.v.to(za.dtype)
            y = y + s.scale * d if s.scale != 1.0 else y + d
        z[idx] = y.to(z.dtype)
    return z


def scute_linear_ref(
    x: Tensor, weight: Tensor, bias: Tensor | None, slots: Sequence[Slots | None], token_slots: Tensor,
    rows: dict[int, Tensor] | None = None,
) -> Tensor:
    """One adapted linear layer over a batch where every token has its own adapter (or none).

    Semantics:
        a = token_slots[t]
        y[t] = W0 x[t] + b0                                                         if a == -1
        y[t] = U_a(W0 T_a(x[t]) + b0) + s_a · v_a ⊙ (B_a (m_a ⊙ (A_a x[t])))          otherwise
        U_a(z) = o_a ⊙ z + o2_a ⊙ rot_g(z) + c_a

    Shapes: x [T, in], weight [out, in], bias [out] or None, slots[a] for a in [0, len(slots)) (None = the
    slot is empty: its tokens get the base output), token_slots [T] int64 with values in [-1, len(slots)),
    `rows` = ``slot_rows(token_slots)`` when the caller already has it (it is the same for every layer).
    Returns y [T, out] in x.dtype. The base GEMM runs in x.dtype, like the server's; the adapter path in
    float32 (float64 for float64 inputs).
    """
    rows = slot_rows(token_slots) if rows is None else rows
    z = F.linear(input_transform_ref(x, slots, token_slots, rows), weight, bias)
    return epilogue_ref(z, x, slots, token_slots, rows)


def _active(slots, token_slots: Tensor, rows: dict[int, Tensor] | None, want) -> list[tuple[int, Tensor]]:
    """(slot, its rows) for each slot present whose `Slots` exist here and satisfy `want`."""
    rows = slot_rows(token_slots) if rows is None else rows
    return [(a, idx) for a, idx in rows.items() if slots[a] is not None and want(slots[a])]
