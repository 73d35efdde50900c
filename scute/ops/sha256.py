"""SHA-256 of a buffer's equal leaves, side by side: the leaves of an adapter file's hash tree (its identity,
`scute.adapters.safetensors_file.Digest`) hashed on the GPU where the file's bytes land anyway, instead of on the
host's cores, where the hash of a large file ends well after its read."""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from scute.ops import triton_on_cpu

# FIPS 180-4: the round constants, then the initial hash value (the kernel reads them as one table)
_CONSTANTS = (
    0x428A2F98, 0x71374491, 0xB5C0FBCF, 0xE9B5DBA5, 0x3956C25B, 0x59F111F1, 0x923F82A4, 0xAB1C5ED5,
    0xD807AA98, 0x12835B01, 0x243185BE, 0x550C7DC3, 0x72BE5D74, 0x80DEB1FE, 0x9BDC06A7, 0xC19BF174,
    0xE49B69C1, 0xEFBE4786, 0x0FC19DC6, 0x240CA1CC, 0x2DE92C6F, 0x4A7484AA, 0x5CB0A9DC, 0x76F988DA,
    0x983E5152, 0xA831C66D, 0xB00327C8, 0xBF597FC7, 0xC6E00BF3, 0xD5A79147, 0x06CA6351, 0x14292967,
    0x27B70A85, 0x2E1B2138, 0x4D2C6DFC, 0x53380D13, 0x650A7354, 0x766A0ABB, 0x81C2C92E, 0x92722C85,
    0xA2BFE8A1, 0xA81A664B, 0xC24B8B70, 0xC76C51A3, 0xD192E819, 0xD6990624, 0xF40E3585, 0x106AA070,
    0x19A4C116, 0x1E376C08, 0x2748774C, 0x34B0BCB5, 0x391C0CB3, 0x4ED8AA4A, 0x5B9CCA4F, 0x682E6FF3,
    0x748F82EE, 0x78A5636F, 0x84C87814, 0x8CC70208, 0x90BEFFFA, 0xA4506CEB, 0xBEF9A3F7, 0xC67178F2,
    0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19,
)
_TABLES: dict[torch.device, Tensor] = {}  # _CONSTANTS on each device the kernel has run on (made once)


def sha256_leaves_ref(data: Tensor | memoryview, leaf: int) -> bytes:
    """Semantics: the sha256 digest of each `leaf`-byte piece of `data`, in order, concatenated (hashlib). Shapes:
    data [n·leaf] uint8 on the CPU (or its memoryview); returns n·32 bytes."""
    view = memoryview(data.numpy()) if isinstance(data, Tensor) else data
    return b"".join(hashlib.sha256(view[i:i + leaf]).digest() for i in range(0, len(view), leaf))


def sha256_leaves(data: Tensor, leaf: int, programs: int | None = None) -> Tensor:
    """Semantics: `sha256_leaves_ref` on the device, not read back: one kernel, a lane per leaf (on CUDA, or on the
    CPU under ``SCUTE_TRITON_CPU=1`` in Triton's interpreter), a one-warp program per 32 leaves, or at most
    `programs` programs, each then hashing several groups of 32 (fewer of the SMs that the steps' kernels run on
    busy, for longer: `bench/bench_side_stream.py`). Shapes: data [n·leaf] uint8 contiguous, leaf a multiple of
    64; returns uint8 [n, 32] on data's device, each row a leaf's digest."""
    n = data.numel() // leaf
    if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous() or n * leaf != data.numel() \
            or leaf % 64:
        raise ValueError(f"sha256_leaves: a contiguous uint8 buffer of whole {leaf}-byte leaves (a multiple of 64), "
                         f"not {data.dtype} {list(data.shape)}")
    if not data.is_cuda and not triton_on_cpu():
        ref = bytearray(sha256_leaves_ref(data, leaf))
        return (torch.frombuffer(ref, dtype=torch.uint8) if ref else torch.empty(0, dtype=torch.uint8)).view(n, 32)
    from scute.ops.sha256_kernels import sha256_leaves_kernel  # lazy: triton.jit reads TRITON_INTERPRET

    table = _TABLES.get(data.device)
    if table is None:
        words = torch.tensor(_CONSTANTS, dtype=torch.int64)
        table = _TABLES[data.device] = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).to(
            data.device)
    out = torch.empty(n, 8, dtype=torch.int32, device=data.device)
    block = 32
    if n:
        aligned, phase = _aligned_below(data)
        groups = -(-n // block)
        grid = groups if programs is None else max(1, min(programs, groups))
        sha256_leaves_kernel[(grid,)](aligned, out, table, n, phase, LEAF=leaf, BLOCK=block, num_warps=1)
    return out.view(torch.uint8)


def _aligned_below(data: Tensor) -> tuple[Tensor, int]:
    """(a view of data's storage from the 16-byte boundary at or below its first byte, the bytes from there to
    data): the kernel reads 16-byte vectors. A storage that does not begin aligned (not one the caching allocator
    gave) is copied to one that does."""
    phase = data.data_ptr() % 16
    if data.storage_offset() < phase or data.untyped_storage().data_ptr() % 16:
        return data.clone(), 0
    return data.as_strided((data.numel() + phase,), (1,), data.storage_offset() - phase), phase
