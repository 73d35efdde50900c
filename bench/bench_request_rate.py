"""The request-rate experiment: how many requests per second an engine sustains over N adapters of one method,
served natively against the same adapters converted to LoRA (`scute convert`), in the same process.

Requests arrive as a gamma process (vLLM's `bench serve` convention: shape = burstiness, mean 1 / rate; burstiness 1
= Poisson), each picking one of N adapters (``uniform``, or ``zipf`` with exponent 1), ``--prompt`` random tokens,
``--new-tokens`` generated (greedy, ``ignore_eos``), driven through `Engine.add_request` / `Engine.step` in real
time. A rate is *sustained* when the p90 time per output token stays within ``--slo`` times the unloaded one (one
request alone) and the queue does not grow (every request starts within ``--max-queue-s`` of its arrival: a run
stops, its requests aborted, as soon as one has waited longer, so an overloaded rate costs seconds). For each
(method, N, popularity, variant) the highest sustained rate is found by doubling from ``--start-rate``, then
bisecting; every run's TTFT and TPOT percentiles are recorded, with the engine's counts of what bounds it
(`engine_counts`: steps, those that ran eagerly, graphs captured, Triton kernels compiled), the mean time of a step,
of it the mean time the host waited for the GPU (what the host's own work did not fill), and its mean tokens (a rate
that fails on time per token: slower steps, or more requests in each) and its slowest step (a compile or a capture
mid-run stalls every running request: it shows there). Before each (variant, N), one request per adapter the device
slots hold warms them and the graphs of every step shape for their steps are captured (`warm_graphs`: a
server's steady state), ``--warm-arrivals`` requests arriving at ``--start-rate`` run unmeasured
(mixed steps, prompts beside decodes, whose kernels compile on first use), then one request alone gives the unloaded
TPOT.

Variants: ``native`` (the method's own adapters) and ``lora-rR`` for each ``--ranks`` R. A conversion's adapters
are N LoRA checkpoints of the conversion's shape (rank R on the same modules; random tensors: what the engine
serves costs the same); its error is the mean `rel_error` of ``--convert`` real conversions (truncated SVD of each
layer's effective change) of the native adapters, written beside the rows. Where the N adapters do not fit the
device at once (``--max-adapters``), they swap through the CPU tier (``max_cpu_adapters = N``) and the disk, as a
user's would. Disk: a LoRA of rank R on all seven projections of the 8B shape is R x 5.2 MB in bf16, so 1024
conversions at rank 64 need 340 GB; ``--layers 4`` needs 43 GB, and ``--adapter-memory-gib`` scaled by the same
factor (1.75 on the H200) keeps as many adapters of each kind on the device as the 32-layer default budget does.

Run on a GPU (Llama-3-8B shape, random bf16 weights):
``PYTHONPATH=. python3 bench/bench_request_rate.py --methods ia3,vera --adapters 64,1024 --out rate.json``;
``--layers`` fewer for a quick look; ``--tiny`` runs a 2-layer model on the CPU (the test does); ``--profile 224``
prints where the host's time of the steps goes in the runs at 224 req/s (cProfile of `Engine.step`).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import os
import pstats
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_engine as B  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)


def pick(popularity: str, n: int, rng: random.Random, i: int = 0) -> int:
    if popularity == "cycle":  # the warm-up: every adapter in turn
        return i % n
    if popularity == "uniform":
        return rng.randrange(n)
    weights = [1.0 / (i + 1) for i in range(n)]  # zipf, exponent 1
    return rng.choices(range(n), weights)[0]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def run_load(engine, paths: list[str], rate: float, args, seed: int) -> dict:
    """One run: ``--requests`` requests at `rate` per second, or more to last ``--min-duration`` seconds (a queue
    that grows shows over seconds, not in a burst); per-request TTFT, TPOT and queueing delay."""
    from scute import SamplingParams

    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    vocab = engine.vocab_size
    sp = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    arrivals, t = [], 0.0
    count = args.requests if rate == float("inf") else max(args.requests, math.ceil(rate * args.min_duration))
    for _ in range(count):
        t += rng.gammavariate(args.burstiness, 1.0 / (rate * args.burstiness)) if rate != float("inf") else 0.0
        arrivals.append(t)
    specs = [paths[pick(args.popularity, len(paths), rng, i)] for i in range(len(arrivals))]
    prompts = [torch.randint(0, vocab, (args.prompt,), generator=g).tolist() for _ in arrivals]
    first, last, started, nxt, waited = {}, {}, {}, 0, 0.0
    oldest = 0  # the earliest arrival not started yet (arrivals are sorted: its wait is the longest)
    counts, slowest, busy = engine_counts(engine), 0.0, 0.0  # busy: the seconds spent in `engine.step`
    profile = cProfile.Profile() if rate in args.profile else None
    start = time.perf_counter()
    while nxt < len(arrivals) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while nxt < len(arrivals) and arrivals[nxt] <= now:
            engine.add_request(f"r{seed}-{nxt}", prompts[nxt], sp, specs[nxt])
            nxt += 1
        while oldest < nxt and oldest in started:
            oldest += 1
        waited = now - arrivals[oldest] if oldest < nxt else 0.0
        if waited > args.max_queue_s:  # the queue grows: this rate is not sustained, stop the run here
            engine.abort_request([f"r{seed}-{i}" for i in range(nxt) if i not in last])
            while engine.has_unfinished_requests():
                engine.step()  # reports the aborted requests
            break
        if not engine.has_unfinished_requests():
            time.sleep(min(0.01, max(0.0, arrivals[nxt] - now)) if nxt < len(arrivals) else 0)
            continue
        before = time.perf_counter()
        if profile is not None:
            profile.enable()
        outs = engine.step()
        if profile is not None:
            profile.disable()
        took = time.perf_counter() - before
        slowest, busy = max(slowest, took), busy + took
        for out in outs:
            i = int(out.request_id.rsplit("-", 1)[1])
            if out.error is not None:
                raise RuntimeError(f"request {i} failed: {out.error}")
            stamp = time.perf_counter() - start
            if out.outputs[0].token_ids:
                first.setdefault(i, stamp)
                started.setdefault(i, stamp)
            if out.finished:
                last[i] = stamp
    if profile is not None:
        print(f"    cProfile of the steps at {rate:g} req/s (own time, top 30):")
        pstats.Stats(profile).sort_stats("tottime").print_stats(30)
    ttft = [first[i] - arrivals[i] for i in first]
    tpot = [(last[i] - first[i]) / (args.new_tokens - 1) for i in last if args.new_tokens > 1]
    queue = [started[i] - arrivals[i] for i in started] + [waited]
    duration = max(last.values()) if last else 0.0
    counted = {k: v - counts[k] for k, v in engine_counts(engine).items()}
    return dict(rate=rate, requests=len(arrivals), aborted=waited > args.max_queue_s, duration_s=duration,
                throughput_req_s=len(last) / duration if duration else None,
                output_tok_s=len(last) * args.new_tokens / duration if duration else None,
                ttft_p50=percentile(ttft, 50), ttft_p90=percentile(ttft, 90), ttft_p99=percentile(ttft, 99),
                tpot_p50=percentile(tpot, 50), tpot_p90=percentile(tpot, 90), tpot_p99=percentile(tpot, 99),
                max_queue_s=max(queue) if queue else None, slowest_step_s=slowest,
                mean_step_s=busy / max(counted["steps"], 1),
                mean_wait_s=counted["device_wait_s"] / max(counted["steps"], 1),
                tokens_per_step=counted["batched_tokens"] / max(counted["steps"], 1), **counted)


def engine_counts(engine) -> dict[str, float]:
    """What bounds a run, counted by the engine: its steps, those replayed from a CUDA graph (the others ran
    eagerly: prefills, mixed steps), graphs captured and the seconds that took (a run that captures waits for it),
    and the Triton kernels compiled (`count_compiles`)."""
    graphs = engine.runner.graphs  # None without CUDA graphs
    return dict(steps=engine.stats["steps"], batched_tokens=engine.stats["batched_tokens"],
                device_wait_s=engine.stats["device_wait_s"],
                graph_replays=graphs.num_replays if graphs else 0,
                graphs_captured=graphs.num_captured if graphs else 0,
                capture_s=graphs.capture_seconds if graphs else 0.0, kernels_compiled=COMPILES[0])


COMPILES = [0, 0]  # Triton kernels compiled in this process since `count_compiles`: all, on the adapter loader
STEP_LOOP_COMPILES: list[str] = []  # the names of the kernels compiled elsewhere than on the adapter loader


def count_compiles() -> None:
    """Count each Triton kernel specialization compiled (a compile on a step stalls it for a second or so; on the
    CPU the interpreter compiles nothing): Triton's JIT cache hook, called before each compilation."""
    import threading

    import triton

    def hook(*args, **kwargs) -> bool:
        COMPILES[0] += 1
        if threading.current_thread().name == "scute-adapter-loader":  # its warm-up (`warm_kernels`)
            COMPILES[1] += 1
        else:
            STEP_LOOP_COMPILES.append(getattr(kwargs.get("fn"), "name", "?"))
        return False  # compile as usual

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is not None and hasattr(runtime, "jit_cache_hook"):
        runtime.jit_cache_hook = hook


