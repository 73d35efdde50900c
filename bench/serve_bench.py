"""`scute serve` end to end: a Llama-3-8B-shaped model and many adapters of five methods behind the HTTP server,
loaded by `bench_serving.py` at several request rates, as clients see it.

Stages (each printed with its elapsed time, and its seconds kept in the JSON):

1. build: a `LlamaForCausalLM` of `bench_engine.LLAMA3_8B` (``--layers`` fewer; ``--tiny`` a toy config for the
   CPU) with random bf16 weights, made on ``--device`` and written once with ``save_pretrained`` (safetensors),
   with a word-level tokenizer over its vocabulary (``t3``, ``t4``, ...; prompts are token ids, the tokenizer
   is there so that the server detokenizes every streamed token as it does for a real model); then
   ``--adapters`` adapters, LoRA r16, DoRA r16, IA3, VeRA r256 and OFT block 32 in turn (equal shares: of 64,
   13 of each and 12 OFT), by `bench_engine.make_adapters` (every tensor re-randomized). All under ``--root``; a later run with the same
   shapes reuses the folder (``--rebuild`` writes it again).
2. serve: ``python -m scute serve`` on 127.0.0.1 and a free port, every adapter served under its folder's name,
   ``--max-adapters`` = ``--adapters`` (all resident at once), dtype bfloat16 on CUDA (float32 on the CPU),
   ``--max-model-len`` input + output + 16; ready once it answers ``GET /v1/models``. Its output goes to
   ``server.log`` under ``--root``.
3. warm-up: twice, one streamed request per adapter, all at once (16 tokens): every adapter is placed in a
   device slot (a placement can change the slot layout, which drops the captured CUDA graphs) and that batch's
   kernels are compiled and graphs captured before anything is measured. Batch sizes and adapter mixes first met
   later still capture theirs on first use.
4. measure: `bench_serving.py` at each of ``--rates`` (requests/s, Poisson arrivals; ``inf``: all at once),
   ``--num-prompts`` requests each, spread uniformly over the adapters, ``--input-len`` random prompt tokens and
   exactly ``--output-len`` generated (greedy, ``ignore_eos``), a fresh seed per rate (no prefix-cache hits).
5. the server is stopped (SIGTERM; SIGKILL after 30 s), also on an error.

Writes ``--out`` (after every rate: a run cut short keeps what it measured): the device, the command, the options,
the server's command line, each stage's seconds and each rate's `bench_serving` result (every request's record
but its inter-token gaps, whose statistics are kept). Prints a table: rate, req/s, output tok/s, TTFT p50/p99,
TPOT p50/p99, ITL p99 (ms), failed requests. Exits 1 if any request failed.

Run on a GPU: ``PYTHONPATH=. python3 bench/serve_bench.py --out bench/results/serving_h200.json``.
On the CPU, a check: ``PYTHONPATH=. python3 bench/serve_bench.py --tiny --device cpu --adapters 10
--num-prompts 20 --rates 8,inf --input-len 16 --output-len 8 --out /tmp/serve_bench_tiny.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import sys
import time

import httpx
import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
import bench_engine as B  # noqa: E402
import bench_serving as S  # noqa: E402

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
WARMUP_TOKENS = 16
T0 = time.perf_counter()


class ServeBenchError(Exception):
    pass


def say(message: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {message}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=32, help="decoder layers of the Llama-3-8B shape")
    p.add_argument("--tiny", action="store_true", help="a toy Llama (hidden 64, 2 layers, vocab 512)")
    p.add_argument("--adapters", type=int, default=64, help="adapters served, the five methods in equal shares")
    p.add_argument("--rates", default="4,16,inf", help="request rates (requests/s, or inf), comma-separated")
    p.add_argument("--num-prompts", type=int, default=200, help="requests per rate")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per rate")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for the server to answer")
    p.add_argument("--server-args", default="", help="more `scute serve` flags, one string (e.g. '--enforce-eager')")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--root", default="/tmp/scute-serve-bench")
    p.add_argument("--rebuild", action="store_true", help="write the model and adapters even if --root has them")
    p.add_argument("--out", default="serve_bench.json")
    args = p.parse_args(argv)
    args.rate_list = [S.parse_rate(r) for r in args.rates.split(",") if r]
    if args.adapters < 1 or args.num_prompts < 1 or not args.rate_list:
        p.error("--adapters, --num-prompts and --rates need at least one each")
    return args


# ---------------------------------------------------------------------------------------------- 1. build
def write_tokenizer(vocab_size: int, folder: str) -> None:
    """A word-level tokenizer with one word per id: <unk>, <s>, </s> (Llama's default ids 0, 1, 2), then t3, ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)


def build(args, times: dict) -> tuple[str, dict[str, str], int]:
    """(model folder, {adapter name: folder}, vocabulary size), written under --root unless already there."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = TINY if args.tiny else {**B.LLAMA3_8B, "num_hidden_layers": args.layers}
    folder = os.path.join(args.root, "tiny" if args.tiny else f"llama3-8b-{args.layers}l")
    model_dir = os.path.join(folder, "model")
    methods = [B.MIX[i % len(B.MIX)] for i in range(args.adapters)]
    counts = {m: methods.count(m) for m in B.MIX if m in methods}
    names = [f"{m}-{i}" for m, n in counts.items() for i in range(n)]
    adapters = {name: os.path.join(folder, "adapters", name) for name in names}
    spec = dict(config=config, adapters=counts)
    marker = os.path.join(folder, "build.json")
    if not args.rebuild and os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == spec:
                say(f"build: reusing {folder} (--rebuild to write it again)")
                return model_dir, adapters, config["vocab_size"]
    if os.path.exists(marker):
        os.remove(marker)  # a build cut short must not pass for a complete one

    t = time.perf_counter()
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = LlamaForCausalLM._from_config(LlamaConfig(**config), dtype=torch.bfloat16).eval()
    params = sum(p.numel() for p in model.parameters())
    times["build_model_s"] = time.perf_counter() - t
    say(f"build: {params / 1e6:.1f} M parameters (bf16) on {args.device} in {times['build_model_s']:.1f} s")

    t = time.perf_counter()
    model.save_pretrained(model_dir)
    write_tokenizer(config["vocab_size"], model_dir)
    times["save_model_s"] = time.perf_counter() - t
    say(f"build: model and tokenizer written to {model_dir} in {times['save_model_s']:.1f} s")

    t = time.perf_counter()
    for method, count in counts.items():
        B.make_adapters(model, method, count, os.path.join(folder, "adapters"))
    times["write_adapters_s"] = time.perf_counter() - t
    size = sum(os.path.getsize(os.path.join(p, "adapter_model.safetensors")) for p in adapters.values())
    say(f"build: {len(adapters)} adapters ({', '.join(f'{n} {m}' for m, n in counts.items())}; {size / 1e6:.1f} MB) "
        f"in {times['write_adapters_s']:.1f} s")
    with open(marker, "w") as f:
        json.dump(spec, f)
    del model
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()  # the server's memory planning counts what this process still holds
    return model_dir, adapters, config["vocab_size"]


# ---------------------------------------------------------------------------------------------- 2. serve
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: str, lines: int = 40) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def server_command(args, model_dir: str, adapters: dict[str, str], port: int) -> list[str]:
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    return [sys.executable, "-m", "scute", "serve", model_dir, "--served-model-name", "base",
            "--adapter", *[f"{n}={p}" for n, p in adapters.items()], "--host", "127.0.0.1", "--port", str(port),
            "--device", args.device, "--dtype", dtype, "--max-adapters", str(len(adapters)),
            "--max-model-len", str(args.input_len + args.output_len + 16), *shlex.split(args.server_args)]


def wait_ready(proc: subprocess.Popen, url: str, log: str, timeout: float) -> list[str]:
    """The served model ids once the server answers GET /v1/models; ServeBenchError if it dies or never does."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise ServeBenchError(f"scute serve exited with status {proc.returncode} before answering; the end of "
                                  f"{log}:\n{log_tail(log)}")
        try:
            r = httpx.get(url + "/v1/models", timeout=5, trust_env=False)
            if r.status_code == 200:
                return [card["id"] for card in r.json()["data"]]
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise ServeBenchError(f"scute serve did not answer GET /v1/models within {timeout:.0f} s; the end of "
                                  f"{log}:\n{log_tail(log)}")
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (as a service manager stops it: uvicorn stops, then `scute serve` shuts its engine down and exits
    0), then SIGKILL if it has not within 30 s."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
        if proc.poll() is not None:
            break
        proc.send_signal(sig)
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            say(f"the server did not stop within {wait} s of {sig.name}")
    say(f"server stopped (exit status {proc.returncode})")


