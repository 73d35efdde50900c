"""Adapters by path load on the adapter loader's thread while steps run: tokens unchanged (the Oracle's), other
requests keep stepping during a slow load, a failed load fails only its requests, loads start on arrival in
arrival order (a bounded number at once), and evicted adapters come back with the same tokens.

`gate` replaces the checkpoint read by one that records each read (folder, thread) and blocks the folders in
`gate.blocked` until `gate.release` is set: a load held as long as the test wants, without timing.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from scute import AdapterRequest, SamplingParams
from scute.adapters import conversion
from scute.engine import adapter_placer
from scute.engine.adapter_loader import Turns
from scute.engine.adapter_manager import MAX_PREFETCH
from scute.engine.request import RequestStatus
from tests.helpers import GREEDY, METHODS, PROMPTS, Oracle, bad_adapters, check, mixed_requests, tiny_model

LOADER = "scute-adapter-loader"


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    return Oracle(tmp_path_factory.mktemp("adapters"))


class Gate:
    def __init__(self) -> None:
        self.blocked: set[str] = set()
        self.started, self.release = threading.Event(), threading.Event()
        self.reads: list[tuple[str, str]] = []  # (folder, thread name) of every read
        self.read_gates: list = []  # the gate each read's reader threads were given

    def loader_reads(self) -> list[str]:
        return [path for path, thread in self.reads if thread == LOADER]


@pytest.fixture
def gate(monkeypatch):
    g, read = Gate(), conversion.read_checkpoint

    def gated_read(path, *args, **kwargs):
        path = os.path.abspath(os.fspath(path))
        g.reads.append((path, threading.current_thread().name))
        g.read_gates.append(kwargs.get("gate"))
        if path in g.blocked:
            g.started.set()
            assert g.release.wait(10), "the test never released the read"
        return read(path, *args, **kwargs)

    monkeypatch.setattr(conversion, "read_checkpoint", gated_read)
    yield g
    g.release.set()


def run(engine) -> dict[str, object]:
    """Step until every request finished; each request's last output."""
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            final[out.request_id] = out
    return final


def test_mixed_batch_by_path_matches_the_oracle(oracle, gate, monkeypatch):
    """The five methods and the base model by path, loaded on the loader thread: the Oracle's tokens, and the
    loader's adapters bit-identical to a conversion on this thread."""
    from scute.engine.adapter_loader import AdapterLoader

    host_copies, host_copy = [], AdapterLoader.host_copy
    monkeypatch.setattr(AdapterLoader, "host_copy", lambda self, *a: (host_copies.append(a), host_copy(self, *a))[1])
    prompts, adapters = mixed_requests()
    engine = oracle.engine()
    outputs = engine.generate(prompts, GREEDY, [None if a is None else oracle.paths[a] for a in adapters],
                              use_tqdm=False)
    check(oracle, outputs, prompts, adapters)
    assert sorted(gate.loader_reads()) == sorted(os.path.abspath(oracle.paths[m]) for m in METHODS)
    assert len(gate.reads) == len(METHODS)  # none on this thread, each folder once
    assert not host_copies  # converted on the CPU: the CPU cache holds the conversion itself, no copy of it
    for method in METHODS:
        loaded, here = engine.adapters.lookup(oracle.paths[method]), engine.adapters.load(oracle.paths[method])
        assert loaded.identity == here.identity and loaded.layers.keys() == here.layers.keys()
        for name, slots in here.layers.items():
            for key, x in slots.tensors().items():
                assert torch.equal(loaded.layers[name].tensors()[key], x), (method, name, key)


