"""Poly (each task against PEFT's forward with its `task_ids`: `test_peft_equality.py`): two tasks differ, the
`task_id` load option (range, other methods, the engine's `load_adapter`), two tasks of one checkpoint as two
adapters, and in one engine batch against PEFT's `generate`."""

from __future__ import annotations

import os

import pytest
import torch
from peft import PolyConfig, get_peft_model

from scute.adapters import AdapterError, load_adapter
from tests.helpers import ALL_LINEAR, IDS, randomize_adapter, rel_err, tiny_model


def poly_adapter(path: str, family: str, dtype: torch.dtype, seed: int = 3, **config):
    peft_model = get_peft_model(tiny_model(family, dtype), PolyConfig(target_modules=ALL_LINEAR, **config))
    randomize_adapter(peft_model, seed=seed)
    with torch.no_grad():  # logits of ±0.2 would give every task nearly equal skill weights
        for name, p in peft_model.named_parameters():
            if "module_logits" in name:
                p.mul_(10)
    peft_model.eval()
    os.makedirs(path, exist_ok=True)
    peft_model.save_pretrained(path)
    return peft_model


def peft_logits(peft_model, task: int) -> torch.Tensor:
    with torch.no_grad():
        # PolyModel.forward hands task_ids to the layers (PeftModel.forward without a task type goes around it)
        return peft_model.base_model(input_ids=IDS, task_ids=torch.full((IDS.shape[0],), task)).logits


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("splits", [1, 2])
def test_poly_tasks_differ(tmp_path, family, dtype, splits):
    """Two tasks of one checkpoint give different outputs in PEFT, so the per-task cases of
    `test_peft_equality.py` (tasks 0 and 2, with the router logits spread as here) would see a wrong task."""
    peft_model = poly_adapter(str(tmp_path / "poly"), family, dtype, seed=1, r=4, n_tasks=3, n_skills=4,
                              n_splits=splits)  # the table's adapter: make_adapter's seed
    assert rel_err(peft_logits(peft_model, 0), peft_logits(peft_model, 2)) > 1e-3, "two tasks gave one output"


def test_poly_needs_a_task_in_range(tmp_path):
    path = str(tmp_path / "poly")
    poly_adapter(path, "llama", torch.float32, r=2, n_tasks=2, n_skills=2, n_splits=1)
    model = tiny_model("llama")
    with pytest.raises(AdapterError, match="load it with task_id=0..1"):
        load_adapter(path, model)
    with pytest.raises(AdapterError, match="task_id=2 is out of range"):
        load_adapter(path, model, task_id=2)


def test_two_tasks_are_two_adapters(tmp_path):
    """Same checkpoint, two tasks: different identities (device slots, KV prefix hashes) and default names."""
    path = str(tmp_path / "poly")
    poly_adapter(path, "llama", torch.float32, r=2, n_tasks=2, n_skills=2, n_splits=1)
    model = tiny_model("llama")
    a, b = (load_adapter(path, model, task_id=t) for t in (0, 1))
    assert a.identity != b.identity and (a.name, b.name) == ("poly@task0", "poly@task1")


def test_task_id_refused_for_other_methods(tmp_path):
    from peft import LoraConfig

    from tests.helpers import make_adapter

    path = str(tmp_path / "lora")
    make_adapter(path, LoraConfig(r=2, target_modules=["q_proj"]))
    refusal = r"\(LORA\): unknown load option 'task_id' \(an option of POLY\); LORA takes: dense$"
    with pytest.raises(AdapterError, match=refusal):
        load_adapter(path, tiny_model("llama"), task_id=0)


def test_engine_load_adapter_takes_the_method_options(tmp_path):
    """`Engine.load_adapter(name, path, **options)` hands options to the method; a name it does not take raises,
    naming the method and its options."""
    from scute import Engine, SamplingParams

    path = str(tmp_path / "poly")
    poly_adapter(path, "llama", torch.float32, r=2, n_tasks=2, n_skills=2, n_splits=1)
    engine = Engine(tiny_model("llama"), device="cpu", dtype="float32", max_model_len=64, block_size=4)
    named = engine.load_adapter("task1", path, task_id=1)
    direct = load_adapter(path, engine.model, task_id=1)
    assert named.name == "task1" and named.identity == direct.identity
    greedy = SamplingParams(temperature=0, max_tokens=4)
    by_name, by_object = engine.generate([[5, 9, 17]] * 2, greedy, ["task1", direct], use_tqdm=False)
    assert by_name.outputs[0].token_ids == by_object.outputs[0].token_ids
    with pytest.raises(AdapterError, match=r"\(POLY\): unknown load option 'task'; POLY takes: dense, task_id \(the"):
        engine.load_adapter("typo", path, task=1)
    with pytest.raises(AdapterError, match="load it with task_id=0..1"):
        engine.load_adapter("none", path)
    assert "typo" not in engine.adapters.named and "none" not in engine.adapters.named


def test_engine_serves_two_tasks_of_one_checkpoint(tmp_path):
    """Tasks 0 and 1 of one Poly checkpoint in one batch, with the same prompt (prefix caching on: the tasks must
    not share KV blocks), and the base model: greedy tokens equal PEFT's `generate` with each task id."""
    from scute import Engine, SamplingParams

    path = str(tmp_path / "poly")
    peft_model = poly_adapter(path, "llama", torch.float32, r=4, n_tasks=2, n_skills=3, n_splits=2)
    prompt, new = [5, 9, 17, 33, 2, 71, 8, 40, 12], 8
    want = {}
    for task in (0, 1):
        with torch.no_grad():
            out = peft_model.base_model.generate(
                input_ids=torch.tensor([prompt]), task_ids=torch.tensor([task]), max_new_tokens=new,
                min_new_tokens=new, do_sample=False, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        want[task] = out[0, len(prompt):].tolist()
    assert want[0] != want[1], "the two tasks generate alike: the test could not see a task mix-up"
    engine = Engine(tiny_model("llama"), device="cpu", dtype="float32", max_model_len=64, block_size=4,
                    enable_prefix_caching=True)
    tasks = [load_adapter(path, engine.model, task_id=t) for t in (0, 1)]
    greedy = SamplingParams(temperature=0, max_tokens=new, min_tokens=new)
    outs = engine.generate([prompt] * 4, greedy, [tasks[0], tasks[1], tasks[0], tasks[1]], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want[0], want[1], want[0], want[1]]
