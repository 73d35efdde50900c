"""PSOFT (its configs against PEFT reloading them: `test_peft_equality.py`, with `tests/helpers.psoft_build`):
why the load-time SVD has to be PEFT's exact call, and the refusals.
"""

from __future__ import annotations

import pytest
import torch
from peft import PsoftConfig

from scute.adapters import AdapterError, convert_checkpoint, load_adapter, read_checkpoint
from scute.adapters.conversion import linear_modules
from tests.helpers import edit_adapter_config, make_adapter, psoft_build, tiny_model


def test_psoft_delta_is_peft_delta_and_not_sign_invariant(tmp_path, monkeypatch):
    """Scute's B·A' equals PEFT's own `get_delta_weight`; an equally valid SVD with one singular pair's sign
    flipped gives another adapter (R's off-diagonal entries of that row and column change sign), so Scute must
    and does reproduce PEFT's exact SVD call rather than anything sign-invariant."""
    with psoft_build():
        peft_model = make_adapter(str(tmp_path), PsoftConfig(r=6, target_modules=["q_proj", "down_proj"]),
                                  "llama", torch.float64)
    base = tiny_model("llama", torch.float64)
    modules = linear_modules(base)

    def deltas():
        slots = convert_checkpoint(read_checkpoint(tmp_path), modules)
        return {n: s.scale * s.B @ s.A for n, s in slots.items()}

    peft_layers = {n[len("base_model.model."):]: m for n, m in peft_model.named_modules()
                   if type(m).__name__ == "Linear" and hasattr(m, "psoft_R")}
    exact = deltas()
    assert set(exact) == set(peft_layers)
    for name, delta in exact.items():
        expected = peft_layers[name].get_delta_weight("default")
        assert ((delta - expected).abs().max() / expected.abs().max()).item() <= 1e-12, name

    svd = torch.linalg.svd

    def flipped_svd(W, **kwargs):
        U, S, Vh = svd(W, **kwargs)
        U, Vh = U.clone(), Vh.clone()
        U[:, 1], Vh[1] = -U[:, 1], -Vh[1]
        return U, S, Vh

    monkeypatch.setattr(torch.linalg, "svd", flipped_svd)
    W = modules["model.layers.0.self_attn.q_proj"].weight.float()
    U, S, Vh = torch.linalg.svd(W, full_matrices=False)
    assert torch.allclose(U * S @ Vh, W, atol=1e-5)  # a valid SVD of the same W0
    for name, delta in deltas().items():
        assert ((delta - exact[name]).norm() / exact[name].norm()).item() > 1e-2, name


@pytest.mark.parametrize("changes,message", [
    ({"random_seed": None}, r"psoft_svd='lowrank' is set without random_seed: .*global RNG state"),
    ({"psoft_svd": "qr"}, r"psoft_svd='qr' is set: PEFT knows only"),
    ({"ab_svd_init": "olora"}, r"ab_svd_init='olora' is set: PEFT knows only"),
    ({"r": 40}, r"r=40 does not fit this layer"),
    ({"psoft_alpha": 0}, r"psoft_alpha=0 is set"),
], ids=["lowrank_unseeded", "svd_mode", "init", "rank", "alpha0"])
def test_psoft_refusals(changes, message, tmp_path):
    make_adapter(str(tmp_path), PsoftConfig(r=4, psoft_svd="lowrank", target_modules=["v_proj"]))
    edit_adapter_config(tmp_path, **changes)
    with pytest.raises(AdapterError, match=message):
        load_adapter(tmp_path, tiny_model())


def test_psoft_config_and_file_must_agree(tmp_path):
    """A magnitude the config switches off but the file holds, or one the file lacks, is refused."""
    make_adapter(str(tmp_path), PsoftConfig(r=4, target_modules=["q_proj"]))
    edit_adapter_config(tmp_path, psoft_mag_a=False)
    with pytest.raises(AdapterError, match=r"unexpected tensor 'psoft_R.vector_a'"):
        load_adapter(tmp_path, tiny_model())
    edit_adapter_config(tmp_path, psoft_orth=False)
    with pytest.raises(AdapterError, match=r"psoft_R.weight' has shape \(6,\).*\(4, 4\)"):
        load_adapter(tmp_path, tiny_model())