def test_a_lora_served_as_its_files_own_copy_keeps_the_oracles_tokens(oracle, monkeypatch):
    """The GPU loader's path for a plain LoRA file in the serving dtype (`AdapterManager._job`'s arriving branch:
    the file's own copy, its rows in the slot pools prepared before its values land, folded in place once they
    have), taken on the CPU by giving the loader the serving dtype as a GPU's has: the Oracle's tokens, in a batch
    with the other methods, and the LoRA's slots are views of one buffer, the file's copy."""
    from scute.adapters.checkpoint import AdapterCheckpoint
    from scute.engine.adapter_loader import AdapterLoader

    monkeypatch.setattr(AdapterLoader, "matrix_dtype", property(lambda loader: loader.dtype))
    arrived, arriving = [], AdapterCheckpoint.arriving
    monkeypatch.setattr(AdapterCheckpoint, "arriving",
                        lambda ckpt, *a, **k: (arrived.append(os.path.abspath(ckpt.path)), arriving(ckpt, *a, **k))[1])
    prompts, adapters = mixed_requests()
    engine = oracle.engine()
    outputs = engine.generate(prompts, GREEDY, [None if a is None else oracle.paths[a] for a in adapters],
                              use_tqdm=False)
    check(oracle, outputs, prompts, adapters)
    # LoRA's files take that path (DoRA's, a LoRA checkpoint too, lands at once for its per-layer converter)
    assert sorted(arrived) == sorted(os.path.abspath(oracle.paths[m]) for m in ("lora", "dora"))
    lora = engine.adapters.lookup(oracle.paths["lora"])
    assert len({x.untyped_storage().data_ptr() for sl in lora.layers.values() for x in sl.tensors().values()}) == 1


def test_synchronous_loads_run_on_the_loader_and_raise_to_the_caller(oracle, gate, tmp_path):
    """`Engine.load_adapter` and `get_by_path` wait for a job of the loader's (whose staging buffers and memo of
    shared matrices a load on another thread would share), from any thread: the reads are the loader's, the
    adapters those a conversion gives, a bad folder's error raised where the call was made."""
    import shutil

    engine = oracle.engine()
    got = {}
    worker = threading.Thread(target=lambda: got.update(ia3=engine.load_adapter("x", oracle.paths["ia3"])))
    worker.start()  # as a server's runtime load runs, on a worker thread
    got["vera"] = engine.adapters.get_by_path(oracle.paths["vera"])
    worker.join(30)
    assert sorted(path for path, _ in gate.reads) == sorted(os.path.abspath(oracle.paths[m]) for m in ("ia3", "vera"))
    assert len(gate.loader_reads()) == 2  # none on the caller's thread
    assert gate.read_gates == [engine.adapters.loader.turns.gate] * 2  # their reads keep off the step loop's turn
    for method, adapter in got.items():
        here = conversion.load_adapter(oracle.paths[method], tiny_model())
        assert adapter.identity == here.identity and adapter.layers.keys() == here.layers.keys()
        for name, slots in here.layers.items():
            for key, x in slots.tensors().items():
                assert torch.equal(adapter.layers[name].tensors()[key], x), (method, name, key)
    broken = tmp_path / "broken"
    shutil.copytree(oracle.paths["lora"], broken)
    (broken / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match="peft_type"):
        engine.load_adapter("broken", broken)
    assert "broken" not in engine.adapters.named


def test_steps_run_while_an_adapter_loads(oracle, gate):
    """While DoRA's read is held, requests on loaded adapters and the base model produce a token every step and
    the DoRA request waits; once released it completes with the Oracle's tokens."""
    engine = oracle.engine()
    engine.generate([PROMPTS[0]] * 2, GREEDY, [oracle.paths["lora"], oracle.paths["ia3"]], use_tqdm=False)
    gate.blocked.add(os.path.abspath(oracle.paths["dora"]))
    prompts, adapters = [PROMPTS[1], PROMPTS[2], PROMPTS[3], PROMPTS[1]], ["dora", None, "lora", "ia3"]
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt, adapter in zip(ids, prompts, adapters):
        engine.add_request(rid, prompt, GREEDY, None if adapter is None else oracle.paths[adapter])
    assert gate.started.wait(10)
    tokens = dict.fromkeys(ids, 0)
    for _ in range(5):
        for out in engine.step():
            tokens[out.request_id] = len(out.outputs[0].token_ids)
    assert not gate.release.is_set() and gate.loader_reads()[-1] == os.path.abspath(oracle.paths["dora"])
    assert tokens == {"r0": 0, "r1": 5, "r2": 5, "r3": 5}  # a token every step each, while DoRA loads
    assert engine.requests["r0"].status is RequestStatus.WAITING
    gate.release.set()
    final = run(engine)
    check(oracle, [final[rid] for rid in ids], prompts, adapters)


