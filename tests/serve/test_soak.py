"""`bench/soak_serve.py`, reduced: through the fixture's server, 400 concurrent operations (good requests
streamed or not over every method, clients that disconnect mid-stream, bad inputs, runtime adapter loads and
unloads); every good answer holds `Engine.generate`'s tokens, every bad input its 4xx, and the server ends idle
with no request left in the engine."""

from __future__ import annotations

import asyncio

import pytest

from scute import SamplingParams
from tests.helpers import bench_module
from tests.serve.conftest import API_KEY

soak_serve = bench_module("soak_serve")

MODELS = ["tiny", "lora", "dora", "ia3", "vera", "oft"]


def engine_reference(reference, served):
    """The soak's reference from an engine outside the server: greedy, ignore_eos, the chosen token's logprob."""
    tok = reference.tokenizer

    def run(models, prompts, max_tokens):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
        out = {}
        for m in models:
            adapter = None if m == "tiny" else str(served / m)
            for p, o in zip(prompts, reference.generate(prompts, params, [adapter] * len(prompts), use_tqdm=False)):
                assert o.error is None, o.error
                c = o.outputs[0]
                out[(m, tuple(p))] = [(tok.decode([t]), lp[t]) for t, lp in zip(c.token_ids, c.logprobs)]
        return out
    return run


@pytest.mark.slow
def test_soak(server, reference, served):
    cfg = soak_serve.SoakConfig(base_url=server[0], api_key=API_KEY, requests=400, concurrency=24, seed=7,
                                models=MODELS, max_tokens=10, disconnect_frac=0.12, bad_frac=0.12, churn_every=40,
                                runtime_path="late-lora", runtime_like="lora", timeout=120, settle=20)
    report = asyncio.run(soak_serve.soak(cfg, engine_reference(reference, served)))
    assert report.ok, "\n".join(report.failures[:20])
    counts = report.counts
    assert counts["operations"] == 400 and counts["churn_ok"] == 10  # every load, request, unload, then 404
    assert counts["good_ok"] >= 250
    assert all(counts[f"bad_{k}"] > 0 for k in ("unknown_model", "too_long", "bad_json", "unknown_field"))
    assert counts["disconnect_stream"] > 0 and counts["disconnect_plain"] > 0
    assert report.final_metrics["aborted_total"] > 0
    assert all(report.final_metrics[g] == 0 for g in soak_serve.IDLE_GAUGES)
    engine = server[1].engine.engine
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting
    assert not any(name.startswith("soak-runtime-") for name in server[1].adapters)


def test_soak_refuses_targets_that_are_not_this_machine():
    with pytest.raises(SystemExit, match="soak_serve: --base-url"):
        soak_serve.main(["--base-url", "http://192.168.1.1:8000", "--requests", "1"])


def test_resident_memory_of_a_process():
    import os

    assert soak_serve.resident_kb(None) is None
    assert soak_serve.resident_kb(os.getpid()) > 1000  # this interpreter holds more than a megabyte
