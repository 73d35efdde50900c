"""The methods' tests other than the PEFT-equality table (`test_peft_equality.py`) for methods without a file
of their own: AdaLoRA's pruned ranks against PEFT reloading them, the refusals (with and without `dense=True`), and
aLoRA's per-token gate against PEFT."""

from __future__ import annotations

import pytest
import torch
from peft import (
    AdaLoraConfig,
    C3AConfig,
    GloraConfig,
    HiraConfig,
    LilyConfig,
    LoraConfig,
    MissConfig,
    PeftModel,
    PveraConfig,
    RandLoraConfig,
    ShiraConfig,
    SupertuningConfig,
)

from scute.adapters import AdapterError, alora_active, load_adapter, read_checkpoint, supported_methods
from scute.compat.convert import convert_adapter
from scute.compat.evaluate import SlotModel
from scute.model.hf import place_adapter, swap_linears
from tests.helpers import IDS, assert_matches_peft, make_adapter, rel_err, run_rows, tiny_model

T4 = ["q_proj", "v_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_adalora_pruned_ranks(dtype, tmp_path):
    """A checkpoint pruned by AdaLoRA's rank pattern (different r' per layer, ranknum still init_r) against
    PEFT reloading that checkpoint."""
    config = AdaLoraConfig(init_r=6, target_r=4, lora_alpha=5, total_step=10, target_modules=T4)
    keep = [[True, False, True, True, False, True], [False] * 5 + [True], [True] * 6, [True, True] + [False] * 4]

    def prune_and_reload(path):
        peft_model = make_adapter(path, config, "llama", dtype)
        names = [n for n, _ in peft_model.base_model.model.named_modules() if n.endswith(tuple(T4))]
        peft_model.peft_config["default"].rank_pattern = {
            f"{n}.lora_E": keep[i % len(keep)] for i, n in enumerate(names)}
        peft_model.save_pretrained(path)
        return PeftModel.from_pretrained(tiny_model("llama", dtype), path).eval()

    assert_matches_peft(tmp_path, config, dtype=dtype, reference=prune_and_reload)
    shapes = {k: v.shape for k, v in read_checkpoint(tmp_path).tensors.items() if k.endswith("lora_E")}
    assert sorted({s[0] for s in shapes.values()}) == [1, 2, 4, 6]


def test_hira_refused_without_dense(tmp_path):
    make_adapter(str(tmp_path), HiraConfig(r=3, target_modules=["q_proj"]))
    with pytest.raises(AdapterError, match=r"Hadamard product.*dense=True"):
        load_adapter(tmp_path, tiny_model())


def test_supertuning_without_saved_indices_refused(tmp_path):
    """Without its saved support positions (save_precomputed_indices=False) Super-Tuning is refused, saying why."""
    make_adapter(str(tmp_path), SupertuningConfig(save_precomputed_indices=False, target_modules=["q_proj"]))
    with pytest.raises(AdapterError, match="save_precomputed_indices=False"):
        load_adapter(tmp_path, tiny_model(), dense=True)


@pytest.mark.parametrize("config,message", [
    (GloraConfig(r=4, target_modules=["q_proj"]), r"W0 ⊙ Xd Xu.*dense=True"),
    (MissConfig(r=8, init_weights="bat", target_modules=["q_proj"]), r"every output block.*dense=True"),
    (PveraConfig(r=8, sample_at_inference=True, target_modules=["q_proj"]), "random noise at every forward"),
    (C3AConfig(block_size=16, target_modules=["q_proj"]), r"block-circulant.*dense=True"),
    (ShiraConfig(r=2, target_modules=["q_proj"]), r"sparse matrix.*dense=True"),
    (SupertuningConfig(target_modules=["q_proj"]), r"sparse support.*dense=True"),
], ids=["glora_lora", "miss_bat", "pvera_sampling", "c3a", "shira", "supertuning"])
def test_refused_without_dense(config, message, tmp_path):
    make_adapter(str(tmp_path), config)
    with pytest.raises(AdapterError, match=message):
        load_adapter(tmp_path, tiny_model())


def test_randlora_without_saved_bases_refused(tmp_path):
    make_adapter(str(tmp_path), RandLoraConfig(r=8, save_projection=False, target_modules=T4))
    with pytest.raises(AdapterError, match="save_projection=True"):
        load_adapter(tmp_path, tiny_model())


def test_lily_refused(tmp_path):
    make_adapter(str(tmp_path), LilyConfig(target_modules=["q_proj", "v_proj"]))
    with pytest.raises(AdapterError, match="averaged over all tokens of the batch"):
        load_adapter(tmp_path, tiny_model(), dense=True)
    assert "LILY" not in supported_methods() and "HIRA" in supported_methods()  # HiRA: served with dense=True


def test_alora_gate_matches_peft(tmp_path):
    """aLoRA loads as its LoRA tensors plus the gate (`Adapter.invocation_tokens`); with the gate `alora_active`
    on the token slots (what the engine does per request) it reproduces PEFT's aLoRA exactly, and applied to
    every token it does not, so the paths that run an adapter on every token refuse it."""
    invocation = [5, 6]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=T4, alora_invocation_tokens=invocation,
                        task_type="CAUSAL_LM")
    peft_model = make_adapter(str(tmp_path / "alora"), config, "llama", torch.float64)
    ids = IDS.clone()
    ids[0, 2:4] = torch.tensor(invocation)
    ids[1, 4:6] = torch.tensor(invocation)  # row 2 has no invocation: base model throughout
    with torch.no_grad():
        expected = peft_model(ids).logits
    model = tiny_model("llama", torch.float64)
    adapter = load_adapter(tmp_path / "alora", model)
    assert adapter.invocation_tokens == (5, 6)
    linears = swap_linears(model, max_adapters=1)
    place_adapter(linears, 0, adapter)
    gate = torch.tensor([alora_active(row.tolist(), invocation) for row in ids])
    assert gate.sum(1).tolist() == [5, 3, 0]
    logits = run_rows(model, None, ids, token_slots=torch.where(gate, 0, -1).flatten())
    assert rel_err(logits, expected) <= 1e-10
    assert rel_err(run_rows(model, [0, 0, 0], ids), expected) > 1e-3  # ungated: wrong
    with pytest.raises(ValueError, match="applies only from its invocation tokens on"):
        SlotModel(tiny_model("llama", torch.float64), max_adapters=1).place(0, adapter)
    with pytest.raises(ValueError, match="an aLoRA adapter is already a LoRA"):
        convert_adapter(adapter, model, rank=2)