# ---------------------------------------------------------------------------------------------- 3, 4. load
async def warm_up(url: str, names: list[str], vocab: int, input_len: int, seed: int) -> list[S.RequestResult]:
    """One streamed request per adapter, all at once (bench_serving's client)."""
    rng = random.Random(seed)
    results = [S.RequestResult(i, name, input_len) for i, name in enumerate(names)]
    limits = httpx.Limits(max_connections=len(names))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits, trust_env=False) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(S.send(client, r, dict(
            model=r.model, prompt=[rng.randrange(vocab) for _ in range(input_len)], max_tokens=WARMUP_TOKENS,
            temperature=0, ignore_eos=True, stream=True, stream_options={"include_usage": True}), t0)
            for r in results))
    return results


def measure(args, url: str, names: list[str], vocab: int, rate: float, seed: int) -> dict:
    argv = ["--base-url", url, "--models", *names, "--num-prompts", str(args.num_prompts), "--request-rate",
            str(rate), "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--vocab-size",
            str(vocab), "--seed", str(seed), "--timeout", str(args.timeout), "--quiet"]
    result = S.main(argv)
    for r in result["requests"]:
        r.pop("itl", None)  # 127 floats a request; itl_ms keeps their statistics
    return result


def fmt_ms(stats: dict, key: str) -> str:
    return "-" if stats.get(key) is None else f"{stats[key]:.1f}"


