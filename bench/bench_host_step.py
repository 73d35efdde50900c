"""Host time of an engine step around its forward: the scheduler, the block manager, the step's inputs, the
sampler's batch, appending the tokens and building the outputs, per running request.

A 2-layer toy Llama on the CPU whose forward is stubbed out (zero logits, no model call), so what is timed is
the Python a decode step pays per request, the part of a step that grows with the batch and bounds it where the
GPU's work is short (a few layers, or a small model). ``--requests`` greedy requests decode (``ignore_eos``) for
``--steps`` timed steps after a few untimed ones, for each `SamplingParams.output_kind` (what `Engine.step`
reports of a running request each step); the best of ``--repeats`` runs, in µs a step and a request. The
steps run eagerly (`eager_inputs` builds their inputs); what a graph step's inputs cost instead is timed apart on
the next step's schedule: built (`graph_step`), then written into the runner's host mirrors with their padding
(`write_padded`) and read into its buffers, each timed alone.

Run: ``PYTHONPATH=. python3 bench/bench_host_step.py --requests 32,128``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_engine as B  # noqa: E402
from bench_request_rate import TINY  # noqa: E402

KINDS = ("cumulative", "delta", "final_only")
KV_BYTES_PER_TOKEN = 2 * TINY["num_hidden_layers"] * TINY["num_key_value_heads"] * \
    TINY["hidden_size"] // TINY["num_attention_heads"] * 4  # K and V, float32


def step_time(engine, requests: int, kind: str, steps: int, prompt: int = 16,
              presence_penalty: float = 0.0) -> tuple[float, float, float]:
    """Seconds of one decode step of `requests` requests of `prompt` tokens (their prompts computed first,
    untimed), of building the inputs of their next step as a CUDA graph's (`graph_step`), and of writing them into
    the runner's host mirrors and reading them into its buffers (`ModelRunner._write_inputs`: every step after the
    first two, each mirror set's, finds the block tables it holds unchanged, as a decode step's mostly are)."""
    from scute import SamplingParams
    from scute.engine.cuda_graph import GraphShape
    from scute.engine.step_inputs import graph_step

    sp = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True, output_kind=kind,
                        presence_penalty=presence_penalty)
    for i in range(requests):
        engine.add_request(f"{kind}-{requests}-{i}", [1 + i % 100] * prompt, sp)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or \
            engine.scheduler.waiting:  # the prompts (in chunks of the token budget)
        engine.step()
    for _ in range(3):  # decode steps
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    took = (time.perf_counter() - start) / steps
    sched, runner = engine.scheduler.schedule(), engine.runner  # scheduled, never run: the requests end below
    shape = GraphShape(len(sched.scheduled))
    start = time.perf_counter()
    for _ in range(steps):
        step = graph_step(sched, shape, runner.block_size)
    build = (time.perf_counter() - start) / steps
    start = time.perf_counter()
    for _ in range(steps):
        runner._write_inputs(step)
    write = (time.perf_counter() - start) / steps
    engine.abort_request([f"{kind}-{requests}-{i}" for i in range(requests)])
    while engine.has_unfinished_requests():
        engine.step()
    return took, build, write


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", default="32,128")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens of each request")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="every request's (its prompt and output "
                   "tokens are then counted on the device each step)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from scute import Engine

    max_model_len = args.prompt + args.steps + 16
    model = B.random_llama({**TINY, "max_position_embeddings": max(TINY["max_position_embeddings"], max_model_len)},
                           device="cpu", dtype=torch.float32)
    counts = [int(n) for n in args.requests.split(",")]
    engine = Engine(model, device="cpu", dtype="float32", max_num_seqs=max(counts),
                    max_model_len=max_model_len, max_num_batched_tokens=max(counts) * max(16, args.prompt),
                    kv_cache_memory_bytes=2 * max(counts) * max_model_len * KV_BYTES_PER_TOKEN)  # all run at once
    vocab = engine.vocab_size
    engine.runner.forward = lambda inputs: torch.zeros(len(inputs.logits_indices), vocab)  # no model call
    rows = []
    for n in counts:
        for kind in KINDS:
            times = [step_time(engine, n, kind, args.steps, args.prompt, args.presence_penalty)
                     for _ in range(args.repeats)]
            best, build, write = (min(t[i] for t in times) for i in range(3))
            rows.append(dict(requests=n, output_kind=kind, step_us=1e6 * best, request_us=1e6 * best / n,
                             graph_inputs_us=1e6 * (build + write), graph_build_us=1e6 * build,
                             graph_write_us=1e6 * write))
            print(f"{n:5d} requests, {kind:<10}: {1e6 * best:8.1f} µs a step, {1e6 * best / n:5.2f} µs a request; "
                  f"a graph step's inputs {1e6 * (build + write):6.1f} µs (built {1e6 * build:5.1f}, written "
                  f"{1e6 * write:5.1f})", flush=True)
    result = dict(command="PYTHONPATH=. python3 " + " ".join(sys.argv), rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
