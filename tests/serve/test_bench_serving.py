"""`bench/bench_serving.py` against the real server of the fixture: every request of a finite-rate and an
all-at-once run succeeds with exactly output-len tokens, over several models; the JSON holds its fields and
ordered percentiles; a target that is not this machine is refused."""

from __future__ import annotations

import json

import pytest

from tests.helpers import bench_module
from tests.serve.conftest import API_KEY

bench_serving = bench_module("bench_serving")

STATS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")


def check(result: dict, num_prompts: int, output_len: int, input_len: int) -> None:
    assert result["failed"] == 0 and result["completed"] == num_prompts, result["errors"]
    assert all(r["success"] and r["output_tokens"] == output_len for r in result["requests"])
    assert all(len(r["itl"]) == output_len - 1 for r in result["requests"])  # one event per token
    assert result["total_output_tokens"] == num_prompts * output_len
    assert result["total_input_tokens"] == num_prompts * input_len
    for key in ("duration_s", "request_throughput", "output_throughput", "total_token_throughput"):
        assert result[key] > 0, key
    assert result["total_token_throughput"] > result["output_throughput"]
    for key in STATS:
        s = result[key]
        assert set(s) == {"mean", "median", "p90", "p99"}, key
        assert 0 < s["median"] <= s["p90"] <= s["p99"], (key, s)
    r = result["requests"][0]
    assert {"model", "ttft", "itl", "latency", "output_tokens", "success", "error", "start"} <= set(r)


@pytest.mark.parametrize("rate", ["25", "inf"])
def test_runs_at_a_finite_and_an_infinite_rate(server, tmp_path, rate):
    out = tmp_path / "bench.json"
    models = "tiny,lora,dora,ia3,vera,oft"
    result = bench_serving.main(["--base-url", server[0], "--api-key", API_KEY, "--models", models,
                                 "--num-prompts", "20", "--request-rate", rate, "--burstiness", "0.5",
                                 "--input-len", "8", "--output-len", "6", "--seed", "3", "--timeout", "60",
                                 "--max-concurrency", "16", "--out", str(out), "--quiet"])
    check(result, 20, 6, 8)
    assert json.loads(out.read_text())["completed"] == 20
    assert result["vocab_size"] == 128  # asked of the server: the tiny model's embedding rows
    assert len(set(r["model"] for r in result["requests"])) >= 3
    starts = [r["start"] for r in result["requests"]]
    if rate == "inf":
        assert max(starts) < 1.0
    else:
        assert max(starts) > 0.1  # spread out: gamma arrivals of mean 40 ms


def test_every_served_model_and_zipf(server):
    result = bench_serving.main(["--base-url", server[0], "--api-key", API_KEY, "--num-prompts", "12",
                                 "--zipf", "2", "--input-len", "4", "--output-len", "3", "--quiet"])
    check(result, 12, 3, 4)
    assert set(result["models"]) >= {"tiny", "lora", "dora", "ia3", "vera", "oft"}
    counts = result["requests_per_model"]
    assert counts[result["models"][0]] == max(counts.values())


def test_workload_is_seeded():
    rng = bench_serving.random.Random(1)
    times = bench_serving.arrival_times(2000, 50.0, 1.0, rng)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert abs(sum(gaps) / len(gaps) - 0.02) < 0.002  # mean inter-arrival 1/R
    assert bench_serving.arrival_times(3, 50.0, 1.0, bench_serving.random.Random(1)) == times[:3]
    assert bench_serving.percentile([1, 2, 3, 4], 50) == 2.5 and bench_serving.percentile([5], 99) == 5


@pytest.mark.parametrize("url", ["http://example.com:8000", "http://10.0.0.1", "http://0.0.0.0:8000",
                                 "http://127.0.0.1.example.com", "ftp://127.0.0.1"])
def test_refuses_targets_that_are_not_this_machine(url):
    with pytest.raises(SystemExit, match="bench_serving: --base-url"):
        bench_serving.main(["--base-url", url, "--num-prompts", "1", "--quiet"])


def test_refuses_lengths_beyond_the_server(server):
    with pytest.raises(SystemExit, match="max_model_len"):
        bench_serving.main(["--base-url", server[0], "--api-key", API_KEY, "--input-len", "60", "--output-len",
                            "10", "--num-prompts", "1", "--quiet"])
