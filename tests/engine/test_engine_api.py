"""The engine's request API: streaming steps, abort, stop conditions, logprobs, seeds, prompt forms."""

from __future__ import annotations

import dataclasses

import pytest

from scute import Engine, SamplingParams
from tests.helpers import PROMPTS, tiny_model


class LetterTokenizer:
    """A stand-in tokenizer: token t is the letter 'a' + t % 26 (enough to test stop strings)."""

    eos_token_id = None

    def __call__(self, text: str) -> dict:
        return {"input_ids": [ord(c) - ord("a") + 3 for c in text]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)


def engine(**options) -> Engine:
    return Engine(tiny_model(), **{"device": "cpu", "max_model_len": 128, **options})


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, **kw)


def test_streaming_steps_and_abort():
    eng = engine()
    full = eng.generate(PROMPTS[:3], greedy(12, ignore_eos=True), use_tqdm=False)
    for i, prompt in enumerate(PROMPTS[:3]):
        eng.add_request(f"r{i}", prompt, greedy(12, ignore_eos=True))
    seen: dict[str, list[list[int]]] = {f"r{i}": [] for i in range(3)}
    final = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen[out.request_id].append(out.outputs[0].token_ids)
            if out.finished:
                final[out.request_id] = out
            if out.request_id == "r1" and len(out.outputs[0].token_ids) == 4:
                eng.abort_request("r1")
    assert final["r1"].outputs[0].finish_reason == "abort" and len(final["r1"].outputs[0].token_ids) == 4
    for i in (0, 2):
        tokens = final[f"r{i}"].outputs[0].token_ids
        assert tokens == full[i].outputs[0].token_ids
        assert [len(s) for s in seen[f"r{i}"]] == list(range(1, 13))  # one token per step, streamed
    assert not eng.requests  # finished requests are dropped once reported


def stream(eng: Engine, prompts, params: list[SamplingParams]) -> dict[str, list]:
    """Every output `step` reports of each request, in order."""
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", prompt, sp)
    seen: dict[str, list] = {f"r{i}": [] for i in range(len(prompts))}
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen[out.request_id].append(out)
    return seen


@pytest.mark.parametrize("n", [1, 2])
def test_output_kinds_report_the_same_outputs(n):
    """Deltas joined are the cumulative outputs (tokens, text, logprobs; prompt logprobs once); "final_only"
    reports a request once, finished, the same as the others' last; a stop string's start is never in a delta."""
    eng = Engine(tiny_model(), tokenizer=LetterTokenizer(), device="cpu", max_model_len=64)
    prompt = "abcdef"
    kw = dict(temperature=0 if n == 1 else 1.0, seed=7, n=n, max_tokens=14, ignore_eos=True, logprobs=2,
              prompt_logprobs=1)
    [whole] = eng.generate([prompt], SamplingParams(**kw), use_tqdm=False)
    text = whole.outputs[0].text
    stop = text[9:12]  # across three tokens (a letter each): joined, the deltas must hold back its start
    assert text.find(stop) == 9
    params = [SamplingParams(**kw, output_kind=kind) for kind in ("cumulative", "delta", "final_only")] + \
        [SamplingParams(**kw, output_kind=kind, stop=[stop]) for kind in ("cumulative", "delta")]
    seen = stream(eng, [prompt] * len(params), params)
    cumulative, delta, final, stop_cumulative, stop_delta = (seen[f"r{i}"] for i in range(5))
    assert len(final) == 1 and final[0].finished and len(delta) == len(cumulative) >= 14
    for outs, last in ((delta, cumulative[-1]), (stop_delta, stop_cumulative[-1])):
        assert outs[0].prompt_logprobs == last.prompt_logprobs is not None  # in the first delta alone
        assert all(o.prompt_logprobs is None for o in outs[1:]) and outs[-1].finished
        for j in range(n):
            want, parts = last.outputs[j], [o.outputs[j] for o in outs]
            assert [t for p in parts for t in p.token_ids] == want.token_ids
            assert "".join(p.text for p in parts) == want.text
            assert [lp for p in parts for lp in p.logprobs] == want.logprobs
            assert parts[-1].cumulative_logprob == want.cumulative_logprob
    assert dataclasses.replace(final[0], request_id="r0") == cumulative[-1]
    assert all(o.prompt_logprobs is not None for o in cumulative)
    assert [o.outputs[0].token_ids for o in cumulative][:14] == [whole.outputs[0].token_ids[:k] for k in range(1, 15)]
    assert cumulative[-1].outputs[0].text == text and stop_cumulative[-1].outputs[0].text == text[:9]
    assert all(len(o.outputs[0].token_ids) == 1 for o in delta[:14])  # one new token a step
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="deltas")


