"""`SamplingParams.n` (n completions of one prompt, its KV blocks shared) and `SamplingParams.prompt_logprobs`,
against transformers + PEFT (greedy `generate`, and the log-softmax of a plain forward over the prompt)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from scute import SamplingParams
from tests.helpers import GREEDY, NEW_TOKENS, PROMPTS, Oracle, random_prompts


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    return Oracle(tmp_path_factory.mktemp("adapters"))


def _all_freed(engine) -> bool:
    return engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# ---------------------------------------------------------------------------------------------- n
def test_n_greedy_gives_n_copies_of_the_reference(oracle):
    """n=3 greedy, with a LoRA, an IA3 adapter and the base model, beside n=1 requests: each of the three
    completions is PEFT's greedy `generate`; one output per request, indexed 0..2."""
    engine = oracle.engine(block_size=4)
    three = dataclasses.replace(GREEDY, n=3)
    adapters = [None, "lora", "ia3", "lora", None]
    params = [three, three, three, GREEDY, GREEDY]
    outputs = engine.generate(PROMPTS + PROMPTS[:1], params, [None if a is None else oracle.paths[a] for a in adapters],
                              use_tqdm=False)
    assert [o.request_id for o in outputs] == [f"gen-{i}" for i in range(5)]
    for out, prompt, adapter, sp in zip(outputs, PROMPTS + PROMPTS[:1], adapters, params):
        assert out.error is None and out.finished
        assert [c.index for c in out.outputs] == list(range(sp.n))
        for c in out.outputs:
            assert c.finish_reason == "length" and c.token_ids == oracle.reference(adapter, prompt), adapter
    assert _all_freed(engine) and not engine.requests


def test_n_seeded_samples_are_reproducible_and_differ(oracle):
    """Sample i of a request with seed s draws from seed s + i: the same tokens alone, amid other requests and
    run again; sample 1 is the request with seed s + 1 alone; the two samples differ."""
    engine = oracle.engine()
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True, n=2)
    [alone] = engine.generate([PROMPTS[2]], sp, [oracle.paths["lora"]], use_tqdm=False)
    crowd = engine.generate(PROMPTS + [PROMPTS[2]], [GREEDY] * 4 + [sp], [None] * 4 + [oracle.paths["lora"]],
                            use_tqdm=False)
    samples = [c.token_ids for c in alone.outputs]
    assert [c.token_ids for c in crowd[-1].outputs] == samples
    assert samples[0] != samples[1]
    for i in range(2):
        single = dataclasses.replace(sp, n=1, seed=1234 + i)
        [one] = engine.generate([PROMPTS[2]], single, [oracle.paths["lora"]], use_tqdm=False)
        assert one.outputs[0].token_ids == samples[i]
    assert _all_freed(engine)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_n_computes_the_prompt_once(oracle, prefix_caching):
    """n=4 over a 21-token prompt (block_size 4): sample 0 computes the prompt; the three others share its five
    full blocks (a reference each, with or without the prefix cache) and compute only the last prompt token.
    `step()` reports the request's id only, with its four completions."""
    prompt, n, new = random_prompts([21], seed=4)[0], 4, 6
    engine = oracle.engine(block_size=4, enable_prefix_caching=prefix_caching)
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=new, min_tokens=new, n=n))
    shared, final = None, None
    while engine.has_unfinished_requests():
        outs = engine.step()
        assert all(o.request_id == "r" and len(o.outputs) == n for o in outs)
        head = engine.requests.get("r")
        running = engine.scheduler.running
        if len(running) == n and shared is None:
            tables = [r.block_table[:5] for r in running]
            assert all(t == tables[0] for t in tables)
            shared = [engine.block_manager.blocks[b].ref_count for b in tables[0]]
        final = outs[-1] if outs else final
        assert head is not None or final.finished
    assert shared == [n] * 5
    assert final.finished and all(c.token_ids == oracle.reference(None, prompt, new) for c in final.outputs)
    assert engine.stats["batched_tokens"] == 21 + (n - 1) * 1 + n * new - n  # the last token of each is not computed
    assert engine.stats["prompt_tokens"] == 21 and engine.stats["generated_tokens"] == n * new
    assert _all_freed(engine)


def test_abort_an_n_request(oracle):
    """An abort ends every sample, before and after the others were released; blocks are all freed."""
    engine = oracle.engine(block_size=4)
    sp = SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True, n=3)
    engine.add_request("early", PROMPTS[3], sp)
    engine.add_request("late", PROMPTS[2], sp)
    engine.add_request("other", PROMPTS[1], GREEDY)
    outs = {}

    def step():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)

    step()  # the prompts: the other samples are still held
    assert len(engine.scheduler.running) == 3 and not engine.scheduler.waiting
    engine.abort_request("early")
    for _ in range(3):
        step()
    assert len(engine.scheduler.running) == 4 and "early" in outs  # "late" (3 samples) and "other"
    engine.abort_request("late")
    while engine.has_unfinished_requests():
        step()
    for rid in ("early", "late"):
        assert [c.finish_reason for c in outs[rid].outputs] == ["abort"] * 3
    assert outs["other"].outputs[0].token_ids == oracle.reference(None, PROMPTS[1])
    assert outs["other"].outputs[0].finish_reason == "length"
    assert _all_freed(engine) and not engine.requests


