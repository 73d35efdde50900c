"""`scute serve` through the official `openai` client and raw HTTP, against a real uvicorn server: the same tokens
as `Engine.generate`, for the base model and every method, streamed and not; runtime adapters and their path
rules; auth; every bad input a 4xx that leaves concurrent good requests intact; many concurrent streams; clients
that disconnect leave no KV blocks held."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
import urllib.request

import httpx
import openai
import pytest

from scute import SamplingParams
from tests.serve.conftest import API_KEY, free_port

MODELS = ["tiny", "lora", "dora", "ia3", "vera", "oft"]
PROMPT = "the quick brown fox jumps over"


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0)


def http(server) -> httpx.Client:
    return httpx.Client(base_url=server[0], headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)


def want(reference, served, model: str, prompt, **options):
    adapter = None if model == "tiny" else str(served / model)
    out = reference.generate([prompt], SamplingParams(**options), [adapter], use_tqdm=False)[0]
    assert out.error is None, out.error
    return out.outputs[0]


@pytest.mark.parametrize("model", MODELS)
def test_completion_streamed_and_not_equals_the_engine(server, reference, served, model):
    expected = want(reference, served, model, PROMPT, temperature=0, max_tokens=8, ignore_eos=True)
    c = client(server)
    r = c.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].text == expected.text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.model == model
    chunks = list(c.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == 8


def test_a_stream_with_a_stop_string_across_tokens_sends_what_the_engine_keeps(server, reference, served):
    """A stop string of two words, which tokens (the word-level tokenizer's: a word per id) complete one after the
    other: the chunks streamed before it completes hold back its start, so that
    their text joined is the engine's output cut where the stop string starts."""
    full = want(reference, served, "lora", PROMPT, temperature=0, max_tokens=12, ignore_eos=True)
    words = full.text.split()
    assert len(words) >= 2, full.text  # the tiny model's greedy output: two words at least
    stop = f"{words[-2]} {words[-1]}"
    expected = want(reference, served, "lora", PROMPT, temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    assert expected.text == full.text[:full.text.find(stop)] and expected.finish_reason == "stop"
    chunks = list(client(server).completions.create(model="lora", prompt=PROMPT, max_tokens=12, temperature=0,
                                                    stop=[stop], stream=True, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == expected.text
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("model", ["tiny", "dora", "oft"])
def test_chat_streamed_and_not_equals_the_engine_on_the_template(server, reference, served, model):
    messages = [{"role": "user", "content": "the lazy dog"}]
    ids = reference.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    expected = want(reference, served, model, ids, temperature=0, max_tokens=6, ignore_eos=True)
    c = client(server)
    r = c.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == expected.text and r.choices[0].message.role == "assistant"
    stream = c.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == expected.text


def test_bad_chat_requests_get_a_400(server):
    """No messages, a conversation longer than the context, a completion that would not fit: each a 400 naming
    its problem (the template and the context are checked before any engine work)."""
    with http(server) as h:
        for body, fragment in ((dict(messages=[]), "messages is empty"),
                               (dict(messages=[{"role": "user", "content": "a " * 80}]), "maximum context length"),
                               (dict(messages=[{"role": "user", "content": "a"}], max_tokens=62), "in the completion")):
            r = h.post("/v1/chat/completions", json=dict(model="tiny", **body))
            assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text
            assert r.json()["error"]["param"] == "messages"


def test_raw_http_token_ids_logprobs_and_sse_framing(server, reference, served):
    ids = [5, 6, 7, 8, 9]
    expected = want(reference, served, "vera", ids, temperature=0, max_tokens=5, logprobs=2, ignore_eos=True)
    with http(server) as h:
        body = dict(model="vera", prompt=ids, max_tokens=5, temperature=0, logprobs=2, ignore_eos=True)
        r = h.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        assert lp["token_logprobs"] == pytest.approx([s[t] for t, s in zip(expected.token_ids, expected.logprobs)])
        for top, step in zip(lp["top_logprobs"], expected.logprobs, strict=True):  # keyed by text: ids that
            best = sorted(step.values(), reverse=True)[:2]  # decode alike share a key
            assert 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(best[0])
            assert all(any(v == pytest.approx(b) for b in best) for v in top.values())
        with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            lines = [line for line in s.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    assert "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]) == expected.text


def test_n_choices_for_completions_and_chat(server, reference, served):
    """n=2 over two prompts: four choices, prompt-major (prompt i's completion j is choice 2i + j), greedy ones
    equal to the engine's (their log-probabilities identify the tokens); streamed, each choice assembles from its
    own chunks; chat likewise; seeded samples differ."""
    second = "red green blue"
    wants = [want(reference, served, "ia3", p, temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
             for p in (PROMPT, second)]
    logprobs = [pytest.approx([lp[t] for t, lp in zip(w.token_ids, w.logprobs)]) for w in wants]
    assert logprobs[0] != [lp[t] for t, lp in zip(wants[1].token_ids, wants[1].logprobs)]
    body = dict(model="ia3", prompt=[PROMPT, second], n=2, max_tokens=6, temperature=0, logprobs=0, ignore_eos=True)
    with http(server) as h:
        r = h.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert [ch["index"] for ch in choices] == [0, 1, 2, 3] and r.json()["usage"]["completion_tokens"] == 24
        assert [ch["logprobs"]["token_logprobs"] for ch in choices] == [logprobs[0]] * 2 + [logprobs[1]] * 2
        with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line and line != "data: [DONE]"]
    streamed = {i: [v for ch in chunks for c in ch["choices"] if c["index"] == i
                    for v in c["logprobs"]["token_logprobs"]] for i in range(4)}
    assert streamed == {0: logprobs[0], 1: logprobs[0], 2: logprobs[1], 3: logprobs[1]}
    assert sum(c["finish_reason"] == "length" for ch in chunks for c in ch["choices"]) == 4
    messages = [{"role": "user", "content": "the lazy dog"}]
    ids = reference.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    expected = want(reference, served, "dora", ids, temperature=0, max_tokens=5, ignore_eos=True, logprobs=0)
    chat_logprobs = pytest.approx([lp[t] for t, lp in zip(expected.token_ids, expected.logprobs)])
    c = client(server)
    options = dict(model="dora", messages=messages, n=2, max_tokens=5, temperature=0, logprobs=True,
                   extra_body={"ignore_eos": True})
    r = c.chat.completions.create(**options)
    assert [ch.index for ch in r.choices] == [0, 1]
    assert all([t.logprob for t in ch.logprobs.content] == chat_logprobs for ch in r.choices)
    assert all(ch.message.content == expected.text for ch in r.choices)
    stream = list(c.chat.completions.create(**options, stream=True))
    for i in range(2):
        mine = [ch.choices[0] for ch in stream if ch.choices and ch.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "length"
        assert [t.logprob for m in mine if m.logprobs for t in m.logprobs.content] == chat_logprobs
    seeded = c.completions.create(model="tiny", prompt=PROMPT, n=2, max_tokens=8, temperature=1.0, seed=5, logprobs=0,
                                  extra_body={"ignore_eos": True})
    assert seeded.choices[0].logprobs.token_logprobs != seeded.choices[1].logprobs.token_logprobs  # seeds 5, 6


def test_serve_refuses_bad_start_up_arguments_before_loading(served, capsys):
    """A name given twice, an adapter named as the base model, a port already listened on: refused with a message
    before the model loads."""
    import socket

    from scute.serve.server import serve_main

    model, lora = str(served / "model"), str(served / "lora")
    with pytest.raises(SystemExit, match="given twice"):
        serve_main([model, "--adapter", f"a={lora}", f"a={lora}"])
    assert serve_main([model, "--served-model-name", "a", "--adapter", f"a={lora}"]) == 1
    assert "is the base model's" in capsys.readouterr().err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert serve_main([model, "--port", str(s.getsockname()[1])]) == 1
    assert "cannot listen on 127.0.0.1:" in capsys.readouterr().err


def test_penalties_reach_the_engine(server, reference, served):
    options = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3)
    expected = want(reference, served, "lora", PROMPT, temperature=0, max_tokens=10, ignore_eos=True, **options)
    plain = want(reference, served, "lora", PROMPT, temperature=0, max_tokens=10, ignore_eos=True)
    r = client(server).completions.create(model="lora", prompt=PROMPT, max_tokens=10, temperature=0,
                                          presence_penalty=1.5, frequency_penalty=0.5,
                                          extra_body={"ignore_eos": True, "repetition_penalty": 1.3})
    assert r.choices[0].text == expected.text
    assert expected.token_ids != plain.token_ids  # the penalties change these tokens


def test_models_lists_the_base_and_every_adapter(server, served):
    data = {m.id: m for m in client(server).models.list().data}
    assert set(MODELS) <= set(data)
    assert all(data[m].parent == "tiny" for m in MODELS[1:]) and data["tiny"].parent is None
    c = client(server)
    assert c.models.retrieve("lora").parent == "tiny" and c.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="nope"):
        c.models.retrieve("nope")


def test_the_start_up_line_names_a_few_adapters_and_counts_the_rest():
    from scute.serve.server import served_line

    assert served_line("base", ["a", "b"]) == "base, a, b"
    many = served_line("base", [f"a{i}" for i in range(20)], most=3)
    assert many.startswith("base, a0, a1, a2 and 17 more adapters") and "a3" not in many


def test_auth_and_health(server):
    assert httpx.get(server[0] + "/health").status_code == 200
    r = httpx.post(server[0] + "/v1/completions", json=dict(model="tiny", prompt="a"))
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    bad = openai.OpenAI(base_url=server[0] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


BAD = [  # (body or raw bytes, status, a fragment the message must hold)
    (dict(model="nope", prompt="a"), 404, "nope"),
    (b"{not json", 400, "JSON"),
    (dict(model="tiny", prompt="a", bogus=1), 400, "bogus"),
    (dict(model="tiny", prompt="a", n=0), 400, "n must be"),
    (dict(model="tiny", prompt="a", best_of=2), 400, "best_of="),
    (dict(model="tiny", prompt="a", logit_bias={"5": 1.0}), 400, "logit_bias"),
    (dict(model="tiny", prompt="a", temperature=-1), 400, "temperature"),
    (dict(model="tiny", prompt="a", max_tokens=True), 400, "max_tokens"),
    (dict(model="tiny", prompt="a", stream="yes"), 400, "stream"),
    (dict(model="tiny", prompt=[7] * 80), 400, "maximum context length is 64"),
    (dict(model="tiny", prompt=[7] * 40, max_tokens=30), 400, "you requested 70 tokens (40 in the prompt, 30 in"),
    (dict(model="tiny", prompt=[5, 100000]), 400, "vocabulary"),
    (dict(model="tiny"), 400, "prompt"),
]


def test_bad_inputs_get_their_4xx_while_good_requests_complete(server, reference, served):
    expected = want(reference, served, "ia3", PROMPT, temperature=0, max_tokens=12, ignore_eos=True)

    async def run():
        async with httpx.AsyncClient(base_url=server[0], headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=60) as h:
            good = [h.post("/v1/completions", json=dict(model="ia3", prompt=PROMPT, max_tokens=12, temperature=0,
                                                        ignore_eos=True)) for _ in range(4)]
            bad = [h.post("/v1/completions", content=b, headers={"Content-Type": "application/json"})
                   if isinstance(b, bytes) else
                   h.post("/v1/completions", json=b) for b, _, _ in BAD]
            return await asyncio.gather(*good, *bad)

    results = asyncio.run(run())
    for r in results[:4]:
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected.text
    for r, (body, status, fragment) in zip(results[4:], BAD):
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert fragment in err["message"] and err["code"] == status and {"type", "param"} <= set(err), err


def test_runtime_adapters_and_their_path_rules(server, reference, served):
    with http(server) as h:
        r = h.post("/v1/load_lora_adapter", json=dict(lora_name="late", lora_path="late-lora"))
        assert r.status_code == 200, r.text
        expected = want(reference, served, "lora", PROMPT, temperature=0, max_tokens=5, ignore_eos=True)
        r = h.post("/v1/completions", json=dict(model="late", prompt=PROMPT, max_tokens=5, temperature=0,
                                                ignore_eos=True))
        assert r.json()["choices"][0]["text"] == expected.text
        for path, status in (("../vera", 403), (str(served / "vera"), 403), ("escape", 403), ("broken", 400),
                             ("missing", 400), ("late\0x", 400), (".", 400), ("", 400)):
            r = h.post("/v1/load_lora_adapter", json=dict(lora_name="x", lora_path=path))
            assert r.status_code == status and r.json()["error"]["param"] == "lora_path", (path, r.text)
        for name in ("late", "", "tiny"):  # taken (as vLLM: not replaced), empty, the base model's
            r = h.post("/v1/load_lora_adapter", json=dict(lora_name=name, lora_path="late-lora"))
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", (name, r.text)
        assert h.post("/v1/unload_lora_adapter", json=dict(lora_name="late")).status_code == 200
        assert h.post("/v1/completions", json=dict(model="late", prompt="a")).status_code == 404
        assert h.get("/v1/models/tiny").json()["id"] == h.get(f"/v1/models/{served / 'model'}").json()["id"] == "tiny"

    async def twice():  # one name asked for twice at once: one load, the other refused while the first runs
        async with httpx.AsyncClient(base_url=server[0], headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=60) as c:
            return await asyncio.gather(*[c.post("/v1/load_lora_adapter", json=dict(lora_name="twice",
                                                                                     lora_path="late-lora"))
                                          for _ in range(2)])

    assert sorted(r.status_code for r in asyncio.run(twice())) == [200, 400]
    with http(server) as h:
        assert h.post("/v1/unload_lora_adapter", json=dict(lora_name="twice")).status_code == 200
        assert h.post("/v1/unload_lora_adapter", json=dict(lora_name="late")).status_code == 404
        text = h.get("/metrics").text
        assert 'scute:adapter_loads_total{model_name="tiny",result="ok"}' in text
        assert metric(text, "scute:adapters_resident") >= 1 and metric(text, "scute:adapter_memory_used_bytes") > 0
        # "late" was placed for its request: its time from the ask to the end of its placement is observed
        assert metric_value(text, 'scute:adapter_load_seconds_count{model_name="tiny"}') >= 1
        assert metric(text, "scute:adapters_loading") == 0 and metric(text, "scute:adapters_cpu") >= 1
        assert 'scute:adapter_evictions_total{model_name="tiny",tier="device"}' in text  # at zero until one is


def test_64_concurrent_streams(server, reference, served):
    names = MODELS * 11
    prompts = [f"{w} quick brown" for w in ("the", "a", "red", "blue", "one", "two", "cat", "dog")]
    expected = {(m, p): want(reference, served, m, p, temperature=0, max_tokens=6, ignore_eos=True).text
                for m in MODELS for p in prompts}

    async def one(c, model, prompt):
        stream = await c.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
        return "".join([ch.choices[0].text async for ch in stream if ch.choices])

    async def run():
        c = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0)
        jobs = [(names[i], prompts[i % len(prompts)]) for i in range(64)]
        texts = await asyncio.gather(*(one(c, m, p) for m, p in jobs))
        return jobs, texts

    jobs, texts = asyncio.run(run())
    assert [expected[j] for j in jobs] == texts


def metric_value(text: str, series: str) -> float:
    line = next((line for line in text.splitlines() if line.startswith(series + " ")), None)
    return 0.0 if line is None else float(line.split()[-1])


def metric(text: str, name: str) -> float:
    return float(re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M).group(1))


@pytest.mark.parametrize("stream", [False, True])
def test_latency_metrics_time_the_first_token_where_the_engine_made_it(server, monkeypatch, stream):
    """A request answered in one body gets its final output alone, so its time to the first token is the engine's
    (`RequestOutput.first_token_time`), not when the body is sent: with each step slowed by 20 ms, a request of 8
    tokens has a TTFT at least 6 steps shorter than its end-to-end latency, streamed or not; and its tokens
    count once each in the generation counter."""
    engine = server[1].engine.engine
    step = engine.step

    def slow_step():
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    series = ('scute:time_to_first_token_seconds_sum{model_name="tiny"}',
              'scute:e2e_request_latency_seconds_sum{model_name="tiny"}',
              'scute:generation_tokens_total{model_name="tiny"}')
    with http(server) as h:
        before = [metric_value(h.get("/metrics").text, s) for s in series]
        body = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, ignore_eos=True, stream=stream)
        r = h.post("/v1/completions", json=body)
        assert r.status_code == 200 and (r.text.endswith("data: [DONE]\n\n") if stream else r.json()["usage"])
        ttft, e2e, tokens = (metric_value(h.get("/metrics").text, s) - b for s, b in zip(series, before))
    assert tokens == 8 and 0 < ttft < e2e - 6 * 0.02, (ttft, e2e)


def test_a_client_that_gives_up_on_a_plain_request_aborts_it(server, monkeypatch):
    """A non-streamed request whose client closes its connection while the request runs is aborted (not run to
    its end): each engine step is slowed so that the request is surely running when the client leaves."""
    import socket
    from urllib.parse import urlparse

    engine = server[1].engine.engine
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: time.sleep(0.05) or step())
    aborted = 'scute:request_success_total{finished_reason="abort",model_name="tiny"}'
    url = urlparse(server[0])
    with http(server) as h:
        before = metric_value(h.get("/metrics").text, aborted)
        body = json.dumps(dict(model="tiny", prompt=PROMPT, max_tokens=50, temperature=0, ignore_eos=True)).encode()
        client = socket.create_connection((url.hostname, url.port))
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
                       + body)
        deadline = time.monotonic() + 20
        while metric(h.get("/metrics").text, "scute:num_requests_running") == 0:
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.02)
        client.close()  # the client gives up: 50 tokens at 50 ms a step would take 2.5 s more
        deadline = time.monotonic() + 2
        while True:
            text = h.get("/metrics").text
            if metric(text, "scute:num_requests_running") == 0:
                break
            assert time.monotonic() < deadline, f"still running 2 s after its client left:\n{text}"
            time.sleep(0.05)
        assert metric_value(text, aborted) == before + 1 and metric(text, "scute:kv_cache_usage_perc") == 0


