"""The engine's overlap of decode steps with the host (runs on the CPU, where CI runs).

On CUDA a decode step is launched before the tokens of the step in flight are read (`Engine._step`). Here a
stand-in runner plays the GPU: its "model" is a fixed function of the input token and its position, its launch
returns an `InFlight` whose tokens the engine reads one call later, and an input token the host does not have
yet comes from the step in flight, as on the device. The same requests through the same stand-in without
overlap (every step run to its end) must give the same tokens, finish reasons and stop reasons: stops found one
step late, a stopped request's extra token dropped, preemption in between. An abort keeps the tokens that had
landed: the one in flight, which no output showed yet, is dropped.
"""

from __future__ import annotations

import pytest

from scute import Engine, SamplingParams
from tests.helpers import StandInRunner, random_prompts, stand_in_model, tiny_model

model = stand_in_model


def _run(overlap: bool, min_length: int = 4, mixed: bool = False, **options):
    engine = Engine(tiny_model(), device="cpu", dtype="float32", max_model_len=64, **options)
    engine.runner = runner = StandInRunner(overlap, mixed)
    prompts = random_prompts([3, 9, 17, 5, 12, 30], seed=3)
    params = [SamplingParams(temperature=0, max_tokens=min_length + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    params[2] = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[model(5, 20), 17, 40, 64])
    params[4] = SamplingParams(temperature=0, max_tokens=30, min_tokens=6, stop_token_ids=[17, 40, 64, 90])
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, sp)
    outputs, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].finish_reason,
                                           out.outputs[0].stop_reason)
        steps += 1
        if steps == 6:
            engine.abort_request("r5")
    return outputs, engine, runner


def test_overlapped_steps_give_the_tokens_of_steps_run_to_their_end():
    want, eager, _ = _run(False)
    got, engine, runner = _run(True)
    assert runner.launched > 0  # the overlap ran
    aborted, aborted_want = got.pop("r5"), want.pop("r5")
    assert got == want
    assert aborted[1:] == aborted_want[1:] == ("abort", None)
    assert aborted[0] == aborted_want[0][: len(aborted[0])] and len(aborted[0]) >= len(aborted_want[0]) - 1
    assert {o[1] for o in want.values()} >= {"length", "stop"}
    # the overlapped engine computed the stopped requests' one extra token each (dropped)
    assert engine.stats["batched_tokens"] > eager.stats["batched_tokens"]
    dropped = len(aborted_want[0]) - len(aborted[0])  # the aborted request's token in flight
    assert engine.stats["generated_tokens"] == eager.stats["generated_tokens"] - dropped


@pytest.mark.parametrize("mixed", [False, True], ids=["decode", "mixed"])
def test_overlap_with_preemption(mixed):
    """With `mixed`, steps with prompt tokens are launched too: a request whose prompt a step in flight completes
    decodes next from its token in flight, and one preempted with a token in flight recomputes it."""
    bytes_per_block = 2 * 2 * 16 * 2 * 16 * 4  # K+V, 2 layers, 16 tokens, 2 kv heads, head_dim 16, fp32
    options = dict(kv_cache_memory_bytes=4 * bytes_per_block, max_num_batched_tokens=32, max_num_seqs=6)
    want, _, _ = _run(False, min_length=20, **options)
    got, engine, runner = _run(True, min_length=20, mixed=mixed, **options)
    assert runner.launched > 0 and engine.stats["preemptions"] > 0
    got.pop("r5"), want.pop("r5")
    assert got == want


def test_overlapped_mixed_steps_give_the_tokens_of_steps_run_to_their_end():
    want, _, _ = _run(False)
    got, _, runner = _run(True, mixed=True)
    *_, decode_runner = _run(True)
    assert runner.launched > decode_runner.launched  # steps with prompt tokens were launched too
    got.pop("r5"), want.pop("r5")
    assert got == want


def test_collections_run_while_the_gpu_runs_a_step_in_flight(monkeypatch):
    """In a step that overlaps the one in flight the garbage collector's automatic collections are off and the step
    loop runs the ones due as it waits for that step (here the stand-in's step is still running whenever asked);
    they are on again after the step, and the tokens are those of steps run to their end."""
    import gc

    from scute.engine.utils import Collections
    from tests import helpers

    calls = []
    run_due = Collections.run_due

    def spy(self, **kwargs):
        calls.append((gc.isenabled(), run_due(self, **kwargs)))
        return calls[-1][1]

    monkeypatch.setattr(helpers._Done, "query", lambda self: False)
    monkeypatch.setattr(Collections, "run_due", spy)
    thresholds = gc.get_threshold()
    gc.set_threshold(10, 2, 2)  # a collection due at every step
    try:
        want, _, _ = _run(False)
        got, engine, runner = _run(True)
    finally:
        gc.set_threshold(*thresholds)
    assert runner.launched > 0 and calls
    assert not any(enabled for enabled, _ in calls)  # automatic collections off while steps overlap
    assert {gen for _, gen in calls} >= {0, 1}  # due ones ran, young and older
    assert gc.isenabled() and not engine.collections.holding  # on again between steps
    got.pop("r5"), want.pop("r5")
    assert got == want


def test_collections_the_user_turned_off_stay_off():
    import gc

    from scute.engine.utils import Collections

    gc.disable()
    try:
        c = Collections()
        with c.held():
            assert not c.holding and c.run_due(young=0.5) is None
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_collections_collect_the_young_generation_early():
    """`run_due` collects early, so that the rest of a step's allocations do not reach the threshold and start a
    collection inside its host work once automatic collections are back on."""
    import gc

    from scute.engine.utils import Collections

    thresholds = gc.get_threshold()
    gc.set_threshold(1000, 10, 10)
    c = Collections()
    try:
        with c.held():
            gc.collect(1)  # the young and middle generations empty: the collections below are young ones
            kept = [[] for _ in range(300)]
            assert c.run_due(young=0.5) is None  # under half the threshold
            kept += [[] for _ in range(300)]
            assert c.run_due(young=0.5) == 0 and gc.get_count()[0] < 100
            kept += [[] for _ in range(200)]
            assert c.run_due(young=0.5) is None and c.run_due(young=0.125) == 0  # an eighth: as the step loop waits
    finally:
        gc.set_threshold(*thresholds)
    assert kept
