"""`scute.compat.vllm`'s `EngineArgs` / `LLMEngine` streaming loop and `LLM.chat`, against `scute.Engine`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

import scute
import scute.compat.vllm as shim

ADAPTERS = [None, "lora", "dora", "ia3", "vera", "lora"]
PROMPTS = ["the quick brown fox", "one two three", "lazy dog runs", "red green blue", "a cat sleeps", "two dogs"]


def engine_args(served, **changes) -> shim.EngineArgs:
    options = {"model": str(served / "model"), "dtype": "float32", "enable_lora": True, "max_loras": 2,
               "max_lora_rank": 8, "max_cpu_loras": 4, "max_num_seqs": 256, "max_model_len": 64, **changes}
    return shim.EngineArgs(**options)


def reference(served, prompts, adapters, max_tokens: int, logprobs: bool = False):
    """`Engine.generate`'s greedy tokens for the same requests (with their cumulative logprobs)."""
    engine = scute.Engine(str(served / "model"), dtype="float32", max_model_len=64)
    sp = scute.SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens, logprobs=0 if logprobs else None)
    outs = engine.generate(prompts, sp, [None if a is None else str(served / a) for a in adapters], use_tqdm=False)
    if logprobs:
        return [o.outputs[0].cumulative_logprob for o in outs]
    return [o.outputs[0].token_ids for o in outs]


def run_loop(engine: shim.LLMEngine, requests) -> dict[str, list[shim.RequestOutput]]:
    """vLLM's example loop: add one request per step until none is left, collect every output per request."""
    requests, seen, request_id = list(requests), {}, 0
    while requests or engine.has_unfinished_requests():
        if requests:
            prompt, sp, lora = requests.pop(0)
            engine.add_request(str(request_id), prompt, sp, lora_request=lora)
            request_id += 1
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


def test_llm_engine_loop_with_lora_dora_ia3_vera_matches_generate(served):
    engine = shim.LLMEngine.from_engine_args(engine_args(served))
    assert engine.get_tokenizer() is engine.engine.tokenizer
    sp = shim.SamplingParams(temperature=0.0, logprobs=1, max_tokens=6, min_tokens=6, stop_token_ids=[32003])
    loras = {name: shim.LoRARequest(name, i + 1, str(served / name)) for i, name in enumerate(["lora", "dora", "ia3", "vera"])}
    seen = run_loop(engine, [(p, sp, loras.get(a)) for p, a in zip(PROMPTS, ADAPTERS)])
    assert sorted(seen, key=int) == [str(i) for i in range(len(PROMPTS))] and not engine.has_unfinished_requests()
    want = reference(served, PROMPTS, ADAPTERS, 6)
    for i, (adapter, tokens) in enumerate(zip(ADAPTERS, want)):
        outs = seen[str(i)]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]  # streamed, cumulative
        assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, 7))
        final = outs[-1]
        assert isinstance(final, shim.RequestOutput) and final.outputs[0].token_ids == tokens
        assert final.lora_request is loras.get(adapter) and final.prompt == PROMPTS[i]
        c = final.outputs[0]
        assert c.finish_reason == "length" and len(c.logprobs) == 6 and c.logprobs[0][c.token_ids[0]].rank == 1
    base = reference(served, PROMPTS, [None] * len(PROMPTS), 6, logprobs=True)  # every adapter counts:
    ours = [seen[str(i)][-1].outputs[0].cumulative_logprob for i in range(len(PROMPTS))]
    assert [abs(o - b) > 1e-4 for o, b in zip(ours, base)] == [a is not None for a in ADAPTERS]


def test_dict_prompts_and_final_only(served):
    engine = shim.LLMEngine.from_engine_args(engine_args(served))
    ids = engine.get_tokenizer()("red green blue")["input_ids"]
    final = shim.SamplingParams(temperature=0, max_tokens=4, min_tokens=4, output_kind=shim.RequestOutputKind.FINAL_ONLY)
    assert engine.add_request("text", {"prompt": "the quick brown fox"}, final) == "text"
    engine.add_request("ids", {"prompt_token_ids": ids}, final)
    engine.add_request("list", ids, scute.SamplingParams(temperature=0, max_tokens=4, min_tokens=4),
                       prompt_text="red green blue")  # the outputs' prompt, as vLLM's
    seen = run_loop(engine, [])
    assert [len(seen["text"]), len(seen["ids"]), len(seen["list"])] == [1, 1, 4]  # FINAL_ONLY: once, finished
    assert all(o.prompt == "red green blue" for o in seen["list"])
    want = reference(served, ["the quick brown fox", ids], [None, None], 4)
    assert seen["text"][0].outputs[0].token_ids == want[0]
    assert seen["ids"][0].outputs[0].token_ids == want[1] == seen["list"][-1].outputs[0].token_ids
    assert seen["ids"][0].prompt is None and seen["ids"][0].prompt_token_ids == ids


