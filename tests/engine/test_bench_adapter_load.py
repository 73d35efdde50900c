"""`bench/bench_adapter_load.py` end to end on the CPU with a tiny model: every method's row, the JSON the GPU run
records."""

from __future__ import annotations

import json

from tests.helpers import bench_module


def test_adapter_load_bench_runs_and_records_rows(tmp_path):
    bench_adapter_load = bench_module("bench_adapter_load")
    out = tmp_path / "load.json"
    result = bench_adapter_load.main(["--device", "cpu", "--tiny", "--repeats", "2", "--root", str(tmp_path / "a"),
                                      "--out", str(out)])
    saved = json.loads(out.read_text())
    assert [r["method"] for r in saved["rows"]] == ["lora", "dora", "ia3", "vera", "oft"] and saved["command"]
    for row in result["rows"]:
        assert row["file_bytes"] > 0 and row["read_s"] > 0 and row["repeats"] == 2
        assert row["servable_s"] >= row["place_s"] > 0 and row["load_s"] > 0 and row["move_s"] >= 0
        assert row["read_checkpoint_s"] > 0
    assert {r["method"]: r["converted_where_w0_is"] for r in saved["rows"]} == dict(
        lora=True, dora=True, ia3=True, vera=False, oft=True)
