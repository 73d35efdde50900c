"""What every pass of the six-slot op shares: the launch configuration, the grid sizing rules, the `ScuteOp`
wrapper and the resources a model's layer calls share (`LaunchResources`: side streams, arrival counters).

`LaunchConfig` holds every tuning constant of the passes, each with the reason for its value; `CONFIG` is the one
in use, read by the passes at each call (a bench or a test swaps it: ``launch.CONFIG = replace(CONFIG, ...)``).
The values are what `bench/bench_ops.py --sweep` picked on an H200 (`bench/results/sweep_*_h200.json`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from scute.ops.meta import BLOCK_M


@dataclass(frozen=True)
class LaunchConfig:
    # shrink
    block_k: int = 128  # K tile
    target_programs: int = 1024  # split-K aims at this many programs (~8 per SM on an H200)...
    max_split_k: int = 16  # ...whose partials the one-token delta sums in one load of split_k x row_block_r
    shrink_warps: int = 4
    shrink_stages: int = 3
    # low-rank delta, one-token tiles
    half_n: int = 64  # chunk = 2·half_n output columns; 64 and 1 warp beat 128 and 2 warps by a small margin
    row_block_r: int = 16  # rank step, up to row_max_block_r for a pool of wide ranks whose chunks are narrow
    row_max_block_r: int = 64
    expand_warps: int = 1
    expand_stages: int = 1
    target_expand_programs: int = 4096  # this delta and the epilogue stream more chunks per program beyond this grid
    # tiles: a step of long_step_tokens tokens or more (prefill) cuts each group's tokens into tiles of
    # long_tile_tokens instead of BLOCK_M, so that the shrink reads a group's A, and the multi-token delta its B,
    # once per that many tokens: at 16 a 64-LoRA prefill re-read them as many bytes as it wrote of the deltas
    long_step_tokens: int = 512
    long_tile_tokens: int = 64
    # low-rank delta, multi-token tiles
    max_block_r: int = 64  # rank tile: the largest rank rounded up to a power of two in [16, 64]; larger ranks
    # get several rank tiles (the shrink's grid, this delta's loop)
    tile_half_n: int = 128  # chunk = 2·tile_half_n columns at rank tile 16 or 32 and BLOCK_M-token tiles; a larger
    # rank tile or a taller tile narrows it (the [tile, chunk] float32 product stays in registers)
    tile_warps: int = 4
    tile_stages: int = 1
    tile_programs_per_sm: int = 3  # a persistent launch: this many programs per SM walk the items...
    tile_items_per_program: int = 4  # ...about this many each (an item's setup is ~6 dependent loads)
    # input transform
    pre_pass_tokens: int = 64  # a program takes one more chunk per this many tokens (`pre_pass_iters`)...
    pre_pass_tile_tokens: int = 128  # ...and from this many tokens on, block transforms of slots with
    window_min_tokens: int = BLOCK_M  # this many tokens or more run in windows of BLOCK_M tokens on tensor cores
    tile_blocks: int = 2  # blocks of T per program of those windows (4 blocks at 4 warps take 168 registers)
    window_warps: int = 4
    pre_pass_copy: int = 1024  # the row kernel: elements a program copies (tokens without a block transform)...
    pre_pass_t_elems: int = 4096  # ...and elements of T a program reads: ~4k at 4 warps, no register spill
    pre_pass_prefill_t_elems: int = 8192  # from pre_pass_tile_tokens on: as much T in fewer, wider chunks
    pre_pass_warps: int = 4
    # shared group (VeRA's matrices)
    shared_block_n: int = 128  # the tile GEMM's output columns...
    shared_max_block_m: int = 64  # ...rows (tokens) at most...
    shared_max_block_k: int = 64  # ...and rank step
    shared_warps: int = 4
    shared_stages: int = 3
    shared_fused_tokens: int = 16  # up to this many tokens the GEMM forms m ⊙ h itself (one launch fewer); from
    # 64 on, its per-column-tile gathers of h and m cost more than the scale pass
    # epilogue
    epilogue_half_n: int = 512  # chunk: this many column pairs
    epilogue_warps: int = 4
    # the fold: from this many tokens, a call whose step's slots are all plain low-rank deltas adds them in its
    # GEMMs (cuBLAS's C input) instead of an epilogue pass. A prefill GEMM is compute-bound, so reading C there
    # is nearly free, where the pass reads d and reads and writes z. Below it (decode steps, which graphs
    # capture) the deltas run beside the GEMMs, off the chain, which the fold would put them on.
    fold_min_tokens: int = 512
    # the deferral: a call of this many tokens or fewer whose step's slots are all plain low-rank deltas, called
    # by a consumer that adds them, returns them beside its outputs instead of launching an epilogue. At one token
    # the epilogue's launch is the chain (lora at 1 request: 4.97 ms a step deferred, 5.30 not, on the H200:
    # bench/results/ab_defer_h200.log); at 16 and 64 requests deferring is 3-5 % slower (there a graph's deltas
    # are zero-filled for padding rows, which a one-token bucket has none of)
    defer_max_tokens: int = 1


CONFIG = LaunchConfig()


def config() -> LaunchConfig:
    """The launch configuration in use."""
    return CONFIG


class ScuteOp:
    """One pass: a `torch.library` custom op (with its fake) that `torch.compile` traces, called as the plain
    function it wraps everywhere else. The dispatcher's wrapping of a Python custom op (schema checks, in-place
    bookkeeping) costs an eager call 27 µs of host time around an empty body, more than many of the Triton
    launches inside (`bench/host_costs.py`); a CUDA graph records the same launches either way."""

    def __init__(self, name: str, mutates_args: tuple[str, ...], fn) -> None:
        self.fn, self.op = fn, torch.library.custom_op(name, fn, mutates_args=mutates_args)
        functools.update_wrapper(self, fn)

    def register_fake(self, fake):
        return self.op.register_fake(fake)

    def __call__(self, *args, **kwargs):
        return (self.op if torch.compiler.is_compiling() else self.fn)(*args, **kwargs)


def scute_op(name: str, mutates_args: tuple[str, ...]):
    """Decorator: the function as a `ScuteOp` named `name`."""
    return lambda fn: ScuteOp(name, mutates_args, fn)


def kernels():
    """The Triton kernels (`scute.ops.kernels`), imported on first use: triton.jit reads TRITON_INTERPRET when it
    decorates them."""
    from scute.ops import kernels as module

    return module


# ---------------------------------------------------------------------------------------------- grid sizing
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tile_tokens(num_tokens: int) -> int:
    """Tokens per tile of a step of `num_tokens` tokens (`LoraMeta.block_m`): BLOCK_M, or long_tile_tokens from
    long_step_tokens on."""
    return CONFIG.long_tile_tokens if num_tokens >= CONFIG.long_step_tokens else BLOCK_M


def block_r(max_rank: int, cap: int | None = None) -> int:
    """Rank tile of a pool whose largest rank is `max_rank`: a power of two in [16, cap] (tl.dot needs 16; cap
    defaults to max_block_r)."""
    return min(max(16, 1 << (max(max_rank, 1) - 1).bit_length()), cap or CONFIG.max_block_r)


def rank_tiles(max_rank: int) -> int:
    """Rank tiles of a pool whose largest rank is `max_rank` (the shrink's grid has one program per tile)."""
    return cdiv(max_rank, block_r(max_rank))


def choose_split_k(in_features: int, programs: int, block_k: int | None = None) -> int:
    """Split-K factor of the shrink, given its `programs` per split (tiles x projections: a wide rank's extra rank
    tiles add programs of their own, and must not cut every other group's split): at decode one adapter's A is
    read by a handful of programs unless K is split. A power of two, fixed by the shapes."""
    c = CONFIG
    want = min(max(1, c.target_programs // max(programs, 1)), c.max_split_k, cdiv(in_features, block_k or c.block_k))
    return 1 << (want.bit_length() - 1)  # a power of two: the splits are summed with one tl.arange


def choose_chunks_per_prog(num_tiles: int, out_features: Sequence[int], half_n: int | None = None) -> int:
    """Column chunks per program of the one-token delta (`num_tiles` tiles) or of the epilogue (that many tokens):
    each program pays a setup of several dependent loads, so it streams several chunks once the grid would exceed
    target_expand_programs."""
    chunks = sum(cdiv(o, 2 * (half_n or CONFIG.half_n)) for o in out_features)
    return max(1, cdiv(num_tiles * chunks, CONFIG.target_expand_programs))


def row_block_r(max_rank: int, half_n: int) -> int:
    """Rank step of the one-token delta: the pool's largest rank rounded up to a power of two in [row_block_r,
    row_max_block_r], as long as the [2·half_n, step] block of B stays within the 2·half_n x row_block_r elements
    of a rank-16 pool at the configured half_n (one warp's registers). A VeRA token at decode (rank 256, chunks of
    32 columns) then walks 4 rank steps instead of 16, each a load the one warp waits for."""
    c = CONFIG
    return max(c.row_block_r, min(block_r(max_rank, c.row_max_block_r), c.row_block_r * c.half_n // half_n))


def rows_half_n(num_tiles: int, out_features: Sequence[int], max_rank: int, half_n: int | None = None) -> int:
    """Half-chunk of the one-token delta: `half_n`, halved (down to 16) while a chunk of the pool's widest rank
    holds more of B than a rank-16 chunk at the configured half_n, and the grid stays within
    target_expand_programs. A one-token program reads chunk x rank elements of B in serial rank steps: with one
    token of rank 256 (VeRA at decode) a 128-column chunk is 16 steps of one program, and a whole projection a few
    dozen programs; narrower chunks spread it over the SMs."""
    c = CONFIG
    half_n = half_n or c.half_n
    while half_n > 16 and max_rank * half_n > c.row_block_r * c.half_n and \
            num_tiles * sum(cdiv(o, half_n) for o in out_features) <= c.target_expand_programs:
        half_n //= 2
    return half_n


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def persistent_programs(device: torch.device) -> int:
    """Programs of a persistent launch on `device` (a few per SM; 4 in the CPU interpreter). Not capped by what
    an SM holds: at 255 registers only 2 of the 3 fit, yet capping to 2 cost the mix at B=256/64 31 µs and gained
    VeRA prefill 12."""
    if device.type != "cuda":
        return 4
    return CONFIG.tile_programs_per_sm * _multiprocessors(device)


def precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # 16-bit inputs: products are exact either way


@functools.cache
def tl_dtype(dtype: torch.dtype):
    """The Triton dtype of a torch matrix dtype (a kernel constant: the pool table's pointers are untyped)."""
    import triton.language as tl

    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]


# ---------------------------------------------------------------------------------------------- resources
class SideStreams(NamedTuple):
    """The side streams of a layer call captured in a CUDA graph."""

    lowrank: torch.cuda.Stream  # the shrink, the one-token delta and the epilogues
    tiles: torch.cuda.Stream  # the multi-token delta, beside the one-token delta
    windows: torch.cuda.Stream  # the input transform's windows, beside its row kernel
    shared: torch.cuda.Stream  # the shared group's products


class LaunchResources:
    """What the layer calls of one model share on a device: the side streams of a call captured in a CUDA graph,
    and the int32 counters the shrink's split programs count their arrivals in. `swap_linears` makes one per model
    and hands it to every layer it makes (a `ScuteLinear` made alone makes its own); each layer call takes its
    layer's. Each counter is reset by its last arrival, so one buffer serves every shrink of a device as long as
    they run in order: in line on the caller's stream, or in a graph on `SideStreams.lowrank`."""

    def __init__(self) -> None:
        self._side: dict[torch.device, SideStreams] = {}
        self._counters: dict[torch.device, list[Tensor]] = {}

    def side_streams(self, device: torch.device) -> SideStreams | None:
        """The side streams on `device` while a CUDA graph is being captured; None otherwise (under torch.compile,
        off the GPU, and in eager steps: there each fork and join costs the host 6-17 µs (`bench/host_costs.py`),
        which a step launched from Python pays on its critical path; a graph pays it once, at capture)."""
        if device.type != "cuda" or torch.compiler.is_compiling() or not torch.cuda.is_current_stream_capturing():
            return None
        if device not in self._side:
            self._side[device] = SideStreams(*(torch.cuda.Stream(device) for _ in range(4)))
        return self._side[device]

    def counters(self, device: torch.device, n: int) -> Tensor:
        """At least `n` zeros on `device`. A larger call gets a larger buffer; the smaller ones are kept, since
        captured graphs hold them. Under torch.compile a fresh one, traced with the call."""
        if torch.compiler.is_compiling():
            return torch.zeros(n, dtype=torch.int32, device=device)
        bufs = self._counters.setdefault(device, [])
        if not bufs or bufs[-1].numel() < n:
            bufs.append(torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device))
        return bufs[-1]


def on(stream: torch.cuda.Stream | None):
    """Run on `stream` (in line when there is none)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