def test_delta_outputs_join_to_the_cumulative_ones(served):
    """``RequestOutputKind.DELTA``: each step reports only the new token, its text and its logprobs (vLLM's
    `Logprob`s, ranked as in a cumulative stream); joined they are the cumulative request's last output."""
    engine = shim.LLMEngine.from_engine_args(engine_args(served))
    kw = dict(temperature=0, max_tokens=6, min_tokens=6, logprobs=2, prompt_logprobs=1)
    lora = shim.LoRARequest("ia3", 1, str(served / "ia3"))
    seen = run_loop(engine, [("the quick brown fox", shim.SamplingParams(**kw), lora),
                             ("the quick brown fox", shim.SamplingParams(**kw, output_kind=shim.RequestOutputKind.DELTA),
                              lora)])
    whole, deltas = seen["0"][-1], seen["1"]
    assert len(deltas) == 6 and all(len(d.outputs[0].token_ids) == 1 for d in deltas) and deltas[-1].finished
    assert [t for d in deltas for t in d.outputs[0].token_ids] == whole.outputs[0].token_ids
    assert "".join(d.outputs[0].text for d in deltas) == whole.outputs[0].text
    assert [lp for d in deltas for lp in d.outputs[0].logprobs] == whole.outputs[0].logprobs
    assert deltas[0].prompt_logprobs == whole.prompt_logprobs and deltas[1].prompt_logprobs is None


def test_abort(served):
    engine = shim.LLMEngine.from_engine_args(engine_args(served))
    sp = shim.SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    for rid in ("a", "b", "c"):
        engine.add_request(rid, "the quick brown fox", sp)
    first = engine.step()
    engine.abort_request("a")
    engine.abort_request(["b"])
    assert engine.get_num_unfinished_requests() == 1
    seen = run_loop(engine, [])
    assert {o.request_id for o in first} <= {"a", "b", "c"} and set(seen) == {"c"}  # aborted: never again
    assert seen["c"][-1].finished and len(seen["c"][-1].outputs[0].token_ids) == 8
    assert not engine.has_unfinished_requests()


def test_n_streams_as_one_request(served):
    """`step` reports an n=2 request by its own id, both completions in each output, cumulative, with its prompt
    logprobs; seeded samples are those of seed s and s + 1 alone."""
    engine = shim.LLMEngine.from_engine_args(engine_args(served))
    sp = shim.SamplingParams(temperature=0.9, seed=7, max_tokens=5, min_tokens=5, n=2, prompt_logprobs=0, logprobs=0)
    engine.add_request("p", "the quick brown fox", sp, lora_request=shim.LoRARequest("ia3", 1, str(served / "ia3")))
    seen = run_loop(engine, [])
    assert set(seen) == {"p"} and seen["p"][-1].finished and not any(o.finished for o in seen["p"][:-1])
    final = seen["p"][-1]
    assert [c.index for c in final.outputs] == [0, 1] and all(len(c.logprobs) == 5 for c in final.outputs)
    assert len(final.prompt_logprobs) == len(final.prompt_token_ids) and final.prompt_logprobs[0] is None
    assert all(len(step) == 1 for step in final.prompt_logprobs[1:])
    alone = scute.Engine(str(served / "model"), dtype="float32", max_model_len=64)
    for i, c in enumerate(final.outputs):
        one = scute.SamplingParams(temperature=0.9, seed=7 + i, max_tokens=5, min_tokens=5)
        [want] = alone.generate(["the quick brown fox"], one, [str(served / "ia3")], use_tqdm=False)
        assert c.token_ids == want.outputs[0].token_ids
    assert final.outputs[0].token_ids != final.outputs[1].token_ids