def test_the_loader_waits_while_the_step_loop_holds_its_turn(oracle, monkeypatch):
    """While a thread holds the step loop's turn (`Turns.step_loop`, as the engine does while a decode step is in
    flight) a load on the loader stops at its first pause point; it goes on, through a pause before every layer,
    once that thread waits (`Turns.waiting`), and converts as on this thread."""
    monkeypatch.setattr(Turns, "max_pause", 30.0)
    engine = oracle.engine()
    turns, path = engine.adapters.loader.turns, oracle.paths["dora"]
    calls, pause = [], turns.pause

    def counted() -> None:
        calls.append(threading.current_thread().name)
        pause()

    monkeypatch.setattr(turns, "pause", counted)
    with turns.step_loop():
        turns.pause()  # the holder's own pause returns at once
        future = engine.adapters.loader.submit(engine.adapters.load, path)
        for _ in range(1000):
            if len(calls) > 1:
                break
            time.sleep(0.01)
        time.sleep(0.2)
        assert calls[1:] == [LOADER] and not future.done()  # held at its first pause
        with turns.waiting():
            loaded = future.result(timeout=30)
    here = engine.adapters.load(path)
    assert calls.count(LOADER) > len(here.layers) and loaded.identity == here.identity
    for name, slots in here.layers.items():
        for key, x in slots.tensors().items():
            assert torch.equal(loaded.layers[name].tensors()[key], x), (name, key)
    turns.pause()  # outside a turn: at once


def test_turns_open_for_a_wait_and_close_after_it_only_inside_the_step_loop():
    """`waiting` inside `step_loop` lets other threads' pauses through and closes again after; outside a turn it
    leaves them free (a loader waited for from outside a step never pauses)."""
    turns, passed = Turns(), []
    turns.max_pause, turns.slice_s = 30.0, 0.0  # every held pause waits

    def pause_elsewhere() -> None:  # a pause on another thread, given 0.2 s to pass
        thread = threading.Thread(target=lambda: (turns.pause(), passed.append(True)))
        thread.start()
        thread.join(0.2)

    with turns.waiting():
        pass
    pause_elsewhere()
    assert len(passed) == 1  # free outside a turn, before and after a wait
    with turns.step_loop():
        with turns.waiting():
            pause_elsewhere()
            assert len(passed) == 2
        pause_elsewhere()
        assert len(passed) == 2  # held again after the wait
    for _ in range(100):
        if len(passed) == 3:
            break
        time.sleep(0.01)
    assert len(passed) == 3  # the turn's end lets the held pause through


def test_a_failed_load_fails_only_its_requests(oracle, tmp_path, gate):
    """Each request of an adapter whose load fails on the loader ends with finish_reason "error" and the message
    the synchronous load raises; the other requests complete."""
    bad = {k: v for k, v in bad_adapters(oracle, tmp_path).items() if k in ("corrupt", "other model", "unknown method")}
    engine = oracle.engine()
    expected = {}
    for name, path in bad.items():
        with pytest.raises(ValueError) as e:
            engine.adapters.load(path)
        expected[name] = f"{type(e.value).__name__}: {e.value}"
    good_prompts, good_adapters = PROMPTS, [None, "lora", "oft", "vera"]
    bad_specs = [*bad.values(), AdapterRequest("named-corrupt", bad["corrupt"])]
    specs = bad_specs + [None if a is None else oracle.paths[a] for a in good_adapters]
    prompts = [PROMPTS[0]] * len(bad_specs) + good_prompts
    for i, (prompt, spec) in enumerate(zip(prompts, specs)):
        engine.add_request(f"r{i}", prompt, GREEDY, spec)
        assert not engine.requests[f"r{i}"].is_finished  # accepted: the read happens on the loader
    final = run(engine)
    outputs = [final[f"r{i}"] for i in range(len(prompts))]
    check(oracle, outputs[len(bad_specs):], good_prompts, good_adapters)
    for out, name in zip(outputs, [*bad, "corrupt"]):
        assert out.error == expected[name]
        assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []
    assert outputs[-len(good_adapters) - 1].adapter_name == "named-corrupt"
    assert set(gate.loader_reads()) >= {os.path.abspath(p) for p in bad.values()}


