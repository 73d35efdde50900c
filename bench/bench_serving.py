"""A load generator for an OpenAI-compatible server (`scute serve`, or any server with vLLM's API): random
prompts streamed through ``/v1/completions``, the latencies each client saw, throughput and percentiles.

Requests: ``--num-prompts`` prompts of ``--input-len`` random token ids (drawn uniformly from the vocabulary the
server accepts: ``--vocab-size``, or asked of the server by one prompt of an out-of-range id), each asking for
exactly ``--output-len`` tokens (``max_tokens`` with ``ignore_eos: true``, greedy unless ``--temperature``). Each
request names one of ``--models`` (default: every model of ``GET /v1/models``), uniformly, or by a Zipf popularity
(``--zipf S``: the k-th model with weight 1/k^S). Arrivals: ``--request-rate R`` requests/s with gamma inter-arrival
times (shape ``--burstiness B``, scale 1/(R*B); B = 1 is a Poisson process, smaller B is burstier), ``inf`` sends
them all at once; ``--max-concurrency C`` bounds the requests in flight.

Per request (streamed as server-sent events, with ``stream_options: {"include_usage": true}``): time to the first
chunk (TTFT), the gaps between chunks (ITL), end-to-end latency, output tokens (the usage the server reports),
success or the error. Reported: requests/s, output tokens/s, total (prompt + output) tokens/s over the run's
wall time, and TTFT, TPOT (time per output token after the first: (latency - TTFT) / (output tokens - 1)), ITL and
end-to-end latency as mean, median, p90, p99 in ms. Prints a table; ``--out`` writes JSON.

Only a server on this machine (127.0.0.1, localhost, ::1) is a valid target; the run is bounded by
``--num-prompts`` and ``--timeout`` seconds (requests unfinished then are cancelled and count as failed).

    python bench/bench_serving.py --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 20 \\
        --input-len 128 --output-len 64 --out out/serving.json
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
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

import httpx

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}
PERCENTILES = (50, 90, 99)


class BenchError(Exception):
    """A run that cannot start (a refused target, a bad option, a server that does not answer as expected)."""


@dataclass
class RequestResult:
    index: int
    model: str
    prompt_len: int
    start: float = 0.0  # seconds from the run's start to the request's send
    success: bool = False
    error: str | None = None
    ttft: float | None = None  # seconds
    latency: float | None = None  # seconds, send to the end of the stream
    itl: list[float] = field(default_factory=list)  # seconds between consecutive chunks after the first
    output_tokens: int = 0
    text: str = ""


def check_local(url: str) -> str:
    """`url` without a trailing slash, if it names a server on this machine; raises BenchError otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BenchError(f"--base-url {url!r}: expected http://HOST:PORT")
    if parts.hostname.lower() not in LOCAL_HOSTS:
        raise BenchError(f"--base-url {url!r}: refused, only a local server is a valid target "
                         f"({', '.join(sorted(LOCAL_HOSTS))})")
    return url.rstrip("/")


def parse_rate(value: str) -> float:
    rate = float(value)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 or inf, got {value}")
    return rate


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Load generator for an OpenAI-compatible server on this machine.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (127.0.0.1, localhost or ::1)")
    p.add_argument("--api-key", default=os.environ.get("SCUTE_API_KEY"), help="Bearer key (default $SCUTE_API_KEY)")
    p.add_argument("--models", nargs="+", default=None,
                   help="models to request (names, or comma-separated); default: every model of /v1/models")
    p.add_argument("--zipf", type=float, default=None, metavar="S",
                   help="pick the k-th model with weight 1/k^S (default: uniformly)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=parse_rate, default=math.inf, help="requests/s; inf: all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the inter-arrival times (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=32, help="generated tokens per request")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="draw prompt ids from [0, V) (default: the range the server accepts, asked of it)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--quiet", action="store_true", help="no table")
    return p


def validate(args: argparse.Namespace) -> None:
    args.base_url = check_local(args.base_url)
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchError("--max-concurrency must be >= 1")
    if not args.burstiness > 0:
        raise BenchError("--burstiness must be > 0")
    if not args.timeout > 0:
        raise BenchError("--timeout must be > 0")
    if args.vocab_size is not None and args.vocab_size < 1:
        raise BenchError("--vocab-size must be >= 1")


