"""`scute.compat.vllm`: vLLM's signatures, unsupported options refused, and a vLLM script run unchanged."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

import scute
import scute.compat.vllm as shim
from scute.compat.signatures import api_records, engine_arg_defaults

SNAPSHOT = os.path.join(os.path.dirname(__file__), "..", "data", "vllm_signatures.json")
SHIM_CLASSES = {"LLM": shim.LLM, "SamplingParams": shim.SamplingParams, "LoRARequest": shim.LoRARequest,
                "RequestOutput": shim.RequestOutput, "CompletionOutput": shim.CompletionOutput,
                "LLMEngine": shim.LLMEngine}


def vllm_records() -> tuple[str, dict, dict]:
    """(source, records, EngineArgs defaults): from an importable vLLM (not our own shim installed as vllm),
    else the snapshot."""
    if "vllm" not in sys.modules or sys.modules["vllm"] is not shim:
        try:
            import vllm
            from vllm import LLM, EngineArgs, LLMEngine, SamplingParams
            from vllm.lora.request import LoRARequest
            from vllm.outputs import CompletionOutput, RequestOutput
        except ImportError:
            pass
        else:
            classes = {"LLM": LLM, "SamplingParams": SamplingParams, "LoRARequest": LoRARequest,
                       "RequestOutput": RequestOutput, "CompletionOutput": CompletionOutput, "LLMEngine": LLMEngine}
            return f"vllm {vllm.__version__}", api_records(classes), engine_arg_defaults(EngineArgs)
    with open(SNAPSHOT) as f:
        snap = json.load(f)
    return f"snapshot of vllm {snap['vllm_version']}", snap["signatures"], snap["engine_args"]


@pytest.mark.parametrize("api", list(api_records(SHIM_CLASSES)))
def test_signatures_match_vllm(api):
    source, records, _ = vllm_records()
    ours = api_records(SHIM_CLASSES)[api]
    theirs = records[api]
    assert [p["name"] for p in ours] == [p["name"] for p in theirs], f"{api} parameter names differ from {source}"
    assert ours == theirs, f"{api} parameter kinds or defaults differ from {source}"


def test_engine_args_signatures_match_vllm():
    """Every vLLM `EngineArgs` field, in vLLM's order, with vLLM's default (None where vLLM builds it)."""
    source, _, theirs = vllm_records()
    ours = engine_arg_defaults(shim.EngineArgs)
    assert list(ours) == list(theirs), f"EngineArgs fields differ from {source}"
    for name, default in theirs.items():
        built = default is None or default.startswith("<")  # a factory or an enum member: None here
        assert ours[name] == ("None" if built else default), f"EngineArgs.{name}'s default differs from {source}"


def test_snapshot_is_of_the_supported_vllm():
    with open(SNAPSHOT) as f:
        snap = json.load(f)
    assert snap["vllm_version"].startswith("0.3")
    for name in ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "max_model_len", "max_num_seqs"):
        assert name in snap["engine_args"], name  # LLM(**kwargs) options the shim maps are vLLM's


# ---------------------------------------------------------------------------------------------- a real model
@pytest.fixture(scope="module")
def llm(served):
    return shim.LLM(model=str(served / "model"), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
                    max_model_len=64, seed=0)


def test_generate_matches_the_engine_and_has_vllm_fields(served, llm):
    prompts = ["the quick brown fox", {"prompt_token_ids": [5, 6, 7, 8, 9]}, "red green blue"]
    sp = shim.SamplingParams(temperature=0, max_tokens=6, min_tokens=6, logprobs=2)
    loras = [None, shim.LoRARequest("lora", 1, str(served / "lora")), shim.LoRARequest("vera", 2, str(served / "vera"))]
    outs = llm.generate(prompts, sp, lora_request=loras, use_tqdm=False)
    engine = scute.Engine(str(served / "model"), dtype="float32", max_model_len=64)
    want = engine.generate(["the quick brown fox", [5, 6, 7, 8, 9], "red green blue"],
                           scute.SamplingParams(temperature=0, max_tokens=6, min_tokens=6),
                           [None, str(served / "lora"), str(served / "vera")], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [w.outputs[0].token_ids for w in want]
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 3
    out = outs[2]
    assert isinstance(out, shim.RequestOutput) and out.finished and out.lora_request is loras[2]
    assert out.prompt == "red green blue" and out.prompt_token_ids == want[2].prompt_token_ids
    c = out.outputs[0]
    assert isinstance(c, shim.CompletionOutput) and c.finish_reason == "length" and c.lora_request is loras[2]
    assert len(c.logprobs) == 6 and all(isinstance(lp, shim.Logprob) for step in c.logprobs for lp in step.values())
    assert c.logprobs[0][c.token_ids[0]].rank == 1  # greedy: the chosen token is the most likely
    assert c.cumulative_logprob == pytest.approx(sum(step[t].logprob for step, t in zip(c.logprobs, c.token_ids)))


def test_n_and_prompt_logprobs_in_vllm_form(served, llm):
    """n completions in one RequestOutput (index 0..n-1; greedy: identical), prompt logprobs as vLLM's list (None
    first, then {token: Logprob} with the prompt token and the top k), equal to the engine's."""
    sp = shim.SamplingParams(temperature=0, max_tokens=5, min_tokens=5, n=3, prompt_logprobs=2, logprobs=1)
    lora = shim.LoRARequest("lora", 1, str(served / "lora"))
    [out] = llm.generate("the quick brown fox", sp, lora_request=lora, use_tqdm=False)
    engine = scute.Engine(str(served / "model"), dtype="float32", max_model_len=64)
    [want] = engine.generate(["the quick brown fox"], scute.SamplingParams(temperature=0, max_tokens=5, min_tokens=5,
                                                                            prompt_logprobs=2),
                             [str(served / "lora")], use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == want.outputs[0].token_ids and len(c.logprobs) == 5 for c in out.outputs)
    prompt = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(prompt) >= 2 and out.prompt_logprobs[0] is None
    for i, (step, ref) in enumerate(zip(out.prompt_logprobs[1:], want.prompt_logprobs[1:]), start=1):
        assert prompt[i] in step and {t: lp.logprob for t, lp in step.items()} == pytest.approx(ref)
        assert sorted(lp.rank for t, lp in step.items() if lp.rank is not None) == [1, 2]
        assert all(isinstance(lp, shim.Logprob) and lp.decoded_token is not None for lp in step.values())
    assert "n=3" in repr(sp) and sp.to_scute().n == 3 and sp.to_scute().prompt_logprobs == 2


