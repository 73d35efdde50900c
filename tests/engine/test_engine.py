"""The engine against transformers + PEFT `generate`: greedy tokens must be identical, float32, CPU.

Each reference runs PEFT with one adapter alone (PEFT ignores `adapter_names` for non-LoRA methods). Every
adapter tensor is randomized before saving (PEFT's zero/identity inits would hide bugs).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from peft import LoraConfig, PeftModel

from scute import AdapterRequest, Engine, SamplingParams
from scute.engine import model_runner
from tests.helpers import FIVE_METHODS as CONFIGS
from tests.helpers import (
    ALL_LINEAR,
    GREEDY,
    METHODS,
    NEW_TOKENS,
    PROMPTS,
    Oracle,
    check,
    make_adapter,
    mixed_requests,
    random_prompts,
)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    return Oracle(tmp_path_factory.mktemp("adapters"))


@pytest.mark.parametrize("method", METHODS)
def test_each_method_matches_peft(oracle, method):
    engine = oracle.engine()
    outputs = engine.generate(PROMPTS, GREEDY, [oracle.paths[method]] * len(PROMPTS), use_tqdm=False)
    check(oracle, outputs, PROMPTS, [method] * len(PROMPTS))


def test_all_methods_and_base_in_one_batch(oracle, monkeypatch):
    prompts, adapters = mixed_requests()
    engine = oracle.engine()
    specs = [None if a is None else oracle.paths[a] for a in adapters]
    steps = []  # each step's host-side slot set (what the adapter kernels specialize on) and its token slots
    context = model_runner.forward_context

    def spy(ctx):
        steps.append((ctx.active_adapter_slots, frozenset(ctx.token_adapter_slots.tolist())))
        return context(ctx)

    monkeypatch.setattr(model_runner, "forward_context", spy)
    outputs = engine.generate(prompts, GREEDY, specs, use_tqdm=False)
    check(oracle, outputs, prompts, adapters)
    assert engine.stats["steps"] < 3 * NEW_TOKENS  # really batched
    assert steps and all(active == tokens for active, tokens in steps)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prefix_caching_on_and_off(oracle, prefix_caching):
    shared = random_prompts([24], seed=5)[0]
    prompts = [shared + tail for tail in random_prompts([2, 5, 9], seed=6)]
    adapters = ["lora", "lora", None]
    engine = oracle.engine(enable_prefix_caching=prefix_caching, block_size=4)
    specs = [None if a is None else oracle.paths[a] for a in adapters]
    first = engine.generate(prompts, GREEDY, specs, use_tqdm=False)
    second = engine.generate(prompts, GREEDY, specs, use_tqdm=False)
    check(oracle, first, prompts, adapters)
    check(oracle, second, prompts, adapters)
    cached = [o.num_cached_tokens for o in second]
    assert all(c >= 24 for c in cached) if prefix_caching else cached == [0, 0, 0]


def test_prefix_cache_is_keyed_by_adapter_content(oracle, tmp_path):
    """The same prompt under the same adapter *name*, after the folder changed: never the stale KV."""
    prompt = random_prompts([30], seed=7)[0]
    engine = oracle.engine(block_size=4)
    path = tmp_path / "swap"
    for method in ("lora", "dora", "lora"):
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(oracle.paths[method], path)
        engine.load_adapter("swap", str(path))
        [out] = engine.generate([prompt], GREEDY, ["swap"], use_tqdm=False)
        check(oracle, [out], [prompt], [method])
    assert out.num_cached_tokens >= 28  # the third run found the first run's blocks again


def test_preemption_under_a_tiny_kv_budget(oracle):
    prompts, adapters = mixed_requests()
    bytes_per_block = 2 * 2 * 4 * 2 * 16 * 4  # K+V, 2 layers, 4 tokens, 2 kv heads, head_dim 16, fp32
    engine = oracle.engine(block_size=4, kv_cache_memory_bytes=20 * bytes_per_block, max_model_len=64)
    specs = [None if a is None else oracle.paths[a] for a in adapters]
    outputs = engine.generate(prompts, GREEDY, specs, use_tqdm=False)
    check(oracle, outputs, prompts, adapters)
    assert engine.stats["preemptions"] > 0


def test_chunked_prefill_forced(oracle):
    prompts, adapters = mixed_requests()
    engine = oracle.engine(max_num_batched_tokens=7, max_num_seqs=4)
    specs = [None if a is None else oracle.paths[a] for a in adapters]
    outputs = engine.generate(prompts, GREEDY, specs, use_tqdm=False)
    check(oracle, outputs, prompts, adapters)


def test_few_adapter_slots(oracle):
    """max_adapters=2 with five adapters in the batch: slots are evicted and reused, results unchanged."""
    prompts, adapters = mixed_requests()
    engine = oracle.engine(max_adapters=2)
    names = {}
    for method in METHODS:
        names[method] = f"ad-{method}"
        engine.load_adapter(names[method], oracle.paths[method])
    specs = [None if a is None else AdapterRequest(names[a]) for a in adapters]
    outputs = engine.generate(prompts, GREEDY, specs, use_tqdm=False)
    check(oracle, outputs, prompts, adapters)
    assert engine.adapters.evictions["device"] >= 3  # five adapters through two slots


def test_output_independent_of_the_batch(oracle):
    """Greedy and seeded sampling give a request the same tokens alone and amid other requests."""
    target = PROMPTS[2]
    engine = oracle.engine()
    sampled = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    for sp in (GREEDY, sampled):
        [alone] = engine.generate([target], sp, [oracle.paths["dora"]], use_tqdm=False)
        others, adapters = mixed_requests()
        crowd = engine.generate(others + [target], [GREEDY] * len(others) + [sp],
                                [None if a is None else oracle.paths[a] for a in adapters] + [oracle.paths["dora"]],
                                use_tqdm=False)
        assert crowd[-1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert alone.outputs[0].token_ids != oracle.reference("dora", target, 10)  # it really sampled


def test_qwen2_mixed_batch(tmp_path):
    oracle = Oracle(tmp_path, "qwen2")
    prompts, adapters = mixed_requests()
    engine = oracle.engine(max_num_batched_tokens=16, max_num_seqs=8, block_size=8)
    outputs = engine.generate(prompts, GREEDY, [None if a is None else oracle.paths[a] for a in adapters],
                              use_tqdm=False)
    check(oracle, outputs, prompts, adapters)


def _other_family(family: str):
    """Tiny Mistral (sliding window 8: exercised by 21+ token prompts) and Qwen3 (q/k norms, tied embeddings)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "max_position_embeddings": 256}
    torch.manual_seed(0)
    if family == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=8, tie_word_embeddings=False))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16, tie_word_embeddings=True))
    return model.eval()


