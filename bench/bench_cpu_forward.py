"""CPU serving path: one packed forward of a SmolLM2-135M-shaped Llama (random weights, 30 layers) with five
rank-8 LoRAs on every projection, 12 tokens (2 base + 2 per adapter), one thread. Three variants timed side by
side in one process, interleaved round by round (the dev VM is shared: run-to-run noise is ±15%):

    base        the same tokens with no adapter in the batch (all slots −1)
    reference   `ScuteLinear` on the reference op's per-adapter loop (`scute_linear_ref`)
    scute       `ScuteLinear` as served on the CPU (`scute_linear_cpu`: low-rank parts batched)

    PYTHONPATH=. .venv/bin/python bench/bench_cpu_forward.py
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import scute.model.linear as linear_mod
from scute.model.context import ForwardContext, forward_context
from scute.model.hf import swap_linears
from scute.ops.cpu import scute_linear_cpu
from scute.ops.reference import scute_linear_ref
from scute.ops.slots import Slots


def reference_path(x, weight, bias, slots, token_slots, stack, rows=None):
    return scute_linear_ref(x, weight, bias, slots, token_slots, rows)


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3)
    model = LlamaForCausalLM(cfg).eval()
    for name, lin in swap_linears(model, max_adapters=8).items():
        if name == "lm_head":
            continue
        for a in range(5):
            lin.set_slot(a, Slots(lin.in_features, lin.out_features, A=torch.randn(8, lin.in_features) * 0.01,
                                  B=torch.randn(lin.out_features, 8) * 0.01))
    ids = torch.randint(0, 1000, (1, 12))
    variants = {"base": (torch.full((12,), -1), scute_linear_cpu),
                "reference": (torch.tensor([-1, 0, 1, 2, 3, 4] * 2), reference_path),
                "scute": (torch.tensor([-1, 0, 1, 2, 3, 4] * 2), scute_linear_cpu)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    logits = {}
    for i in range(16):
        for name, (slots, op) in variants.items():
            linear_mod.scute_linear_cpu = op
            start = time.perf_counter()
            with torch.no_grad(), forward_context(ForwardContext(token_adapter_slots=slots)):
                logits[name] = model(ids).logits
            if i:  # the first round warms up
                times[name].append(time.perf_counter() - start)
    linear_mod.scute_linear_cpu = scute_linear_cpu
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    for name, ms in med.items():
        print(f"{name:<10} median {ms:6.1f} ms per forward ({len(times[name])} runs)")
    adapters = {k: med[k] - med["base"] for k in ("reference", "scute")}
    print(f"adapter time: reference {adapters['reference']:.1f} ms, scute {adapters['scute']:.1f} ms "
          f"({adapters['reference'] / adapters['scute']:.2f}x); max |logit diff| scute vs reference "
          f"{(logits['scute'] - logits['reference']).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
