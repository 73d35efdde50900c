"""A soak of one OpenAI-compatible server on this machine (`scute serve`): many concurrent requests, with clients
that disconnect mid-stream, bad inputs and runtime adapter loads and unloads mixed in; every answer checked.

The workload (``--requests`` operations, ``--concurrency`` at a time, seeded by ``--seed``):

* good requests (the rest): a random served model, a prompt from a pool of ``--prompts`` random token-id prompts,
  1 to ``--max-tokens`` tokens, greedy with ``ignore_eos`` and ``logprobs: 0``, streamed or not. Each must answer
  200 with exactly its ``max_tokens`` tokens, and those must be the reference's: the same token texts and
  log-probabilities as the first tokens of the same prompt run alone (``reference``), which identifies the tokens;
* disconnects (``--disconnect-frac``): a long streamed request whose client goes away after 1-3 events, or a
  non-streamed one whose client goes away after a few ms;
* bad inputs (``--bad-frac``), each with its status: an unknown model (404), a prompt of ``max_model_len``
  tokens (400, streamed or not), a body that is not JSON (400), an unknown field (400);
* adapter churn (one per ``--churn-every`` operations, when the server allows runtime adapters): load
  ``--runtime-path`` (relative to the server's ``--allow-runtime-adapters`` directory) under a fresh name, three
  good requests to it (the reference of ``--runtime-like``, or of that adapter run alone), unload it, then a
  request to it must get 404.

At the end the server must be idle: ``/metrics`` shows ``scute:num_requests_running`` 0,
``scute:num_requests_waiting`` 0 and ``scute:kv_cache_usage_perc`` 0 (within ``--settle`` seconds).

The reference of the command line: each (model, prompt) sent alone, one at a time, before the soak (so the
soak checks that load, batching, disconnects and churn change nobody's tokens). `soak()` also takes a reference
from elsewhere (the tests give `Engine.generate`'s tokens).

    python bench/soak_serve.py --base-url http://127.0.0.1:8000 --requests 2000 --concurrency 32 \\
        --runtime-path my-lora --out out/soak.json

Exits 0 when every check held, 1 otherwise (the failures are printed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import BenchError, check_local, error_text, list_models, probe_vocab_size  # noqa: E402

# (model, prompt ids) -> the first max_tokens tokens as (token text, logprob)
Reference = dict[tuple[str, tuple[int, ...]], list[tuple[str, float]]]
ReferenceFn = Callable[[list[str], list[list[int]], int], Awaitable[Reference] | Reference]
IDLE_GAUGES = ("scute:num_requests_running", "scute:num_requests_waiting", "scute:kv_cache_usage_perc")


@dataclass
class SoakConfig:
    base_url: str = "http://127.0.0.1:8000"
    api_key: str | None = None
    requests: int = 2000
    concurrency: int = 32
    seed: int = 0
    models: list[str] | None = None  # default: every model of /v1/models
    prompts: int = 8
    prompt_len: tuple[int, int] = (3, 10)
    max_tokens: int = 12
    disconnect_frac: float = 0.1
    bad_frac: float = 0.1
    churn_every: int = 50  # one adapter load/unload cycle per this many operations; 0: none
    runtime_path: str | None = None  # a folder inside the server's runtime adapter directory
    runtime_like: str | None = None  # a served model the runtime adapter answers exactly like
    logprob_tol: float = 1e-3
    request_timeout: float = 120.0
    timeout: float = 1800.0  # the whole soak
    settle: float = 30.0  # seconds for the server to go idle after the last request


@dataclass
class SoakReport:
    counts: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)
    duration_s: float = 0.0
    final_metrics: dict[str, float] = field(default_factory=dict)
    server_rss_kb: dict[str, int] = field(default_factory=dict)  # with --server-pid: "start", "end"

    @property
    def ok(self) -> bool:
        return not self.failures

    def fail(self, message: str) -> None:
        if len(self.failures) < 200:
            self.failures.append(message)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(counts=dict(self.counts), statuses={str(k): v for k, v in self.statuses.items()}, ok=self.ok)
        return d


def metric(text: str, name: str) -> float | None:
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)]
    return sum(values) if values else None


def choice_tokens(choice: dict) -> list[tuple[str, float]]:
    lp = choice.get("logprobs") or {}
    return list(zip(lp.get("tokens") or [], lp.get("token_logprobs") or []))


class Soak:
    def __init__(self, cfg: SoakConfig, client: httpx.AsyncClient, report: SoakReport) -> None:
        self.cfg, self.client, self.report = cfg, client, report
        self.rng = random.Random(cfg.seed)
        self.reference: Reference = {}
        self.churns = 0

    # ------------------------------------------------------------------ good requests
    async def good(self, model: str, prompt: list[int], like: str | None = None) -> None:
        cfg, rng = self.cfg, self.rng
        max_tokens, stream = rng.randint(1, cfg.max_tokens), rng.random() < 0.5
        body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)
        what = f"good {model} {prompt} max_tokens={max_tokens} stream={stream}"
        try:
            got, usage = await (self._streamed(body) if stream else self._plain(body))
        except _Refused as e:
            self.report.fail(f"{what}: {e}")
            return
        except (httpx.HTTPError, ValueError, KeyError) as e:
            self.report.fail(f"{what}: {type(e).__name__}: {e}")
            return
        want = self.reference[(like or model, tuple(prompt))][:max_tokens]
        same = len(got) == len(want) and all(
            t == u and math.isclose(a, b, abs_tol=cfg.logprob_tol) for (t, a), (u, b) in zip(got, want))
        if usage != max_tokens or not same:
            self.report.fail(f"{what}: {usage} tokens {got}, want {want}")
        else:
            self.report.counts["good_ok"] += 1

    async def _plain(self, body: dict) -> tuple[list, int]:
        r = await self.client.post("/v1/completions", json=body)
        self.report.statuses[r.status_code] += 1
        if r.status_code != 200:
            raise _Refused(error_text(r, r.content))
        data = r.json()
        return choice_tokens(data["choices"][0]), data["usage"]["completion_tokens"]

    async def _streamed(self, body: dict) -> tuple[list, int]:
        got, usage, done = [], None, False
        body = dict(body, stream=True, stream_options={"include_usage": True})
        async with self.client.stream("POST", "/v1/completions", json=body) as r:
            self.report.statuses[r.status_code] += 1
            if r.status_code != 200:
                raise _Refused(error_text(r, await r.aread()))
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or []:
                    got += choice_tokens(choice)
        if not done:
            raise _Refused("the stream ended without [DONE]")
        return got, usage

    # ------------------------------------------------------------------ disconnects
    async def disconnect(self, model: str, prompt: list[int]) -> None:
        rng = self.rng
        body = dict(model=model, prompt=prompt, max_tokens=self.long_tokens(prompt), temperature=0, ignore_eos=True)
        if rng.random() < 0.8:  # mid-stream
            events = rng.randint(1, 3)
            async with self.client.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
                if r.status_code != 200:
                    self.report.fail(f"disconnect {model}: {error_text(r, await r.aread())}")
                    return
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events -= 1
                        if events == 0:
                            break  # leaving the block closes the connection mid-stream
            self.report.counts["disconnect_stream"] += 1
        else:  # a client that gives up on a non-streamed answer
            task = asyncio.ensure_future(self.client.post("/v1/completions", json=body))
            await asyncio.sleep(rng.uniform(0.001, 0.05))
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            self.report.counts["disconnect_plain"] += 1

    def long_tokens(self, prompt: list[int]) -> int:
        return max(1, self.max_model_len - len(prompt) - 1)

    # ------------------------------------------------------------------ bad inputs
    async def bad(self, model: str) -> None:
        rng, kind = self.rng, self.rng.choice(["unknown_model", "too_long", "bad_json", "unknown_field"])
        stream = rng.random() < 0.5
        headers = None
        if kind == "unknown_model":
            status, body = 404, dict(model="no-such-model", prompt=[5, 6], max_tokens=2, stream=stream)
        elif kind == "too_long":
            status, body = 400, dict(model=model, prompt=[5] * self.max_model_len, max_tokens=2, stream=stream)
        elif kind == "bad_json":
            status, body = 400, b'{"model": "' + model.encode() + b'", "prompt": [5, 6'
            headers = {"Content-Type": "application/json"}
        else:
            status, body = 400, dict(model=model, prompt=[5, 6], max_tokens=2, stream=stream, no_such_field=1)
        if isinstance(body, bytes):
            r = await self.client.post("/v1/completions", content=body, headers=headers)
        else:
            r = await self.client.post("/v1/completions", json=body)
        self.report.statuses[r.status_code] += 1
        try:
            err = r.json()["error"]
            shaped = err["code"] == status and isinstance(err["message"], str)
        except (ValueError, KeyError, TypeError):
            shaped = False
        if r.status_code != status or not shaped:
            self.report.fail(f"bad {kind} stream={stream}: HTTP {r.status_code} {r.text[:200]}, want {status}")
        else:
            self.report.counts[f"bad_{kind}"] += 1

    # ------------------------------------------------------------------ runtime adapters
    async def load(self, name: str) -> bool:
        r = await self.client.post("/v1/load_lora_adapter", json=dict(lora_name=name, lora_path=self.cfg.runtime_path))
        self.report.statuses[r.status_code] += 1
        if r.status_code != 200:
            self.report.fail(f"load {name} from {self.cfg.runtime_path!r}: {error_text(r, r.content)}")
        return r.status_code == 200

    async def unload(self, name: str) -> bool:
        r = await self.client.post("/v1/unload_lora_adapter", json=dict(lora_name=name))
        self.report.statuses[r.status_code] += 1
        if r.status_code != 200:
            self.report.fail(f"unload {name}: {error_text(r, r.content)}")
        return r.status_code == 200

    async def churn(self) -> None:
        self.churns += 1
        name = f"soak-runtime-{self.cfg.seed}-{self.churns}"
        if not await self.load(name):
            return
        await asyncio.gather(*(self.good(name, self.rng.choice(self.prompts), like=self.runtime_like)
                               for _ in range(3)))
        if not await self.unload(name):
            return
        r = await self.client.post("/v1/completions", json=dict(model=name, prompt=[5], max_tokens=1))
        self.report.statuses[r.status_code] += 1
        if r.status_code != 404:
            self.report.fail(f"{name} after its unload: HTTP {r.status_code}, want 404")
        else:
            self.report.counts["churn_ok"] += 1

    # ------------------------------------------------------------------ the run
    async def setup(self, reference: ReferenceFn | None) -> None:
        cfg, rng = self.cfg, self.rng
        served, max_model_len = await list_models(self.client)
        if max_model_len is None:
            raise BenchError("/v1/models does not give max_model_len")
        self.max_model_len = max_model_len
        self.models = cfg.models or [m for m in served if not m.startswith("soak-runtime-")]
        if unknown := set(self.models) - set(served):
            raise BenchError(f"models {sorted(unknown)} are not served (the server lists {served})")
        if cfg.max_tokens + cfg.prompt_len[1] >= max_model_len:
            raise BenchError(f"max_tokens {cfg.max_tokens} + prompt length {cfg.prompt_len[1]} do not fit the "
                             f"server's max_model_len {max_model_len}")
        vocab = await probe_vocab_size(self.client, self.models[0])
        self.prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*cfg.prompt_len))]
                        for _ in range(cfg.prompts)]
        self.runtime_like = cfg.runtime_like
        solo = reference is None
        if solo:
            reference = self.solo_reference
        models = list(self.models)
        if cfg.runtime_path and cfg.churn_every and self.runtime_like is None:
            if not solo:
                raise BenchError("a reference from elsewhere needs runtime_like (the model the runtime adapter "
                                 "answers like)")
            self.runtime_like = f"soak-runtime-{cfg.seed}-reference"
            if not await self.load(self.runtime_like):
                raise BenchError(f"cannot load the runtime adapter: {self.report.failures[-1]}")
            models.append(self.runtime_like)
        result = reference(models, self.prompts, cfg.max_tokens)
        self.reference = await result if asyncio.iscoroutine(result) else result
        if solo and self.runtime_like not in (None, cfg.runtime_like):
            await self.unload(self.runtime_like)

    async def solo_reference(self, models: list[str], prompts: list[list[int]], max_tokens: int) -> Reference:
        """Each (model, prompt) alone on the server, one at a time."""
        out: Reference = {}
        for m in models:
            for p in prompts:
                body = dict(model=m, prompt=p, max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)
                got, n = await self._plain(body)
                if n != max_tokens:
                    raise BenchError(f"reference {m} {p}: {n} tokens, want {max_tokens}")
                out[(m, tuple(p))] = got
        return out

    def plan(self) -> list[tuple]:
        cfg, rng, ops = self.cfg, self.rng, []
        churn = bool(cfg.runtime_path) and cfg.churn_every > 0
        for i in range(cfg.requests):
            if churn and i % cfg.churn_every == cfg.churn_every // 2:
                ops.append(("churn",))
                continue
            model, prompt, x = rng.choice(self.models), rng.choice(self.prompts), rng.random()
            if x < cfg.disconnect_frac:
                ops.append(("disconnect", model, prompt))
            elif x < cfg.disconnect_frac + cfg.bad_frac:
                ops.append(("bad", model))
            else:
                ops.append(("good", model, prompt))
        return ops

    async def run(self, ops: list[tuple]) -> None:
        queue: asyncio.Queue = asyncio.Queue()
        for op in ops:
            queue.put_nowait(op)

        async def worker() -> None:
            while not queue.empty():
                kind, *rest = queue.get_nowait()
                try:
                    await getattr(self, kind)(*rest)
                except (httpx.HTTPError, ValueError, KeyError) as e:
                    self.report.fail(f"{kind} {rest}: {type(e).__name__}: {e}")
        await asyncio.gather(*(worker() for _ in range(self.cfg.concurrency)))

    async def idle(self) -> None:
        """The server's gauges all 0 within cfg.settle seconds."""
        deadline = time.monotonic() + self.cfg.settle
        while True:
            text = (await self.client.get("/metrics")).text
            values = {name: metric(text, name) for name in IDLE_GAUGES}
            if all(v == 0 for v in values.values()):
                break
            if time.monotonic() > deadline:
                self.report.fail(f"the server is not idle {self.cfg.settle} s after the soak: {values}")
                break
            await asyncio.sleep(0.1)
        self.report.final_metrics = values
        aborted = re.findall(r'^scute:request_success_total\{finished_reason="abort"[^}]*\} (\S+)$', text, re.M)
        self.report.final_metrics["aborted_total"] = sum(float(v) for v in aborted)


