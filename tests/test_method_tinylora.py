"""TinyLoRA against PEFT: per layer (unfolded and folded) and whole model, float64 (≤ 1e-10) and float32
(≤ 1e-5), llama and qwen2; refusals.

PEFT's frozen buffers are perturbed before saving as well as v (randomized by `make_adapter`): the SVD factors
tinylora_A/B (so a converter that recomputed them from W0 would fail) and the projections P by a relative 1e-3
(so one that regenerated P from the seed would fail, while P stays recognisably the draw for its seed).
"""

from __future__ import annotations


import pytest
import torch
from peft import TinyLoraConfig
from safetensors.torch import load_file, save_file

from scute.adapters import AdapterError, load_adapter
from tests.helpers import ALL_LINEAR, make_adapter, perturbed_buffers, tiny_model
from tests.test_methods_extra import BOTH, T4, assert_matches_peft, peft_grid


def tinylora_buffers(name: str) -> float:
    """The SVD factors strongly, the projections P by a relative 1e-3 (see the module docstring)."""
    return 1e-3 if ".tinylora_P." in name else 0.5 if ".tinylora_" in name else 0.0


CONFIGS = {
    # one v per layer (14 layers), r = 2 everywhere
    "r2_all_linear": lambda: TinyLoraConfig(r=2, u=5, target_modules=ALL_LINEAR),
    # 8 layers, weight_tying 0.5: 4 groups of 2 layers
    "tied_half": lambda: TinyLoraConfig(r=4, u=13, weight_tying=0.5, projection_seed=7, target_modules=T4),
    # one v for all layers, u = 1
    "tied_full_u1": lambda: TinyLoraConfig(r=3, u=1, weight_tying=1.0, target_modules=T4),
    # r = 40 clipped to 32 on v_proj (32×64); 8 layers, weight_tying 0.3: round(5.6) = 6 groups of 1, the last 3
    # layers share group 5; u·r² < 16 nowhere
    "r_clipped_tied": lambda: TinyLoraConfig(r=40, u=3, weight_tying=0.3, target_modules=T4),
    # bias="all": trained biases of every layer, adapted or not (k_proj only has a bias in the file)
    "bias_all": lambda: TinyLoraConfig(r=2, u=4, bias="all", target_modules=["q_proj", "v_proj", "down_proj"]),
}


@peft_grid(dict.fromkeys(CONFIGS, BOTH))
def test_tinylora_matches_peft(case, family, dtype, tmp_path):
    assert_matches_peft(tmp_path, CONFIGS[case](), family, dtype, build_ctx=lambda: perturbed_buffers(tinylora_buffers))


def test_tinylora_shares_the_svd_factor(tmp_path):
    """The SVD factor on the wider side is shared (interned) between adapters; R goes into the other."""
    model = tiny_model()
    adapters = []
    for seed in (1, 2):
        make_adapter(str(tmp_path / str(seed)), TinyLoraConfig(r=2, u=5, target_modules=T4), seed=seed)
        adapters.append(load_adapter(tmp_path / str(seed), model))
    a, b = (x.layers["model.layers.0.self_attn.q_proj"] for x in adapters)  # out ≤ in: A shared
    assert a.shared == {"A"} and a.A is b.A and not torch.equal(a.B, b.B)
    a, b = (x.layers["model.layers.0.mlp.up_proj"] for x in adapters)  # out > in: B shared
    assert a.shared == {"B"} and a.B is b.B and not torch.equal(a.A, b.A)


def test_tinylora_without_saved_projections_refused(tmp_path):
    make_adapter(str(tmp_path), TinyLoraConfig(r=2, u=5, save_projection=False, target_modules=T4))
    with pytest.raises(AdapterError, match="save_projection=False is set: .*torch.normal"):
        load_adapter(tmp_path, tiny_model())


def test_tinylora_foreign_layer_order_refused(tmp_path):
    """Two layers' projections swapped: the layer ↔ v pairing is not PEFT's, so the file is refused."""
    make_adapter(str(tmp_path), TinyLoraConfig(r=2, u=5, target_modules=T4))
    file = tmp_path / "adapter_model.safetensors"
    t = load_file(file)
    a, b = (f"base_model.model.model.layers.0.{m}.tinylora_P" for m in ("self_attn.q_proj", "mlp.up_proj"))
    t[a], t[b] = t[b], t[a]
    save_file(t, file)
    with pytest.raises(AdapterError, match="not PEFT's draw for seed projection_seed"):
        load_adapter(tmp_path, tiny_model())