def test_a_failed_n_request_fails_alone(oracle):
    engine = oracle.engine()
    outputs = engine.generate(PROMPTS[:2], [dataclasses.replace(GREEDY, n=3), GREEDY],
                              ["/does/not/exist", None], use_tqdm=False)
    assert outputs[0].error and [c.finish_reason for c in outputs[0].outputs] == ["error"] * 3
    assert outputs[1].outputs[0].token_ids == oracle.reference(None, PROMPTS[1])
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)


# ---------------------------------------------------------------------------------------------- prompt logprobs
def _reference_logprobs(oracle, adapter, prompt) -> torch.Tensor:
    return oracle.logits(adapter, prompt).log_softmax(dim=-1)


def _check_prompt_logprobs(out, ref: torch.Tensor, prompt: list[int], k: int) -> None:
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        entry, want = got[i], ref[i - 1]
        assert next(iter(entry)) == prompt[i]  # the prompt token first
        assert abs(entry[prompt[i]] - want[prompt[i]].item()) < 1e-4, i
        top = want.topk(k)
        assert set(entry) == set(top.indices.tolist()) | {prompt[i]}
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[t] - v) < 1e-4


@pytest.mark.parametrize("budget", [2048, 7])
def test_prompt_logprobs_match_a_plain_forward(oracle, budget):
    """Every prompt token's logprob and the top 3, with and without an adapter, next to requests without them,
    whole or in chunks of a 7-token budget; the generated tokens are unchanged."""
    prompts = PROMPTS[1:] + PROMPTS[1:]
    adapters = [None, None, None, "lora", "dora", "ia3"]
    want = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, prompt_logprobs=3)] * 3
    engine = oracle.engine(max_num_batched_tokens=budget, max_num_seqs=4)
    params = [want[0], GREEDY, want[0], want[0], GREEDY, want[0]]
    outputs = engine.generate(prompts, params, [None if a is None else oracle.paths[a] for a in adapters],
                              use_tqdm=False)
    for out, prompt, adapter, sp in zip(outputs, prompts, adapters, params):
        assert out.outputs[0].token_ids == oracle.reference(adapter, prompt)
        if sp.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            _check_prompt_logprobs(out, _reference_logprobs(oracle, adapter, prompt), prompt, 3)


def test_prompt_logprobs_with_a_warm_prefix_cache_and_n(oracle):
    """A request asking for prompt logprobs reads no cached block (it computes its whole prompt and gets every
    logprob); with n=2 the samples still share its blocks."""
    prompt = random_prompts([30], seed=8)[0]
    engine = oracle.engine(block_size=4)
    [warm] = engine.generate([prompt], GREEDY, [oracle.paths["lora"]], use_tqdm=False)
    [again] = engine.generate([prompt], GREEDY, [oracle.paths["lora"]], use_tqdm=False)
    assert again.num_cached_tokens == 28 and warm.prompt_logprobs is None
    before = engine.stats["batched_tokens"]
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, prompt_logprobs=0, n=2)
    [out] = engine.generate([prompt], sp, [oracle.paths["lora"]], use_tqdm=False)
    assert out.num_cached_tokens == 0
    assert engine.stats["batched_tokens"] - before == 30 + 2 + 2 * NEW_TOKENS - 2  # sample 1: its last 2 prompt tokens
    _check_prompt_logprobs(out, _reference_logprobs(oracle, "lora", prompt), prompt, 0)
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])
    assert [c.token_ids for c in out.outputs] == [oracle.reference("lora", prompt)] * 2
    assert _all_freed(engine)


def test_without_prompt_logprobs_the_lm_head_sees_only_sampled_rows(oracle, monkeypatch):
    """The normal path is unchanged: every forward keeps the logits of the sampled rows only; a request with
    prompt logprobs adds its prompt rows in its own steps."""
    engine = oracle.engine(max_num_batched_tokens=16, max_num_seqs=4)
    kept, forward = [], engine.runner.model.forward

    def spy(*args, logits_to_keep=0, **kwargs):
        kept.append(int(logits_to_keep.shape[0]))
        return forward(*args, logits_to_keep=logits_to_keep, **kwargs)

    monkeypatch.setattr(engine.runner.model, "forward", spy)
    sampled = []
    step = engine.runner.execute

    def count(sched, sampling):
        sampled.append(len(sampling))
        return step(sched, sampling)

    monkeypatch.setattr(engine.runner, "execute", count)
    engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert kept == sampled
    kept.clear(), sampled.clear()
    sp = dataclasses.replace(GREEDY, prompt_logprobs=1)
    engine.generate([PROMPTS[3]], sp, use_tqdm=False)
    assert sum(kept) - sum(sampled) == len(PROMPTS[3]) - 1