def test_eviction_and_reload_keep_tokens(oracle, gate, monkeypatch):
    """Two device slots and two CPU-cached adapters for five adapters, twice over: adapters are evicted and
    read and placed again, tokens unchanged."""
    placed, place = [], adapter_placer.placing
    monkeypatch.setattr(adapter_placer, "placing", lambda linears, slot, a, prepared, units: (
        a is None or placed.append(a.identity), place(linears, slot, a, prepared, units))[1])
    engine = oracle.engine(max_adapters=2, max_cpu_adapters=2)
    prompts, adapters = mixed_requests()
    specs = [None if a is None else oracle.paths[a] for a in adapters]
    for _ in range(2):
        outputs = engine.generate(prompts, GREEDY, specs, use_tqdm=False)
        check(oracle, outputs, prompts, adapters)
    assert len(set(placed)) == len(METHODS) and len(placed) > len(METHODS) + 2  # placed again after eviction
    assert len(gate.loader_reads()) > len(METHODS) and len(gate.reads) == len(gate.loader_reads())  # re-read
    # what a server reports of it (`scute.serve.metrics`): each placement's time from its request's ask, the
    # evictions of both tiers, nothing loading at the end, the CPU tier at its bound
    manager = engine.adapters
    seconds = manager.take_load_seconds()
    assert len(seconds) == len(placed) and all(s > 0 for s in seconds) and manager.take_load_seconds() == []
    assert manager.evictions["device"] >= len(placed) - 2 and manager.evictions["cpu"] > 0
    assert manager.loads_in_progress == 0 and manager.cpu_adapters == 2
    # the two adapters in the slots are served from them, the others from none (`slot_of`)
    slots = [engine.adapters.slot_of(engine.adapters.get_by_path(oracle.paths[m])) for m in METHODS]
    assert sorted(s for s in slots if s is not None) == [0, 1] and slots.count(None) == len(METHODS) - 2


def test_an_adapter_the_cpu_tier_evicts_is_let_go_on_the_loader(oracle):
    """The CPU tier's eviction hands the adapter to the loader thread, which frees its host memory there (an munmap
    of milliseconds for a large adapter, which on the step loop would stall the step): with one adapter cached,
    caching a second lets the first go, and its last reference dies on the loader."""
    import gc
    import weakref

    manager = oracle.engine(max_cpu_adapters=1).adapters
    died = []
    first = manager.get_by_path(oracle.paths["lora"])
    weakref.finalize(first, lambda: died.append(threading.current_thread().name))
    del first
    gc.collect()
    assert died == []  # the cache holds it
    manager.get_by_path(oracle.paths["ia3"])  # evicts the first
    assert manager.loader.wait_idle(10)
    assert died == [LOADER]


def test_placements_spread_over_steps_keep_tokens(oracle, monkeypatch):
    """Each placement advanced one slot pool per step (as when the device finishes every step before the host
    has more time), with two slots for five adapters: requests of other adapters decode between the pools of a
    placement and of the evictions before it, and every token is still PEFT's."""
    engine = oracle.engine(max_adapters=2)
    place, steps = engine.adapters.place, []
    monkeypatch.setattr(engine.adapters, "place", lambda more: steps.append(engine.adapters.placer.busy) or
                        place(lambda: False))
    prompts, adapters = mixed_requests()
    specs = [None if a is None else oracle.paths[a] for a in adapters]
    check(oracle, engine.generate(prompts, GREEDY, specs, use_tqdm=False), prompts, adapters)
    pools = len({id(x.group or x) for x in engine.adapters.linears.values()})
    assert sum(steps) >= pools * len(METHODS)  # each placement took a step per pool


def test_prefetch_on_arrival_in_order_and_bounded(oracle, gate, monkeypatch):
    """With max_num_seqs full, requests on five cold adapters arrive: their loads start at once (before any of
    them can be scheduled), in arrival order, `MAX_PREFETCH` at most given to the loader while none is placed."""
    engine = oracle.engine(max_num_seqs=2)
    submitted, submit = [], engine.adapters.loader.submit
    monkeypatch.setattr(engine.adapters.loader, "submit", lambda fn, *a: (submitted.append(a), submit(fn, *a))[1])
    long = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"base{i}", PROMPTS[i], long)
    engine.step()
    gate.blocked.add(os.path.abspath(oracle.paths[METHODS[0]]))
    for method in METHODS:
        engine.add_request(method, PROMPTS[3], GREEDY, oracle.paths[method])
    assert gate.started.wait(10)  # the first read began on arrival, no slot of max_num_seqs free
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["base0", "base1"]
    assert len(submitted) == MAX_PREFETCH < len(METHODS)
    assert engine.adapters.loads_in_progress == len(METHODS)  # given to the loader or queued: all asked for
    gate.release.set()
    final = run(engine)
    assert gate.loader_reads() == [os.path.abspath(oracle.paths[m]) for m in METHODS]
    assert engine.adapters.loads_in_progress == 0
    check(oracle, [final[m] for m in METHODS], [PROMPTS[3]] * len(METHODS), METHODS)
    assert final["base0"].outputs[0].token_ids == oracle.reference(None, PROMPTS[0], 12)


