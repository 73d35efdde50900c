"""Paged attention: the Triton kernels (in the interpreter on CPU, natively on CUDA) against the PyTorch path,
and the PyTorch path against dense causal attention."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from scute.model.attention import AttentionMetadata, torch_paged_attention

PAGE = 16


def paged_case(q_lens, seq_lens, heads=4, kv_heads=2, head_dim=16, device="cpu", seed=0):
    """Random requests with scattered block tables; returns (q, k, v, caches, meta, full K/V per request)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // PAGE) for s in seq_lens) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, qsl, _history = [], [], [0], []
    k_cache = torch.randn(num_blocks, PAGE, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, PAGE, kv_heads, head_dim, generator=g)
    for q_len, seq_len in zip(q_lens, seq_lens):
        table = [perm.pop() for _ in range(-(-seq_len // PAGE))]
        tables.append(table)
        slots += [table[p // PAGE] * PAGE + p % PAGE for p in range(seq_len - q_len, seq_len)]
        qsl.append(qsl[-1] + q_len)
    T = qsl[-1]
    q = torch.randn(T, heads, head_dim, generator=g)
    k = torch.randn(T, kv_heads, head_dim, generator=g)
    v = torch.randn(T, kv_heads, head_dim, generator=g)
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), query_start_loc_host=qsl,
        seq_lens_host=list(seq_lens), kv_caches=[],
    )
    to = lambda x: x.to(device)
    meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables = map(
        to, (meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables))
    return to(q), to(k), to(v), to(k_cache), to(v_cache), meta


CASES = {
    "decode": ([1, 1, 1], [5, 17, 40]),
    "prefill": ([7, 20], [7, 20]),
    "chunked + decode": ([5, 1, 16, 3], [21, 33, 16, 50]),
    "long decode": ([1, 1, 1, 1], [300, 33, 1, 600]),  # decode splits: several, one, none to split, the cap
}


def dense_reference(q, k_cache, v_cache, meta, window=None):
    """Per request: gather its K/V position by position and run plain causal attention in float64."""
    outs = []
    kv_heads = k_cache.shape[2]
    for i, seq_len in enumerate(meta.seq_lens_host):
        qs, qe = meta.query_start_loc_host[i], meta.query_start_loc_host[i + 1]
        table = meta.block_tables[i].tolist()
        idx = [table[p // PAGE] * PAGE + p % PAGE for p in range(seq_len)]
        K = k_cache.reshape(-1, kv_heads, k_cache.shape[-1])[idx].double().transpose(0, 1)
        V = v_cache.reshape(-1, kv_heads, k_cache.shape[-1])[idx].double().transpose(0, 1)
        Q = q[qs:qe].double().transpose(0, 1)
        rep = Q.shape[0] // kv_heads
        K, V = K.repeat_interleave(rep, 0), V.repeat_interleave(rep, 0)
        qpos = torch.arange(seq_len - (qe - qs), seq_len)[:, None]
        kpos = torch.arange(seq_len)[None]
        mask = kpos <= qpos
        if window:
            mask &= kpos > qpos - window
        outs.append(F.scaled_dot_product_attention(Q, K, V, attn_mask=mask).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("window", [None, 6])
def test_torch_paged_attention_matches_dense(case, window):
    q, k, v, kc, vc, meta = paged_case(*CASES[case])
    out = torch_paged_attention(q, k, v, kc, vc, meta, 16 ** -0.5, window)
    want = dense_reference(q, kc, vc, meta, window)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def check_triton(device: str) -> None:
    """The Triton store + attention against the PyTorch path on every case (float32)."""
    import scute.model.attention_triton as mod

    for case, window in itertools.product(CASES, [None, 6]):
        heads = (6, 2) if case == "prefill" else (4, 2)  # group 3 exercises the padded GQA rows
        q, k, v, kc, vc, meta = paged_case(*CASES[case], heads=heads[0], kv_heads=heads[1], device=device)
        kc2, vc2 = kc.clone(), vc.clone()
        want = torch_paged_attention(q, k, v, kc, vc, meta, 16 ** -0.5, window)
        mod.store_kv(k, v, kc2, vc2, meta.slot_mapping)
        torch.testing.assert_close((kc2, vc2), (kc, vc), rtol=0, atol=0)
        out = mod.paged_attention(q, kc2, vc2, meta, 16 ** -0.5, window)
        where = f"{case}, window {window}"
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4, msg=lambda m, where=where: f"{where}: {m}")
        if case == "chunked + decode":  # as a mixed step's CUDA graph runs it: the same results, padding zeros
            padded = padded_meta(meta, extra_tokens=5, extra_seqs=3)
            qp = torch.cat([q, torch.randn(5, *q.shape[1:], device=device)])
            out_padded = mod.paged_attention(qp, kc2, vc2, padded, 16 ** -0.5, window)
            assert torch.equal(out_padded[: q.shape[0]], out), f"{where}: padded differs"
            assert not out_padded[q.shape[0]:].any(), f"{where}: padding rows not zero"
        if case == "long decode":  # a decode token's result does not depend on the rest of the batch
            for i in range(meta.num_seqs):
                alone = mod.paged_attention(q[i:i + 1], kc2, vc2, one_request(meta, i), 16 ** -0.5, window)
                assert torch.equal(alone, out[i:i + 1]), f"{where}: request {i} alone differs"


def one_request(meta: AttentionMetadata, i: int) -> AttentionMetadata:
    """The decode metadata of request i alone (its one token at row 0)."""
    dev = meta.seq_lens.device
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping[i:i + 1], query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=dev),
        seq_lens=meta.seq_lens[i:i + 1], block_tables=meta.block_tables[i:i + 1], max_query_len=1,
        max_seq_len=meta.seq_lens_host[i], query_start_loc_host=[0, 1], seq_lens_host=[meta.seq_lens_host[i]],
        kv_caches=[])


def padded_meta(meta: AttentionMetadata, extra_tokens: int, extra_seqs: int) -> AttentionMetadata:
    """`meta` padded as a mixed step's CUDA graph is (`ModelRunner`): one more request holds `extra_tokens`
    padding tokens at seq_len 0, and `extra_seqs` − 1 more have none."""
    dev, qsl = meta.seq_lens.device, meta.query_start_loc_host
    total = qsl[-1] + extra_tokens
    qsl = qsl + [total] * extra_seqs
    lens = meta.seq_lens_host + [0] * extra_seqs
    tables = torch.cat([meta.block_tables, meta.block_tables.new_zeros(extra_seqs, meta.block_tables.shape[1])])
    return AttentionMetadata(
        slot_mapping=torch.cat([meta.slot_mapping, meta.slot_mapping.new_full((extra_tokens,), -1)]),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev), block_tables=tables,
        max_query_len=total, max_seq_len=meta.max_seq_len, query_start_loc_host=qsl, seq_lens_host=lens,
        kv_caches=[])


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU CI's check; with CUDA the compiled kernel is tested "
                    "(test_triton_paged_attention_on_cuda), and triton 3.6's interpreter fails on this kernel")
def test_triton_paged_attention_in_the_interpreter():
    """Triton's interpreter mode is fixed when triton is first imported, so this runs in a fresh process."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    root = os.path.abspath(os.path.join(__file__, "../../.."))  # the repository root
    code = "import tests.model.test_attention as t; t.check_triton('cpu')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_paged_attention_on_cuda():
    check_triton("cuda")


if __name__ == "__main__":
    check_triton("cuda" if torch.cuda.is_available() else "cpu")
    print("ok")
