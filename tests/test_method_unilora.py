"""Uni-LoRA against PEFT: per layer (unfolded and folded) and whole model, float64 (≤ 1e-10) and float32
(≤ 1e-5), llama and qwen2, from checkpoints saved with save_indices=True, and with PEFT's default
save_indices=False (θ alone: every layer's indices rebuilt); the index regeneration against PEFT's buffers.

θ is randomized by `make_adapter`; the saved scales are perturbed too (they are 1/√count, nearly constant), so
a converter that recomputed them instead of reading them would fail.
"""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel, UniLoraConfig, get_peft_model
from peft.tuners.unilora.layer import UniLoraLayer
from safetensors.torch import load_file

from scute.adapters.methods.unilora import regenerate_indices
from tests.helpers import ALL_LINEAR, make_adapter, perturbed_buffers, tiny_model
from tests.test_methods_extra import BOTH, T4, assert_matches_peft, peft_grid


def unilora_scales(name: str) -> float:
    """UniLoRA's saved scales."""
    return 0.5 if ".unilora_scales_" in name else 0.0


CONFIGS = {
    "r4_d64": lambda: UniLoraConfig(r=4, theta_d_length=64, save_indices=True, target_modules=T4),
    # D = 3·1856 = 5568 entries over d = 5000: counts 1 or 2
    "r3_all_linear": lambda: UniLoraConfig(r=3, theta_d_length=5000, proj_seed=3, save_indices=True,
                                           target_modules=ALL_LINEAR),
    # heavy collisions: 7 values for 8·(2·128 + 2·96) entries
    "r8_d7": lambda: UniLoraConfig(r=8, theta_d_length=7, save_indices=True, target_modules=["q_proj", "v_proj"]),
    "bias_all": lambda: UniLoraConfig(r=4, theta_d_length=128, bias="all", save_indices=True,
                                      target_modules=["q_proj", "down_proj"]),
}


@peft_grid(dict.fromkeys(CONFIGS, BOTH))
def test_unilora_matches_peft(case, family, dtype, tmp_path):
    assert_matches_peft(tmp_path, CONFIGS[case](), family, dtype, build_ctx=lambda: perturbed_buffers(unilora_scales))


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


UNSAVED = {  # PEFT's default save_indices=False: the file holds θ (and trained biases) only
    "default": lambda: UniLoraConfig(r=4, theta_d_length=64, target_modules=T4),
    "all_linear_bias": lambda: UniLoraConfig(r=3, theta_d_length=500, proj_seed=5, bias="all",
                                             target_modules=ALL_LINEAR),
}


@peft_grid(dict.fromkeys(UNSAVED, BOTH))
def test_unilora_without_saved_indices_matches_peft(case, family, dtype, tmp_path):
    """Every targeted layer's indices and scales rebuilt from the base model's layer order (against PEFT
    reloading the file, which rebuilds them too)."""
    assert not any("unilora_indices" in k for k in _saved_keys(tmp_path, UNSAVED[case](), family, dtype))
    assert_matches_peft(tmp_path, UNSAVED[case](), family, dtype,
                        reference=lambda path: PeftModel.from_pretrained(tiny_model(family, dtype), path))


def _saved_keys(path, config, family, dtype) -> list[str]:
    make_adapter(str(path / "probe"), config, family, dtype)
    return list(load_file(str(path / "probe" / "adapter_model.safetensors")))