def test_placed_adapters_leave_the_collectors_generations(oracle):
    """After a placement ends the adapter's objects are frozen (`gc.freeze`): full collections, which hold the
    interpreter lock, no longer walk the resident adapters."""
    import gc

    engine = oracle.engine()
    check(oracle, engine.generate([PROMPTS[0]], GREEDY, [oracle.paths["lora"]], use_tqdm=False), [PROMPTS[0]],
          ["lora"])
    slots = next(iter(engine.adapters.get_by_path(oracle.paths["lora"]).layers.values()))
    placed = engine.adapters.linears[next(iter(engine.adapters.get_by_path(oracle.paths["lora"]).layers))]
    tracked = {id(o) for o in gc.get_objects()}
    assert gc.get_freeze_count() > 0 and id(placed.slots) not in tracked and id(slots) not in tracked


AT_EXIT = """
import sys
from tests.helpers import FIVE_METHODS, make_adapter, tiny_model
from scute import Engine, SamplingParams

class Cycle:
    def __init__(self):
        self.me = self
    def __del__(self):
        print("cycle collected", flush=True)

cycle = Cycle()
make_adapter(sys.argv[1], FIVE_METHODS["lora"](), "llama")
engine = Engine(tiny_model(), device="cpu", dtype="float32", max_model_len=64)
engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2), [sys.argv[1]], use_tqdm=False)  # a placement: frozen
del cycle
"""


