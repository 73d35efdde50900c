"""GraLoRA against PEFT: per layer (unfolded and folded) and whole model, float64 (≤ 1e-10) and float32 (≤ 1e-5),
on llama and qwen2 (biased q/k/v), several k, r, hybrid ranks and targets; inconsistent checkpoints refused; and one
batch mixing a GraLoRA adapter with a LoRA one and base rows.

The widths of the tiny model (hidden 64, intermediate 96, k/v out 32) are divisible by k = 1, 2, 4, 8 on every
linear layer, so those run on ALL_LINEAR.
"""

from __future__ import annotations


import pytest
import torch
from peft import GraloraConfig, LoraConfig

import scute.adapters.methods.gralora
from scute.adapters import AdapterError, convert_checkpoint, load_adapter, read_checkpoint, supported_methods
from scute.adapters.conversion import linear_modules
from scute.adapters.registry import get_method
from scute.model.hf import place_adapter, swap_linears
from tests.helpers import ALL_LINEAR, edit_adapter_config, effect_err, make_adapter, rel_err, tiny_model
from tests.test_methods_extra import BOTH, QKV, T4, TOL, assert_matches_peft, peft_grid, run

CASES = {
    "k2_r4": (lambda: GraloraConfig(r=4, gralora_k=2, alpha=8, target_modules=T4), BOTH),
    "k4_r8_hybrid3": (lambda: GraloraConfig(r=8, gralora_k=4, hybrid_r=3, alpha=5, target_modules=ALL_LINEAR),
                      BOTH),
    # s = r / k = 1: every sub-block rank 1
    "k8_r8": (lambda: GraloraConfig(r=8, gralora_k=8, alpha=12, target_modules=ALL_LINEAR), ("llama",)),
    # k = 1 is plain LoRA (plus the hybrid LoRA)
    "k1_r3_hybrid2": (lambda: GraloraConfig(r=3, gralora_k=1, hybrid_r=2, alpha=7, target_modules=T4), ("llama",)),
    "k2_r6_hybrid1": (lambda: GraloraConfig(r=6, gralora_k=2, hybrid_r=1, alpha=3, target_modules=T4), ("qwen2",)),
    # trained biases (saved as base_layer.bias): the loader's generic correction
    "k2_r4_bias": (lambda: GraloraConfig(r=4, gralora_k=2, hybrid_r=2, bias="gralora_only", target_modules=QKV),
                   ("qwen2",)),
}


@peft_grid({c: fams for c, (_, fams) in CASES.items()})
def test_gralora_matches_peft(case, family, dtype, tmp_path):
    assert_matches_peft(tmp_path, CASES[case][0](), family, dtype)


def test_gralora_registered():
    """The registry serves GraLoRA through `scute.adapters.methods.gralora`."""
    assert get_method("GRALORA").convert is scute.adapters.methods.gralora.convert_gralora
    assert "GRALORA" in supported_methods()


def test_gralora_normal_form_rank(tmp_path):
    """Rank k·r + hybrid_r, scale alpha / (r + hybrid_r), each block row of A reading one input chunk only."""
    make_adapter(str(tmp_path), GraloraConfig(r=8, gralora_k=4, hybrid_r=3, alpha=5, target_modules=["up_proj"]),
                 "llama", torch.float64)
    slots = convert_checkpoint(read_checkpoint(tmp_path), linear_modules(tiny_model("llama", torch.float64)))
    s = slots["model.layers.0.mlp.up_proj"]  # in 64, out 96
    assert s.rank == 4 * 8 + 3 and s.scale == 5 / 11
    assert s.A[:8, 16:].abs().sum() == 0 and s.A[8:16, :16].abs().sum() == 0
    assert s.B[:24, 2:8].abs().sum() == 0  # chunk 0's ranks 2..7 feed output chunks 1..3 only


@pytest.mark.parametrize("changes,message", [
    ({"hybrid_r": 0}, r"hybrid LoRA tensors .* hybrid_r=0"),
    ({"hybrid_r": 5}, r"tensor 'gralora_A_general.weight' has shape \(2, 64\), the base layer needs \(5, 64\)"),
    ({"gralora_k": 4}, r"tensor 'gralora_A' has shape \(2, 32, 4\), the base layer needs \(4, 16, 4\)"),
    ({"gralora_k": 3}, r"r=4 is not divisible by gralora_k=3"),
    ({"r": 6, "gralora_k": 3}, r"gralora_k=3 does not divide in_features=64"),
    ({"gralora_k": 0}, r"gralora_k=0 .* integer ≥ 1"),
], ids=["hybrid_dropped", "hybrid_mismatch", "k_mismatch", "r_not_divisible", "k_not_dividing", "k_zero"])
def test_gralora_inconsistent_checkpoint_refused(changes, message, tmp_path):
    """A config that does not match the saved tensors is refused, naming the option or tensor."""
    make_adapter(str(tmp_path), GraloraConfig(r=4, gralora_k=2, hybrid_r=2, target_modules=["q_proj"]))
    edit_adapter_config(tmp_path, **changes)
    with pytest.raises(AdapterError, match=message):
        load_adapter(tmp_path, tiny_model())


def test_gralora_fan_in_fan_out_refused(tmp_path):
    make_adapter(str(tmp_path), GraloraConfig(r=4, target_modules=["q_proj"]))
    edit_adapter_config(tmp_path, fan_in_fan_out=True)
    with pytest.raises(AdapterError, match="fan_in_fan_out=True"):
        load_adapter(tmp_path, tiny_model())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_gralora_mixed_batch(dtype, tmp_path):
    """One forward with rows of two GraLoRA adapters (one hybrid), a LoRA adapter and base rows, in shuffled
    slots: each row equals PEFT with that adapter alone."""
    configs = {
        "gralora": GraloraConfig(r=8, gralora_k=4, hybrid_r=3, alpha=5, target_modules=ALL_LINEAR),
        "gralora_k2": GraloraConfig(r=4, gralora_k=2, alpha=8, target_modules=T4),
        "lora": LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR),
    }
    ids = torch.randint(0, 128, (5, 6), generator=torch.Generator().manual_seed(3))
    model = tiny_model("qwen2", dtype)
    refs, adapters = {}, {}
    for i, (name, config) in enumerate(configs.items()):
        peft_model = make_adapter(str(tmp_path / name), config, "qwen2", dtype, seed=20 + i)
        with torch.no_grad():
            refs[name] = peft_model(ids).logits
        adapters[name] = load_adapter(tmp_path / name, model, name=name)
    with torch.no_grad():
        base_logits = model(ids).logits
    linears = swap_linears(model, max_adapters=3)
    order = ["lora", "gralora", "gralora_k2"]
    for slot, name in enumerate(order):
        place_adapter(linears, slot, adapters[name])
    rows = ["gralora", None, "lora", "gralora_k2", None]
    logits = run(model, [-1 if r is None else order.index(r) for r in rows], ids)
    for i, name in enumerate(rows):
        if name is None:
            assert torch.equal(logits[i], base_logits[i])
            continue
        assert rel_err(logits[i], refs[name][i]) <= TOL[dtype]["rel"], name
        assert effect_err(logits[i], refs[name][i], base_logits[i]) <= TOL[dtype]["effect"], name