# ---------------------------------------------------------------------------------------------- the workload
def arrival_times(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Send times (seconds from the start) of `n` requests: gamma inter-arrivals of mean 1/rate; all 0 at inf."""
    if math.isinf(rate):
        return [0.0] * n
    t, times = 0.0, []
    for _ in range(n):
        times.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return times


def model_weights(models: list[str], zipf: float | None) -> list[float]:
    return [1.0] * len(models) if zipf is None else [1.0 / (k + 1) ** zipf for k in range(len(models))]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile, linear between the closest ranks (numpy's default)."""
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def stats_ms(values: list[float]) -> dict[str, float | None]:
    """mean, median, p90, p99 in ms (None each when there are no values: JSON has no NaN)."""
    ms = [v * 1000 for v in values]
    if not ms:
        return {"mean": None, "median": None, **{f"p{q}": None for q in PERCENTILES if q != 50}}
    out = {"mean": sum(ms) / len(ms), "median": percentile(ms, 50)}
    out.update({f"p{q}": percentile(ms, q) for q in PERCENTILES if q != 50})
    return out


# ---------------------------------------------------------------------------------------------- talking to it
def error_text(response: httpx.Response, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:200].decode(errors="replace")
    return f"HTTP {response.status_code}: {message}"


async def list_models(client: httpx.AsyncClient) -> tuple[list[str], int | None]:
    """The served model ids and the base model's max_model_len (None if the server does not say)."""
    r = await client.get("/v1/models")
    if r.status_code != 200:
        raise BenchError(f"GET /v1/models: {error_text(r, r.content)}")
    cards = r.json()["data"]
    lens = [c["max_model_len"] for c in cards if isinstance(c.get("max_model_len"), int)]
    return [c["id"] for c in cards], (min(lens) if lens else None)


async def probe_vocab_size(client: httpx.AsyncClient, model: str) -> int:
    """The vocabulary the server accepts prompt ids from: its message for an out-of-range id when it names the
    range, else a bisection on one-token prompts (200: inside, 400: outside)."""
    async def accepts(token: int) -> tuple[bool, str]:
        r = await client.post("/v1/completions", json=dict(model=model, prompt=[token], max_tokens=1))
        if r.status_code == 200:
            return True, ""
        if r.status_code == 400:
            return False, error_text(r, r.content)
        raise BenchError(f"probing the vocabulary: {error_text(r, r.content)}")

    ok, message = await accepts(2**31 - 1)
    if ok:
        raise BenchError("the server accepts any token id: pass --vocab-size")
    if m := re.search(r"\[0, (\d+)\)", message):
        return int(m.group(1))
    if not (await accepts(0))[0]:
        raise BenchError(f"the server refuses the prompt [0]: {message}; pass --vocab-size")
    lo, hi = 0, 2**31 - 1  # lo accepted, hi refused
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if (await accepts(mid))[0] else (lo, mid)
    return hi


async def send(client: httpx.AsyncClient, result: RequestResult, body: dict, t0: float) -> None:
    """One streamed completion; fills `result` (never raises but for cancellation)."""
    start = time.perf_counter()
    result.start = start - t0
    last = None
    done = usage = False
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                result.error = error_text(r, await r.aread())
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    usage = True
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                result.text += chunk["choices"][0].get("text") or ""
        result.latency = time.perf_counter() - start
        if not done:
            result.error = "the stream ended without [DONE]"
        elif not usage:
            result.error = "the stream carried no usage"
        elif result.ttft is None:
            result.error = "the stream carried no tokens"
        else:
            result.success = True
    except (httpx.HTTPError, ValueError, KeyError) as e:
        result.error = f"{type(e).__name__}: {e}"


async def run(args: argparse.Namespace) -> dict:
    validate(args)
    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or args.num_prompts, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=args.timeout, limits=limits,
                                 trust_env=False, follow_redirects=False) as client:
        served, max_model_len = await list_models(client)
        models = [m for item in args.models for m in item.split(",") if m] if args.models else served
        if unknown := [m for m in models if m not in served]:
            raise BenchError(f"--models {unknown}: not served (the server lists {served})")
        if not models:
            raise BenchError("the server lists no models")
        if max_model_len is not None and args.input_len + args.output_len > max_model_len:
            raise BenchError(f"--input-len {args.input_len} + --output-len {args.output_len} exceeds the server's "
                             f"max_model_len {max_model_len}")
        vocab = args.vocab_size or await probe_vocab_size(client, models[0])

        times = arrival_times(args.num_prompts, args.request_rate, args.burstiness, rng)
        chosen = rng.choices(models, weights=model_weights(models, args.zipf), k=args.num_prompts)
        prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
        results = [RequestResult(i, m, args.input_len) for i, m in enumerate(chosen)]
        gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, t0 + times[i] - time.perf_counter()))
            body = dict(model=chosen[i], prompt=prompts[i], max_tokens=args.output_len, temperature=args.temperature,
                        ignore_eos=True, stream=True, stream_options={"include_usage": True})
            if gate is None:
                await send(client, results[i], body, t0)
            else:
                async with gate:
                    await send(client, results[i], body, t0)

        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(one(i)) for i in range(args.num_prompts)]
        _, late = await asyncio.wait(tasks, timeout=args.timeout)
        for t in late:
            t.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        duration = time.perf_counter() - t0
    for r in results:
        if not r.success and r.error is None:
            r.error = f"unfinished after --timeout {args.timeout} s"
    return summarize(args, models, vocab, results, duration)