def test_unsupported_options_raise_never_ignored(served, llm):
    folder = str(served / "model")
    for kwargs in ({"pipeline_parallel_size": 2}, {"quantization": "awq"}, {"trust_remote_code": True},
                   {"runner": "pooling"}, {"speculative_config": {"method": "ngram"}}, {"no_such_option": 1}):
        with pytest.raises(shim.UnsupportedOptionError, match=next(iter(kwargs))):
            shim.LLM(folder, **kwargs)
    for kwargs in ({"bad_words": ["x"]}, {"min_p": 0.1},
                   {"logit_bias": {1: 2.0}}):
        with pytest.raises(shim.UnsupportedOptionError, match=next(iter(kwargs))):
            shim.SamplingParams(**kwargs)
    shim.SamplingParams(n=1, presence_penalty=0.0, output_kind=shim.RequestOutputKind.FINAL_ONLY)  # defaults pass
    assert shim.SamplingParams(output_kind=shim.RequestOutputKind.DELTA).to_scute().output_kind == "delta"
    with pytest.raises(shim.UnsupportedOptionError, match="priority"):
        llm.generate("the cat", priority=[1], use_tqdm=False)
    with pytest.raises(ValueError, match="must be the same"):
        llm.generate(["the cat", "a dog"], lora_request=[None], use_tqdm=False)
    with pytest.raises(ValueError, match="id must be > 0"):
        shim.LoRARequest("x", 0, "/nowhere")


def test_lora_needs_enable_lora_and_a_bad_adapter_raises(served, llm):
    plain = shim.LLM(model=str(served / "model"), dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.generate("the cat", lora_request=shim.LoRARequest("lora", 1, str(served / "lora")), use_tqdm=False)
    with pytest.raises(ValueError, match="requests failed"):
        llm.generate("the cat", lora_request=shim.LoRARequest("bad", 3, str(served / "nowhere")), use_tqdm=False)


SCRIPT = """
import sys
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest

if __name__ == "__main__":
    model, lora, vera, out = sys.argv[1:5]
    llm = LLM(model=model, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=5, min_tokens=5)
    outputs = llm.generate(["the quick brown fox", "one two three", "lazy dog"], params,
                           lora_request=[None, LoRARequest("lora", 1, lora), LoRARequest("vera", 2, vera)])
    with open(out, "w") as f:
        for o in outputs:
            f.write(" ".join(map(str, o.outputs[0].token_ids)) + "\\n")
"""


def test_a_vllm_script_runs_unchanged(served, tmp_path, monkeypatch):
    script = tmp_path / "offline_inference.py"
    script.write_text(textwrap.dedent(SCRIPT))
    out = tmp_path / "tokens.txt"
    for name in shim._MODULES:  # a real vLLM would be shadowed only inside this test
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    try:
        assert shim.main([str(script), str(served / "model"), str(served / "lora"), str(served / "vera"),
                          str(out)]) == 0
    finally:
        shim.uninstall_as_vllm()
    rows = [list(map(int, line.split())) for line in out.read_text().splitlines()]
    engine = scute.Engine(str(served / "model"), dtype="float32", max_model_len=64)
    want = engine.generate(["the quick brown fox", "one two three", "lazy dog"],
                           scute.SamplingParams(temperature=0, max_tokens=5, min_tokens=5),
                           [None, str(served / "lora"), str(served / "vera")], use_tqdm=False)
    assert rows == [w.outputs[0].token_ids for w in want]
    assert "vllm" not in sys.modules or sys.modules["vllm"] is not shim


def test_sampling_params_map_to_scute():
    sp = shim.SamplingParams(temperature=1e-6, top_k=5, top_p=0.5, seed=3, max_tokens=9, stop=["x"], logprobs=1)
    s = sp.to_scute()
    assert s.greedy and s.max_tokens == 9 and s.seed == 3 and s.stop_strings == ("x",) and s.logprobs == 1
    s = shim.SamplingParams(temperature=0.7, top_k=5, top_p=0.5).to_scute()
    assert (s.temperature, s.top_k, s.top_p) == (0.7, 5, 0.5)
    s = shim.SamplingParams(presence_penalty=0.2, frequency_penalty=-0.1, repetition_penalty=1.1).to_scute()
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.2, -0.1, 1.1)
    assert sp.clone().max_tokens == 9 and "max_tokens=9" in repr(sp)
    with pytest.raises(ValueError):
        shim.SamplingParams(temperature=-1.0)
