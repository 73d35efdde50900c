"""`bench/bench_placement.py` runs (tiny shape): both paths time a placement."""

from __future__ import annotations

import pytest

from tests.helpers import bench_module

bench_placement = bench_module("bench_placement")


@pytest.mark.parametrize("method", ["lora", "vera"])
def test_bench_placement_tiny(method):
    row = bench_placement.measure(method, 4, 64, "cpu", 3)
    assert row["method"] == method and row["slots"] == 4
    assert row["update_slot_ms"] > 0 and row["update_ms"] > 0