def test_clients_that_disconnect_leave_no_kv_blocks_held(server):
    aborted = 'scute:request_success_total{finished_reason="abort",model_name="tiny"}'
    with http(server) as h:
        before = metric_value(h.get("/metrics").text, aborted)
        for _ in range(3):
            body = dict(model="oft", prompt=PROMPT, max_tokens=50, temperature=0, ignore_eos=True, stream=True)
            with h.stream("POST", "/v1/completions", json=body) as s:
                next(s.iter_lines())  # the first event, then the client goes away
        deadline = time.monotonic() + 20
        while True:
            text = h.get("/metrics").text
            if metric(text, "scute:num_requests_running") == 0 and metric(text, "scute:kv_cache_usage_perc") == 0:
                break
            assert time.monotonic() < deadline, text
            time.sleep(0.1)
        assert metric_value(text, aborted) == before + 3  # stopped by the disconnect, not run to their end
    state = server[1]
    assert not state.engine.engine.scheduler.running and not state.engine.engine.requests


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_scute_serve_stops_its_engine_on_a_signal(served, sig):
    """`python -m scute serve` as a user runs it: up, answering, then SIGTERM (a service manager's stop) or SIGINT
    (Ctrl-C): it shuts the engine down and exits 0."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "scute", "serve", str(served / "model"), "--port", str(port),
                             "--device", "cpu", "--dtype", "float32", "--max-model-len", "64"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                assert time.monotonic() < deadline, "scute serve did not start"
                time.sleep(0.2)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert "scute serve: stopped" in out
