"""Triton kernels tested on the CPU, in Triton's interpreter: the set-up the kernel test modules share.

triton.language decorates its own helpers in the mode TRITON_INTERPRET says when triton is first imported, and
other test modules import it at collection (transformers -> torch._dynamo -> triton). A module calls
`use_interpreter()` before it imports triton: on the CPU the variable is set if triton is not imported yet;
otherwise the module's tests skip (`skip_here`) and its `test_in_a_fresh_interpreter_process` runs the module
again in a fresh process with the variable set (`run_in_fresh_process`). On CUDA the kernels run on the GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def use_interpreter() -> bool:
    """Set TRITON_INTERPRET=1 on the CPU if triton is not imported yet; returns True when this process cannot run
    the module's kernels in the interpreter (they then run in a fresh process)."""
    fresh = DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1" and "triton" in sys.modules
    if DEVICE == "cpu" and not fresh:
        os.environ["TRITON_INTERPRET"] = "1"
    return fresh


def skip_here(request, fresh: bool) -> None:
    """Skip a test that runs in the fresh process (for an autouse fixture)."""
    if fresh and request.node.originalname != "test_in_a_fresh_interpreter_process":
        pytest.skip("runs in test_in_a_fresh_interpreter_process: triton was imported before TRITON_INTERPRET=1")


def run_in_fresh_process(path: str, fresh: bool) -> None:
    """The body of a module's `test_in_a_fresh_interpreter_process`: run the module at `path` with the
    interpreter in a new process, from the repository root; fails with its output if any of its tests fails."""
    if not fresh:
        pytest.skip("this process runs the tests itself")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path], check=False,
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
