"""Tensor parallelism of the normal form: each rank's share of a base layer and of its adapters' slots.

vLLM-style tensor parallelism over ``N = world_size`` ranks, with no collective beyond the base layer's own:

* **column-parallel** (q/k/v, gate/up): rank r owns the output rows ``O_r = [r·out/N, (r+1)·out/N)`` and sees the
  full input x. It computes ``y[:, O_r]`` exactly; the ranks' outputs are concatenated (or consumed sharded by
  the next, row-parallel, layer).
* **row-parallel** (o, down): rank r owns the input columns ``I_r = [r·in/N, (r+1)·in/N)`` and sees only
  ``x[:, I_r]``. It computes a partial output over all ``out`` features and one all-reduce sums the partials.
  What must be added once, the base bias b0 and the adapters' c, lives on rank 0 only.

Every shard is a view of the full tensor (no copy), so the shards of a *shared* matrix (VeRA's A/B) are views of
the same storage in every adapter that shares it, and stay shared. Sharding commutes with `Slots.folded()`
(every folding rule is elementwise along the sharded dimension). The derivation, the table of rules and the
conditions: docs/normal_form.md, section "Tensor parallelism".
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from torch import Tensor

from scute.ops.slots import Slots

Kind = Literal["column", "row"]
KINDS = ("column", "row")


def shard_range(size: int, rank: int, world_size: int, what: str = "size") -> tuple[int, int]:
    """``[lo, hi)`` = ``[rank·size/N, (rank+1)·size/N)``, rank's contiguous share of `size` features.

    Raises ValueError if `size` is not divisible by `world_size` (the shards would be uneven; vLLM refuses too) or
    if `rank` is not in ``[0, world_size)``; `what` names the dimension in the message.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    if size % world_size:
        raise ValueError(f"{what} {size} cannot be split over {world_size} ranks: needs {what} % world_size == 0")
    w = size // world_size
    return rank * w, (rank + 1) * w


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown parallel kind {kind!r}; known: {KINDS}")


def shard_weight(weight: Tensor, bias: Tensor | None, kind: Kind, rank: int,
                 world_size: int) -> tuple[Tensor, Tensor | None]:
    """Rank `rank`'s share of a base ``nn.Linear`` (weight W0, bias b0).

    Semantics:
        column:  W_r = W0[O_r, :],  b_r = b0[O_r]               y[:, O_r] = x W_r^T + b_r
        row:     W_r = W0[:, I_r],  b_r = b0 if r == 0 else None  y = Σ_r (x[:, I_r] W_r^T + b_r)   (all-reduce)
    with O_r / I_r rank r's contiguous share of the outputs / inputs (`shard_range`). On a row-parallel layer the
    bias stays in rank 0's GEMM, where its adapters' epilogue also sees it (an output-side U scales it:
    ``U(Σ_r z_r + b0) = Σ_{r>0} L(z_r) + U(z_0 + b0)``, L = U without c).

    Shapes: weight [out, in], bias [out] or None. Returns (W_r, b_r): column [out/N, in], [out/N] or None; row
    [out, in/N], [out] on rank 0 and None elsewhere. Views, no copy. Raises ValueError if out (column) or in (row)
    is not divisible by `world_size`, or for a bad kind / rank.
    """
    _check_kind(kind)
    out_f, in_f = weight.shape
    if bias is not None and tuple(bias.shape) != (out_f,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, weight {tuple(weight.shape)} needs ({out_f},)")
    if kind == "column":
        lo, hi = shard_range(out_f, rank, world_size, "out_features")
        return weight[lo:hi], None if bias is None else bias[lo:hi]
    lo, hi = shard_range(in_f, rank, world_size, "in_features")
    return weight[:, lo:hi], bias if rank == 0 else None


def shard_slots(slots: Slots, kind: Kind, rank: int, world_size: int) -> Slots:
    """Rank `rank`'s share of one adapter on a tensor-parallel linear layer, so that the rank's
    ``scute_linear_ref(x_r, W_r, b_r, [slots_r], token_slots)`` (with ``(W_r, b_r) = shard_weight(...)``) is
    its share of the full layer's output.

    Semantics (O_r / I_r as in `shard_weight`; "full" = the slot unchanged, on every rank):
        column:  t, t_blocks, A, m full (every rank has the full x);  o, o2, c, B (rows), v  → [O_r]
                 rot_group unchanged; needs rot_group | out/N so no rotation pair straddles two ranks.
        row:     t → t[I_r];  t_blocks → its blocks inside I_r (one shared block: full); A → A[:, I_r]
                 (needs b | in/N so no block straddles two ranks);  o, o2, rot_group, m, B, v full;
                 c on rank 0 only (it is added once, like the bias).
        scale, shared and merged are kept.
    Then  column: y = concat_r y_r (along features);  row: y = Σ_r y_r (the base layer's all-reduce).

    Shapes: column → in_features unchanged, out_features = out/N; row → in_features = in/N, out_features
    unchanged. Every tensor is a view of the original (shared matrices stay views of the shared storage).
    Raises ValueError naming the slot and the condition when a slot cannot be sharded without an extra
    collective (rot_g on a column layer, t_blocks on a row layer), when the sharded dimension is not divisible
    by `world_size`, or for a bad kind / rank.
    """
    _check_kind(kind)
    s = slots
    if kind == "column":
        lo, hi = shard_range(s.out_features, rank, world_size, "out_features")
        w = hi - lo
        if s.o2 is not None and w % s.rot_group:
            raise ValueError(
                f"slot o2 (rot_g with rot_group {s.rot_group}) cannot be column-sharded: out_features "
                f"{s.out_features} over {world_size} ranks gives {w} outputs per rank, so a rotation group would "
                f"straddle two ranks and pair outputs j, j+{s.rot_group // 2} held by different ranks; needs "
                f"rot_group to divide out_features / world_size")
        new = {n: getattr(s, n)[lo:hi] for n in ("o", "o2", "c", "B", "v") if getattr(s, n) is not None}
        return replace(s, out_features=w, **new)

    lo, hi = shard_range(s.in_features, rank, world_size, "in_features")
    w = hi - lo
    new: dict[str, Tensor | None] = {}
    if s.t is not None:
        new["t"] = s.t[lo:hi]
    if s.t_blocks is not None:
        nb, b, _ = s.t_blocks.shape
        if w % b:
            raise ValueError(
                f"slot t_blocks (block size {b}) cannot be row-sharded: in_features {s.in_features} over "
                f"{world_size} ranks gives {w} inputs per rank, so a block would straddle two ranks and need "
                f"inputs another rank holds; needs the block size to divide in_features / world_size")
        new["t_blocks"] = s.t_blocks if nb == 1 else s.t_blocks[lo // b:hi // b]
    if s.A is not None:
        new["A"] = s.A[:, lo:hi]
    if rank != 0 and s.c is not None:
        new["c"] = None
    return replace(s, in_features=w, **new)