@pytest.mark.parametrize("family", ["mistral", "qwen3"])
def test_other_families_match_peft(family, tmp_path):
    from peft import get_peft_model

    from tests.helpers import randomize_adapter

    peft_model = get_peft_model(_other_family(family), CONFIGS["lora"]())
    randomize_adapter(peft_model, seed=3)
    peft_model.eval().save_pretrained(tmp_path / "lora")
    prompts = PROMPTS[1:]
    refs = {}
    for name, model in (("base", _other_family(family)),
                        ("lora", PeftModel.from_pretrained(_other_family(family), tmp_path / "lora").eval())):
        for prompt in prompts:
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                     do_sample=False)
            refs[name, tuple(prompt)] = out[0, len(prompt):].tolist()
    engine = Engine(_other_family(family), device="cpu", max_model_len=128, block_size=4)
    specs = [None, str(tmp_path / "lora")] * len(prompts)
    doubled = [p for p in prompts for _ in range(2)]
    outputs = engine.generate(doubled, GREEDY, specs, use_tqdm=False)
    for out, prompt, spec in zip(outputs, doubled, specs):
        assert out.outputs[0].token_ids == refs["base" if spec is None else "lora", tuple(prompt)], (family, spec)


def test_adapters_for_a_gpu_model_convert_on_cpu(oracle):
    """On a GPU the converters still run on the CPU (on copies of the adapted layers' weights): same slots."""
    from scute.engine.adapter_manager import AdapterManager

    engine = oracle.engine()
    manager = engine.adapters
    remote = AdapterManager(manager.model, manager.linears, 8, 256, 4, torch.device("cuda"))  # load() only
    for method in METHODS:
        a, b = manager.load(oracle.paths[method]), remote.load(oracle.paths[method])
        assert a.identity == b.identity and a.layers.keys() == b.layers.keys()
        for name, slots in a.layers.items():
            for key, x in slots.tensors().items():
                y = b.layers[name].tensors()[key]
                assert y.device.type == "cpu" and torch.equal(x, y), (method, name, key)


