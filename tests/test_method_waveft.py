"""WaveFT against PEFT itself: per layer (unfolded and folded) and whole model, float64 (≤ 1e-10) and float32
(≤ 1e-5), both families, served as a dense ΔW (``dense=True``); the refusals.

PEFT's spectrum and inverse DWT run in the adapter's dtype (float64 on a float64 base). The coefficient positions
are not in the file: PEFT regenerates them from `random_loc_seed` when it builds the layer, as Scute does at load;
one case checks against PEFT *reloading* the saved adapter.

One adjustment, in float64 only (`exact_filters`): PEFT's tabulated db3 filter (copied from PyWavelets) is up to
3.6e-12 off the exact Daubechies filter that Scute computes (its squares sum to 1 + 4.2e-12; db1, db2, db4..db10
agree to the last bit), which the tiny model's layers amplify to ~5e-10 in the float64 logits. The float64
reference is PEFT with its filter table replaced by the exact filters (`test_peft_db3_table_quirk` pins the
difference); in float32 it is PEFT's own table, untouched.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from peft import PeftModel, WaveFTConfig

from scute.adapters import AdapterError, load_adapter
from scute.adapters.methods.waveft import daubechies
from tests.helpers import ALL_LINEAR, make_adapter, tiny_model
from tests.test_methods_extra import BOTH, T4, assert_matches_peft


@contextlib.contextmanager
def exact_filters(dtype):
    """PEFT's WaveFT with the exact Daubechies filters in its table (float64 only; see the module docstring)."""
    if dtype != torch.float64:
        yield
        return
    from peft.tuners.waveft import wavelet

    saved = dict(wavelet._WAVELET_COEFFS)
    wavelet._WAVELET_COEFFS.update({f"db{n}": list(daubechies(n)) for n in range(1, 11)})
    try:
        yield
    finally:
        wavelet._WAVELET_COEFFS.clear()
        wavelet._WAVELET_COEFFS.update(saved)

# in/out: 64/64 (q, o), 64/32 (k, v), 64/96 (gate, up), 96/64 (down)
CASES = {
    "db1": lambda: WaveFTConfig(n_frequency=300, scaling=5.0, target_modules=ALL_LINEAR),
    # L = 4: a padded 66×66 grid etc.; n per layer from the pattern
    "db2_pattern": lambda: WaveFTConfig(n_frequency=150, scaling=7.0, wavelet_family="db2", random_loc_seed=3,
                                        n_frequency_pattern={"up_proj": 40, "k_proj": 2048}, target_modules=ALL_LINEAR),
    "db3": lambda: WaveFTConfig(n_frequency=120, scaling=3.0, wavelet_family="db3", target_modules=T4),
    # L = 20: the grid is 18 wider than the layer on each axis
    "db10": lambda: WaveFTConfig(n_frequency=500, scaling=2.0, wavelet_family="db10", target_modules=T4),
    "no_idwt": lambda: WaveFTConfig(n_frequency=200, scaling=4.0, use_idwt=False, target_modules=ALL_LINEAR),
    "proportional": lambda: WaveFTConfig(n_frequency=100, scaling=5.0, wavelet_family="db4",
                                         proportional_parameters=True, target_modules=ALL_LINEAR),
}


@pytest.mark.parametrize("family", BOTH)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", list(CASES))
def test_waveft_matches_peft(case, dtype, family, tmp_path):
    assert_matches_peft(tmp_path, CASES[case](), family, dtype, run_ctx=exact_filters, dense=True)


def test_waveft_matches_peft_reloaded(tmp_path):
    """The positions come from the seed on both sides: PEFT reloading the file agrees too."""
    config = WaveFTConfig(n_frequency=250, scaling=6.0, wavelet_family="db5", random_loc_seed=11, target_modules=T4)
    reload = lambda path: PeftModel.from_pretrained(tiny_model("qwen2", torch.float64), path).eval()
    assert assert_matches_peft(tmp_path, config, "qwen2", torch.float64, dense=True, reference=reload,
                               run_ctx=exact_filters) <= 1e-10


