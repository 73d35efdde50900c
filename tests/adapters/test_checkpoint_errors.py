"""Bad adapters fail at the boundary with an error that names the file, the module and the problem."""

from __future__ import annotations

import os

import pytest
import torch
from peft import LoraConfig, OFTConfig, PeanutConfig
from safetensors.torch import load_file, save_file

from scute.adapters import AdapterError, load_adapter, read_checkpoint
from scute.adapters.checkpoint import SAFETENSORS
from tests.helpers import edit_adapter_config, make_adapter, tiny_model

Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
WEIGHTS = SAFETENSORS


def edit_tensors(path, fn):
    tensors = load_file(os.path.join(path, WEIGHTS))
    fn(tensors)
    save_file(tensors, os.path.join(path, WEIGHTS))


def load_error(path, model=None, **kw) -> str:
    with pytest.raises(AdapterError) as e:
        load_adapter(path, model if model is not None else tiny_model(), **kw)
    return str(e.value)


def test_good_adapter_loads(lora_dir):
    adapter = load_adapter(lora_dir, tiny_model())
    assert adapter.peft_type == "LORA" and len(adapter.layers) == 4
    assert all(s.live == ("A", "B") and s.merged == ("s",) for s in adapter.layers.values())


def test_unknown_peft_type_lists_supported(lora_dir):
    edit_adapter_config(lora_dir, peft_type="FOO")
    msg = load_error(lora_dir)
    assert "'FOO' is not supported" in msg and all(m in msg for m in ("IA3", "LORA", "OFT", "VERA"))


@pytest.mark.parametrize("peft_type, why", [("XLORA", "hidden states"), ("PREFIX_TUNING", "virtual tokens"),
                                            ("LN_TUNING", "LayerNorm")])
def test_known_unserved_peft_type_says_why(lora_dir, peft_type, why):
    edit_adapter_config(lora_dir, peft_type=peft_type)
    msg = load_error(lora_dir)
    assert f"{peft_type!r} is not supported: " in msg and why in msg and "LORA" in msg.split("supported: ")[-1]


def test_missing_tensor(lora_dir):
    edit_tensors(lora_dir, lambda t: t.pop(f"{Q0}.lora_B.weight"))
    msg = load_error(lora_dir)
    assert "model.layers.0.self_attn.q_proj" in msg and "missing tensor 'lora_B.weight'" in msg


def test_targeted_module_without_tensors(lora_dir):
    edit_tensors(lora_dir, lambda t: [t.pop(k) for k in list(t) if k.startswith(Q0)])
    assert "targets model.layers.0.self_attn.q_proj but the file has no tensors" in load_error(lora_dir)


def test_extra_tensor(lora_dir):
    edit_tensors(lora_dir, lambda t: t.update({f"{Q0}.lora_C.weight": torch.zeros(2)}))
    assert "unexpected tensor" in load_error(lora_dir) and "lora_C" in load_error(lora_dir)


def test_module_the_base_model_lacks(lora_dir):
    def rename(t):
        t[f"{Q0.replace('layers.0', 'layers.9')}.lora_A.weight"] = t.pop(f"{Q0}.lora_A.weight")
    edit_tensors(lora_dir, rename)
    assert "model.layers.9.self_attn.q_proj" in load_error(lora_dir) and "another model" in load_error(lora_dir)


def test_adapter_for_another_model(lora_dir):
    msg = load_error(lora_dir, tiny_model(hidden=32))
    assert "shape" in msg and "another model" in msg and "q_proj" in msg


def test_oft_adapter_for_another_model(tmp_path):
    make_adapter(str(tmp_path), OFTConfig(r=0, oft_block_size=8, target_modules=["q_proj"]))
    assert "in_features=48" in load_error(tmp_path, tiny_model(hidden=48))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_values(lora_dir, bad):
    edit_tensors(lora_dir, lambda t: t[f"{Q0}.lora_A.weight"].view(-1).__setitem__(3, bad))
    assert "NaN or Inf" in load_error(lora_dir) and "lora_A" in load_error(lora_dir)


