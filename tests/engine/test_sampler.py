"""Sampler: greedy fast path, top-k / top-p filtering, seeded rows, min_tokens masking, logprobs."""

from __future__ import annotations

import torch

from scute.engine.sampler import Sampler, SamplingBatch


def batch(n, temperature=1.0, top_k=0, top_p=1.0, generators=None, masked=([], []), logprobs=-1):
    return SamplingBatch([temperature] * n, [top_k] * n, [top_p] * n, generators or [None] * n, masked, logprobs)


def sampler(seed=0) -> Sampler:
    return Sampler(torch.Generator().manual_seed(seed))


def test_greedy_and_degenerate_filters_are_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    want = logits.argmax(-1)
    assert torch.equal(sampler()(logits, batch(6, temperature=0.0)).token_ids, want)
    assert torch.equal(sampler()(logits, batch(6, top_k=1)).token_ids, want)
    assert torch.equal(sampler()(logits, batch(6, top_p=1e-6)).token_ids, want)


def test_samples_follow_the_filtered_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    tokens = sampler()(logits, batch(4000)).token_ids
    freq = torch.bincount(tokens, minlength=4) / 4000
    assert torch.allclose(freq, probs, atol=0.03)
    tokens = sampler()(logits, batch(4000, top_k=2)).token_ids  # renormalized over the two best
    assert torch.allclose(torch.bincount(tokens, minlength=4) / 4000, torch.tensor([0.625, 0.375, 0, 0]), atol=0.03)
    tokens = sampler()(logits, batch(4000, top_p=0.7)).token_ids  # 0.5 + 0.3 reaches 0.7
    assert set(tokens.unique().tolist()) == {0, 1}


def test_seeded_rows_ignore_their_neighbours():
    """A seeded row draws the same tokens whatever the batch around it: other rows, another batch size, another
    position, another engine seed; an unseeded row's draws do change with them."""
    g = torch.Generator().manual_seed(1)
    row = torch.randn(1, 100, generator=g).repeat(64, 1)  # one row's logits, drawn 64 times: 64 draws of its noise
    seeded = lambda n: [torch.Generator().manual_seed(42 + i) for i in range(n)]
    a = sampler(0)(row, batch(64, generators=seeded(64))).token_ids
    others = torch.randn(10, 100, generator=g)
    mixed = torch.cat([others[:7], row, others[7:]])  # the seeded rows 7..70 of 74
    b = sampler(1)(mixed, batch(74, generators=[None] * 7 + seeded(64) + [None] * 3)).token_ids[7:71]
    assert torch.equal(a, b) and len(a.unique()) > 8  # the draws themselves vary
    c = sampler(1)(mixed, batch(74)).token_ids[7:71]  # unseeded: the engine's generator
    assert not torch.equal(a, c)


def test_min_tokens_mask_and_logprobs():
    logits = torch.zeros(2, 10)
    logits[:, 3] = 5.0
    out = sampler()(logits, batch(2, temperature=0.0, masked=([0], [3]), logprobs=2))
    assert out.token_ids.tolist()[1] == 3 and out.token_ids.tolist()[0] != 3
    raw = logits.log_softmax(-1)
    assert torch.allclose(out.logprobs, raw.gather(-1, out.token_ids[:, None])[:, 0])  # of the raw logits
    assert out.top_ids[:, 0].tolist() == [3, 3]


def test_a_stop_id_beyond_the_vocabulary_under_min_tokens_is_harmless():
    """min_tokens masks the stop ids; one the model cannot produce (vLLM scripts pass such ids) is skipped."""
    from tests.helpers import tiny_model

    from scute import Engine, SamplingParams

    engine = Engine(tiny_model(), device="cpu", dtype="float32", max_model_len=64)
    sp = SamplingParams(temperature=0, max_tokens=6, min_tokens=4, stop_token_ids=[32003])
    plain = SamplingParams(temperature=0, max_tokens=6, min_tokens=4)
    out, ref = engine.generate([[5, 6, 7], [5, 6, 7]], [sp, plain], use_tqdm=False)
    assert out.error is None and out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_argmax_rows_is_the_first_maximum():
    from scute.engine.sampler import ARGMAX_PARTS, argmax_rows

    vocab = ARGMAX_PARTS * 1024
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, vocab, generator=g).to(torch.bfloat16)  # bf16: many ties among the largest
    logits[1, 7], logits[1, vocab - 3] = 50, 50  # a tie across parts: the first wins
    logits[2, 3000], logits[2, 3001] = 40, 40  # a tie inside a part
    logits[3] = 0  # every logit equal
    logits[4, vocab - 1] = 60  # the last logit
    assert torch.equal(argmax_rows(logits), logits.argmax(-1))
    assert argmax_rows(logits).tolist()[1:] == [7, 3000, 0, vocab - 1]
    odd = torch.randn(3, vocab + 1, generator=g)  # not in equal parts: one reduction
    assert torch.equal(argmax_rows(odd), odd.argmax(-1))
