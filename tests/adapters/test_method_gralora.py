"""GraLoRA (its configs against PEFT: `test_peft_equality.py`): registration, the normal form's rank and
block structure, inconsistent checkpoints refused, and one batch mixing GraLoRA adapters with a LoRA one and base
rows, each row against PEFT with that adapter alone.
"""

from __future__ import annotations


import pytest
import torch
from peft import GraloraConfig, LoraConfig

import scute.adapters.methods.gralora
from scute.adapters import AdapterError, convert_checkpoint, load_adapter, read_checkpoint, supported_methods
from scute.adapters.conversion import linear_modules
from scute.adapters.registry import get_method
from tests.helpers import (
    ALL_LINEAR,
    TOL,
    assert_rows_match,
    edit_adapter_config,
    make_adapter,
    mixed_forward,
    peft_alone,
    tiny_model,
)

T4 = ["q_proj", "v_proj", "up_proj", "down_proj"]

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
        "gralora": lambda: GraloraConfig(r=8, gralora_k=4, hybrid_r=3, alpha=5, target_modules=ALL_LINEAR),
        "gralora_k2": lambda: GraloraConfig(r=4, gralora_k=2, alpha=8, target_modules=T4),
        "lora": lambda: LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR),
    }
    ids = torch.randint(0, 128, (5, 6), generator=torch.Generator().manual_seed(3))
    refs, paths = peft_alone(tmp_path, configs, "qwen2", dtype, ids, seed=20)
    model = tiny_model("qwen2", dtype)
    adapters = {name: load_adapter(path, model, name=name) for name, path in paths.items()}
    with torch.no_grad():
        base_logits = model(ids).logits
    rows = ["gralora", None, "lora", "gralora_k2", None]
    logits = mixed_forward(model, adapters, ["lora", "gralora", "gralora_k2"], rows, ids)
    assert_rows_match(logits, rows, refs, base_logits, TOL[dtype])
