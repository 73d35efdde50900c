"""Bad requests fail alone, with a clear error in their output; the rest of the batch completes."""

from __future__ import annotations

import os

import pytest

from scute import Engine, SamplingParams
from tests.helpers import GREEDY, PROMPTS, Oracle, bad_adapters, check, tiny_model


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    return Oracle(tmp_path_factory.mktemp("adapters"))


def test_bad_requests_fail_alone(oracle, tmp_path):
    kept = ("missing", "corrupt", "other model", "rank")
    bad = {k: v for k, v in bad_adapters(oracle, tmp_path).items() if k in kept}
    engine = oracle.engine(max_model_len=40, max_adapter_rank=8)
    good_prompts = PROMPTS[:3]
    good_adapters = [None, "lora", "oft"]
    prompts = [PROMPTS[0]] * len(bad) + good_prompts + [list(range(3, 45)), [5, 999], "text without tokenizer"]
    specs = list(bad.values()) + [None if a is None else oracle.paths[a] for a in good_adapters]
    specs += [None, None, None]
    specs.append(None)
    prompts.append(PROMPTS[1])
    specs[-1] = "never-loaded-name"
    outputs = engine.generate(prompts, GREEDY, specs, use_tqdm=False)

    n_bad = len(bad)
    check(oracle, outputs[n_bad:n_bad + 3], good_prompts, good_adapters)
    failed = outputs[:n_bad] + outputs[n_bad + 3:]
    for out in failed:
        assert out.finished and out.error, out
        assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []
    errors = [o.error for o in failed]
    assert "no such folder" in errors[0]
    assert "corrupt" in errors[1]
    assert "another model" in errors[2] or "in_features" in errors[2]
    assert "max_adapter_rank" in errors[3]
    assert "max_model_len" in errors[4]
    assert "outside the vocabulary" in errors[5]
    assert "tokenizer" in errors[6]
    assert "never-loaded-name" in errors[7]
    # a failed folder is named as a loaded one is: by its own name, whether or not it could be read
    assert [o.adapter_name for o in outputs[:n_bad]] == ["does-not-exist", "corrupt", "other-model", "big-rank"]
    assert [o.adapter_name for o in outputs[n_bad + 1:n_bad + 3]] == [
        os.path.basename(oracle.paths[a]) for a in good_adapters[1:]]


def test_stop_strings_without_a_tokenizer_fail_their_request_alone():
    """No tokenizer, no text to find a stop string in: the request is refused with the reason, not run with its
    stop strings ignored; one with stop token ids beside it runs."""
    engine = Engine(tiny_model(), device="cpu", max_model_len=64)
    words = SamplingParams(temperature=0, max_tokens=4, stop=["the end"])
    ids = SamplingParams(temperature=0, max_tokens=4, stop_token_ids=[3])
    refused, ran = engine.generate([[5, 6], [5, 6]], [words, ids], use_tqdm=False)
    assert refused.outputs[0].finish_reason == "error" and "stop strings need a tokenizer" in refused.error
    assert ran.error is None and ran.outputs[0].token_ids


def test_load_adapter_raises_and_unknown_option():
    with pytest.raises(TypeError, match="unknown engine option 'max_lora'"):
        Engine(tiny_model(), device="cpu", max_lora=4)
    engine = Engine(tiny_model(), device="cpu", max_model_len=64)
    with pytest.raises(ValueError, match="no such folder"):
        engine.load_adapter("x", "/nonexistent/adapter")


def test_model_paths_and_devices_that_cannot_serve(tmp_path):
    """An adapter folder given as the model, a folder without config.json, a device this process has not: each a
    ValueError that says so, at once: before transformers is asked to read anything."""
    from peft import LoraConfig

    from tests.helpers import make_adapter

    make_adapter(str(tmp_path / "lora"), LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="a PEFT adapter folder, not a base model"):
        Engine(str(tmp_path / "lora"), device="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        Engine(str(tmp_path / "empty"), device="cpu")
    with pytest.raises(ValueError, match="device 'cuda:99'"):
        Engine(tiny_model(), device="cuda:99")
    with pytest.raises(ValueError, match="device 'bogus'"):
        Engine(tiny_model(), device="bogus")


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        Engine(tiny_model(), device="cpu", max_model_len=256, kv_cache_memory_bytes=4 * 8192)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        Engine(tiny_model(), device="cpu", max_model_len=100000)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Engine(tiny_model(), device="cpu", max_num_batched_tokens=8, max_num_seqs=16)


def test_sampling_params_validation():
    for bad in ({"temperature": -1}, {"top_p": 0}, {"max_tokens": 0}, {"min_tokens": 5, "max_tokens": 2},
                {"stop": [""]}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
