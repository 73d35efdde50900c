"""Uni-LoRA (its configs against PEFT, indices saved or not: `test_peft_equality.py`): the index
regeneration against PEFT's buffers.
"""

from __future__ import annotations

import pytest
import torch
from peft import UniLoraConfig, get_peft_model
from peft.tuners.unilora.layer import UniLoraLayer

from scute.adapters.methods.unilora import regenerate_indices
from tests.helpers import ALL_LINEAR, tiny_model

T4 = ["q_proj", "v_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("config", [
    UniLoraConfig(r=4, theta_d_length=64, target_modules=T4),
    UniLoraConfig(r=3, theta_d_length=5000, proj_seed=3, target_modules=ALL_LINEAR),
], ids=["r4_d64", "r3_all_linear"])
def test_unilora_regenerated_indices_match_peft(config, dtype):
    """`regenerate_indices` from the layers' shapes in model order reproduces PEFT's indices and scales exactly."""
    peft_model = get_peft_model(tiny_model("llama", dtype), config)
    layers = [m for m in peft_model.modules() if isinstance(m, UniLoraLayer)]
    shapes = [(m.out_features, m.in_features) for m in layers]
    got = regenerate_indices(shapes, config.r, config.theta_d_length, config.proj_seed)
    for m, (ia, ib, sa, sb) in zip(layers, got, strict=True):
        assert torch.equal(ia, m.unilora_indices_A["default"]) and torch.equal(ib, m.unilora_indices_B["default"])
        assert torch.equal(sa.to(dtype), m.unilora_scales_A["default"])
        assert torch.equal(sb.to(dtype), m.unilora_scales_B["default"])
