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
