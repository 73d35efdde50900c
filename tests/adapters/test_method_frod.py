"""FRoD (its configs against PEFT, served dense: `test_peft_equality.py`): `frod_u` is PEFT's U bit for bit,
PEFT's module categories, and the refusals.

No patch of PEFT is needed in float64: PEFT's FRoD forward runs in the model dtype (x's), with U rounded to float32
at init whatever the model dtype — a rounding Scute repeats (`test_frod_u_as_peft_recomputes_it`).
"""

from __future__ import annotations

import pytest
import torch
from peft import FrodConfig

from scute.adapters import AdapterError, load_adapter, read_checkpoint
from scute.adapters.methods.frod import category, frod_u
from tests.helpers import make_adapter, tiny_model

T4 = ["q_proj", "v_proj", "up_proj", "down_proj"]


def test_frod_u_as_peft_recomputes_it():
    """`frod_u` is PEFT's U bit for bit (its own `_calculate_frod_u_and_lambda` on the same W0 and V)."""
    from peft.tuners.frod.layer import FrodLayer

    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(32, 64, generator=g, dtype=torch.float64) * 0.02
    v = torch.linalg.qr(torch.randn(64, 64, generator=g, dtype=torch.float64))[0]
    u_peft, _ = FrodLayer._calculate_frod_u_and_lambda(None, v, w0)
    assert torch.equal(frod_u(w0, v, torch.float64), u_peft.double())
    assert not torch.equal(frod_u(w0, v, torch.float64), _unrounded_u(w0, v))  # the float32 rounding matters
    w0[:, 5] = 0  # a zero column of W0 V⁻ᵀ (V = I): U's column is zero, as in PEFT
    eye = torch.eye(64, dtype=torch.float64)
    u_peft, _ = FrodLayer._calculate_frod_u_and_lambda(None, eye, w0)
    assert torch.equal(frod_u(w0, eye, torch.float64), u_peft.double())
    assert not frod_u(w0, eye, torch.float64)[:, 5].any()


def _unrounded_u(w0, v):
    coeff = torch.linalg.solve(v, w0.T).T
    return coeff / coeff.norm(dim=0)


def test_frod_categories():
    assert category("model.layers.0.self_attn.q_proj") == "self_attn_q_proj"
    assert category("model.layers.3.mlp.experts.2.gate_proj") == "gate_proj"
    assert category("encoder.layer.0.attention.output.dense") == "attention_output"
    assert category("lm_head") == "lm_head"


def test_frod_refused_without_dense(tmp_path):
    make_adapter(str(tmp_path), FrodConfig(target_modules=["q_proj"], progressbar=False))
    with pytest.raises(AdapterError, match=r"FRoD replaces the weight.*full rank.*dense=True"):
        load_adapter(tmp_path, tiny_model())


def test_frod_without_saved_projection_refused(tmp_path):
    make_adapter(str(tmp_path), FrodConfig(save_projection=False, target_modules=T4, progressbar=False))
    assert not any(k.startswith("base_model.frod_") for k in read_checkpoint(tmp_path).tensors)
    with pytest.raises(AdapterError, match="save_projection=True"):
        load_adapter(tmp_path, tiny_model(), dense=True)


def test_frod_wrong_basis_shape_refused(tmp_path):
    """A V of the wrong size (another model) is refused, naming the tensor."""
    make_adapter(str(tmp_path), FrodConfig(target_modules=["down_proj"], progressbar=False), hidden=64)
    from safetensors.torch import load_file, save_file

    file = tmp_path / "adapter_model.safetensors"
    sd = load_file(file)
    sd["base_model.frod_V.mlp_down_proj"] = sd["base_model.frod_V.mlp_down_proj"][:64, :64].contiguous()
    save_file(sd, file)
    with pytest.raises(AdapterError, match=r"frod_V.mlp_down_proj has shape \(64, 64\)"):
        load_adapter(tmp_path, tiny_model(), dense=True)
