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
    assert block("method") == (ROOT / "scute" / "adapters" / "delora.py").read_text()


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
