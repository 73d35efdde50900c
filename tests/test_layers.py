"""Imports run one way: a module of `scute` imports only from its own layer or the layers below it.

Layers, bottom to top: `scute/ops/` (the normal form and the ops), `scute/adapters/`, `scute/model/`,
`scute/engine/`, then `scute/compat/`, `scute/serve/`, `scute/cli.py` and the package's own `__init__`/`__main__`. The leaf
modules (`scute.config`, `scute.sampling_params`, `scute.outputs`) may be imported by anyone and import only each
other. Every import is read from the source (function-level ones and those under ``TYPE_CHECKING`` too), so a
cycle cannot hide behind a lazy import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "scute"
LAYERS = ("ops", "adapters", "model", "engine", "top")
LEAVES = {"scute.config", "scute.sampling_params", "scute.outputs"}
TOP = {"scute", "scute.__main__", "scute.cli", "scute.compat", "scute.serve"}


def layer(module: str) -> str:
    """The layer of a `scute` module name ("leaf" for the leaf modules); raises for a module in none."""
    if module in LEAVES:
        return "leaf"
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in LAYERS[:-1]:
        return parts[1]
    if module in TOP or ".".join(parts[:2]) in TOP:
        return "top"
    raise AssertionError(f"module {module} is in no layer: add it to tests/test_layers.py's LAYERS, LEAVES or TOP")


def module_name(path: Path, root: Path = PACKAGE) -> str:
    """The dotted name of the module in file `path` of the package folder `root`."""
    rel = path.relative_to(root.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def is_module(name: str, root: Path = PACKAGE) -> bool:
    rel = root.parent / Path(*name.split("."))
    return rel.with_suffix(".py").is_file() or (rel / "__init__.py").is_file()


def scute_imports(path: Path, root: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, imported module) for every import of a `scute` module in the file, wherever it is written.
    ``from package import name`` counts as an import of ``package.name`` when that is a module."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                found.append((node.lineno, f"{base}.{a.name}" if is_module(f"{base}.{a.name}", root) else base))
    return [(line, m) for line, m in found if m == "scute" or m.startswith("scute.")]


def allowed(importer: str, imported: str) -> bool:
    src, dst = layer(importer), layer(imported)
    if dst == "leaf":
        return True
    if src == "leaf":
        return False
    return LAYERS.index(dst) <= LAYERS.index(src)


def violations(root: Path = PACKAGE) -> list[tuple[str, int, str]]:
    """(importer, line, imported) for every import from a lower layer to a higher one under `root`."""
    out = []
    for path in sorted(root.rglob("*.py")):
        importer = module_name(path, root)
        out += [(importer, line, m) for line, m in scute_imports(path, root) if not allowed(importer, m)]
    return out


def describe(importer: str, line: int, imported: str) -> str:
    return (f"{importer} (line {line}, layer {layer(importer)}) imports {imported} (layer {layer(imported)}): "
            "a lower layer may not import a higher one")


def test_imports_run_one_way():
    bad = [describe(*v) for v in violations()]
    assert not bad, "\n".join(bad)


def test_every_module_is_in_a_layer():
    for path in PACKAGE.rglob("*.py"):
        layer(module_name(path))


@pytest.mark.parametrize("importer, statement", [
    ("ops/bad.py", "from scute.adapters import load_adapter\n"),
    ("ops/bad.py", "def f():\n    import scute.engine.engine\n"),
    ("ops/bad.py", "import typing\nif typing.TYPE_CHECKING:\n    from scute.model.linear import ScuteLinear\n"),
    ("adapters/bad.py", "from ..model import hf\n"),
    ("model/bad.py", "from scute import Engine\n"),
    ("config.py", "from scute.ops.slots import Slots\n"),
])
def test_an_upward_import_fails(tmp_path, importer, statement):
    """The check finds an upward import wherever it is written, and passes the same file's downward ones."""
    root = tmp_path / "scute"
    file = root / importer
    file.parent.mkdir(parents=True)
    downward = "from scute.outputs import RequestOutput\nfrom scute.ops import cpu\n"
    file.write_text(("" if importer == "config.py" else downward) + statement)
    found = violations(root)
    assert [v[0] for v in found] == [module_name(file, root)], found
