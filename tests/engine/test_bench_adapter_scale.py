"""`bench/bench_background_loads.py`, `bench/bench_turns.py` and `bench/bench_resident.py` end to end on the CPU
with a tiny model: the loads asked for during decoding all land in slots, the emulated step loop times its host
work beside real loads, the slots fill, and the JSON the GPU runs record."""

from __future__ import annotations

import json

from tests.helpers import bench_module


def test_background_loads_bench_places_every_cold_adapter(tmp_path):
    from scute.engine.adapter_loader import Turns

    slice_s = Turns.slice_s
    bench = bench_module("bench_background_loads")
    out = tmp_path / "bg.json"
    result = bench.main(["--tiny", "--layers", "2", "--batch", "3", "--cold", "2", "--rounds", "2", "--steps", "5",
                         "--prompt", "8", "--interval", "0.02", "--max-loading-steps", "300", "--slice", "0.0002",
                         "--root", str(tmp_path / "adapters"), "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["slice_s"] == 0.0002 and Turns.slice_s == slice_s  # set on the bench engine's loader, not the class
    assert saved["loads"] == saved["placed"] == 4  # asked, staged, given a slot and placed: every one
    assert 1 <= result["placement_steps"] <= 4 and result["loading_steps"] >= result["placement_steps"]
    assert [len(r["quiet"]) for r in saved["rounds"]] == [5, 5]
    assert result["quiet_median_ms"] > 0 and result["p99_over_quiet_median"] > 0
    # the loader's phases were timed during the loading steps, and the traced functions are themselves again
    from scute.adapters import conversion

    assert any("convert_checkpoint" in o for r in saved["rounds"] for o in r["phases"])
    assert conversion.convert_checkpoint.__name__ == "convert_checkpoint" and "slow_step_phases" in saved
    # so were the quiet steps' own parts (the step loop's: no loader phase among them)
    assert all(len(r["quiet_phases"]) == 5 and all("schedule" in o for o in r["quiet_phases"]) for r in saved["rounds"])
    assert not any("convert_checkpoint" in o for r in saved["rounds"] for o in r["quiet_phases"])
    # each step's thread times (Linux's schedstat): the step loop's split, the loader's CPU while it loads
    steps = [o for r in saved["rounds"] for o in r["phases"] + r["quiet_phases"]]
    assert all({"step loop run queue", "step loop blocked", "loader CPU"} <= o.keys() for o in steps)
    assert sum(o["loader CPU"] for r in saved["rounds"] for o in r["phases"]) > 0
    assert sum(o["step loop CPU"] for o in steps) > 0
    assert "slow_quiet_step_phases" in saved


def test_background_loads_bench_reads_a_saved_runs_steps(tmp_path):
    """`--phases-of`: a saved result's GPU-slow loading steps against the others, the phases each overlapped, their
    launch and work after the wait, and the walls of the steps after a slow one."""
    quiet = [[8.0, 1, 0.0, 9.0, 0]] * 3
    steps = [[8.0, 1, 0.0, 9.0, 0], [12.0, 1, 0.0, 11.0, 0], [6.0, 1, 0.0, 9.0, 0], [8.0, 1, 0.0, 9.0, 0]]
    phases = [{"launch": 1.0, "_outputs": 0.5, "untraced": 0.5, "pack": 2.0, "readers CPU": 0.0},
              {"launch": 3.0, "_outputs": 1.0, "untraced": 2.0, "start_load": 4.0, "wait": 3.0, "readers CPU": 9.0},
              {"launch": 1.0, "_outputs": 0.5, "untraced": 0.5, "readers CPU": 1.0},
              {"launch": 1.0, "_outputs": 0.5, "untraced": 0.5, "readers CPU": 2.0}]
    path = tmp_path / "bg.json"
    path.write_text(json.dumps({"rounds": [{"quiet": quiet, "steps": steps, "phases": phases}]}))
    out = bench_module("bench_background_loads").main(["--phases-of", str(path)])
    assert out["GPU-slow"]["steps"] == 1 and out["other"]["steps"] == 3
    assert out["GPU-slow"]["overlapped"] == {"pack": 0, "start_load": 1}
    assert out["other"]["overlapped"] == {"pack": 1, "start_load": 0}
    assert out["GPU-slow"]["launch_median_ms"] == 3.0 and out["GPU-slow"]["after_wait_median_ms"] == 3.0
    assert out["after_slow_wall_median_ms"] == 6.0
    assert out["GPU-slow"]["threads_median_ms"] == {"readers CPU": 9.0}  # thread times: medians, not overlaps
    assert out["other"]["threads_median_ms"] == {"readers CPU": 1.0}


def test_turns_bench_times_the_host_work_beside_the_loads(tmp_path):
    from scute.engine.adapter_loader import AdapterLoader, Turns

    pause, submit = Turns.pause, AdapterLoader.submit
    out = tmp_path / "turns.json"
    result = bench_module("bench_turns").main(["--layers", "2", "--hidden", "64", "--cold", "2", "--rounds", "1",
                                               "--steps", "5", "--host-ms", "0.5", "--gpu-ms", "2", "--interval",
                                               "0.01", "--root", str(tmp_path / "adapters"),
                                               "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["loads"] == 2 and saved["quiet_steps"] == 5 and saved["loading_steps"] >= 1
    assert 0 < saved["quiet_host"]["median_ms"] <= saved["quiet_host"]["max_ms"]
    assert saved["quiet_wall"]["median_ms"] >= 2  # the emulated GPU's time at least
    assert result["host_p99_over_quiet_median"] > 0 and any(k.startswith("start of _job") for k in saved["stretches"])
    assert saved["free_84mb_ms"] > 0
    assert (Turns.pause, AdapterLoader.submit) == (pause, submit)  # put back


def test_resident_bench_fills_every_slot(tmp_path):
    bench = bench_module("bench_resident")
    out = tmp_path / "resident.json"
    result = bench.main(["--tiny", "--layers", "2", "--per-method", "12", "--batch", "4", "--new-tokens", "6",
                         "--prompt", "8", "--repeats", "1", "--root", str(tmp_path / "adapters"), "--out", str(out)])
    saved = json.loads(out.read_text())
    assert [r["resident"] for r in saved["rows"]] == [4, 24]
    assert all(r["decode_steps"] > 0 for r in result["rows"]) and result["ratio_full_over_few"] > 0


def test_place_adapter_bench_runs(tmp_path):
    """`bench/bench_place_adapter.py` on a 2-layer model, in a process of its own (it runs Triton's CPU tables in
    the interpreter, which must be set before triton is imported)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "place.json"
    proc = subprocess.run([sys.executable, "bench/bench_place_adapter.py", "--layers", "2", "--repeats", "3",
                           "--root", str(tmp_path / "adapters"), "--out", str(out)], cwd=root, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": root, "TRITON_INTERPRET": "1"}, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = json.loads(out.read_text())
    assert saved["pools"] == saved["prepared_pools"] == 8  # 4 pools a layer, every one prepared
    assert all(v > 0 for row in saved["ms"].values() for v in row.values())


def test_background_loads_bench_ablations_apply_and_are_put_back():
    import pytest
    import torch

    from scute.adapters import safetensors_file
    from scute.engine.adapter_manager import AdapterManager

    bench = bench_module("bench_background_loads")
    saved = safetensors_file.sha256_leaves, AdapterManager._host_copy
    with bench.ablated(["hash", "host-copy"], "cpu"):
        assert safetensors_file.sha256_leaves is not saved[0] and AdapterManager._host_copy is not saved[1]
        leaves = torch.arange(4 * 64, dtype=torch.int64).to(torch.uint8)
        digests = safetensors_file.sha256_leaves(leaves, 64)  # the stand-in still tells leaves apart
        assert digests.shape == (4, 32) and len({bytes(d.tolist()) for d in digests}) == 4
    assert (safetensors_file.sha256_leaves, AdapterManager._host_copy) == saved
    hash_, leaf = safetensors_file.SpanLeaves.hash, safetensors_file.LEAF
    with bench.ablated(["cpu-hash"], "cpu"):
        assert safetensors_file.LEAF == safetensors_file.CHUNK
        buffer = torch.randint(0, 256, (8 * 64,), dtype=torch.uint8)
        leaves = safetensors_file.SpanLeaves(buffer, 64, 1, 5, 64)  # leaves 1..5 of the file, on the reader threads
        leaves.hash(None)
        assert leaves.result() == safetensors_file.sha256_leaves_ref(buffer[64:6 * 64], 64)
    assert (safetensors_file.SpanLeaves.hash, safetensors_file.LEAF) == (hash_, leaf)
    from scute.engine.adapter_loader import Turns

    gate = Turns.gate
    with bench.ablated(["ungated-readers"], "cpu"):
        assert Turns().gate is None  # the loads' reads get no gate
    assert Turns.gate is gate
    with pytest.raises(SystemExit, match="unknown"):
        with bench.ablated(["nope"], "cpu"):
            pass
    with pytest.raises(SystemExit, match="needs CUDA"):
        with bench.ablated(["priority"], "cpu"):
            pass