def test_stop_token_ids_eos_and_length():
    eng = engine()
    [base] = eng.generate([PROMPTS[1]], greedy(10, ignore_eos=True), use_tqdm=False)
    tokens = base.outputs[0].token_ids
    stop = tokens[4]
    first = tokens.index(stop)
    [out] = eng.generate([PROMPTS[1]], greedy(10, stop_token_ids=[stop]), use_tqdm=False)
    assert out.outputs[0].token_ids == tokens[:first + 1]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop)
    [out] = eng.generate([PROMPTS[1]], greedy(10, stop_token_ids=[stop], min_tokens=first + 1), use_tqdm=False)
    assert stop not in out.outputs[0].token_ids[:first + 1]  # masked until min_tokens
    eng.eos_token_ids = [stop]  # as if the model's EOS were that token
    [out] = eng.generate([PROMPTS[1]], greedy(10), use_tqdm=False)
    assert out.outputs[0].token_ids == tokens[:first + 1] and out.outputs[0].stop_reason is None
    [out] = eng.generate([PROMPTS[1]], greedy(10, ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].token_ids == tokens and out.outputs[0].finish_reason == "length"


def test_stop_strings_and_text():
    eng = Engine(tiny_model(), tokenizer=LetterTokenizer(), device="cpu", max_model_len=64)
    [base] = eng.generate(["hello"], greedy(12, ignore_eos=True), use_tqdm=False)
    text = base.outputs[0].text
    assert len(text) == 12 and base.prompt_token_ids == [10, 7, 14, 14, 17]
    stop = text[5:7]
    index = text.find(stop)
    [out] = eng.generate(["hello"], greedy(12, stop=[stop, "zzzz"], ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].text == text[:index] and out.outputs[0].stop_reason == stop
    [out] = eng.generate(["hello"], greedy(12, stop=stop, include_stop_str_in_output=True, ignore_eos=True),
                         use_tqdm=False)
    assert out.outputs[0].text == text[:index + 2]


def test_logprobs_of_chosen_tokens():
    eng = engine()
    [out] = eng.generate([PROMPTS[2]], greedy(6, logprobs=3, ignore_eos=True), use_tqdm=False)
    c = out.outputs[0]
    assert len(c.logprobs) == 6
    for token, entry in zip(c.token_ids, c.logprobs):
        assert len(entry) == 3 and entry[token] == max(entry.values()) <= 0.0  # greedy: the top token
    assert c.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(c.token_ids, c.logprobs)))
    [plain] = eng.generate([PROMPTS[2]], greedy(6, ignore_eos=True), use_tqdm=False)
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None


def test_seeded_sampling_is_reproducible():
    sp = [SamplingParams(temperature=1.0, top_p=0.95, seed=s, max_tokens=16, ignore_eos=True) for s in (1, 1, 2)]
    a = engine().generate([PROMPTS[0]] * 3, sp, use_tqdm=False)
    b = engine(seed=99).generate([PROMPTS[0]], sp[0], use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in a]
    assert tokens[0] == tokens[1] == b[0].outputs[0].token_ids
    assert tokens[0] != tokens[2]
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    x = engine(seed=5).generate([PROMPTS[0]], unseeded, use_tqdm=False)
    y = engine(seed=5).generate([PROMPTS[0]], unseeded, use_tqdm=False)
    assert x[0].outputs[0].token_ids == y[0].outputs[0].token_ids  # the engine seed fixes the rest


def test_prompt_forms_and_max_model_len():
    eng = engine(max_model_len=20)
    single = eng.generate(PROMPTS[0], greedy(4, ignore_eos=True), use_tqdm=False)
    assert len(single) == 1 and len(single[0].outputs[0].token_ids) == 4
    [out] = eng.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                         use_tqdm=False)
    assert out.outputs[0].finish_reason == "length" and len(PROMPTS[1]) + len(out.outputs[0].token_ids) == 20
    with pytest.raises(ValueError, match="one per prompt"):
        eng.generate(PROMPTS[:2], adapters=[None], use_tqdm=False)
