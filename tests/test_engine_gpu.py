"""The engine on CUDA: the same greedy tokens as transformers + PEFT in float32, and a bfloat16 run.

Runnable as a script on a GPU machine: ``python tests/test_engine_gpu.py`` also prints a small throughput
figure (random SmolLM2-135M-shaped model, bf16, five adapters of five methods in one batch).
"""

from __future__ import annotations

import time

import pytest
import torch

from scute import Engine, SamplingParams
from tests.test_engine import GREEDY, METHODS, NEW_TOKENS, Oracle, _mixed_batch, check

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    return Oracle(tmp_path_factory.mktemp("adapters"))


def specs(oracle, adapters):
    return [None if a is None else oracle.paths[a] for a in adapters]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cuda_fp32_matches_peft(oracle, backend):
    prompts, adapters = _mixed_batch()
    engine = oracle.engine(device="cuda", attention_backend=backend)
    outputs = engine.generate(prompts, GREEDY, specs(oracle, adapters), use_tqdm=False)
    check(oracle, outputs, prompts, adapters)


def test_cuda_fp32_chunked_prefill_preemption_prefix_cache(oracle):
    prompts, adapters = _mixed_batch()
    bytes_per_block = 2 * 2 * 16 * 2 * 16 * 4  # K+V, 2 layers, 16 tokens, 2 kv heads, head_dim 16, fp32
    engine = oracle.engine(device="cuda", max_num_batched_tokens=32, max_num_seqs=8,
                           kv_cache_memory_bytes=6 * bytes_per_block, max_model_len=64)
    for _ in range(2):  # the second pass hits the prefix cache
        outputs = engine.generate(prompts, GREEDY, specs(oracle, adapters), use_tqdm=False)
        check(oracle, outputs, prompts, adapters)
    assert engine.stats["preemptions"] > 0


def test_cuda_bf16_run_completes(oracle):
    prompts, adapters = _mixed_batch()
    engine = oracle.engine(device="cuda", dtype="bfloat16")
    outputs = engine.generate(prompts, GREEDY, specs(oracle, adapters), use_tqdm=False)
    for out in outputs:
        assert out.error is None and len(out.outputs[0].token_ids) == NEW_TOKENS
    first = [o.outputs[0].token_ids[0] == oracle.reference(a, o.prompt_token_ids)[0] for o, a in zip(outputs, adapters)]
    print(f"bf16: first token equal to the fp32 PEFT reference for {sum(first)}/{len(first)} requests")


def throughput(num_requests: int = 64, max_tokens: int = 128, tmp: str = "/tmp/scute-gpu-bench") -> dict:
    """Random SmolLM2-135M-shaped Llama in bf16, five adapters of five methods + base, one batch."""
    from peft import get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers import randomize_adapter
    from tests.test_engine import CONFIGS

    cfg = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
               "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 2048, "tie_word_embeddings": True}
    paths = {}
    for i, method in enumerate(METHODS):
        torch.manual_seed(0)
        peft_model = get_peft_model(LlamaForCausalLM(LlamaConfig(**cfg)), CONFIGS[method]())
        randomize_adapter(peft_model, seed=i)
        paths[method] = f"{tmp}/{method}"
        peft_model.save_pretrained(paths[method])
    torch.manual_seed(0)
    engine = Engine(LlamaForCausalLM(LlamaConfig(**cfg)), device="cuda", dtype="bfloat16", max_model_len=1024)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 49152, (int(n),), generator=g).tolist() for n in torch.randint(32, 256, (num_requests,), generator=g)]
    adapters = [[None, *paths.values()][i % 6] for i in range(num_requests)]
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.generate(prompts[:6], sp, adapters[:6], use_tqdm=False)  # warm-up: Triton compiles
    torch.cuda.synchronize()
    start, steps = time.perf_counter(), engine.stats["steps"]
    outputs = engine.generate(prompts, sp, adapters, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"requests": num_requests, "tokens": tokens, "seconds": round(elapsed, 2), "tok_per_s": round(tokens / elapsed, 1),
                "steps": engine.stats["steps"] - steps, "device": torch.cuda.get_device_name()}


if __name__ == "__main__":
    print(throughput())