class _Refused(Exception):
    """A good request answered with an error."""


async def soak(cfg: SoakConfig, reference: ReferenceFn | None = None) -> SoakReport:
    """Runs the soak of `cfg`; `reference(models, prompts, max_tokens)` gives the expected tokens (default: each
    alone on the server). Raises BenchError when it cannot start; every failed check is in the report."""
    cfg.base_url = check_local(cfg.base_url)
    report = SoakReport()
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.concurrency + 8, max_keepalive_connections=cfg.concurrency + 8)
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, timeout=cfg.request_timeout,
                                 limits=limits, trust_env=False, follow_redirects=False) as client:
        s = Soak(cfg, client, report)
        await s.setup(reference)
        ops = s.plan()
        start = time.monotonic()
        try:
            await asyncio.wait_for(s.run(ops), cfg.timeout)
        except asyncio.TimeoutError:
            report.fail(f"the soak did not finish within {cfg.timeout} s")
        report.duration_s = time.monotonic() - start
        report.counts["operations"] = len(ops)
        await s.idle()
    return report


def resident_kb(pid: int | None) -> int | None:
    """The resident memory of process `pid` in kB (Linux), None without one."""
    if pid is None:
        return None
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def main(argv: list[str] | None = None) -> SoakReport:
    p = argparse.ArgumentParser(description="Soak an OpenAI-compatible server on this machine.")
    d = SoakConfig()
    p.add_argument("--base-url", default=d.base_url)
    p.add_argument("--api-key", default=os.environ.get("SCUTE_API_KEY"))
    p.add_argument("--requests", type=int, default=d.requests, help="operations in all")
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--models", nargs="+", default=None, help="default: every model of /v1/models")
    p.add_argument("--prompts", type=int, default=d.prompts, help="random prompts in the pool")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--disconnect-frac", type=float, default=d.disconnect_frac)
    p.add_argument("--bad-frac", type=float, default=d.bad_frac)
    p.add_argument("--churn-every", type=int, default=d.churn_every)
    p.add_argument("--runtime-path", default=None, help="an adapter folder, relative to the server's "
                   "--allow-runtime-adapters directory (no churn without it)")
    p.add_argument("--runtime-like", default=None, help="a served model that answers as the runtime adapter")
    p.add_argument("--timeout", type=float, default=d.timeout, help="seconds for the whole soak")
    p.add_argument("--server-pid", type=int, default=None, help="the server's process: its resident memory is "
                   "recorded before and after the soak")
    p.add_argument("--out", default=None, help="write the report as JSON here")
    args = p.parse_args(argv)
    models = [m for item in args.models for m in item.split(",") if m] if args.models else None
    cfg = SoakConfig(base_url=args.base_url, api_key=args.api_key, requests=args.requests,
                     concurrency=args.concurrency, seed=args.seed, models=models, prompts=args.prompts,
                     max_tokens=args.max_tokens, disconnect_frac=args.disconnect_frac, bad_frac=args.bad_frac,
                     churn_every=args.churn_every, runtime_path=args.runtime_path, runtime_like=args.runtime_like,
                     timeout=args.timeout)
    start_rss = resident_kb(args.server_pid)
    try:
        report = asyncio.run(soak(cfg))
    except BenchError as e:
        raise SystemExit(f"soak_serve: {e}") from None
    if args.server_pid is not None:
        report.server_rss_kb = dict(start=start_rss, end=resident_kb(args.server_pid))
    print(f"soak: {report.counts['operations']} operations in {report.duration_s:.1f} s; "
          f"{dict(sorted(report.counts.items()))}; HTTP {dict(sorted(report.statuses.items()))}; "
          f"final {report.final_metrics}" + (f"; server RSS kB {report.server_rss_kb}" if report.server_rss_kb else ""))
    for failure in report.failures:
        print(f"FAIL {failure}")
    print("OK" if report.ok else f"{len(report.failures)} failures")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report.as_dict(), f, indent=1)
    return report


if __name__ == "__main__":
    sys.exit(0 if main(sys.argv[1:]).ok else 1)
