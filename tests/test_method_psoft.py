"""PSOFT against PEFT itself: per layer (unfolded and folded) and whole model, float64 (≤ 1e-10) and float32
(≤ 1e-5), both families; the refusals; and why the load-time SVD has to be PEFT's exact call.

The oracle is PEFT *loading the saved adapter* (`PeftModel.from_pretrained`): A and B are not in the file, PEFT
rebuilds them from W0 at load exactly as Scute does. Two adjustments to PEFT, both in `psoft_build`:

* float64: PEFT refuses a float64 base ("PSOFT init requires float32/float16/bfloat16"). The float64 reference
  lets PEFT build its A and B its own way (float32 SVD of W0 — the tiny models' float64 weights are float32 values,
  so that SVD sees exactly W0) and then widens the two buffers to float64, so that PEFT's forward runs in float64
  instead of casting x down to the buffers' float32. In float32 it is PEFT's default path, untouched.
* randomization: `tests/helpers.randomize_adapter` does randomize every saved PSOFT tensor (`psoft_R.weight`,
  `vector_a`, `vector_b` are all trainable), but to 0.2·noise: magnitudes of ~0.2 scale R by ~0.04 and leave
  ``R − I ≈ −I``. Here the magnitudes become 1 + 0.3·noise and a free (``psoft_orth=False``) R becomes
  I + 0.2·noise, so R itself carries the adapter's effect and a wrong R cannot hide.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from peft import PeftModel, PsoftConfig

from scute.adapters import AdapterError, convert_checkpoint, load_adapter, read_checkpoint
from scute.adapters.conversion import linear_modules
from tests import helpers
from tests.helpers import ALL_LINEAR, edit_adapter_config, make_adapter, tiny_model
from tests.test_methods_extra import BOTH, T4, assert_matches_peft, peft_grid


@contextlib.contextmanager
def psoft_build():
    """PEFT's PSOFT with float64 buffers on a float64 base, and R's tensors randomized around their init."""
    from peft.tuners.psoft.layer import PsoftLayer

    build, randomize = PsoftLayer._build_psoft_ab_cache_buffers, helpers.randomize_adapter

    def build64(self, adapter_name, init_type):
        weight = self.get_base_layer().weight
        if weight.dtype != torch.float64:
            return build(self, adapter_name, init_type)
        w64 = weight.data
        assert torch.equal(w64.float().double(), w64), "PEFT's float32 SVD would not see W0 itself"
        weight.data = w64.float()
        try:
            build(self, adapter_name, init_type)  # PEFT's own float32 SVD and factors
        finally:
            weight.data = w64
        A, B = self._get_psoft_ab_cache_buffers(adapter_name)
        self._set_psoft_ab_cache_buffers(adapter_name, A.double(), B.double())

    def randomize_psoft(peft_model, seed=1):
        randomize(peft_model, seed)
        g = torch.Generator().manual_seed(seed + 100)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
                if name.endswith(("psoft_R.default.vector_a", "psoft_R.default.vector_b")):
                    p.copy_(1 + 0.3 * noise)
                elif name.endswith("psoft_R.default.weight") and p.dim() == 2:  # psoft_orth=False: R itself
                    p.copy_(torch.eye(p.shape[0], dtype=p.dtype) + 0.2 * noise)

    PsoftLayer._build_psoft_ab_cache_buffers, helpers.randomize_adapter = build64, randomize_psoft
    try:
        yield
    finally:
        PsoftLayer._build_psoft_ab_cache_buffers, helpers.randomize_adapter = build, randomize


def reload(family, dtype):
    """PEFT loading the saved adapter: A and B rebuilt from W0, R from the file."""
    return lambda path: PeftModel.from_pretrained(tiny_model(family, dtype), path).eval()


# name -> (config factory, families). Ranks: the widths are 64 (in and out of q/o, up/gate in, down out),
# 96 (up/gate out, down in), 32 (k/v out): r = 32 is full rank on k/v_proj.
CASES = {
    "cayley": (lambda: PsoftConfig(r=8, psoft_alpha=16, target_modules=ALL_LINEAR), BOTH),
    "cayley_r32": (lambda: PsoftConfig(r=32, psoft_alpha=8, target_modules=T4 + ["k_proj"]), ("llama",)),
    "neumann5": (lambda: PsoftConfig(r=4, psoft_alpha=6, use_cayley_neumann=True, target_modules=T4), BOTH),
    # ‖Q‖_F ≈ 0.2·√28 > 0.9: projected; t = 3 (the same polynomial as t = 4: I + 2Q + 2Q² + Q³)
    "neumann3_eps": (lambda: PsoftConfig(r=8, use_cayley_neumann=True, num_cayley_neumann_terms=3,
                                         cayley_neumann_eps=0.9, target_modules=T4), ("llama",)),
    # ‖Q‖_F ≈ 0.2·√3 < 0.95: not projected; t = 7
    "neumann7_eps_idle": (lambda: PsoftConfig(r=3, use_cayley_neumann=True, num_cayley_neumann_terms=7,
                                              cayley_neumann_eps=0.95, target_modules=T4), ("llama",)),
    "free_R_no_mag": (lambda: PsoftConfig(r=6, psoft_alpha=12, psoft_orth=False, psoft_mag_a=False,
                                          psoft_mag_b=False, target_modules=ALL_LINEAR), BOTH),
    "pissa_mag_a": (lambda: PsoftConfig(r=5, ab_svd_init="pissa_init", psoft_mag_b=False, target_modules=T4),
                    ("llama",)),
    "free_R_mag_b": (lambda: PsoftConfig(r=4, psoft_orth=False, psoft_mag_a=False, target_modules=T4),
                     ("qwen2",)),
    "lowrank": (lambda: PsoftConfig(r=4, psoft_svd="lowrank", psoft_svd_lowrank_niter=3, random_seed=7,
                                    target_modules=T4 + ["k_proj"]), BOTH),
}


@peft_grid({c: fams for c, (_, fams) in CASES.items()})
def test_psoft_matches_peft(case, family, dtype, tmp_path):
    assert_matches_peft(tmp_path, CASES[case][0](), family, dtype, build_ctx=psoft_build,
                        reference=reload(family, dtype))


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
