"""vLLM's presence, frequency and repetition penalties: the sampler against a loop over the definitions, the tokens
kept on the device (`PenaltyTokens`) counted before the host reads them, the engine against a full-recompute greedy
loop on the tiny model, and steps sampling penalized requests overlapped with a stand-in runner, as in
`test_overlap.py`."""

from __future__ import annotations

import pytest
import torch

from scute import Engine, SamplingParams
from scute.engine.request import Request
from scute.engine.sampler import PenaltyTokens, Sampler, SamplingBatch
from tests.helpers import StandInRunner, random_prompts, tiny_model

VOCAB = 64


def reference_penalties(logits, prompt, output, sp: SamplingParams):
    """The definitions, one token at a time (float32 scalars, the order of the definitions)."""
    out = logits.clone()
    p, f, r = (torch.tensor(x, dtype=torch.float32) for x in
               (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty))
    for v in range(logits.shape[0]):
        x, count = logits[v], output.count(v)
        if v in prompt or count > 0:
            x = x / r if x > 0 else x * r
        x = x - f * count
        x = x - p * (1.0 if count > 0 else 0.0)
        out[v] = x
    return out


ROW_PARAMS = [  # rows without penalties mixed in; each penalty alone, both signs, and combined
    {},
    {"presence_penalty": 1.5},
    {"frequency_penalty": 0.7},
    {"repetition_penalty": 1.8},
    {},
    {"presence_penalty": -0.5, "frequency_penalty": 1.2, "repetition_penalty": 1.3},
    {"repetition_penalty": 0.6},
    {"frequency_penalty": -0.4, "presence_penalty": 2.0},
]


