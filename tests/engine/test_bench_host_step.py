"""bench/bench_host_step.py on the CPU: a row per (batch, output kind), each timed over decoding requests with the
forward stubbed out, and a graph step's inputs timed beside."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_host_step  # noqa: E402


def test_host_step_rows(tmp_path):
    result = bench_host_step.main(["--requests", "2,5", "--steps", "3", "--repeats", "1",
                                   "--out", str(tmp_path / "host.json")])
    rows = result["rows"]
    assert [(r["requests"], r["output_kind"]) for r in rows] == [(n, k) for n in (2, 5) for k in bench_host_step.KINDS]
    assert all(r["step_us"] > 0 and r["graph_build_us"] > 0 and r["graph_write_us"] > 0 for r in rows)
    assert (tmp_path / "host.json").exists()
