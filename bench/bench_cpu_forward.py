"""CPU serving path: one packed forward of a SmolLM2-135M-shaped Llama (random weights, 30 layers) with five
rank-8 LoRAs on every projection, 12 tokens (2 base + 2 per adapter), one thread. Prints the median time.

    PYTHONPATH=. .venv/bin/python bench/bench_cpu_forward.py
"""

from __future__ import annotations

import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from scute.adapters import Slots
from scute.engine.context import ForwardContext, forward_context
from scute.model.hf import swap_linears


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
    slots = torch.tensor([-1, 0, 1, 2, 3, 4] * 2)
    times = []
    for i in range(16):
        start = time.perf_counter()
        with torch.no_grad(), forward_context(ForwardContext(token_adapter_slots=slots)):
            model(ids)
        if i:  # the first call warms up
            times.append(time.perf_counter() - start)
    print(f"median {sorted(times)[len(times) // 2] * 1e3:.1f} ms per forward ({len(times)} runs)")


if __name__ == "__main__":
    main()