def test_frozen_cycles_are_collected_at_exit(tmp_path):
    """A process that placed an adapter (its objects frozen) frees their cycles at exit, extension objects among
    them (Triton's, imported by transformers, would otherwise report themselves leaked)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", AT_EXIT, str(tmp_path / "lora")], cwd=root, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": root})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "cycle collected" in done.stdout
    assert "leaked" not in done.stderr


def test_the_gate_holds_other_threads_while_the_step_loop_holds_its_turn():
    """`Turns.gate` (where the reader threads read a file's next part): at once outside the step loop's turn; inside
    it, until the step loop waits for the GPU; at most `max_pause` if it never does."""
    turns, passed = Turns(), []
    turns.max_pause = 30.0
    turns.gate()  # no turn held: at once

    def reader() -> None:
        turns.gate()
        passed.append(time.perf_counter())

    with turns.step_loop():
        thread = threading.Thread(target=reader)
        thread.start()
        time.sleep(0.2)
        assert passed == []  # held
        with turns.waiting():
            thread.join(5)
        assert len(passed) == 1
        turns.max_pause = 0.05
        start = time.perf_counter()
        thread = threading.Thread(target=reader)
        thread.start()
        thread.join(5)
        assert len(passed) == 2 and 0.04 <= passed[1] - start < 5  # its bound


def test_a_held_turn_lets_the_loader_run_its_slice_then_waits():
    """Inside the step loop's turn, a thread whose wait ended runs on through its pause points for `slice_s`
    seconds (a host-bound step loop never waits for the GPU: a load still advances every step), then waits
    again until the turn ends."""
    turns, passed, go = Turns(), [], threading.Event()
    turns.max_pause, turns.slice_s = 30.0, 0.5

    def loader() -> None:
        turns.pause()  # held, no slice yet: waits
        passed.append(1)
        go.wait(5)
        turns.pause()  # held again, within its slice: goes on
        passed.append(2)
        time.sleep(0.6)
        turns.pause()  # its slice spent: waits for the turn's end
        passed.append(3)

    def until(n: int) -> None:
        for _ in range(500):
            if len(passed) >= n:
                return
            time.sleep(0.01)

    with turns.step_loop():
        thread = threading.Thread(target=loader)
        thread.start()
        time.sleep(0.2)
        assert passed == []
        with turns.waiting():
            until(1)
        go.set()
        until(2)
        assert passed == [1, 2]
        time.sleep(1.0)
        assert passed == [1, 2]
    thread.join(5)
    assert passed == [1, 2, 3]


def _pausing(turns: Turns, every: float, passed: list[float], stop: threading.Event) -> threading.Thread:
    """A loader thread (not started) at a pause point every `every` seconds until `stop`: the time it went on from
    each in `passed`."""
    def loader() -> None:
        while not stop.is_set():
            turns.pause()
            passed.append(time.perf_counter())
            time.sleep(every)

    return threading.Thread(target=loader, daemon=True)


def test_a_turn_after_a_wait_as_long_as_the_slice_gives_the_loader_none_of_it():
    """A step loop that waited for the GPU at least `slice_s` gave the loader its slice then: inside the turn after
    it, the loader waits at its next pause point, though it went on from one a moment before (where a shorter
    wait would let it run on for `slice_s`)."""
    turns, passed, stop = Turns(), [], threading.Event()
    turns.max_pause, turns.slice_s = 30.0, 0.3
    thread = _pausing(turns, 0.01, passed, stop)
    try:
        with turns.step_loop():
            thread.start()
            time.sleep(0.1)
            assert passed == []
            with turns.waiting():
                time.sleep(0.35)  # the wait outlasts the slice
            ended = time.perf_counter()
            time.sleep(0.2)
            assert 10 < len(passed) and sum(t > ended for t in passed) <= 1
    finally:
        stop.set()
    thread.join(5)
    assert not thread.is_alive()


def test_the_loader_runs_idle_work_only_where_the_step_loop_does_not_hold_its_turn():
    """`Turns.idle` (the engine's garbage collections due) runs at a pause point of another thread while the step
    loop waits or outside its turn; never inside its turn, where it would delay the step's host work."""
    turns, ran = Turns(), []
    turns.max_pause, turns.slice_s = 0.01, 0.0  # a held pause waits 10 ms, then goes on
    turns.idle = lambda: ran.append(threading.current_thread().name)

    def pause_elsewhere() -> None:
        thread = threading.Thread(target=turns.pause, name="other")
        thread.start()
        thread.join(5)

    pause_elsewhere()
    assert ran == ["other"]  # outside a turn
    with turns.step_loop():
        turns.pause()  # the holder's own pause
        pause_elsewhere()
        assert ran == ["other"]  # inside the turn: not run
        with turns.waiting():
            pause_elsewhere()
        assert ran == ["other", "other"]  # while the step loop waits


def test_a_kernel_warm_up_out_of_memory_fails_no_load(oracle, monkeypatch):
    """The loader's kernel warm-up (`scute.model.warmup`) running out of device memory warns and lets the load
    go on: the requests get PEFT's tokens."""
    from scute.engine import adapter_manager

    warmed = []

    def out_of_memory(linears, adapter, tokens, done, pause):
        warmed.append((adapter.peft_type, tokens))
        raise torch.OutOfMemoryError("no room for the warm-up")

    monkeypatch.setattr(adapter_manager, "warm_kernels", out_of_memory)
    engine = oracle.engine()
    engine.adapters.warm_tokens = (1, 16)
    prompts, adapters = [PROMPTS[0], PROMPTS[1]], ["lora", "ia3"]
    with pytest.warns(UserWarning, match="no device memory to compile"):
        outputs = engine.generate(prompts, GREEDY, [oracle.paths[a] for a in adapters], use_tqdm=False)
    check(oracle, outputs, prompts, adapters)
    assert sorted(warmed) == [("IA3", (1, 16)), ("LORA", (1, 16))]


def test_a_capture_waits_for_the_loaders_pause_point_and_the_job_for_the_capture():
    """`CaptureGuard`: a capture that starts while a job works waits for the job's next pause point; the job goes
    on only once the capture has ended; outside a job, `pause` and `released` do nothing."""
    from scute.engine.cuda_graph import CaptureGuard

    guard, order, started = CaptureGuard(), [], threading.Event()
    guard.pause()  # not a job's thread: nothing
    with guard.released():
        pass

    def job() -> None:
        with guard.job():
            started.set()
            time.sleep(0.3)  # work between two pause points: the capture below waits meanwhile
            order.append("work")
            guard.pause()
            order.append("after the pause")

    thread = threading.Thread(target=job)
    thread.start()
    started.wait(5)
    with guard.capturing():
        order.append("capture")
        time.sleep(0.1)  # the job, at its pause point, does not take the guard back meanwhile
        order.append("capture ends")
    thread.join(5)
    assert order == ["work", "capture", "capture ends", "after the pause"]
    with guard.capturing():  # no job: at once
        pass


def test_a_loader_waiting_for_its_turn_lets_a_capture_run():
    """A loader job parked in `Turns.pause` while the step loop holds its turn has released the capture guard:
    the step loop captures at once, without waiting for the loader's `max_pause`."""
    from scute.engine.adapter_loader import CAPTURE_GUARD

    turns, parked, passed = Turns(), threading.Event(), []
    turns.max_pause, turns.slice_s = 30.0, 0.0

    def loader() -> None:
        with CAPTURE_GUARD.job():
            parked.set()
            turns.pause()  # the turn is held: waits, the guard released
            passed.append(1)

    with turns.step_loop():
        thread = threading.Thread(target=loader)
        thread.start()
        parked.wait(5)
        time.sleep(0.1)
        start = time.perf_counter()
        with CAPTURE_GUARD.capturing():
            waited = time.perf_counter() - start
        assert waited < 5 and passed == []
    thread.join(5)
    assert passed == [1]


def test_stage_prepares_rows_before_the_values_land_and_stages_what_finish_gives():
    """`AdapterLoader.stage(moved, finish)`: the rows come from the adapter as it was before its values landed
    (the work that overlaps the transfer), `finish` runs after them, and the adapter staged is what it returned."""
    from scute.adapters import Adapter
    from scute.engine.adapter_loader import AdapterLoader

    order = []
    early, done = (Adapter(n, "p", "LORA", {}, ident, {}) for n, ident in (("early", ""), ("done", "id")))
    loader = AdapterLoader(torch.device("cpu"),
                           prepare=lambda a, pause, then: order.append(("prepare", a)) or {"rows": 1})

    def finish():
        order.append(("finish", None))
        return done

    staged = loader.stage(early, finish)
    assert order == [("prepare", early), ("finish", None)]
    assert staged.adapter is done and staged.prepared == {"rows": 1}
    thens = []  # what runs work on the values: the caller's, else work run at once
    loader.prepare = lambda a, pause, then: thens.append(then) or {}
    loader.stage(early, finish, then=print)
    loader.stage(early)
    ran = []
    thens[1](lambda: ran.append(1))
    assert thens[0] is print and ran == [1]


def test_a_job_given_during_the_step_loops_turn_begins_when_it_waits():
    """A job begins at a pause point: one given while the step loop holds its turn (a load a step's `poll` starts)
    waits for the step loop's wait for the GPU, so that its read's threads start there, not in the turn."""
    from scute.engine.adapter_loader import AdapterLoader

    loader, began = AdapterLoader(torch.device("cpu")), []
    loader.turns.max_pause = 30.0
    with loader.turns.step_loop():
        future = loader.submit(lambda: began.append(time.perf_counter()))
        time.sleep(0.2)
        assert began == []
        with loader.turns.waiting():
            waited = time.perf_counter()
            future.result(timeout=5)
    assert began[0] >= waited


def test_a_process_exits_once_its_loaders_jobs_are_done(tmp_path):
    """A process that ends with a job on the loader lets it finish first: its daemon thread stopped inside a call
    into torch as the interpreter ends would abort the process."""
    import subprocess
    import sys

    done = tmp_path / "done"
    script = ("import time, torch\nfrom scute.engine.adapter_loader import AdapterLoader\n"
              "loader = AdapterLoader(torch.device('cpu'))\n"
              f"loader.submit(lambda: (time.sleep(0.5), open({str(done)!r}, 'w').close()))\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert run.returncode == 0, run.stderr
    assert done.exists()


def test_the_switch_interval_is_the_processs_own_again_after_overlapping_jobs():
    """Two loaders' jobs that overlap (two engines in one process): the interval is the loader's while either
    runs, and the one found before the first, not the first's, once the last ends."""
    import sys

    from scute.engine.adapter_loader import _SWITCH_INTERVAL

    before = sys.getswitchinterval()
    first, second = _SWITCH_INTERVAL.during(2e-4), _SWITCH_INTERVAL.during(2e-4)
    first.__enter__()
    second.__enter__()
    try:  # the first ends while the second runs
        first.__exit__(None, None, None)
        assert sys.getswitchinterval() == pytest.approx(2e-4)
    finally:  # whatever failed, the process's interval is put back for the tests after this one
        second.__exit__(None, None, None)
    assert sys.getswitchinterval() == before
