"""The `scute` command's wiring (the demo itself needs the SmolLM2 package and minutes: run `scute demo`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from scute.cli import main


def test_demo_help():
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0


def test_python_dash_m_scute():
    proc = subprocess.run([sys.executable, "-m", "scute", "--help"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and "demo" in proc.stdout


def test_explain_through_the_cli(tmp_path, capsys):
    from peft import LoraConfig

    from tests.helpers import make_adapter

    make_adapter(str(tmp_path), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    assert main(["explain", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "model.layers.*.self_attn.q_proj ×2" in out and "A[4×64] B[64×4]" in out


@pytest.mark.parametrize("command", ["explain", "convert"])
def test_delegated_commands_have_help(command):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
