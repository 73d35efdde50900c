"""TinyLoRA (its configs against PEFT, with its saved buffers perturbed: `test_peft_equality.py`): the SVD
factor shared between adapters, and the refusals.
"""

from __future__ import annotations


import pytest
import torch
from peft import TinyLoraConfig
from safetensors.torch import load_file, save_file

from scute.adapters import AdapterError, load_adapter
from tests.helpers import make_adapter, tiny_model

T4 = ["q_proj", "v_proj", "up_proj", "down_proj"]


def test_tinylora_shares_the_svd_factor(tmp_path):
    """The SVD factor on the wider side is shared (interned) between adapters loaded with one table; R goes into
    the other."""
    model, interned = tiny_model(), {}
    adapters = []
    for seed in (1, 2):
        make_adapter(str(tmp_path / str(seed)), TinyLoraConfig(r=2, u=5, target_modules=T4), seed=seed)
        adapters.append(load_adapter(tmp_path / str(seed), model, interned=interned))
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
