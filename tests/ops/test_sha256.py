"""SHA-256 of many leaves (`scute.ops.sha256`) against hashlib: in Triton's interpreter on the CPU (small leaves;
`tests/interpreter.py`), on the GPU with the adapter files' leaf size. Leaves start at any byte (a file's span
does), and lanes past the last leaf store nothing."""

from __future__ import annotations

import hashlib

import pytest
import torch

from tests.interpreter import DEVICE, interpreter_module, spy_launches, use_interpreter

FRESH_PROCESS = use_interpreter()  # before triton is imported (tests/interpreter.py)
pytest.importorskip("triton")

from scute.ops import sha256 as sha  # noqa: E402

_in_interpreter_process, test_in_a_fresh_interpreter_process = interpreter_module(__file__, FRESH_PROCESS,
                                                                                  triton_cpu=True)
LEAVES = [(64, 3), (192, 2)] if DEVICE == "cpu" else [(64, 1000), (8192, 700), (8192, 1)]


@pytest.mark.parametrize("leaf,n", LEAVES)
def test_leaves_match_hashlib_at_any_offset(monkeypatch, leaf, n):
    from scute.ops import sha256_kernels

    g = torch.Generator().manual_seed(leaf + n)
    data = torch.randint(0, 256, (leaf * n + 16,), dtype=torch.uint8, generator=g)
    data[:leaf] = 0  # a leaf of zeros: the padding is the standard's, not a function of the bytes
    for start in (0, 3, 8, 14):  # the leaves' start 16-byte aligned, or any byte past it
        seen = spy_launches(monkeypatch, sha256_kernels, "sha256_leaves_kernel")
        got = sha.sha256_leaves(data.to(DEVICE)[start:start + leaf * n], leaf)
        assert seen and got.shape == (n, 32) and got.dtype == torch.uint8
        want = b"".join(hashlib.sha256(data[start + i * leaf:start + (i + 1) * leaf].numpy().tobytes()).digest()
                        for i in range(n))
        assert got.cpu().numpy().tobytes() == want
        assert sha.sha256_leaves_ref(data[start:start + leaf * n], leaf) == want


@pytest.mark.parametrize("programs", [1, 2, 3, 100])
def test_fewer_programs_than_groups_hash_every_leaf(monkeypatch, programs):
    """A grid of fewer programs than groups of 32 leaves: each program hashes the groups of its id, then every
    grid's size on; the grid never exceeds the groups (70 leaves: 3 groups)."""
    from scute.ops import sha256_kernels

    data = torch.randint(0, 256, (64 * 70 + 3,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    seen = spy_launches(monkeypatch, sha256_kernels, "sha256_leaves_kernel")
    got = sha.sha256_leaves(data.to(DEVICE)[3:], 64, programs=programs)
    assert seen[0][1] == (min(programs, 3),)
    assert got.cpu().numpy().tobytes() == sha.sha256_leaves_ref(data[3:], 64)


def test_leaves_at_the_end_of_their_storage_and_in_one_that_begins_unaligned(monkeypatch):
    """The kernel reads the aligned 16 bytes around the leaves' last byte: leaves that end their storage hash as
    hashlib does; a storage that does not begin 16-byte aligned (no room below the leaves) is hashed from a copy."""
    from scute.ops import sha256_kernels

    g = torch.Generator().manual_seed(5)
    data = torch.randint(0, 256, (3 * 64 + 8,), dtype=torch.uint8, generator=g).to(DEVICE)
    assert sha.sha256_leaves(data[8:], 64).cpu().numpy().tobytes() == sha.sha256_leaves_ref(data[8:].cpu(), 64)
    raw = bytearray(torch.randint(0, 256, (3 * 64 + 5,), dtype=torch.uint8, generator=g).numpy().tobytes())
    unaligned = torch.frombuffer(raw, dtype=torch.uint8, offset=3, count=3 * 64)
    seen = spy_launches(monkeypatch, sha256_kernels, "sha256_leaves_kernel")
    got = sha.sha256_leaves(unaligned.to(DEVICE), 64)
    assert seen and got.cpu().numpy().tobytes() == sha.sha256_leaves_ref(unaligned, 64)


def test_no_leaves_and_the_cpu_path_without_the_interpreter(monkeypatch):
    assert sha.sha256_leaves(torch.zeros(0, dtype=torch.uint8, device=DEVICE), 64).shape == (0, 32)
    monkeypatch.delenv("SCUTE_TRITON_CPU", raising=False)  # CPU tensors: hashlib
    data = torch.arange(128, dtype=torch.uint8)
    want = hashlib.sha256(bytes(range(64))).digest() + hashlib.sha256(bytes(range(64, 128))).digest()
    assert sha.sha256_leaves(data, 64).numpy().tobytes() == want
    assert sha.sha256_leaves(data[:0], 64).shape == (0, 32)


def test_refuses_what_is_not_whole_leaves():
    with pytest.raises(ValueError, match="whole 64-byte leaves"):
        sha.sha256_leaves(torch.zeros(100, dtype=torch.uint8), 64)
    with pytest.raises(ValueError, match="a multiple of 64"):
        sha.sha256_leaves(torch.zeros(96, dtype=torch.uint8), 96)
