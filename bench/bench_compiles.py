"""Triton compiles while an engine serves: bursts of requests on adapters of one method, each burst's steps timed
and the kernels Triton compiled during it counted (`bench_request_rate.count_compiles`: its JIT cache hook), on
the step loop and on the adapter loader's thread.

An engine with CUDA graphs (decode batches, mixed steps of up to 1024 tokens, captured at start on the base
model) serves ``--background`` base-model requests that decode all along (topped up as they end: the running
requests a stall of the step loop stalls), and gets, in order: two warm bursts of 16 short prompts on
``--method`` adapters (the method's first steps: the variants of its kernels compile, on the loader as it stages
the first adapter, `scute.model.warmup`, or else on the step loop), then bursts of ``n x length`` prompt tokens,
4 new tokens each. A burst of more than 1024 tokens runs its prefill eagerly, at its own token count: with a count
that is not a multiple of 16 after ones that are, a kernel specialized on its token count compiles again (a
second or two, every running request stalled) where an unspecialized one (`scute.ops.kernels`) compiles nothing.
Prints per burst: tokens, steps, the median and slowest step, the compiles and those of them on the loader;
writes JSON.

Run on a GPU (4 layers of the Llama-3-8B shape, IA3): ``PYTHONPATH=. python3 bench/bench_compiles.py``; ``--tiny``
runs a 2-layer model on the CPU (the interpreter compiles nothing: the test checks it runs).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_engine as B  # noqa: E402
from bench_request_rate import COMPILES, STEP_LOOP_COMPILES, TINY, count_compiles  # noqa: E402

BURSTS = ((16, 16), (16, 16), (4, 128), (8, 128), (9, 128), (9, 128), (9, 129), (9, 131), (10, 137), (12, 127),
          (16, 128), (20, 101))  # (prompts, tokens each): the first two warm the method's kernels


def burst(engine, paths: list[str], n: int, length: int, tag: str, g: torch.Generator, background: int) -> dict:
    """`n` prompts of `length` random tokens on the adapters in turn, stepped to their end while `background`
    base-model requests decode."""
    from scute import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    waiting = set()
    for i in range(n):
        prompt = torch.randint(0, engine.vocab_size, (length,), generator=g).tolist()
        engine.add_request(f"{tag}-{i}", prompt, sp, paths[i % len(paths)])
        waiting.add(f"{tag}-{i}")
    before, on_loader, named, steps = COMPILES[0], COMPILES[1], len(STEP_LOOP_COMPILES), []
    while waiting:
        top_up(engine, background)
        t = time.perf_counter()
        outputs = engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        steps.append(time.perf_counter() - t)
        waiting -= {o.request_id for o in outputs if o.finished}
    return dict(prompts=n, length=length, tokens=n * length, steps=len(steps),
                median_ms=1e3 * statistics.median(steps), slowest_ms=1e3 * max(steps),
                compiles=COMPILES[0] - before, compiles_on_loader=COMPILES[1] - on_loader,
                step_loop_kernels=STEP_LOOP_COMPILES[named:])


_BACKGROUND = itertools.count()


def top_up(engine, background: int) -> None:
    """Keep `background` base-model requests running (64 new tokens each, 8-token prompts)."""
    from scute import SamplingParams

    running = [r for r in engine.requests if r.startswith("bg-")]
    for i in itertools.islice(_BACKGROUND, background - len(running)):
        engine.add_request(f"bg-{i}", [1 + i % 100] * 8, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="ia3", help="the adapters' method (of bench_engine.MIX)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--background", type=int, default=8, help="base-model requests decoding all along")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU")
    p.add_argument("--root", default="/tmp/scute-bench-compiles")
    p.add_argument("--out", default="compiles.json")
    args = p.parse_args(argv)
    count_compiles()
    from scute import Engine

    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    model = B.random_llama(TINY if args.tiny else {**B.LLAMA3_8B, "num_hidden_layers": args.layers}, device, dtype)
    paths = B.make_adapters(model, args.method, 16, os.path.join(args.root, args.method))
    engine = Engine(model, device=device, dtype=str(dtype).split(".")[1], max_adapters=32, max_num_seqs=256,
                    max_model_len=512)
    g, rows = torch.Generator().manual_seed(0), []
    print("burst     tokens  steps  median ms  slowest ms  compiles  on the loader")
    for k, (n, length) in enumerate(BURSTS):
        row = burst(engine, paths, n, length, f"b{k}", g, args.background)
        rows.append(row)
        print(f"{n:3d} x {length:3d} {row['tokens']:7d} {row['steps']:6d} {row['median_ms']:10.1f} "
              f"{row['slowest_ms']:11.1f} {row['compiles']:9d} {row['compiles_on_loader']:14d}  "
              f"{' '.join(row['step_loop_kernels'])}", flush=True)
    result = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", method=args.method,
                  layers=args.layers, background=args.background, command=" ".join(sys.argv), rows=rows)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
