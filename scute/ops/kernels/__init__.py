"""Triton kernels of the six-slot op: input-transform pre-pass, shrink, expand with epilogue.

Imported lazily (`scute.ops.launch.kernels`, on first use) because `triton.jit` decides at decoration time whether
to run compiled or in the interpreter (``TRITON_INTERPRET=1``). Table layout and flags: `scute.ops.pool`.

A tile is up to `LoraMeta.block_m` tokens of one adapter group (16 at decode, where a tile is mostly one token;
more in a long step, `launch.tile_tokens`). The shrink is a tile GEMM on
tensor cores (`tl.dot` of x and A in their own dtype: exact products, fp32 sums; fp32 inputs in IEEE fp32, no
tf32) over the grid (tile, K split x rank tile, projection); masked rows move no bytes. The delta d = B (m ⊙ h)
(float32 sums, stored in `SlotPool.delta_dtype`) is two launches, each compiled to its own register count (at
decode, the programs an SM holds are what hides their load latency): `delta_rows_kernel` runs a one-token tile
(most tiles at decode) as a row, whose h is a rank-length vector (its product with a block of B rows is a
multiply-sum along each row's contiguous rank values, in fp32, over rank steps of 16, or up to 64 in a pool of
wide ranks: `launch.row_block_r`); `delta_tiles_kernel` runs a tile of several tokens as a tensor-core
product (h split in two 16-bit parts: about 16 mantissa bits), reading each B block once for all of them. The shrink's
K-split partials of h are summed by the row kernel as it reads them, or once by the shrink for multi-token tiles
and groups wider than one rank step (see `shrink_kernel`). None of these reads the base output, so they run
beside the base GEMM; `epilogue_kernel` then applies o ⊙ z + o2 ⊙ rot(z) + c + v ⊙ d to each adapter token.

Arguments that change from step to step (a step's token count, a pass's chunks per program, a write's rows)
are not specialized (`do_not_specialize`): Triton compiles a kernel again for an integer argument that is 1, a
multiple of 16, or neither, and a compile mid-serving stalls every running request for one to two seconds (an
eager step of an odd token count after graphs of multiples of 16). They bound loops and masks only, never a
vectorized access, so nothing is lost.
"""

from __future__ import annotations

from scute.ops.kernels.input_transform import input_transform_kernel, input_tiles_kernel
from scute.ops.kernels.shrink import shrink_kernel
from scute.ops.kernels.lora_delta import delta_rows_kernel, delta_tiles_kernel
from scute.ops.kernels.shared_delta import shared_scale_kernel, shared_expand_kernel
from scute.ops.kernels.epilogue import epilogue_kernel

__all__ = [
    "input_transform_kernel", "input_tiles_kernel", "shrink_kernel", "delta_rows_kernel", "delta_tiles_kernel",
    "shared_scale_kernel", "shared_expand_kernel", "epilogue_kernel",
]
