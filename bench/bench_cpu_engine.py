"""The demo's workload end to end on the CPU: 12 requests (2 prompts × the base model and the five demo adapters:
LoRA and DoRA r=8, IA3, VeRA r=256, OFT), greedy, 40 tokens each, one `Engine.generate` per round, one thread.
The served CPU op (`scute_linear_cpu`) and the reference loop (`scute_linear_ref`) alternate round by round in
one process (the dev VM is shared: ±15% run to run); prints the median tok/s of each and whether the tokens agree.

Needs the demo's cache (``make demo`` once). Run: ``PYTHONPATH=. .venv/bin/python bench/bench_cpu_engine.py``
"""

from __future__ import annotations

import os
import statistics
import time

import torch

import scute.model.linear as linear_mod
from scute import Engine, SamplingParams
from scute.ops.cpu import scute_linear_cpu
from scute.ops.reference import scute_linear_ref

CACHE = os.path.expanduser("~/.cache/scute/demo")
METHODS = ("lora", "dora", "ia3", "vera", "oft")


def reference_path(x, weight, bias, slots, token_slots, stack, rows=None):
    return scute_linear_ref(x, weight, bias, slots, token_slots, rows)


def main(rounds: int = 3) -> None:
    torch.set_num_threads(1)
    engine = Engine(f"{CACHE}/smollm2-135m-instruct", device="cpu", dtype="float32", max_model_len=512)
    adapters = [None, *(f"{CACHE}/adapters/{m}" for m in METHODS)] * 2
    prompts = ["How do I cook rice well?"] * 6 + ["What is a good way to learn?"] * 6
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.generate(prompts, params, adapters, use_tqdm=False)  # warm-up
    rates: dict[str, list[float]] = {"scute": [], "reference": []}
    tokens = {}
    for _ in range(rounds):
        for name, op in (("scute", scute_linear_cpu), ("reference", reference_path)):
            linear_mod.scute_linear_cpu = op
            start = time.perf_counter()
            outputs = engine.generate(prompts, params, adapters, use_tqdm=False)
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start))
            tokens[name] = [o.outputs[0].token_ids for o in outputs]
    linear_mod.scute_linear_cpu = scute_linear_cpu
    for name, r in rates.items():
        print(f"{name:<10} median {statistics.median(r):5.1f} tok/s  (rounds: {', '.join(f'{x:.1f}' for x in r)})")
    print(f"same tokens: {tokens['scute'] == tokens['reference']}")


if __name__ == "__main__":
    main()
