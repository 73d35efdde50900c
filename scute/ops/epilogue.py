"""The epilogue pass: z ← o ⊙ z + o2 ⊙ rot_g(z) + c + v ⊙ d, in place on each projection's base output
(scute::epilogue_)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from scute.ops.launch import cdiv, config, kernels, scute_op


@scute_op("scute::epilogue_", mutates_args=("zs",))
def epilogue_(zs: list[Tensor], ds: list[Tensor], table: Tensor, token_slots: Tensor, half_n: int,
              chunks_per_prog: int) -> None:
    """The epilogue, in place on each projection's base output.

    Semantics (token t with slot a ≥ 0, projection p, group g of a; z = zs[p][t] before the call):
        zs[p][t] ← o ⊙ z + o2 ⊙ rot_g(z) + c + v ⊙ ds[p][t]       (ds[p][t] = 0 if g has no low-rank part in p)
    with empty slots as identity / zero, computed in float32 and stored in z's dtype; rows of base tokens
    (slot −1) are not touched. Reference: `scute.ops.reference.epilogue_ref`.

    Shapes: zs = P ≤ 3 tensors [T, out_p] (unit column stride, any row stride: column slices of one merged
    GEMM's output will do; one dtype), ds as many contiguous tensors of the same shapes
    (from the delta ops; any, if the pool has no low-rank slot), token_slots [T] int32. A program per (token,
    `chunks_per_prog` chunks of 2·half_n columns of one projection).
    """
    num_tokens = zs[0].shape[0]
    if num_tokens == 0:
        return
    outs = [z.shape[1] for z in zs] + [0] * (3 - len(zs))
    kernels().epilogue_kernel[epilogue_grid(num_tokens, outs, half_n, chunks_per_prog)](
        *zs, *[zs[0]] * (3 - len(zs)), *ds, *[ds[0]] * (3 - len(ds)), table, token_slots, table.shape[1], *outs,
        *[z.stride(0) for z in zs], *[0] * (3 - len(zs)), chunks_per_prog, P=len(zs), HB=half_n,
        num_warps=config().epilogue_warps)


def epilogue_grid(num_tokens: int, outs: Sequence[int], half_n: int, chunks_per_prog: int) -> tuple[int, int]:
    """The epilogue's grid: a program per (token, `chunks_per_prog` chunks of 2·half_n columns of one
    projection)."""
    return num_tokens, sum(cdiv(n, 2 * half_n * chunks_per_prog) for n in outs)


@epilogue_.register_fake
def _(zs, ds, table, token_slots, half_n, chunks_per_prog):
    return None
