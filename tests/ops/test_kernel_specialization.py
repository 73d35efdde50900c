"""Every Triton kernel leaves the arguments that change from step to step unspecialized.

Triton compiles a kernel again for an integer argument that is 1, a multiple of 16, or neither; a compile while
requests run stalls all of them for a second or two (an eager step of 1161 tokens after graphs of multiples of
16 did, on an H200). So a kernel that takes a step's token or request count, a write's row count or a pass's
chunks per program names them in ``do_not_specialize`` (`scute.ops.kernels`). Read from the sources (importing
the kernels here would fix Triton's interpreter mode for the rest of the test process).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEP_VARYING = {"num_tokens", "num_seqs", "n_rows", "chunks_per_prog"}


def jit_kernels(path: pathlib.Path) -> list[tuple[str, set[str], set[str]]]:
    """(name, its parameters, its do_not_specialize names) of each `triton.jit` function in `path`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.FunctionDef):
            continue
        for dec in node.decorator_list:
            func = dec.func if isinstance(dec, ast.Call) else dec
            if ast.unparse(func) != "triton.jit":
                continue
            kept = set()
            for kw in dec.keywords if isinstance(dec, ast.Call) else []:
                if kw.arg == "do_not_specialize":
                    kept = {ast.literal_eval(e) for e in kw.value.elts}
            out.append((node.name, {a.arg for a in node.args.args}, kept))
    return out


def kernel_files() -> list[pathlib.Path]:
    return sorted(p for p in (ROOT / "scute").rglob("*.py") if "triton.jit" in p.read_text())


def test_the_sources_hold_kernels():
    names = {name for p in kernel_files() for name, _, _ in jit_kernels(p)}
    assert {"shrink_kernel", "_paged_attention_kernel", "epilogue_kernel", "scatter_rows_kernel"} <= names


@pytest.mark.parametrize("path", kernel_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_step_varying_arguments_are_not_specialized(path):
    for name, params, kept in jit_kernels(path):
        if name.startswith("_") and not name.endswith("_kernel"):
            continue  # a helper inlined into its kernel: only a launched kernel's arguments are specialized
        missing = (params & STEP_VARYING) - kept
        assert not missing, f"{path.name}: {name} specializes on {sorted(missing)}: add them to do_not_specialize"