def _requests(temperature: float = 0.0, seed: int = 0):
    """One request per ROW_PARAMS entry with a random prompt and a random output with repeats (tokens < 24)."""
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for i, kw in enumerate(ROW_PARAMS):
        prompt = torch.randint(0, 24, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        req = Request(f"r{i}", None, prompt, SamplingParams(temperature=temperature, **kw), None, None, i)
        for t in torch.randint(0, 24, (int(torch.randint(2 if i else 0, 20, (1,), generator=g)),), generator=g):
            req.append_token(int(t))
        reqs.append(req)
    return reqs


def _logits(reqs, seed: int = 0):
    """Random logits of both signs; each row's best raw token one it generated, so penalties can change it."""
    logits = 3 * torch.randn(len(reqs), VOCAB, generator=torch.Generator().manual_seed(seed))
    for i, req in enumerate(reqs):
        if req.output_token_ids:
            logits[i, req.output_token_ids[0]] = logits[i].max() + 0.3
    return logits


def _penalties(reqs):
    return PenaltyTokens(torch.device("cpu")).batch(reqs)


def _batch(reqs, penalties=True, **kw):
    n = len(reqs)
    temps = [r.sampling_params.temperature for r in reqs]
    return SamplingBatch(temps, [0] * n, [1.0] * n, kw.get("generators", [None] * n), kw.get("masked", ([], [])),
                         kw.get("logprobs", -1), _penalties(reqs) if penalties else None)


def test_penalties_match_the_definitions():
    reqs = _requests()
    logits = _logits(reqs)
    penalties = _penalties(reqs)
    assert penalties.rows == [i for i, kw in enumerate(ROW_PARAMS) if kw]
    got = penalties.apply(logits)
    for i, req in enumerate(reqs):
        want = reference_penalties(logits[i], req.prompt_token_ids, req.output_token_ids, req.sampling_params)
        assert torch.equal(got[i], want), f"row {i}: {ROW_PARAMS[i]}"
        assert torch.equal(got[i], logits[i]) == (not ROW_PARAMS[i])  # untouched exactly when it has none
    assert _penalties([r for i, r in enumerate(reqs) if not ROW_PARAMS[i]]) is None


def test_greedy_rows_with_penalties_take_the_penalized_argmax():
    reqs = _requests()
    logits = _logits(reqs)
    ref = torch.stack([reference_penalties(logits[i], r.prompt_token_ids, r.output_token_ids, r.sampling_params)
                       for i, r in enumerate(reqs)])
    tokens = Sampler(torch.Generator().manual_seed(0))(logits, _batch(reqs)).token_ids
    assert torch.equal(tokens, ref.argmax(-1))
    changed = tokens != logits.argmax(-1)
    assert changed.any()  # the penalties changed some choices (the greedy fast path did not skip them)
    assert not any(changed[i] for i, kw in enumerate(ROW_PARAMS) if not kw)


def test_sampled_rows_draw_from_the_penalized_distribution_and_logprobs_stay_raw():
    reqs = _requests(temperature=0.8, seed=1)
    logits = _logits(reqs, seed=1)
    ref = torch.stack([reference_penalties(logits[i], r.prompt_token_ids, r.output_token_ids, r.sampling_params)
                       for i, r in enumerate(reqs)])
    masked = ([4, 5], [7, 9])  # min_tokens masking on top of the penalties
    gens = lambda: [torch.Generator().manual_seed(i) if i % 2 else None for i in range(len(reqs))]  # noqa: E731
    got = Sampler(torch.Generator().manual_seed(3))(logits, _batch(reqs, generators=gens(), masked=masked,
                                                                   logprobs=2))
    want = Sampler(torch.Generator().manual_seed(3))(ref, _batch(reqs, False, generators=gens(), masked=masked))
    assert torch.equal(got.token_ids, want.token_ids)
    plain = Sampler(torch.Generator().manual_seed(3))(logits, _batch(reqs, False, generators=gens(), masked=masked))
    assert not torch.equal(got.token_ids, plain.token_ids)
    raw = logits.log_softmax(-1)  # logprobs: of the raw logits, whatever the penalties
    assert torch.equal(got.logprobs, raw.gather(-1, got.token_ids[:, None])[:, 0])
    assert torch.equal(got.top_ids, raw.topk(2, dim=-1).indices)


def test_tokens_in_flight_are_counted_from_the_device():
    """Steps as the engine overlaps them: a step's sampled tokens reach the host after the next step has sampled,
    yet every step's penalties count them (the step that sampled them wrote them on the device). Nine requests,
    at most six at once, two more a step: finished ones free their rows for new ones (reset), more requests than
    the table holds and outputs longer than its width grow it. Each step equals the definitions over the
    request's whole history, and the penalties change some choices."""
    g = torch.Generator().manual_seed(4)
    params = [kw for kw in ROW_PARAMS if kw]
    queue = [Request(f"q{i}", None, torch.randint(0, 24, (int(torch.randint(1, 7, (1,), generator=g)),),
                                                  generator=g).tolist(),
                     SamplingParams(temperature=0, **params[i % len(params)]), None, None, i) for i in range(9)]
    lengths = {req: 3 + 7 * (i % 4) for i, req in enumerate(queue)}  # 3 to 24 output tokens
    tokens, sampler = PenaltyTokens(torch.device("cpu")), Sampler(torch.Generator().manual_seed(0))
    running, pending, rows, shapes, changed = [], {}, {}, set(), 0
    while queue or running or pending:
        for _ in range(2):  # two new requests a step at most, while fewer than six run
            if len(running) < 6 and queue:
                running.append(queue.pop(0))
        got = []
        if running:
            histories = [r.output_token_ids + ([pending[r]] if r in pending else []) for r in running]
            logits = 3 * torch.randn(len(running), VOCAB, generator=g)
            for i, history in enumerate(histories):  # the best raw token one the request has: penalties matter
                if history:
                    logits[i, history[-1]] = logits[i].max() + 0.3
            n = len(running)
            batch = SamplingBatch([0.0] * n, [0] * n, [1.0] * n, [None] * n, ([], []), -1, tokens.batch(running))
            got = sampler(logits, batch).token_ids.tolist()
            rows.update((r.request_id, tokens.rows[r]) for r in running)
            shapes.add(tuple(tokens.ids.shape))
            for i, (req, history) in enumerate(zip(running, histories)):
                want = reference_penalties(logits[i], req.prompt_token_ids, history, req.sampling_params)
                assert got[i] == int(want.argmax()), (req.request_id, len(history))
                changed += got[i] != int(logits[i].argmax())
        for req, token in pending.items():  # the step before lands after this one sampled
            req.num_pending -= 1
            req.append_token(token)
            if req.num_output_tokens == lengths[req]:
                req.finish("length")
        pending = dict(zip(running, got))
        for req in pending:
            req.num_pending += 1
        running = [r for r in running if r.num_output_tokens < lengths[r]]
    assert len(rows) == 9 and len(set(rows.values())) < 9  # rows were reused
    assert len(shapes) > 2 and changed > 0  # the table grew (rows and width)


def test_a_row_is_given_only_to_a_request_without_tokens_in_flight():
    req = _requests()[1]
    req.num_pending = 1
    with pytest.raises(RuntimeError, match="token in flight"):
        _penalties([req])


@pytest.mark.parametrize("bad", [{"presence_penalty": 2.5}, {"presence_penalty": -2.01}, {"frequency_penalty": 3},
                                 {"frequency_penalty": float("nan")}, {"repetition_penalty": 0},
                                 {"repetition_penalty": -1.0}, {"repetition_penalty": float("inf")}])
def test_out_of_range_penalties_raise(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**bad)
    assert SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.01).has_penalties
    assert not SamplingParams().has_penalties


