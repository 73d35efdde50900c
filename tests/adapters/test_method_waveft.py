"""WaveFT (its configs against PEFT, served dense: `test_peft_equality.py`): the Daubechies filters, the one
quirk of PEFT's filter table (db3, which `tests/helpers.exact_filters` replaces in float64), odd layer shapes
against PEFT's layer, and the refusals.
"""

from __future__ import annotations

import pytest
import torch
from peft import WaveFTConfig

from scute.adapters import AdapterError, load_adapter
from scute.adapters.methods.waveft import daubechies
from tests.helpers import exact_filters, make_adapter, tiny_model


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