# ---------------------------------------------------------------------------------------------- aLoRA
INVOCATION = [7, 9, 11]


def _invoke(prompt: list[int], *at: int) -> list[int]:
    """`prompt` with the aLoRA invocation tokens written at each position of `at`."""
    out = list(prompt)
    for a in at:
        out[a:a + len(INVOCATION)] = INVOCATION
    return out


@pytest.fixture(scope="module")
def alora(oracle, tmp_path_factory):
    """An aLoRA adapter (PEFT `alora_invocation_tokens`) and, for the mutation check, the same tensors as a
    plain LoRA."""
    root = tmp_path_factory.mktemp("alora")
    for name, invocation in (("alora", INVOCATION), ("alora_ungated", None)):
        oracle.paths[name] = str(root / name)
        make_adapter(oracle.paths[name], LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR,
                                                    alora_invocation_tokens=invocation, task_type="CAUSAL_LM"),
                     seed=31)
    return oracle.paths["alora"]


def test_alora_matches_peft(oracle, alora):
    """aLoRA applies its LoRA from the start of the last occurrence of its invocation tokens in the prompt on,
    generated tokens included, and nowhere if they do not occur: greedy tokens equal PEFT's aLoRA `generate`,
    next to base requests in one batch. The gate matters: the same tensors applied to every token (a plain
    LoRA) give other tokens."""
    raw = random_prompts([30, 30, 30, 30, 12], seed=9)
    prompts = [_invoke(raw[0], 0), _invoke(raw[1], 14), _invoke(raw[2], 3, 20), _invoke(raw[3], 27), raw[4]]
    assert INVOCATION[0] not in raw[4]  # no invocation: the base model throughout
    engine = oracle.engine(block_size=4)
    outputs = engine.generate(prompts * 2, GREEDY, [alora] * 5 + [None] * 5, use_tqdm=False)
    check(oracle, outputs, prompts * 2, ["alora"] * 5 + [None] * 5)
    gated = [o.outputs[0].token_ids for o in outputs[:5]]
    assert gated[4] == outputs[9].outputs[0].token_ids
    assert any(g != o.outputs[0].token_ids for g, o in zip(gated[:4], outputs[5:9]))  # the adapter acts
    assert any(g != oracle.reference("alora_ungated", p) for g, p in zip(gated[:4], prompts))  # the gate acts


def test_alora_prefix_shares_the_base_kv_cache(oracle, alora):
    """The tokens before an aLoRA's invocation run on the base model: a base request's cached blocks serve them
    (and the blocks the adapter touches are never served to a base request)."""
    shared = random_prompts([24], seed=11)[0]
    assert INVOCATION[0] not in shared
    engine = oracle.engine(block_size=4)
    [base] = engine.generate([shared + [5]], GREEDY, [None], use_tqdm=False)
    prompt = _invoke(shared + random_prompts([6], seed=12)[0], 24)
    [out] = engine.generate([prompt], GREEDY, [alora], use_tqdm=False)
    check(oracle, [base, out], [shared + [5], prompt], [None, "alora"])
    assert out.num_cached_tokens == 24
    [again] = engine.generate([prompt], GREEDY, [None], use_tqdm=False)  # the same tokens, on the base model
    check(oracle, [again], [prompt], [None])
    assert again.num_cached_tokens == 24  # not 28: the block holding the invocation was computed by the aLoRA