def warm_graphs(engine, path: str) -> None:
    """The CUDA graphs of every step shape (decode batch sizes and mixed step sizes) for steps over the variant's
    adapters, captured before the measured runs, as a server serving them for a while has them: captured on
    demand, each would stall the running requests of the first run to meet its shape (tens of ms) and move the
    rates by the order the runs met the shapes in. `path`: the adapter the warm-up's last request ran on (in a
    slot)."""
    if engine.runner.graphs is None:
        return
    slot = engine.adapters.slot_of(engine.adapters.get_by_path(path))
    if slot is None:  # not left in a slot: the runs capture the graphs they need as they meet their shapes
        print(f"  warm-up: {path} is in no slot; graphs not captured ahead", flush=True)
        return
    engine.runner.capture_graphs([slot], progress=False)


def sustained(run: dict, unloaded_tpot: float, args) -> bool:
    return not run["aborted"] and run["tpot_p90"] <= args.slo * unloaded_tpot and \
        run["max_queue_s"] <= args.max_queue_s


def max_rate(engine, paths: list[str], args, unloaded_tpot: float) -> tuple[float, list[dict]]:
    """The highest sustained rate: doubled from --start-rate while sustained, then --bisect bisections."""
    runs: list[dict] = []

    def attempt(rate: float) -> bool:
        run = run_load(engine, paths, rate, args, seed=len(runs))
        run["sustained"] = sustained(run, unloaded_tpot, args)
        runs.append(run)
        tpot = "-" if run["tpot_p90"] is None else f"{1e3 * run['tpot_p90']:.1f} ms"
        print(f"    rate {rate:8.2f}/s: tpot p90 {tpot}, queue {run['max_queue_s']:.2f} s, {run['steps']} steps of "
              f"{1e3 * run['mean_step_s']:.2f} ms ({1e3 * run['mean_wait_s']:.2f} waiting for the GPU), "
              f"{run['tokens_per_step']:.1f} tokens "
              f"({run['steps'] - run['graph_replays']} eager, {run['graphs_captured']} graphs captured, "
              f"{run['kernels_compiled']} kernels compiled, slowest {1e3 * run['slowest_step_s']:.0f} ms), "
              f"{'ok' if run['sustained'] else 'over (stopped early)' if run['aborted'] else 'over'}", flush=True)
        return run["sustained"]

    good, bad, rate = 0.0, None, args.start_rate
    while bad is None and rate <= args.max_rate:
        good, bad, rate = (rate, None, 2 * rate) if attempt(rate) else (good, rate, rate)
    for _ in range(args.bisect if bad is not None else 0):
        rate = (good + bad) / 2 if good else bad / 2
        good, bad = (rate, bad) if attempt(rate) else (good, rate)
    return good, runs