# ---------------------------------------------------------------------------------------------- the engine
def reference_greedy(model, prompt: list[int], sp: SamplingParams, new_tokens: int) -> list[int]:
    """The whole sequence through the HF model at every step, the reference penalties, argmax."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            token = int(reference_penalties(logits, prompt, out, sp).argmax())
            ids.append(token)
            out.append(token)
    return out


NEW = 12
PENALIZED = [
    SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, presence_penalty=1.0),
    SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, frequency_penalty=0.6),
    SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, repetition_penalty=1.6),
    SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, presence_penalty=0.4, frequency_penalty=0.3,
                   repetition_penalty=1.3),
    # repeats encouraged: counts above 1, where the frequency penalty's count and the presence indicator differ
    SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, presence_penalty=0.5, frequency_penalty=-0.5),
]
PLAIN = [
    SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=5, max_tokens=NEW, ignore_eos=True),
]
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # K+V, 2 layers, 16 tokens, 2 kv heads, head_dim 16, fp32


@pytest.mark.parametrize("options", [{}, {"kv_cache_memory_bytes": 7 * BLOCK_BYTES, "max_num_batched_tokens": 16,
                                          "max_num_seqs": 8}], ids=["batched", "chunked-and-preempted"])
def test_engine_greedy_with_penalties_matches_full_recompute(options):
    prompts = random_prompts([5, 9, 14, 20, 7, 11], seed=7)
    prompts.insert(4, prompts[1])  # a prompt whose greedy output repeats, for the repeat-encouraging request
    model = tiny_model()
    n = len(PENALIZED)
    params = PENALIZED + PLAIN
    engine = Engine(tiny_model(), device="cpu", dtype="float32", max_model_len=64, **options)
    outputs = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    if options:
        assert engine.stats["preemptions"] > 0
    for prompt, sp, got in zip(prompts[:n], PENALIZED, outputs):
        assert got == reference_greedy(model, prompt, sp, NEW), sp
        assert got != reference_greedy(model, prompt, PLAIN[0], NEW)  # the penalties mattered
    assert max(outputs[n - 1].count(t) for t in outputs[n - 1]) > 2
    assert outputs[n] == reference_greedy(model, prompts[n], PLAIN[0], NEW)
    alone = Engine(tiny_model(), device="cpu", dtype="float32", max_model_len=64, **options)
    want = [o.outputs[0].token_ids for o in alone.generate(prompts[n:], PLAIN, use_tqdm=False)]
    assert outputs[n:] == want  # the unpenalized requests: the tokens they get without penalized neighbours


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlapped_penalized_steps_on_the_gpu_match_full_recompute():
    """On CUDA the decode steps are graph replays launched before the step in flight lands: penalized requests
    sampled with a token in flight count it from the device, and their greedy tokens are the reference's."""
    prompts = random_prompts([5, 9, 14, 20, 7, 11], seed=7)
    prompts.insert(4, prompts[1])
    model, n = tiny_model(), len(PENALIZED)
    engine = Engine(tiny_model(), device="cuda", dtype="float32", max_model_len=64)
    launch, in_flight = engine.runner.launch, []

    def spy(sched, sampling, flight):
        in_flight.append(any(r.num_pending and r.sampling_params.has_penalties for r in sampling))
        return launch(sched, sampling, flight)

    engine.runner.launch = spy
    outputs = [o.outputs[0].token_ids for o in engine.generate(prompts, PENALIZED + PLAIN, use_tqdm=False)]
    assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0 and any(in_flight)
    for prompt, sp, got in zip(prompts[:n], PENALIZED, outputs):
        assert got == reference_greedy(model, prompt, sp, NEW), sp
    assert outputs[n] == reference_greedy(model, prompts[n], PLAIN[0], NEW)


# ---------------------------------------------------------------------------------------------- the overlap
def penalized_model(history: list[int], position: int) -> int:
    """A penalized request's next token depends on its whole history, as the sampler's penalties do."""
    return (sum(history[: position + 1]) * 13 + position) % VOCAB


class CountingRunner(StandInRunner):
    """Every decode step launched (graph-like), its tokens read a call later; a penalized request's token comes from
    its whole history as the device has it (the host's tokens and the one in flight, as `PenaltyTokens` keeps
    them). Counts the penalized requests sampled with a token in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight = 0

    def next_token(self, req, position: int, token: int) -> int:
        if req.sampling_params.has_penalties:
            self.in_flight += req.num_pending > 0
            return penalized_model(req.all_token_ids[:position] + [token], position)
        return super().next_token(req, position, token)


def _overlap_run(overlap: bool):
    engine = Engine(tiny_model(), device="cpu", dtype="float32", max_model_len=64)
    runner = engine.runner = CountingRunner()
    if not overlap:
        runner.launch = lambda *args: None  # every step run to its end
    prompts = random_prompts([3, 9, 17, 5], seed=3, vocab=VOCAB)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, presence_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, repetition_penalty=1.2),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
    outs = engine.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], runner


def test_a_penalized_request_is_overlapped():
    """The engine launches a step sampling a penalized request before the step in flight lands (its tokens are
    on the device), with the tokens of steps run to their end."""
    want, _ = _overlap_run(False)
    got, runner = _overlap_run(True)
    assert got == want
    assert runner.in_flight > 0
