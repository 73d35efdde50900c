"""Tensor parallelism over two CPU processes (gloo): the same greedy tokens as one process, float32.

A tiny Llama saved with `save_pretrained` (every rank loads it from the folder); the five core adapters (every
tensor randomized) and the base model mixed in one batch, under chunked prefill, a prefix cache and fewer device
slots than adapters (slots evicted and reused: placements sent to the worker mid-run). Also: an adapter the
shards cannot hold fails alone, sizes that do not divide the model and built models are refused before any
process starts, a dead worker is an error on rank 0, and `close` ends the worker.
"""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist
from peft import LoraConfig, OFTConfig

from scute import Engine, SamplingParams
from scute.adapters import AdapterError
from tests.helpers import GREEDY, METHODS, Oracle, make_adapter, mixed_requests, tiny_model

OPTIONS = dict(device="cpu", dtype="float32", max_model_len=128, max_num_batched_tokens=48, max_num_seqs=8,
               block_size=4, max_adapters=3)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The model folder, the adapters, one engine with tensor_parallel_size=2, and the tokens of one process."""
    root = tmp_path_factory.mktemp("tp")
    folder = str(root / "model")
    tiny_model().save_pretrained(folder)
    oracle = Oracle(root)
    prompts, adapters = mixed_requests()
    specs = [None if a is None else oracle.paths[a] for a in adapters]
    one = Engine(folder, **OPTIONS)
    want = tokens(one.generate(prompts, GREEDY, specs, use_tqdm=False))
    engine = Engine(folder, tensor_parallel_size=2, **OPTIONS)
    yield engine, oracle, folder, want, one
    engine.close()


def tokens(outputs) -> list[list[int]]:
    """The greedy tokens of outputs that each finished by length, without error."""
    for out in outputs:
        assert out.error is None, out.error
        assert out.outputs[0].finish_reason == "length"
    return [o.outputs[0].token_ids for o in outputs]


def test_sharded_model_and_kv_cache(served):
    engine, *_ = served
    q, o = (engine.adapters.linears[f"model.layers.0.self_attn.{n}"] for n in ("q_proj", "o_proj"))
    assert (q.weight.shape, o.weight.shape) == ((32, 64), (64, 32))  # 2 of 4 query heads; o's inputs halved
    assert q.group is not None and q.group.merged()[0].shape == (32 + 16 + 16, 64)  # q/k/v merged per rank
    assert o.bias is None and o.shard.kind == "row" and q.shard.kind == "column"
    assert engine.runner.kv_caches[0][0].shape[2] == 1  # 1 of 2 KV heads


def test_five_methods_mixed_equal_one_process(served):
    engine, oracle, _, want, _ = served
    prompts, adapters = mixed_requests()
    specs = [None if a is None else oracle.paths[a] for a in adapters]
    for _ in range(2):  # the second run reads the prefix cache
        outputs = engine.generate(prompts, GREEDY, specs, use_tqdm=False)
        assert tokens(outputs) == want
    assert any(o.num_cached_tokens for o in outputs)
    by_prompt = {}
    for prompt, got in zip(prompts, want):
        by_prompt.setdefault(tuple(prompt), set()).add(tuple(got))
    assert all(len(v) > 1 for v in by_prompt.values())  # the adapters change the tokens: the check can fail


def test_named_adapters_and_prompt_logprobs(served):
    engine, oracle, _, want, _ = served
    prompts, adapters = mixed_requests()
    for method in METHODS:
        engine.load_adapter(f"tp-{method}", oracle.paths[method])
    sp = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, prompt_logprobs=2)
    outputs = engine.generate(prompts[:6], sp, [None if a is None else f"tp-{a}" for a in adapters[:6]],
                              use_tqdm=False)
    assert tokens(outputs) == want[:6]
    assert all(len(o.prompt_logprobs) == len(p) for o, p in zip(outputs, prompts))


def test_row_parallel_dora_and_an_adapter_the_shards_cannot_hold(served, tmp_path):
    """DoRA on o/down (its norm needs all of W0, which rank 0 keeps for conversion) equals one process; an
    adapter whose OFT blocks straddle the ranks' inputs fails alone."""
    engine, _, _, _, one = served
    rows = str(tmp_path / "dora-rows")
    make_adapter(rows, LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["o_proj", "down_proj"]), seed=3)
    bad = str(tmp_path / "oft32")  # blocks of 32 on down_proj: 96 inputs give 48 per rank, and 32 does not divide 48
    make_adapter(bad, OFTConfig(r=0, oft_block_size=32, target_modules=["down_proj"]))
    prompts = mixed_requests()[0][:2]
    [want] = tokens(one.generate(prompts[1:], GREEDY, [rows], use_tqdm=False))
    outputs = engine.generate(prompts, GREEDY, [bad, rows], use_tqdm=False)
    assert outputs[0].outputs[0].finish_reason == "error"
    assert "tensor_parallel_size=2" in outputs[0].error and "t_blocks" in outputs[0].error
    assert tokens(outputs[1:]) == [want]
    with pytest.raises(AdapterError, match="cannot be row-sharded"):
        engine.load_adapter("bad", bad)


def test_refused_before_any_process_starts(served, tmp_path):
    _, _, folder, _, _ = served
    with pytest.raises(ValueError, match="needs the model as a path"):
        Engine(tiny_model(), tensor_parallel_size=2, **OPTIONS)
    with pytest.raises(ValueError, match="does not divide the model's num_attention_heads=4"):
        Engine(folder, tensor_parallel_size=3, **OPTIONS)
    wide = str(tmp_path / "wide")  # 4 heads and 2 KV heads; 4 ranks would need 4 KV heads
    tiny_model().save_pretrained(wide)
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        Engine(wide, tensor_parallel_size=4, **OPTIONS)


def test_flags_pass_the_size_through():
    from scute.compat.vllm_args import engine_options
    from scute.serve.server import build_parser, engine_options as serve_options

    assert serve_options(build_parser().parse_args(["m", "-tp", "2"]))["tensor_parallel_size"] == 2
    assert serve_options(build_parser().parse_args(["m", "--tensor-parallel-size", "2"]))["tensor_parallel_size"] == 2
    assert engine_options({"tensor_parallel_size": 2}, "EngineArgs") == {"tensor_parallel_size": 2}


def test_close_then_a_dead_worker_is_an_error_on_rank_0(served):
    """Last: closes the module's engine (one engine with tensor_parallel_size > 1 per process at a time)."""
    engine, _, folder, _, _ = served
    worker = engine.tp.workers[0]
    engine.close()
    assert worker.exitcode == 0 and not dist.is_initialized()
    engine = Engine(folder, tensor_parallel_size=2, **OPTIONS)
    worker = engine.tp.workers[0]
    os.kill(worker.pid, 9)
    worker.join(10)
    with pytest.raises(RuntimeError, match="worker rank 1 .* exited with code -9"):
        engine.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    engine.close()
    assert not dist.is_initialized()