def test_daubechies_filters():
    """The spectral factorization gives orthonormal filters with N vanishing moments, the Haar one for N = 1."""
    assert daubechies(1) == pytest.approx([2 ** -0.5] * 2, abs=1e-16)
    for n in range(1, 11):
        g = torch.tensor(daubechies(n), dtype=torch.float64)
        assert g.shape == (2 * n,)
        assert abs(g.sum().item() - 2 ** 0.5) < 1e-14
        for shift in range(n):  # ⟨g, g shifted by 2·shift⟩ = δ
            assert abs((g[2 * shift:] @ g[:2 * n - 2 * shift]).item() - (shift == 0)) < 1e-14
        k = torch.arange(2 * n, dtype=torch.float64)
        for p in range(n):  # the high-pass filter kills polynomials of degree < N
            assert abs(((-1) ** k * k ** p * g).sum().item()) < 1e-9 * max(1, (2 * n) ** p)


def test_peft_db3_table_quirk():
    """The one filter where PEFT's table is not the exact one: db3, off by up to 3.6e-12."""
    from peft.tuners.waveft.wavelet import Wavelet

    for n in range(1, 11):
        diff = max(abs(a - b) for a, b in zip(daubechies(n), Wavelet(f"db{n}").rec_lo))
        assert (diff < 1e-11 and diff > 1e-12) if n == 3 else diff == 0.0, (n, diff)


def test_waveft_refused_without_dense(tmp_path):
    make_adapter(str(tmp_path), WaveFTConfig(n_frequency=50, target_modules=["q_proj"]))
    with pytest.raises(AdapterError, match=r"inverse wavelet transform of a sparse spectrum.*dense=True"):
        load_adapter(tmp_path, tiny_model())


@pytest.mark.parametrize("family", ["sym2", "coif1", "db11"])
def test_waveft_unsupported_wavelet_refused(family, tmp_path):
    """PEFT accepts symlets, coiflets and db11+ in its config (db11+ then fails in its own forward): refused."""
    make_adapter(str(tmp_path), WaveFTConfig(n_frequency=50, wavelet_family=family, target_modules=["q_proj"]))
    with pytest.raises(AdapterError, match=rf"wavelet_family='{family}' is not supported"):
        load_adapter(tmp_path, tiny_model(), dense=True)


def test_waveft_spectrum_too_long_refused(tmp_path):
    import json
    import os

    from safetensors.torch import load_file, save_file

    make_adapter(str(tmp_path), WaveFTConfig(n_frequency=50, target_modules=["q_proj"]))
    f = os.path.join(tmp_path, "adapter_model.safetensors")
    tensors = {k: torch.zeros(64 * 64 + 1) for k in load_file(f)}
    save_file(tensors, f)
    with open(os.path.join(tmp_path, "adapter_config.json")) as fh:
        assert json.load(fh)["peft_type"] == "WAVEFT"
    with pytest.raises(AdapterError, match=r"expected \[n\] with 0 < n ≤ out·in = 4096"):
        load_adapter(tmp_path, tiny_model(), dense=True)


@pytest.mark.parametrize("wavelet", ["db1", "db2", "db7"])
@pytest.mark.parametrize("shape", [(33, 47), (48, 21)], ids=["33x47", "48x21"])
def test_waveft_odd_shapes(wavelet, shape):
    """Odd widths (padded by one more, then cropped): the converter's ΔW against PEFT's layer, float64."""
    from peft.tuners.waveft.layer import WaveFTLinear

    from scute.adapters.conversion import LayerCheckpoint
    from scute.adapters.methods.waveft import convert_waveft

    out, inp = shape
    base = torch.nn.Linear(inp, out, bias=False, dtype=torch.float64)
    config = WaveFTConfig(n_frequency=300, scaling=3.0, wavelet_family=wavelet, random_loc_seed=5)
    layer = WaveFTLinear(base, "default", config=config, n_frequency=300)
    with torch.no_grad():
        layer.waveft_spectrum["default"].copy_(torch.randn(300, generator=torch.Generator().manual_seed(2)))
    with exact_filters(torch.float64), torch.no_grad():
        expected = layer.get_delta_weight("default").double()
    ckpt = LayerCheckpoint("m", config.to_dict(), base, None,
                           {"waveft_spectrum": layer.waveft_spectrum["default"].detach()}, None, {}, {}, dense=True)
    slots = convert_waveft(ckpt)
    got = slots.B @ slots.A
    assert got.shape == (out, inp) and expected.abs().max() > 0.1
    assert (got - expected).abs().max() <= 1e-12 * expected.abs().max()