def lora_like(native: list[str], model, rank: int, root: str, convert: int, dtype: torch.dtype,
              ) -> tuple[list[str], float | None]:
    """N LoRA folders of the conversions' shape, and the mean error of `convert` real conversions. The N files
    are the first conversion's tensors, each scaled by its own random factors drawn on the model's device (a
    thousand rank-64 files are tens of GB: drawn on a CPU they take minutes), in `dtype`."""
    from safetensors.torch import load_file, save_file
    from tqdm.auto import tqdm

    from scute.adapters import load_adapter
    from scute.compat.convert import convert_adapter, save_lora

    errors, first = [], None
    for i, path in enumerate(native[:max(convert, 1)]):
        conv = convert_adapter(load_adapter(path, model), model, rank)
        out = save_lora(conv, model, os.path.join(root, f"conv-r{rank}-{i}"), dtype=dtype)
        errors.append(conv.rel_error)
        first = first or out
    device = next(model.parameters()).device
    tensors = load_file(os.path.join(first, "adapter_model.safetensors"), device=str(device))
    tensors = {k: v.float() for k, v in tensors.items()}
    with open(os.path.join(first, "adapter_config.json")) as f:
        config = f.read()
    paths = []
    for i in tqdm(range(len(native)), desc=f"LoRA r{rank} files", unit="file", file=sys.stderr):
        folder = os.path.join(root, f"lora-r{rank}-{i}")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "adapter_config.json"), "w") as dst:
            dst.write(config)
        g = torch.Generator(device).manual_seed(i)
        save_file({k: (v * (1 + 0.01 * torch.randn(v.shape, generator=g, device=device))).to(dtype).cpu()
                   for k, v in tensors.items()}, os.path.join(folder, "adapter_model.safetensors"))
        paths.append(folder)
    return paths, (statistics.mean(errors) if convert else None)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="ia3,vera")
    p.add_argument("--adapters", default="64,256,1024")
    p.add_argument("--popularity", default="uniform", choices=["uniform", "zipf"])
    p.add_argument("--ranks", default="16,64", help="ranks of the LoRA conversions")
    p.add_argument("--convert", type=int, default=2, help="real conversions whose mean error is reported")
    p.add_argument("--max-adapters", type=int, default=256, help="device slots (more adapters swap via the CPU)")
    p.add_argument("--adapter-memory-gib", type=float, default=None,
                   help="the engine's adapter_memory_bytes in GiB (default: the engine's, "
                        "scute.engine.adapter_memory.default_budget)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--slo", type=float, default=2.0, help="p90 TPOT bound, times the unloaded TPOT")
    p.add_argument("--max-queue-s", type=float, default=2.0)
    p.add_argument("--start-rate", type=float, default=4.0)
    p.add_argument("--max-rate", type=float, default=4096.0)
    p.add_argument("--bisect", type=int, default=3)
    p.add_argument("--warm-arrivals", type=int, default=0,
                   help="requests arriving at --start-rate before each variant's runs, unmeasured (0: none)")
    p.add_argument("--warm-rate", type=float, default=None,
                   help="the warm arrivals' rate (default: --start-rate); a high one meets the larger mixed steps "
                        "(and their kernels' first compilation) before the measured runs")
    p.add_argument("--min-duration", type=float, default=0.0,
                   help="each run has enough requests to last this many seconds of arrivals")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU")
    p.add_argument("--profile", type=lambda v: [float(r) for r in v.split(",")], default=[],
                   help="rates (comma-separated) whose runs print a cProfile of the engine's steps: where the "
                        "host's time of a step goes at that load")
    p.add_argument("--root", default="/tmp/scute-bench-rate")
    p.add_argument("--out", default="request_rate.json")
    args = p.parse_args(argv)
    count_compiles()
    from transformers import LlamaConfig, LlamaForCausalLM

    from scute import Engine

    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    cfg = LlamaConfig(**(TINY if args.tiny else {**B.LLAMA3_8B, "num_hidden_layers": args.layers}))
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype).eval()
    counts = [int(n) for n in args.adapters.split(",")]
    result = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", layers=cfg.num_hidden_layers,
                  prompt=args.prompt, new_tokens=args.new_tokens, popularity=args.popularity, slo=args.slo,
                  max_adapters=args.max_adapters, warm_arrivals=args.warm_arrivals,
                  warm_rate=args.warm_rate, min_duration=args.min_duration,
                  command="PYTHONPATH=. python3 " + " ".join(sys.argv), rows=[])
    variants = {}  # every adapter is written (and converted) before the engine takes the model over
    for method in args.methods.split(","):
        native = B.make_adapters(model, method, max(counts), os.path.join(args.root, method))
        variants[(method, "native")] = (native, None)
        for rank in (int(r) for r in args.ranks.split(",") if r):
            variants[(method, f"lora-r{rank}")] = lora_like(native, model, rank, os.path.join(args.root, method),
                                                            args.convert, dtype)
    # One engine serves every variant in turn, as one server would: N adapters of a variant swap through its
    # device slots and its CPU tier; the previous variant's adapters are evicted as they go cold.
    memory = None if args.adapter_memory_gib is None else int(args.adapter_memory_gib * 2**30)
    engine = Engine(model, device=device, dtype=str(dtype).split(".")[1], max_num_seqs=256,
                    max_adapters=min(max(counts), args.max_adapters), max_cpu_adapters=max(counts),
                    max_adapter_rank=256, max_model_len=args.prompt + args.new_tokens + 16, adapter_memory_bytes=memory)
    result["adapter_memory_bytes"] = engine.adapters.memory.budget
    for (method, name), (paths, error) in variants.items():
        for n in counts:
            print(f"{method} {name} N={n}", flush=True)
            # every request of the warm-up waits as long as its adapter's load takes (loads run one at a time)
            warm = argparse.Namespace(**{**vars(args), "requests": min(n, args.max_adapters), "popularity": "cycle",
                                         "max_queue_s": float("inf")})
            start = time.perf_counter()
            run_load(engine, paths[:n], float("inf"), warm, seed=20_000)  # loads the adapters the slots hold
            loaded = time.perf_counter()
            warm_graphs(engine, paths[warm.requests - 1])
            graphed = time.perf_counter()
            if args.warm_arrivals:  # mixed steps (prompts beside decodes) as a server has run them, unmeasured
                arrivals = argparse.Namespace(**{**vars(warm), "requests": args.warm_arrivals,
                                                 "popularity": args.popularity, "min_duration": 0.0})
                run_load(engine, paths[:n], args.warm_rate or args.start_rate, arrivals, seed=30_000)
            print(f"  warm-up: {warm.requests} requests over as many adapters {loaded - start:.1f} s, graphs "
                  f"{graphed - loaded:.1f} s, {args.warm_arrivals} arrivals {time.perf_counter() - graphed:.1f} s",
                  flush=True)
            solo = run_load(engine, paths[:n], float("inf"), argparse.Namespace(**{**vars(args), "requests": 1}),
                            seed=10_000)
            rate, runs = max_rate(engine, paths[:n], args, solo["tpot_p50"])
            result["rows"].append(dict(method=method, variant=name, adapters=n, conversion_error=error,
                                       max_rate=rate, unloaded_tpot=solo["tpot_p50"], runs=runs))
            print(f"  max sustained rate {rate:.2f}/s", flush=True)
            with open(args.out, "w") as f:  # after every row: a run cut short keeps what it measured
                json.dump(result, f, indent=1)
    for row in result["rows"]:
        print(f"{row['method']:<5} {row['variant']:<9} N={row['adapters']:<5} {row['max_rate']:8.2f} req/s "
              f"(error {row['conversion_error'] if row['conversion_error'] is not None else '-'})")
    return result


if __name__ == "__main__":
    main()
