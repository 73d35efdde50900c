"""docs/adding_a_method.md stays true: its converter is the shipped one, and registered from the page's own text
into a registry without it, it loads, converts and passes the page's test against PEFT."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scute.adapters import registry

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "adding_a_method.md"


def block(tag: str) -> str:
    """The ```python block right after ``<!-- walkthrough: tag ... -->`` in the page."""
    match = re.search(rf"<!-- walkthrough: {tag}\b[^>]*-->\s*```python\n(.*?)```", DOC.read_text(), re.DOTALL)
    assert match, f"no '{tag}' walkthrough block in {DOC}"
    return match.group(1)


def test_page_shows_the_shipped_converter():
    assert block("method") == (ROOT / "scute" / "adapters" / "methods" / "delora.py").read_text()


def test_walkthrough_runs(tmp_path, monkeypatch):
    registry.supported_methods()  # the built-ins are registered ...
    fresh = {k: v for k, v in registry._METHODS.items() if k != "DELORA"}
    monkeypatch.setattr(registry, "_METHODS", fresh)  # ... but DELORA comes from the page only
    namespace: dict = {"__name__": "walkthrough_delora"}
    exec(compile(block("method"), "adding_a_method.md[method]", "exec"), namespace)  # noqa: S102 (the page)
    assert registry.get_method("DELORA").convert is namespace["convert_delora"]
    with pytest.raises(ValueError, match="already registered"):  # one converter per peft_type
        exec(compile(block("method"), "adding_a_method.md[method]", "exec"), {"__name__": "again"})  # noqa: S102

    exec(compile(block("test"), "adding_a_method.md[test]", "exec"), namespace)  # noqa: S102
    namespace["test_delora_matches_peft"](tmp_path)


def test_every_file_in_methods_is_discovered():
    """No list to keep: every module of `scute.adapters.methods` is imported by the registry, and every built-in
    converter lives in one of them."""
    import pkgutil
    import sys

    from scute.adapters import methods

    registry.supported_methods()
    names = [f"{methods.__name__}.{m.name}" for m in pkgutil.iter_modules(methods.__path__)]
    assert len(names) >= 30 and all(n in sys.modules for n in names)
    assert {m.convert.__module__ for m in registry._METHODS.values()} <= set(names)
