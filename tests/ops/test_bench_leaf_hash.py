"""`bench/bench_leaf_hash.py` runs (a small buffer): the host's rows, and the kernel's where there is a GPU."""

from __future__ import annotations

import torch

from tests.helpers import bench_module


def test_bench_leaf_hash_small(tmp_path):
    result = bench_module("bench_leaf_hash").main(["--mb", "0.5", "--repeats", "1", "--out", str(tmp_path / "o.json")])
    assert len(result["ms"]) == (5 if torch.cuda.is_available() else 2) and all(v > 0 for v in result["ms"].values())
