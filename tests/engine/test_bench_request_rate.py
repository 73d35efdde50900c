"""`bench/bench_request_rate.py` end to end on the CPU with a tiny model: native IA3 adapters and their rank-4 LoRA
conversions through one engine, a rate search per row, the JSON the GPU run records; and `bench/bench_compiles.py`
alike."""

from __future__ import annotations

import json

from tests.helpers import bench_module


def test_request_rate_bench_runs_and_records_rows(tmp_path, monkeypatch):
    import triton

    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", None)  # the bench sets it: restored after
    bench_request_rate = bench_module("bench_request_rate")
    out = tmp_path / "rate.json"
    loads, run_load = [], bench_request_rate.run_load

    def counted(engine, paths, rate, args, seed):
        loads.append((rate, args.requests, args.max_queue_s))
        return run_load(engine, paths, rate, args, seed)
    monkeypatch.setattr(bench_request_rate, "run_load", counted)
    result = bench_request_rate.main([
        "--tiny", "--methods", "ia3", "--adapters", "3", "--ranks", "4", "--convert", "1", "--requests", "6",
        "--prompt", "8", "--new-tokens", "4", "--start-rate", "1000", "--max-rate", "1000", "--bisect", "1",
        "--slo", "1000", "--max-queue-s", "1000", "--warm-arrivals", "3", "--warm-rate", "500",
        "--min-duration", "0.008", "--root", str(tmp_path / "adapters"), "--out", str(out)])
    saved = json.loads(out.read_text())
    assert (saved["warm_arrivals"], saved["warm_rate"], saved["min_duration"]) == (3, 500, 0.008)
    assert loads.count((500, 3, float("inf"))) == 2  # each variant ran 3 unmeasured arrivals, waiting for all
    assert [(r["variant"], r["adapters"]) for r in saved["rows"]] == [("native", 3), ("lora-r4", 3)]
    for row in result["rows"]:
        assert row["max_rate"] == 1000 and row["unloaded_tpot"] > 0  # a bound this loose is always met
        run = row["runs"][0]
        # 1000 requests/s for 8 ms: no more than --requests
        assert run["requests"] == 8 and 0 < run["ttft_p50"] <= run["ttft_p90"] <= run["ttft_p99"]
    native, lora = saved["rows"]
    assert native["conversion_error"] is None and 0 < lora["conversion_error"] < 1  # IA3 is not rank 4
    run = native["runs"][0]
    assert run["slowest_step_s"] > 0 and run["kernels_compiled"] == 0  # the CPU's interpreter compiles nothing
    assert 0 < run["mean_step_s"] <= run["slowest_step_s"] and run["mean_wait_s"] == 0  # the CPU: no graph steps
    # 8 requests of --prompt tokens, each generating --new-tokens: every token computed once (no prefix hits)
    assert run["batched_tokens"] == 8 * (saved["prompt"] + saved["new_tokens"] - 1)
    before = list(bench_request_rate.COMPILES)
    assert triton.knobs.runtime.jit_cache_hook(key="k", repr="r", fn=None, compile={}, is_manual_warmup=False,
                                               already_compiled=False) is False
    assert bench_request_rate.COMPILES == [before[0] + 1, before[1]]  # not on the adapter loader's thread


def test_an_overloaded_run_stops_early(tmp_path, monkeypatch):
    """A rate whose queue outgrows --max-queue-s stops its run at once (its requests aborted) and is not
    sustained; the search then reports no sustained rate."""
    import triton

    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", None)
    bench_request_rate = bench_module("bench_request_rate")
    result = bench_request_rate.main([
        "--tiny", "--methods", "ia3", "--adapters", "2", "--ranks", "4", "--convert", "0", "--requests", "40",
        "--prompt", "8", "--new-tokens", "4", "--start-rate", "100000", "--max-rate", "100000", "--bisect", "0",
        "--max-queue-s", "0.000001", "--root", str(tmp_path / "adapters"), "--out", str(tmp_path / "rate.json")])
    for row in result["rows"]:
        (run,) = row["runs"]
        assert run["aborted"] and not run["sustained"] and row["max_rate"] == 0
        assert run["max_queue_s"] > 0.000001


def test_compiles_bench_runs(tmp_path, monkeypatch):
    """`bench/bench_compiles.py` on the CPU: every burst stepped to its end and recorded (the interpreter compiles
    nothing, so every count is 0)."""
    import triton

    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", None)  # the bench sets it: restored after
    bench_compiles = bench_module("bench_compiles")
    result = bench_compiles.main(["--tiny", "--root", str(tmp_path / "adapters"), "--out", str(tmp_path / "c.json")])
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert rows == result["rows"] and len(rows) == len(bench_compiles.BURSTS)
    assert [r["tokens"] for r in rows] == [n * length for n, length in bench_compiles.BURSTS]
    assert all(r["steps"] >= 4 and 0 < r["median_ms"] <= r["slowest_ms"] and r["compiles"] == 0 for r in rows)
    assert all(r["compiles_on_loader"] == 0 for r in rows) and result["background"] == 8
