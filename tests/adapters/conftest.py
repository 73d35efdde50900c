"""Fixtures of the adapter tests."""

from __future__ import annotations

import pytest
from peft import LoraConfig

from tests.helpers import make_adapter


@pytest.fixture()
def lora_dir(tmp_path):
    """A real PEFT LoRA folder (r=4 on q and v of the tiny Llama), every tensor randomized."""
    make_adapter(str(tmp_path), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    return tmp_path
