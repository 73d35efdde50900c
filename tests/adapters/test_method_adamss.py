"""AdaMSS (its configs against PEFT: `test_peft_equality.py`): against PEFT reloading the checkpoint (which
recomputes the row partition from W0, as Scute does) with a perturbed newB (bias column included, on qwen2); and the
refusals.

PEFT needs scikit-learn to build an AdaMSS adapter (KMeans), and so does Scute to recompute its partition.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sklearn")

from peft import AdamssConfig, PeftModel
from safetensors.torch import load_file, save_file

from scute.adapters import AdapterError, load_adapter
from tests.helpers import ALL_LINEAR, assert_matches_peft, make_adapter, tiny_model


def _scatter_indices(peft_model) -> dict[str, torch.Tensor]:
    return {n: m.scatter_index["default"] for n, m in peft_model.named_modules()
            if getattr(m, "scatter_index", None)}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_adamss_reloaded_checkpoint(dtype, tmp_path):
    """The reference is PEFT loading the saved checkpoint (its partition recomputed at load), with newB perturbed
    in the file (a random projection, bias column included), so that its exact value is what is tested."""
    config = AdamssConfig(r=16, num_subspaces=4, subspace_rank=2, target_modules=ALL_LINEAR)

    def reload(path):
        file = f"{path}/adapter_model.safetensors"
        tensors = load_file(file)
        g = torch.Generator().manual_seed(3)
        for key, x in tensors.items():
            if key.endswith("adamss_newB"):
                tensors[key] = x + 0.3 * torch.randn(x.shape, generator=g, dtype=torch.float64).to(x.dtype)
        save_file(tensors, file)
        model = PeftModel.from_pretrained(tiny_model("qwen2", dtype), path).eval()
        scatter = _scatter_indices(model)
        # the partitions are not trivial (a converter ignoring them would fail) and match the in-memory model's
        assert any(not torch.equal(s, torch.arange(len(s))) for s in scatter.values())
        assert all(torch.equal(s, built[n]) for n, s in scatter.items())
        return model

    built = _scatter_indices(make_adapter(str(tmp_path), config, "qwen2", dtype))
    assert_matches_peft(tmp_path, config, "qwen2", dtype, reference=reload)


def test_adamss_other_base_refused(tmp_path):
    """Another base (another W0: another partition, whose row counts differ from the saved ones) is refused."""
    make_adapter(str(tmp_path), AdamssConfig(r=16, num_subspaces=4, subspace_rank=2, target_modules=["q_proj"]))
    with pytest.raises(AdapterError, match=r"subspaces recomputed from the base weight.*PEFT recomputes it"):
        load_adapter(tmp_path, tiny_model(seed=5))


def test_adamss_needs_sklearn(tmp_path, monkeypatch):
    make_adapter(str(tmp_path), AdamssConfig(r=16, num_subspaces=4, subspace_rank=2, target_modules=["q_proj"]))
    monkeypatch.setitem(__import__("sys").modules, "sklearn.cluster", None)
    with pytest.raises(AdapterError, match="install scikit-learn"):
        load_adapter(tmp_path, tiny_model())


def test_adamss_missing_subspace_refused(tmp_path):
    make_adapter(str(tmp_path), AdamssConfig(r=16, num_subspaces=4, subspace_rank=2, target_modules=["q_proj"]))
    file = f"{tmp_path}/adapter_model.safetensors"
    save_file({k: v for k, v in load_file(file).items() if not k.endswith("adamss_B.1")}, file)
    with pytest.raises(AdapterError, match="some are missing"):
        load_adapter(tmp_path, tiny_model())