def test_engine_refusals_name_the_option(served):
    folder = str(served / "model")
    for changes in ({"pipeline_parallel_size": 2}, {"quantization": "awq"}, {"speculative_config": {"method": "ngram"}},
                    {"runner": "pooling"}, {"enable_chunked_prefill": False}, {"compilation_config": {"level": 3}}):
        with pytest.raises(shim.UnsupportedOptionError, match=next(iter(changes))):
            shim.EngineArgs(model=folder, **changes)
    with pytest.raises(TypeError, match="no_such_option"):
        shim.EngineArgs(model=folder, no_such_option=1)
    shim.EngineArgs(model=folder, tensor_parallel_size=1, pipeline_parallel_size=1, kv_cache_dtype="auto")  # defaults
    with pytest.raises(shim.UnsupportedOptionError, match="bad_words"):
        shim.SamplingParams(temperature=0.0, logprobs=1, bad_words=["x"])
    with pytest.raises(shim.UnsupportedOptionError, match="stat_loggers"):
        shim.LLMEngine.from_engine_args(engine_args(served), stat_loggers=[object()])
    engine = shim.LLMEngine.from_engine_args(engine_args(served, enable_lora=False))
    sp = shim.SamplingParams(temperature=0, max_tokens=2)
    for kwargs in ({"priority": 1}, {"tokenization_kwargs": {"truncation": True}}, {"session_id": "s"}):
        with pytest.raises(shim.UnsupportedOptionError, match=next(iter(kwargs))):
            engine.add_request("x", "the cat", sp, **kwargs)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        engine.add_request("x", "the cat", sp, lora_request=shim.LoRARequest("lora", 1, str(served / "lora")))
    with pytest.raises(TypeError, match="request_id"):
        engine.add_request(1, "the cat", sp)
    lora_engine = shim.LLMEngine.from_engine_args(engine_args(served))
    with pytest.raises(ValueError, match="failed"):
        lora_engine.add_request("bad", "the cat", sp, lora_request=shim.LoRARequest("bad", 9, str(served / "nowhere")))
    assert lora_engine.step() == [] and not lora_engine.has_unfinished_requests()  # the refused one is not reported


# ---------------------------------------------------------------------------------------------- LLM.chat
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant :{% endif %}")
CONVERSATIONS = [
    [{"role": "user", "content": "the quick brown fox"}],
    [{"role": "system", "content": "one two"}, {"role": "user", "content": [{"type": "text", "text": "red"},
                                                                            {"type": "text", "text": "blue"}]}],
]


@pytest.fixture(scope="module")
def chat_llm(served):
    return shim.LLM(model=str(served / "model"), dtype="float32", enable_lora=True, max_lora_rank=16,
                    max_model_len=64, chat_template=TEMPLATE)


def test_chat_single_and_batched_equal_generate_on_the_templated_text(served, chat_llm):
    sp = shim.SamplingParams(temperature=0, max_tokens=5, min_tokens=5)
    lora = shim.LoRARequest("dora", 1, str(served / "dora"))
    texts = ["user : the quick brown fox assistant :", "system : one two user : red\nblue assistant :"]
    batched = chat_llm.chat(CONVERSATIONS, sp, use_tqdm=False, lora_request=lora)
    single = chat_llm.chat(CONVERSATIONS[0], sp, use_tqdm=False, lora_request=lora)
    want = chat_llm.generate(texts, sp, use_tqdm=False, lora_request=lora)
    assert [o.prompt for o in batched] == texts and single[0].prompt == texts[0]
    assert [o.outputs[0].token_ids for o in batched] == [w.outputs[0].token_ids for w in want]
    assert single[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert batched[0].prompt_token_ids == chat_llm.get_tokenizer()(texts[0], add_special_tokens=False)["input_ids"]
    other = chat_llm.chat(CONVERSATIONS[0], sp, use_tqdm=False, chat_template="{{ messages[0]['content'] }}",
                          chat_template_kwargs={"unused": 1})
    assert other[0].prompt == "the quick brown fox"
    continued = chat_llm.chat([*CONVERSATIONS[0], {"role": "assistant", "content": "a"}], sp, use_tqdm=False,
                              add_generation_prompt=False, continue_final_message=True)
    assert continued[0].prompt.startswith("user : the quick brown fox assistant : a")


def test_chat_refusals(served, chat_llm):
    plain = shim.LLM(model=str(served / "model"), dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="chat template"):
        plain.chat(CONVERSATIONS[0], use_tqdm=False)
    for kwargs in ({"mm_processor_kwargs": {"a": 1}}, {"tokenization_kwargs": {"truncation": True}},
                   {"chat_template_content_format": "openai"}):
        with pytest.raises(shim.UnsupportedOptionError, match=next(iter(kwargs))):
            chat_llm.chat(CONVERSATIONS[0], use_tqdm=False, **kwargs)
    with pytest.raises(shim.UnsupportedOptionError, match="messages"):
        chat_llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], use_tqdm=False)
    with pytest.raises(ValueError, match="continue_final_message"):
        chat_llm.chat(CONVERSATIONS[0], use_tqdm=False, continue_final_message=True)