def summarize(args, models: list[str], vocab: int, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    config = {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()
              if k not in ("api_key", "quiet")}
    config["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate
    errors: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    return dict(
        config=config, models=models, vocab_size=vocab, duration_s=duration,
        num_prompts=len(results), completed=len(ok), failed=len(results) - len(ok), errors=errors,
        total_input_tokens=input_tokens, total_output_tokens=output_tokens,
        request_throughput=len(ok) / duration, output_throughput=output_tokens / duration,
        total_token_throughput=(input_tokens + output_tokens) / duration,
        ttft_ms=stats_ms([r.ttft for r in ok]), tpot_ms=stats_ms(tpots),
        itl_ms=stats_ms([x for r in ok for x in r.itl]), e2el_ms=stats_ms([r.latency for r in ok]),
        requests_per_model={m: sum(r.model == m for r in results) for m in models},
        requests=[{k: v for k, v in asdict(r).items() if k != "text"} for r in results],
    )


def table(result: dict) -> str:
    rows = [("Successful requests", result["completed"]), ("Failed requests", result["failed"]),
            ("Duration (s)", f"{result['duration_s']:.2f}"),
            ("Total input tokens", result["total_input_tokens"]),
            ("Total output tokens", result["total_output_tokens"]),
            ("Request throughput (req/s)", f"{result['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{result['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{result['total_token_throughput']:.2f}")]
    for key, title in (("ttft_ms", "Time to first token"), ("tpot_ms", "Time per output token (excl. 1st)"),
                       ("itl_ms", "Inter-token latency"), ("e2el_ms", "End-to-end latency")):
        rows.append((f"--- {title} (ms)", ""))
        rows += [(f"  {stat}", "-" if value is None else f"{value:.2f}") for stat, value in result[key].items()]
    width = max(len(name) for name, _ in rows) + 2
    lines = [f"{'=' * 20} Serving benchmark {'=' * 20}"]
    lines += [f"{name:<{width}}{value}" for name, value in rows]
    for error, count in result["errors"].items():
        lines.append(f"error x{count}: {error}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """Runs the benchmark of the command line `argv`; returns the result (what ``--out`` holds)."""
    args = build_parser().parse_args(argv)
    try:
        result = asyncio.run(run(args))
    except BenchError as e:
        raise SystemExit(f"bench_serving: {e}") from None
    if not args.quiet:
        print(table(result), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    res = main(sys.argv[1:])
    sys.exit(0 if res["failed"] == 0 else 1)
