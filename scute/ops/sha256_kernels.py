"""Triton kernel of `scute.ops.sha256` (semantics and reference there): SHA-256 (FIPS 180-4) of many equal leaves at
once, one leaf per lane. A leaf is hashed serially (one 64-byte block after another, as SHA-256 requires), so the
parallelism is the number of leaves; the words are uint32 and every sum wraps as the standard's do."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rotr(x, n: tl.constexpr):
    return (x >> n) | (x << (32 - n))


@triton.jit
def _round(a, b, c, d, e, f, g, h, w, k):
    """One round; returns the state shifted by one (the new a, then a..g as b..h with e replaced)."""
    t1 = h + (_rotr(e, 6) ^ _rotr(e, 11) ^ _rotr(e, 25)) + (g ^ (e & (f ^ g))) + k + w
    t2 = (_rotr(a, 2) ^ _rotr(a, 13) ^ _rotr(a, 22)) + ((a & b) | (c & (a | b)))
    return t1 + t2, a, b, c, d + t1, e, f, g


@triton.jit
def _k(k_ptr, i: tl.constexpr):
    return tl.load(k_ptr + i).to(tl.uint32, bitcast=True)


@triton.jit
def _sixteen(a, b, c, d, e, f, g, h, w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15, k_ptr):
    """Rounds with the message words w0..w15 and the constants k_ptr[0:16]."""
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w0, _k(k_ptr, 0))
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w1, _k(k_ptr, 1))
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w2, _k(k_ptr, 2))
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w3, _k(k_ptr, 3))
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w4, _k(k_ptr, 4))
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w5, _k(k_ptr, 5))
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w6, _k(k_ptr, 6))
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w7, _k(k_ptr, 7))
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w8, _k(k_ptr, 8))
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w9, _k(k_ptr, 9))
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w10, _k(k_ptr, 10))
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w11, _k(k_ptr, 11))
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w12, _k(k_ptr, 12))
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w13, _k(k_ptr, 13))
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w14, _k(k_ptr, 14))
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, w15, _k(k_ptr, 15))
    return a, b, c, d, e, f, g, h


@triton.jit
def _s0(x):
    return _rotr(x, 7) ^ _rotr(x, 18) ^ (x >> 3)


@triton.jit
def _s1(x):
    return _rotr(x, 17) ^ _rotr(x, 19) ^ (x >> 10)


@triton.jit
def _next16(w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15):
    """The next 16 words of the message schedule, W[t] = σ1(W[t-2]) + W[t-7] + σ0(W[t-15]) + W[t-16], computed in
    place over the window of the last 16 (slot t mod 16; the words updated earlier in this call are the newer)."""
    w0 += _s0(w1) + w9 + _s1(w14)
    w1 += _s0(w2) + w10 + _s1(w15)
    w2 += _s0(w3) + w11 + _s1(w0)
    w3 += _s0(w4) + w12 + _s1(w1)
    w4 += _s0(w5) + w13 + _s1(w2)
    w5 += _s0(w6) + w14 + _s1(w3)
    w6 += _s0(w7) + w15 + _s1(w4)
    w7 += _s0(w8) + w0 + _s1(w5)
    w8 += _s0(w9) + w1 + _s1(w6)
    w9 += _s0(w10) + w2 + _s1(w7)
    w10 += _s0(w11) + w3 + _s1(w8)
    w11 += _s0(w12) + w4 + _s1(w9)
    w12 += _s0(w13) + w5 + _s1(w10)
    w13 += _s0(w14) + w6 + _s1(w11)
    w14 += _s0(w15) + w7 + _s1(w12)
    w15 += _s0(w0) + w8 + _s1(w13)
    return w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15


@triton.jit
def _compress(h0, h1, h2, h3, h4, h5, h6, h7,
              w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15, k_ptr):
    """The state after one 64-byte block (its 16 big-endian words): 4 x 16 rounds, a loop (the code of 16 rounds
    compiled once, not 64)."""
    a, b, c, d, e, f, g, h = h0, h1, h2, h3, h4, h5, h6, h7
    for i in range(4):
        if i > 0:
            w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15 = _next16(
                w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15)
        a, b, c, d, e, f, g, h = _sixteen(a, b, c, d, e, f, g, h, w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10,
                                          w11, w12, w13, w14, w15, k_ptr + 16 * i)
    return h0 + a, h1 + b, h2 + c, h3 + d, h4 + e, h5 + f, h6 + g, h7 + h


@triton.jit
def _deal(x, BLOCK: tl.constexpr, N: tl.constexpr):
    """x [BLOCK, N] -> (x[:, 0::2], x[:, 1::2]), each [BLOCK, N // 2] (N = 2: each [BLOCK])."""
    if N == 2:
        return tl.split(x)
    return tl.split(tl.reshape(x, [BLOCK, N // 2, 2]))


@triton.jit
def _words(tile, BLOCK: tl.constexpr):
    """The 16 big-endian uint32 words of each row of tile (uint8 [BLOCK, 64]: a 64-byte block per lane), as 16
    tensors [BLOCK]: bytes paired into halfwords, halfwords into words, then the words dealt out (no arithmetic
    past the pairing: each split moves values between layouts)."""
    even, odd = _deal(tile.to(tl.uint32), BLOCK, 64)  # bytes 2m and 2m+1
    hi, lo = _deal((even << 8) | odd, BLOCK, 32)  # halfwords 2w and 2w+1
    w = (hi << 16) | lo
    e, o = _deal(w, BLOCK, 16)  # words 2m, 2m+1
    ee, eo = _deal(e, BLOCK, 8)  # 4q, 4q+2
    oe, oo = _deal(o, BLOCK, 8)  # 4q+1, 4q+3
    eee, eeo = _deal(ee, BLOCK, 4)  # 8r, 8r+4
    eoe, eoo = _deal(eo, BLOCK, 4)  # 8r+2, 8r+6
    oee, oeo = _deal(oe, BLOCK, 4)  # 8r+1, 8r+5
    ooe, ooo = _deal(oo, BLOCK, 4)  # 8r+3, 8r+7
    w0, w8 = _deal(eee, BLOCK, 2)
    w4, w12 = _deal(eeo, BLOCK, 2)
    w2, w10 = _deal(eoe, BLOCK, 2)
    w6, w14 = _deal(eoo, BLOCK, 2)
    w1, w9 = _deal(oee, BLOCK, 2)
    w5, w13 = _deal(oeo, BLOCK, 2)
    w3, w11 = _deal(ooe, BLOCK, 2)
    w7, w15 = _deal(ooo, BLOCK, 2)
    return w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15


@triton.jit
def _store(out, lanes, j: tl.constexpr, h, live):
    """Word j of each lane's digest, stored so that its bytes in memory are the digest's (big-endian)."""
    swapped = (h >> 24) | ((h >> 8) & 0xFF00) | ((h & 0xFF00) << 8) | (h << 24)
    tl.store(out + lanes * 8 + j, swapped.to(tl.int32, bitcast=True), mask=live)


# a load's leaf count and where its leaves start (any byte): never a recompile, one compile for every file
@triton.jit(do_not_specialize=["src", "n_leaves"])
def sha256_leaves_kernel(src, out, k_ptr, n_leaves, LEAF: tl.constexpr, BLOCK: tl.constexpr):
    """Program: BLOCK leaves of LEAF bytes (a multiple of 64), one per lane. src uint8 [n_leaves·LEAF]; out int32
    [n_leaves, 8], each row the leaf's digest bytes; k_ptr int32 [72]: the 64 round constants, then the 8 initial
    hash words (their bits). Each block is loaded as one [BLOCK, 64] tile, each row's bytes side by side (one
    memory transaction covers consecutive bytes of a leaf, where loads a word per lane would touch BLOCK leaves
    LEAF bytes apart: the load/store units the steps' kernels beside it use are spared), then dealt into words."""
    lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = lanes < n_leaves
    rows = src + lanes.to(tl.int64)[:, None] * LEAF + tl.arange(0, 64)[None, :]
    zero = tl.zeros([BLOCK], dtype=tl.uint32)
    h0, h1, h2, h3 = zero + _k(k_ptr, 64), zero + _k(k_ptr, 65), zero + _k(k_ptr, 66), zero + _k(k_ptr, 67)
    h4, h5, h6, h7 = zero + _k(k_ptr, 68), zero + _k(k_ptr, 69), zero + _k(k_ptr, 70), zero + _k(k_ptr, 71)
    for block in range(LEAF // 64 + 1):  # the leaf's blocks, then the padding block of a LEAF-byte message
        data = live & (block < LEAF // 64)
        tile = tl.load(rows + block * 64, mask=data[:, None], other=0)
        w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15 = _words(tile, BLOCK)
        pad = (zero + (block == LEAF // 64)).to(tl.uint32)  # 1 in the padding block: a 1 bit, zeros, the length
        h0, h1, h2, h3, h4, h5, h6, h7 = _compress(
            h0, h1, h2, h3, h4, h5, h6, h7, w0 | (pad << 31), w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12,
            w13, w14, w15 | (pad * (LEAF * 8)), k_ptr)
    _store(out, lanes, 0, h0, live)
    _store(out, lanes, 1, h1, live)
    _store(out, lanes, 2, h2, live)
    _store(out, lanes, 3, h3, live)
    _store(out, lanes, 4, h4, live)
    _store(out, lanes, 5, h5, live)
    _store(out, lanes, 6, h6, live)
    _store(out, lanes, 7, h7, live)