# ---------------------------------------------------------------------------------------------- a vLLM script
# The shape of vLLM's examples/offline_inference/multilora_inference.py: EngineArgs -> LLMEngine, a queue of
# (prompt, SamplingParams, LoRARequest) fed one per step, finished outputs printed.
SCRIPT = """
import sys

from vllm import EngineArgs, LLMEngine, RequestOutput, SamplingParams
from vllm.lora.request import LoRARequest


def create_test_prompts(lora_path):
    greedy = SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1, max_tokens=128, stop_token_ids=[32003])
    return [
        ("the quick brown fox", greedy, None),
        ("one two three", SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2, max_tokens=12), None),
        ("lazy dog runs", greedy, LoRARequest("first-lora", 1, lora_path)),
        ("red green blue", greedy, LoRARequest("first-lora", 1, lora_path)),
        ("a cat sleeps", greedy, LoRARequest("second-lora", 2, lora_path)),
        ("two three one", greedy, LoRARequest("second-lora", 2, lora_path)),
    ]


def process_requests(engine: LLMEngine, test_prompts):
    request_id = 0
    while test_prompts or engine.has_unfinished_requests():
        if test_prompts:
            prompt, sampling_params, lora_request = test_prompts.pop(0)
            engine.add_request(str(request_id), prompt, sampling_params, lora_request=lora_request)
            request_id += 1
        request_outputs: list[RequestOutput] = engine.step()
        for request_output in request_outputs:
            if request_output.finished:
                print(request_output)


def initialize_engine(model):
    engine_args = EngineArgs(model=model, enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=2,
                             max_num_seqs=256)
    return LLMEngine.from_engine_args(engine_args)


if __name__ == "__main__":
    engine = initialize_engine(sys.argv[1])
    process_requests(engine, create_test_prompts(sys.argv[2]))
"""


def test_a_multilora_vllm_script_runs_unchanged(served, tmp_path):
    script = tmp_path / "multilora_inference.py"
    script.write_text(textwrap.dedent(SCRIPT))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "scute.compat.vllm", str(script), str(served / "model"),
                           str(served / "dora")], capture_output=True, text=True, check=False, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = re.findall(r"RequestOutput\(request_id=(\d+), .*?CompletionOutput\(index=0, text=.*?, token_ids=\[([\d, ]*)\]",
                      proc.stdout)
    assert sorted(int(rid) for rid, _ in rows) == list(range(6)), proc.stdout
    got = {int(rid): [int(t) for t in ids.split(",") if t.strip()] for rid, ids in rows}
    prompts = ["the quick brown fox", "one two three", "lazy dog runs", "red green blue", "a cat sleeps", "two three one"]
    engine = scute.Engine(str(served / "model"), max_adapter_rank=8, dtype="bfloat16")  # "auto" on a float32 folder
    want = engine.generate(prompts, [scute.SamplingParams(temperature=0, max_tokens=n) for n in (128, 12, 128, 128, 128, 128)],
                           [None, None] + [str(served / "dora")] * 4, use_tqdm=False)
    sampled = 1  # sampled with a presence penalty: its tokens depend on the RNG's state, not compared
    assert 0 < len(got[sampled]) <= 12
    assert [got[i] for i in range(6) if i != sampled] == [w.outputs[0].token_ids for i, w in enumerate(want) if i != sampled]


def test_dtype_auto_downcasts_a_float32_checkpoint_as_vllm(served, tmp_path):
    """vLLM's dtype="auto" runs a float32 checkpoint in bfloat16 (on CPU and on bf16 GPUs); other dtypes stay."""
    import json

    import torch

    from scute.compat.vllm_args import auto_dtype

    folder = served / "model"
    assert json.loads((folder / "config.json").read_text()).get("dtype", "float32") == "float32"
    assert auto_dtype(folder) == ("bfloat16" if not torch.cuda.is_available() or torch.cuda.is_bf16_supported()
                                  else "float16")
    assert shim.LLM(model=str(folder), max_model_len=64).engine.config.torch_dtype() == torch.bfloat16
    assert shim.LLM(model=str(folder), dtype="float32", max_model_len=64).engine.config.torch_dtype() == torch.float32
    half = tmp_path / "half"
    half.mkdir()
    (half / "config.json").write_text(json.dumps({"dtype": "float16"}))
    assert auto_dtype(half) == "auto" and auto_dtype(tmp_path / "model.gguf") == "auto"