@pytest.mark.parametrize("how", ["truncate", "garbage", "empty"])
def test_corrupt_weights(lora_dir, how):
    file = os.path.join(lora_dir, WEIGHTS)
    data = open(file, "rb").read()
    data = {"truncate": data[: len(data) // 2], "garbage": os.urandom(100), "empty": b""}[how]
    open(file, "wb").write(data)
    assert "corrupt or truncated" in load_error(lora_dir) and WEIGHTS in load_error(lora_dir)


def test_missing_files(lora_dir, tmp_path):
    assert "no such folder" in load_error(tmp_path / "nope")
    os.remove(os.path.join(lora_dir, WEIGHTS))
    assert f"missing {WEIGHTS}" in load_error(lora_dir)
    os.remove(os.path.join(lora_dir, "adapter_config.json"))
    assert "missing adapter_config.json" in load_error(lora_dir)


def test_broken_config(lora_dir):
    open(os.path.join(lora_dir, "adapter_config.json"), "w").write("{not json")
    assert "cannot read" in load_error(lora_dir)


def test_pickle_refused_unless_opted_in(lora_dir):
    expected = load_adapter(lora_dir, tiny_model())
    tensors = load_file(os.path.join(lora_dir, WEIGHTS))
    torch.save(tensors, os.path.join(lora_dir, "adapter_model.bin"))
    os.remove(os.path.join(lora_dir, WEIGHTS))
    assert "allow_pickle=True" in load_error(lora_dir)
    adapter = load_adapter(lora_dir, tiny_model(), allow_pickle=True)
    for name, s in adapter.layers.items():
        assert torch.equal(s.A, expected.layers[name].A) and torch.equal(s.B, expected.layers[name].B)


def test_pre_014_oft_refused(tmp_path):
    make_adapter(str(tmp_path), OFTConfig(r=0, oft_block_size=8, target_modules=["q_proj"]))
    edit_adapter_config(tmp_path, oft_block_size=None)
    assert "PEFT < 0.14" in load_error(tmp_path)


def test_identity_changes_with_content(lora_dir):
    before = read_checkpoint(lora_dir).identity
    edit_tensors(lora_dir, lambda t: t[f"{Q0}.lora_A.weight"].mul_(2))
    assert read_checkpoint(lora_dir).identity != before


def test_modules_to_save_refused(tmp_path):
    make_adapter(str(tmp_path), LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    assert "modules_to_save" in load_error(tmp_path)


def test_gpt2_conv1d_adapter_refused(tmp_path):
    """A real GPT-2 (Conv1D layers, weight [in, out]) LoRA: refused by name, not misread as an nn.Linear one."""
    from peft import get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    peft_model = get_peft_model(GPT2LMHeadModel(config), LoraConfig(r=2, target_modules=["c_attn"],
                                                                    fan_in_fan_out=True))
    peft_model.save_pretrained(str(tmp_path))
    model = GPT2LMHeadModel(config)
    msg = load_error(str(tmp_path), model)
    assert "Conv1D" in msg and "fan_in_fan_out" in msg
    edit_adapter_config(tmp_path, fan_in_fan_out=False)  # the layers say it too
    assert "Conv1D" in load_error(str(tmp_path), model)


def test_not_served_table_names_real_unserved_types():
    from peft.utils import PeftType

    from scute.adapters import supported_methods
    from scute.adapters.registry import NOT_SERVED

    assert set(NOT_SERVED) <= {p.value for p in PeftType} and not set(NOT_SERVED) & set(supported_methods())


def test_numbered_key_families(tmp_path):
    """A ``*`` key name (PEANuT's ``peanut_encoders.*.weight``) takes any one segment, whatever the depth, and
    nothing more: an extra numbered tensor the config does not use, or a two-segment one, is refused by name."""
    make_adapter(str(tmp_path), PeanutConfig(r=2, depth=3, target_modules=["q_proj"]))
    assert len(load_adapter(tmp_path, tiny_model()).layers) == 2
    edit_tensors(tmp_path, lambda t: t.update({f"{Q0}.peanut_encoders.7.weight": torch.zeros(2, 2)}))
    assert "unexpected tensor 'peanut_encoders.7.weight'" in load_error(tmp_path)
    edit_tensors(tmp_path, lambda t: t.update({f"{Q0}.peanut_encoders.1.x.weight": torch.zeros(2, 2)}))
    assert "not a PEANUT tensor" in load_error(tmp_path)
