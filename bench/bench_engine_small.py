"""Engine throughput on a small model: a random SmolLM2-135M-shaped Llama in bf16 on CUDA, serving the base model
and five adapters of the five core methods (LoRA, DoRA, IA3, VeRA, OFT; every adapter tensor randomized) in one
`Engine.generate` call: 64 requests of 32-255 prompt tokens, cycling base and the five adapters, greedy,
128 new tokens each (``ignore_eos``). One warm-up call (Triton compiles) is not timed.

Prints one dict: requests, generated tokens, seconds, tokens per second, engine steps, device.

Run: ``PYTHONPATH=. python3 bench/bench_engine_small.py`` (needs CUDA and peft).
"""

from __future__ import annotations

import time

import torch

from scute import Engine, SamplingParams

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODEL = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
         "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 2048,
         "tie_word_embeddings": True}


def method_configs() -> dict:
    """One PEFT config of each core method (the small ranks and targets of the engine tests)."""
    from peft import IA3Config, LoraConfig, OFTConfig, VeraConfig

    return {
        "lora": LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR),
        "dora": LoraConfig(r=6, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj", "up_proj"]),
        "ia3": IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
        "vera": VeraConfig(r=8, target_modules=["q_proj", "v_proj", "up_proj"]),
        "oft": OFTConfig(r=0, oft_block_size=8, target_modules=ALL_LINEAR),
    }


def randomize(peft_model, seed: int) -> None:
    """Every trainable adapter tensor random (scales around their identity init), so no adapter is a no-op."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if not p.requires_grad:
                continue
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
            if "lora_magnitude_vector" in name or "ia3_l" in name:
                p.mul_(1 + 0.3 * noise)
            elif "oft_R" in name:
                p.copy_(0.15 * noise)
            elif "vera_lambda" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(0.2 * noise)


def throughput(num_requests: int = 64, max_tokens: int = 128, tmp: str = "/tmp/scute-gpu-bench") -> dict:
    """Random SmolLM2-135M-shaped Llama in bf16, five adapters of five methods + base, one batch."""
    from peft import get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    paths = {}
    for i, (method, config) in enumerate(method_configs().items()):
        torch.manual_seed(0)
        peft_model = get_peft_model(LlamaForCausalLM(LlamaConfig(**MODEL)), config)
        randomize(peft_model, seed=i)
        paths[method] = f"{tmp}/{method}"
        peft_model.save_pretrained(paths[method])
    torch.manual_seed(0)
    engine = Engine(LlamaForCausalLM(LlamaConfig(**MODEL)), device="cuda", dtype="bfloat16", max_model_len=1024)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(32, 256, (num_requests,), generator=g)
    prompts = [torch.randint(0, MODEL["vocab_size"], (int(n),), generator=g).tolist() for n in lengths]
    adapters = [[None, *paths.values()][i % 6] for i in range(num_requests)]
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.generate(prompts[:6], sp, adapters[:6], use_tqdm=False)  # warm-up: Triton compiles
    torch.cuda.synchronize()
    start, steps = time.perf_counter(), engine.stats["steps"]
    outputs = engine.generate(prompts, sp, adapters, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"requests": num_requests, "tokens": tokens, "seconds": round(elapsed, 2),
            "tok_per_s": round(tokens / elapsed, 1), "steps": engine.stats["steps"] - steps,
            "device": torch.cuda.get_device_name()}


if __name__ == "__main__":
    print(throughput())