def table(rows: list[dict]) -> str:
    head = ("rate", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p99", "failed")
    lines = ["  ".join(f"{h:>9}" for h in head) + "   (latencies in ms)"]
    for r in rows:
        cells = (r["config"]["request_rate"], f"{r['request_throughput']:.2f}", f"{r['output_throughput']:.0f}",
                 fmt_ms(r["ttft_ms"], "median"), fmt_ms(r["ttft_ms"], "p99"), fmt_ms(r["tpot_ms"], "median"),
                 fmt_ms(r["tpot_ms"], "p99"), fmt_ms(r["itl_ms"], "p99"), r["failed"])
        lines.append("  ".join(f"{c!s:>9}" for c in cells))
    return "\n".join(lines)


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("serve_bench: --device cuda but no GPU is visible (on the CPU: --device cpu --tiny)")
    import peft
    import transformers

    times: dict[str, float] = {}
    result = dict(device=device_name(args.device), torch=torch.__version__, transformers=transformers.__version__,
                  peft=peft.__version__, command="PYTHONPATH=. python3 " + shlex.join(sys.argv),
                  options={k: v for k, v in vars(args).items() if k != "rate_list"}, times_s=times, rates=[])

    def save() -> None:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    say(f"device: {result['device']}")
    model_dir, adapters, vocab = build(args, times)
    names = list(adapters)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = server_command(args, model_dir, adapters, port)
    result["server_command"] = shlex.join(cmd)
    log = os.path.join(args.root, "server.log")
    env = {k: v for k, v in os.environ.items() if k != "SCUTE_API_KEY"}  # no key: bench_serving sends none
    env["PYTHONPATH"] = os.pathsep.join([REPO, *filter(None, [env.get("PYTHONPATH")])])
    say(f"serve: starting scute serve on {url} ({len(names)} adapters; output in {log})")
    t = time.perf_counter()
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log_file,
                                stderr=subprocess.STDOUT)
    try:
        served = wait_ready(proc, url, log, args.startup_timeout)
        times["server_start_s"] = time.perf_counter() - t
        if missing := sorted(set(names) - set(served)):
            raise ServeBenchError(f"the server does not list the adapters {missing}")
        say(f"serve: ready in {times['server_start_s']:.1f} s, serving {len(served)} models")
        for k in range(2):
            t = time.perf_counter()
            warm = asyncio.run(warm_up(url, names, vocab, args.input_len, args.seed + 1000 + k))
            times[f"warmup{k + 1}_s"] = time.perf_counter() - t
            if failed := [r for r in warm if not r.success]:
                raise ServeBenchError(f"warm-up: {len(failed)} of {len(warm)} requests failed, e.g. {failed[0].model}: "
                                      f"{failed[0].error}")
            say(f"warm-up {k + 1}: {len(warm)} requests x {WARMUP_TOKENS} tokens in {times[f'warmup{k + 1}_s']:.1f} s")
        for k, rate in enumerate(args.rate_list):
            say(f"measure: rate {rate}/s, {args.num_prompts} requests ...")
            t = time.perf_counter()
            r = measure(args, url, names, vocab, rate, args.seed + k)
            times[f"rate_{r['config']['request_rate']}_s"] = time.perf_counter() - t
            result["rates"].append(r)
            save()
            say(f"measure: rate {rate}/s: {r['completed']} ok, {r['failed']} failed, {r['duration_s']:.1f} s, "
                f"{r['output_throughput']:.0f} output tok/s")
            for error, count in r["errors"].items():
                say(f"  error x{count}: {error}")
    except ServeBenchError as e:
        save()
        raise SystemExit(f"serve_bench: {e}") from None
    finally:
        stop(proc)
    times["total_s"] = time.perf_counter() - T0
    save()
    print(table(result["rates"]))
    print("stage seconds: " + ", ".join(f"{k[:-2]} {v:.1f}" for k, v in times.items()))
    say(f"wrote {args.out}")
    return 0 if all(r["failed"] == 0 for r in result["rates"]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
