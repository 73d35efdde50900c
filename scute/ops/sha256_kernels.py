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
    """x [BLOCK, N] (N > 2) -> (x[:, 0::2], x[:, 1::2]), each [BLOCK, N // 2]."""
    return tl.split(tl.reshape(x, [BLOCK, N // 2, 2]))


@triton.jit
def _be_words(tile, BLOCK: tl.constexpr, N: tl.constexpr):
    """uint8 [BLOCK, N] -> its big-endian uint32 words, [BLOCK, N // 4]: bytes paired into halfwords, halfwords
    into words (each split moves values between layouts; the pairing is the only arithmetic)."""
    even, odd = _deal(tile.to(tl.uint32), BLOCK, N)  # bytes 2m and 2m+1
    hi, lo = _deal((even << 8) | odd, BLOCK, N // 2)  # halfwords 2w and 2w+1
    return (hi << 16) | lo


@triton.jit
def _four_words(w, BLOCK: tl.constexpr):
    """uint32 [BLOCK, 4] -> its 4 columns, each [BLOCK], in order."""
    e, o = _deal(w, BLOCK, 4)
    w0, w2 = tl.split(e)
    w1, w3 = tl.split(o)
    return w0, w1, w2, w3


@triton.jit
def _at(q, x0, x1, x2, x3):
    """x_q, q in 0..3 (the same for every lane)."""
    return tl.where(q == 0, x0, tl.where(q == 1, x1, tl.where(q == 2, x2, x3)))


@triton.jit
def _funnel(a, b, s):
    """The big-endian word that starts s bytes (0..3) into the pair of words a, b: (a << 8s) | (b >> (32 - 8s)),
    without a shift by 32 where s = 0 (b >> 1 >> 31 is 0)."""
    return (a << (8 * s)) | ((b >> 1) >> (31 - 8 * s))


@triton.jit
def _message(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, x16, x17, x18, x19, phase):
    """The 16 words of a 64-byte block that starts `phase` bytes (0..15) into the 80 bytes of the big-endian
    words x0..x19."""
    q, s = (phase // 4).to(tl.uint32), (phase % 4).to(tl.uint32)
    u0, u1, u2, u3 = _at(q, x0, x1, x2, x3), _at(q, x1, x2, x3, x4), _at(q, x2, x3, x4, x5), _at(q, x3, x4, x5, x6)
    u4, u5, u6, u7 = _at(q, x4, x5, x6, x7), _at(q, x5, x6, x7, x8), _at(q, x6, x7, x8, x9), _at(q, x7, x8, x9, x10)
    u8, u9 = _at(q, x8, x9, x10, x11), _at(q, x9, x10, x11, x12)
    u10, u11 = _at(q, x10, x11, x12, x13), _at(q, x11, x12, x13, x14)
    u12, u13 = _at(q, x12, x13, x14, x15), _at(q, x13, x14, x15, x16)
    u14, u15, u16 = _at(q, x14, x15, x16, x17), _at(q, x15, x16, x17, x18), _at(q, x16, x17, x18, x19)
    return (_funnel(u0, u1, s), _funnel(u1, u2, s), _funnel(u2, u3, s), _funnel(u3, u4, s), _funnel(u4, u5, s),
            _funnel(u5, u6, s), _funnel(u6, u7, s), _funnel(u7, u8, s), _funnel(u8, u9, s), _funnel(u9, u10, s),
            _funnel(u10, u11, s), _funnel(u11, u12, s), _funnel(u12, u13, s), _funnel(u13, u14, s),
            _funnel(u14, u15, s), _funnel(u15, u16, s))


@triton.jit
def _store(out, lanes, j: tl.constexpr, h, live):
    """Word j of each lane's digest, stored so that its bytes in memory are the digest's (big-endian)."""
    swapped = (h >> 24) | ((h >> 8) & 0xFF00) | ((h & 0xFF00) << 8) | (h << 24)
    tl.store(out + lanes * 8 + j, swapped.to(tl.int32, bitcast=True), mask=live)


# a load's leaf count and the phase of its leaves' start (any byte): never a recompile, one compile for every file
@triton.jit(do_not_specialize=["n_leaves", "phase"])
def sha256_leaves_kernel(src, out, k_ptr, n_leaves, phase, LEAF: tl.constexpr, BLOCK: tl.constexpr):
    """Program: groups of BLOCK leaves of LEAF bytes (a multiple of 64), one leaf per lane: the group of its id,
    then every grid's size on (a grid of a program per group, or fewer, each hashing several: fewer SMs busy beside
    the steps' kernels for longer). src uint8, 16-byte aligned: the leaves are its bytes phase.. (0 <= phase < 16)
    up to phase + n_leaves·LEAF; out int32 [n_leaves, 8], each row the leaf's digest bytes; k_ptr int32 [72]: the 64
    round constants, then the 8 initial hash words (their bits). Each 64-byte block of a lane's leaf is read as
    16-byte vectors from the aligned bytes around it (four, and where phase > 0 the next: 5 loads a lane, where a
    byte at a time, 64 loads, each touching BLOCK leaves LEAF bytes apart, would keep the load units the steps'
    kernels beside it busy), each [BLOCK, 16] tile held a lane to a thread (no shared memory, which a kernel beside
    it may want whole), its words dealt out and shifted by the phase. The aligned 16 bytes around the leaves' first
    and last byte are read whole (inside the allocation, whose blocks are aligned and sized in multiples of 16
    bytes); the bytes outside the leaves are shifted out."""
    vector = tl.arange(0, 16)[None, :]
    for group in range(tl.program_id(0), tl.cdiv(n_leaves, BLOCK), tl.num_programs(0)):
        lanes = group * BLOCK + tl.arange(0, BLOCK)
        live = lanes < n_leaves
        rows = src + lanes.to(tl.int64)[:, None] * LEAF
        has_tail = ((lanes * 0 + phase) > 0)[:, None]  # a mask per row (the interpreter takes no scalar one)
        zero = tl.zeros([BLOCK], dtype=tl.uint32)
        h0, h1, h2, h3 = zero + _k(k_ptr, 64), zero + _k(k_ptr, 65), zero + _k(k_ptr, 66), zero + _k(k_ptr, 67)
        h4, h5, h6, h7 = zero + _k(k_ptr, 68), zero + _k(k_ptr, 69), zero + _k(k_ptr, 70), zero + _k(k_ptr, 71)
        for block in range(LEAF // 64 + 1):  # the leaf's blocks, then the padding block of a LEAF-byte message
            data = (live & (block < LEAF // 64))[:, None]
            at = rows + block * 64 + vector  # [BLOCK, 16] tiles: a lane's 16 bytes in a thread, no shared memory
            x0, x1, x2, x3 = _four_words(_be_words(tl.load(at, mask=data, other=0), BLOCK, 16), BLOCK)
            x4, x5, x6, x7 = _four_words(_be_words(tl.load(at + 16, mask=data, other=0), BLOCK, 16), BLOCK)
            x8, x9, x10, x11 = _four_words(_be_words(tl.load(at + 32, mask=data, other=0), BLOCK, 16), BLOCK)
            x12, x13, x14, x15 = _four_words(_be_words(tl.load(at + 48, mask=data, other=0), BLOCK, 16), BLOCK)
            x16, x17, x18, x19 = _four_words(  # all 16: a mask per row loads a vector (those past the phase unused)
                _be_words(tl.load(at + 64, mask=data & has_tail, other=0), BLOCK, 16), BLOCK)
            w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15 = _message(
                x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, x16, x17, x18, x19, phase)
            pad = (zero + (block == LEAF // 64)).to(tl.uint32)  # 1 in the padding block: a 1, zeros, the length
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
