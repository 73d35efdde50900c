"""Triton kernels tested on the CPU, in Triton's interpreter: the set-up the kernel test modules share.

triton.language decorates its own helpers in the mode TRITON_INTERPRET says when triton is first imported, and
other test modules import it at collection (transformers -> torch._dynamo -> triton). A module calls
`use_interpreter()` before it imports triton: on the CPU the variable is set if triton is not imported yet;
otherwise the module's tests skip (`skip_here`) and its `test_in_a_fresh_interpreter_process` runs the module
again in a fresh process with the variable set (`run_in_fresh_process`). `interpreter_module` makes both pieces
for a module. On CUDA the kernels run on the GPU. `spy_launches` records a module's kernel launches, so that a
path that silently falls back to a reference fails its test.
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


def interpreter_module(path: str, fresh: bool, triton_cpu: bool = False):
    """The autouse fixture and the `test_in_a_fresh_interpreter_process` of the kernel test module at `path`
    (``fresh``: its `use_interpreter()`), to bind at its top level under those names. `triton_cpu`: the module's
    tests also route layers on CPU tensors through the Triton path (``SCUTE_TRITON_CPU=1``)."""

    @pytest.fixture(autouse=True)
    def _in_interpreter_process(request, monkeypatch):
        skip_here(request, fresh)
        if triton_cpu:
            monkeypatch.setenv("SCUTE_TRITON_CPU", "1")

    def test_in_a_fresh_interpreter_process():
        run_in_fresh_process(path, fresh)

    return _in_interpreter_process, test_in_a_fresh_interpreter_process


def spy_launches(monkeypatch, module, *names: str) -> list[tuple[str, tuple]]:
    """Replace each kernel `names` of `module` (a module of `triton.jit` kernels) by one that records
    ``(name, grid)`` in the returned list, then launches the kernel."""
    launched: list[tuple[str, tuple]] = []
    for name in names:
        class Spy:
            def __getitem__(self, grid, _name=name, _kernel=getattr(module, name)):
                launched.append((_name, tuple(grid)))
                return _kernel[grid]

        monkeypatch.setattr(module, name, Spy())
    return launched
