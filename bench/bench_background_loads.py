"""The decode step while cold adapters load in the background: its time with loads against its time without.

One Llama-3-8B-shaped `LlamaForCausalLM` (random bf16 weights; ``--layers`` fewer for a quick look) served by
``Engine(model, device="cuda", dtype="bfloat16")`` with CUDA graphs; ``--batch`` requests over as many distinct
LoRA r16 adapters decode ``--prompt`` + many tokens (greedy, ``ignore_eos``). Adapter folders as in
`bench_engine.make_adapters` (PEFT saves, every tensor re-randomized); ``--cold`` further folders of the
``--methods`` in turn, never read before the loading phase.

Quiet phase: the wall time of ``--steps`` decode steps (`Engine.step`) with nothing loading. Loading phase: every
``--interval`` seconds one cold adapter is asked for as a request's arrival asks for it (`AdapterManager.prefetch`
with a stand-in waiting request: the loader thread reads, converts and copies it to the device); once it is
staged, `ready` gives it a free slot and begins its placement, which the next steps advance while the device runs
(`Placer`), as for a request's adapter; the stand-in request is then done with it (`acquire`, `release`) — so
every loading-phase step is a decode step of the same requests, and the steps that place an adapter (those that
begin with a placement in progress) are among them. Both phases alternate ``--rounds`` times. Reports the quiet
median, the loading phase's median / p90 / p99 / max, p99 over the quiet median, the placement steps' median,
each load's latency (asked → placed), the garbage collector's full collections during the loading phases
(their count and longest: one holds the interpreter lock, so the step loop waits it out), and for the slow
loading steps and the slow quiet ones (over `SLOW` quiet medians) which phases of the loader's work and which
collections of the garbage collector (any generation) ran during them and how long the step's own parts took
(schedule, launch, the wait for the GPU, placements, the tokens' landing and the outputs; `Trace`: the functions
of `TRACED` wrapped while both phases run; ``untraced``: the step's time in none of its own parts), beside those
parts' median in the phase's other steps, the step loop's CPU time in the step and the time it was neither on a
CPU nor waiting for the GPU, split into its time waiting for a core and blocked (on the interpreter lock, mostly),
with the loader's and the reader threads' CPU time in the step (`schedstat.py`), and the longest of the loader's
stretches between its pause points that overlapped it (`stretches.py`: a step loop's turn that begins inside one
shares the interpreter lock until it ends), with the longest kinds of stretch over the loading phases; on CUDA,
for the slow steps, the other loading steps and the quiet ones, how long the GPU sat idle before each step's
launch and how long it ran the step (`Clock`: slower GPU work, or a host that launched late). The ratios: p99 over
the quiet median, and (the figure) p99 of each loading step's time over the quiet steps' linear fit in their KV
tokens at its own (the context grows as the phases run, and a decode step with it). On the bench engine's loader
alone: ``--switch-interval`` sets `AdapterLoader.switch_interval` (``default`` keeps it), ``--max-pause``
`Turns.max_pause` (0: the loader never waits for the step loop's turn), ``--slice`` `Turns.slice_s` (0: it waits
at every pause point inside the turn). ``--gc off`` turns the garbage collector's automatic collections off for
both phases (the engine's `Collections` then hold nothing: what collections cost the steps). ``--ablate`` changes
parts of a load's work (`ABLATIONS`, comma-separated; bench-only stand-ins, not options of the engine) to tell
what each costs the steps: run it beside a run without, on one machine (``bash bench/run_gpu.sh ablate``);
``--readers``, ``--part-kb`` and ``--hash-programs`` how a file is read and hashed.
``--phases-of RESULT`` runs nothing: it reads a saved result step by step (`phases_of`).

Run on a GPU: ``PYTHONPATH=. python3 bench/bench_background_loads.py --out background_loads.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_engine as B  # noqa: E402
from bench_adapter_load import add_read_args, set_reads  # noqa: E402
from bench_request_rate import TINY, percentile  # noqa: E402
from schedstat import ThreadTimes  # noqa: E402
from stretches import Stretches  # noqa: E402
from stretches import summary as stretch_summary  # noqa: E402


ABLATIONS = {
    "hash": "the identity's leaves hashed by a stand-in (each leaf's first 32 bytes copied: one small kernel, the "
            "adapters still told apart) in place of the sha256 kernel",
    "cpu-hash": "the identity's leaves hashed on the host's reader threads (hashlib, 4 MB leaves, after the read) in "
                "place of the sha256 kernel",
    "host-copy": "the CPU tier keeps no copy of an adapter converted on the GPU: its entry is dropped where the copy "
                 "would be asked for (read again when asked)",
    "priority": "the engine and its steps on a CUDA stream of the highest priority (the loader's at the default)",
    "ungated-readers": "the reader threads read a file whatever the step loop does, a run in one read call each (no "
                       "`Turns.gate` between parts)",
}
THREADS = ThreadTimes()
THREAD_TIMES = ("step loop CPU", "step loop off CPU", "step loop run queue", "step loop blocked", "loader CPU",
                "loader run queue", "readers CPU", "readers run queue")  # per step (`step_phases`)
SLOW = 1.15  # a loading step over this many quiet medians (the bar on the p99) is slow: what it overlapped is reported


class Clock:
    """Each step's wall time, its KV tokens (a decode step's time grows with them) and, on CUDA, what the GPU did
    meanwhile: an event recorded just before `ModelRunner.launch` completes once the GPU has finished the work
    queued before it (or when the host records it, if the GPU was idle by then), one recorded as `Engine.step`
    returns once the step's own work is done. Between the previous step's end and the launch the GPU was idle
    (`idle_ms`: the host launched late); from the launch to the end it ran the step's graph and the placements
    queued with it (`busy_ms`: the GPU was slow). `segments`: the caching allocator's device allocations and frees
    (cudaMalloc / cudaFree, which take the driver's locks; a free synchronizes the device) since the step before."""

    def __init__(self, engine) -> None:
        self.engine, self.cuda = engine, engine.runner.device.type == "cuda"
        self.marks: list[tuple] = []  # (wall, kv, launch event or None, end event, allocator segments) per step
        self._launch_event = None
        self._saved = None

    def __enter__(self) -> Clock:
        from scute.engine.model_runner import ModelRunner

        launch = self._saved = ModelRunner.launch

        def timed_launch(runner, *args, **kwargs):
            if self.cuda:
                self._launch_event = torch.cuda.Event(enable_timing=True)
                self._launch_event.record()
            return launch(runner, *args, **kwargs)
        ModelRunner.launch = timed_launch
        return self

    def __exit__(self, *exc) -> None:
        from scute.engine.model_runner import ModelRunner

        ModelRunner.launch = self._saved

    def step(self) -> int:
        """Run one step; its index in `marks`."""
        engine, self._launch_event = self.engine, None
        kv = sum(r.num_tokens for r in engine.scheduler.running)
        t = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t
        end = None
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        self.marks.append((wall, kv, self._launch_event, end, self._segments()))
        return len(self.marks) - 1

    def _segments(self) -> int:
        if not self.cuda:
            return 0
        stats = torch.cuda.memory_stats(self.engine.runner.device)
        return stats.get("segment.all.allocated", 0) + stats.get("segment.all.freed", 0)

    def rows(self, indices: list[int]) -> list[tuple[float, int, float | None, float | None, int]]:
        """(wall s, kv tokens, GPU idle ms, GPU busy ms, allocator segments) of the steps at `indices`."""
        if self.cuda:
            torch.cuda.synchronize()
        out = []
        for i in indices:
            wall, kv, launch, end, segs = self.marks[i]
            prev = self.marks[i - 1][3] if i > 0 else None
            idle = prev.elapsed_time(launch) if launch is not None and prev is not None else None
            busy = launch.elapsed_time(end) if launch is not None else None
            out.append((wall, kv, idle, busy, segs - (self.marks[i - 1][4] if i > 0 else segs)))
        return out


TRACED = (  # (module, attribute): the adapter loader's phases, timed on whichever thread runs them
    ("scute.adapters.checkpoint", "read_safetensors"), ("scute.adapters.conversion", "convert_checkpoint"),
    ("scute.adapters.adapter", "pack"), ("scute.engine.adapter_manager", "prepare_adapter"),
    ("scute.engine.adapter_loader", "AdapterLoader.host_and_device"),
    ("scute.engine.adapter_loader", "AdapterLoader.stage"),
    # the step's own parts, on the step loop: which one a slow step spent its time in
    ("scute.engine.adapter_manager", "AdapterManager.poll"), ("scute.engine.adapter_manager", "AdapterManager.place"),
    ("scute.engine.scheduler", "Scheduler.schedule"), ("scute.engine.model_runner", "ModelRunner.launch"),
    ("scute.engine.model_runner", "InFlight.wait"), ("scute.engine.engine", "Engine._release_samples"),
    ("scute.engine.output_processor", "OutputProcessor.append_tokens"), ("scute.engine.engine", "Engine._outputs"),
    # finer phases of the loader's work
    ("scute.engine.adapter_manager", "start_load"), ("scute.adapters.conversion", "_group_keys"),
    *(("scute.adapters.checkpoint", f"AdapterCheckpoint.{p}") for p in ("tensors_on", "arriving", "land", "verify")),
    ("scute.engine.adapter_loader", "AdapterLoader.to_device"), ("scute.adapters.safetensors_file", "layout_of"),
)
STEP_PARTS = ("poll", "place", "schedule", "launch", "wait", "_release_samples", "append_tokens", "_outputs")


class Trace:
    """While entered: the wall time span of each call of the `TRACED` functions and of each collection of the
    garbage collector (``collection gen<N>``: one holds the interpreter lock, so the step loop waits it out), as
    (name, start, end)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, float, float]] = []
        self.collections: list[tuple[int, int, float, str]] = []  # (generation, young objects, ms, thread)
        self._gc: dict[int, tuple[float, int]] = {}
        self._saved: list[tuple[object, str, object]] = []
        self.stretches = Stretches()  # the loader's runs between pause points
        self.cpu: dict[str, float] = {}  # each traced name's thread CPU seconds so far (its calls' threads)

    def _collections(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc[threading.get_ident()] = time.perf_counter(), gc.get_count()[0]
        elif threading.get_ident() in self._gc:
            (start, young), end = self._gc.pop(threading.get_ident()), time.perf_counter()
            self.spans.append((f"collection gen{info['generation']}", start, end))
            self.collections.append((info["generation"], young, 1e3 * (end - start), threading.current_thread().name))

    def _timed(self, name: str, fn):
        def timed(*args, **kwargs):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spans.append((name, start, time.perf_counter()))
                self.cpu[name] = self.cpu.get(name, 0.0) + time.thread_time() - cpu
        return timed

    def __enter__(self) -> Trace:
        gc.callbacks.append(self._collections)
        self.stretches.__enter__()
        for module, attr in TRACED:
            owner = importlib.import_module(module)
            if "." in attr:
                owner, attr = getattr(owner, attr.split(".")[0]), attr.split(".")[1]
            self._saved.append((owner, attr, getattr(owner, attr)))
            setattr(owner, attr, self._timed(attr, getattr(owner, attr)))
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._collections)
        self.stretches.__exit__()
        for owner, attr, fn in reversed(self._saved):
            setattr(owner, attr, fn)

    def overlaps(self, start: float, end: float) -> dict[str, float]:
        """Each traced name's ms within [start, end], and ``untraced``: the ms of [start, end] (one step) in none of
        the step's own parts (`STEP_PARTS`): the step loop between them, waiting for the interpreter lock or
        running code not traced."""
        out: dict[str, float] = {}
        for name, a, b in self.spans:
            if a < end and b > start:
                out[name] = out.get(name, 0.0) + 1e3 * (min(b, end) - max(a, start))
        out["untraced"] = 1e3 * (end - start) - sum(out.get(n, 0.0) for n in STEP_PARTS)
        return out


def loading_phase(engine, clock: Clock, cold: list[str], args) -> dict:
    """Steps while one cold adapter is asked for every --interval seconds, until every one is placed."""
    from scute import SamplingParams
    from scute.engine.request import Request

    manager, sp = engine.adapters, SamplingParams(max_tokens=1)
    waiting, asked, latency, steps, placing = [], {}, [], [], []
    start, todo = time.perf_counter(), list(cold)
    spans = []  # each loading step's start and end
    with Trace() as trace:
        while todo or waiting:
            now = time.perf_counter() - start
            if todo and now >= args.interval * len(asked):
                path = todo.pop(0)
                req = Request(f"cold-{len(asked)}", None, [1], sp, manager.lookup(path), None, -len(asked) - 1)
                asked[req] = now
                manager.prefetch(req)
                waiting.append(req)
            for req in [r for r in waiting if manager.ready(r)]:  # placed (`ready` began it once staged)
                waiting.remove(req)
                manager.acquire(req.adapter)
                manager.release(req.adapter)
                latency.append(time.perf_counter() - start - asked[req])
            placing.append(manager.placer.busy)
            steps.append(timed_step(clock, trace, spans))
            if len(steps) > args.max_loading_steps:
                raise RuntimeError(f"loads did not finish in {len(steps)} steps ({len(waiting) + len(todo)} to go)")
    phases = [{**step_phases(trace, *sp), "longest loader stretch": trace.stretches.longest_within(*sp[:2])}
              for sp in spans]
    return dict(steps=steps, placing=placing, latency=latency, phases=phases,
                full_collections_ms=[1e3 * (b - a) for name, a, b in trace.spans if name == "collection gen2"],
                collections=trace.collections, stretches=trace.stretches.records)


def timed_step(clock: Clock, trace: Trace, spans: list[tuple]) -> int:
    """`clock.step()`, with the step's start, end, the step loop's CPU seconds in it but in its wait for the GPU
    (`InFlight.wait`, which may spin: not the step loop's work) and the threads' scheduler times in it
    (`ThreadTimes.delta`) appended to `spans`."""
    before = THREADS.sample()
    start, cpu, wait_cpu = time.perf_counter(), time.thread_time(), trace.cpu.get("wait", 0.0)
    index = clock.step()
    end, cpu = time.perf_counter(), time.thread_time() - cpu - (trace.cpu.get("wait", 0.0) - wait_cpu)
    spans.append((start, end, cpu, THREADS.delta(before, THREADS.sample())))
    return index


def step_phases(trace: Trace, start: float, end: float, cpu: float, threads: dict[str, float]) -> dict[str, float]:
    """`Trace.overlaps` of a step, with the step loop's CPU ms in it (``step loop CPU``), the ms it was neither on
    a CPU nor waiting for the GPU (``step loop off CPU``), and of that its ms on a run queue, waiting for a core
    (``step loop run queue``: too many threads runnable) and the rest (``step loop blocked``: waiting for a lock,
    the interpreter lock mostly); the loader's and the reader threads' ms on a CPU and on a run queue in the step
    (``loader CPU``, ``readers run queue``, ...: `schedstat.ThreadTimes`; none where Linux does not report
    them)."""
    phases = trace.overlaps(start, end)
    wall = 1e3 * (end - start)
    off = wall - 1e3 * cpu - phases.get("wait", 0.0)
    out = {**phases, "step loop CPU": 1e3 * cpu, "step loop off CPU": off}
    if "step loop run queue" in threads:
        out["step loop blocked"] = max(0.0, off - threads["step loop run queue"])
    return {**out, **{k: ms for k, ms in threads.items() if k != "step loop CPU"}}  # the CPU less the wait's above


def quiet_phase(clock: Clock, steps: int) -> dict:
    """`steps` decode steps with nothing loading, each step's parts traced as in a loading phase."""
    spans, quiet = [], []
    with Trace() as trace:
        for _ in range(steps):
            quiet.append(timed_step(clock, trace, spans))
    return dict(quiet=quiet, quiet_phases=[step_phases(trace, *sp) for sp in spans],
                quiet_collections=trace.collections)


def slow_steps(steps: list[tuple], med: float, phase: str, at: int = 0) -> tuple[list, list, dict]:
    """The (row, phases) of `steps` over `SLOW` quiet medians (`med`) of the rows' field `at` (0: the wall time; 3:
    the GPU's busy time), the others, and for each traced name in the slow ones: their count, its median ms there
    and in the others (printed)."""
    slow = [(s, ph) for s, ph in steps if s[at] > SLOW * med]
    others = [(s, ph) for s, ph in steps if s[at] <= SLOW * med]
    overlapped = {n: [ph[n] for _, ph in slow if n in ph] for n in {n for _, ph in slow for n in ph}}
    typical = {n: statistics.median(ph.get(n, 0.0) for _, ph in others) for n in overlapped} if others else {}
    own = [n for n in (*STEP_PARTS, "untraced", "longest loader stretch", *THREAD_TIMES) if n in overlapped]
    if own:  # in every step: their medians
        print(f"  the {len(slow)} slow {phase} steps' own parts and threads, median ms (in the others): " + ", ".join(
            f"{n} {statistics.median(overlapped[n]):.2f} ({typical.get(n, 0.0):.2f})" for n in own))
    for name, ms in sorted(((n, ms) for n, ms in overlapped.items() if n not in own), key=lambda kv: -len(kv[1])):
        print(f"  {name} overlapped {len(ms)} of the {len(slow)} slow {phase} steps (median "
              f"{statistics.median(ms):.1f} ms; {typical.get(name, 0.0):.1f} ms in the other {phase} steps)")
    return slow, others, {n: dict(steps=len(ms), median_ms=statistics.median(ms), other_steps_median_ms=typical.get(n))
                          for n, ms in overlapped.items()}


def phases_of(path: str) -> dict:
    """A saved result's loading steps read one by one (its `rounds`, ms): those whose GPU busy time ran over `SLOW`
    quiet medians of it against the others, how many of each overlapped each phase of the loader's, and the
    medians of their launch, of the step loop's work after its wait (`_outputs` and the untraced rest) and of the
    threads' times in them (`THREAD_TIMES`, where the run has them); and the wall time of the steps that follow a
    step whose wall ran over `SLOW` quiet medians (printed)."""
    with open(path) as f:
        rounds = json.load(f)["rounds"]
    quiet = [s for r in rounds for s in r["quiet"]]
    if any(s[3] is None for r in rounds for s in r["quiet"] + r["steps"]):
        raise SystemExit(f"{path}: a run without GPU times (on the CPU)")
    busy, wall = statistics.median(s[3] for s in quiet), statistics.median(s[0] for s in quiet)
    steps = [(s, ph) for r in rounds for s, ph in zip(r["steps"], r["phases"])]
    groups = {"GPU-slow": [(s, ph) for s, ph in steps if s[3] > SLOW * busy],
              "other": [(s, ph) for s, ph in steps if s[3] <= SLOW * busy]}
    own = {*STEP_PARTS, "untraced", "longest loader stretch", *THREAD_TIMES}
    names = sorted({n for _, ph in steps for n, ms in ph.items() if ms > 0 and n not in own})
    out = {"quiet_busy_median_ms": busy, "quiet_wall_median_ms": wall}
    print(f"quiet steps: GPU busy median {busy:.2f} ms, wall median {wall:.2f} ms; loading steps:")
    for label, group in groups.items():
        row = dict(steps=len(group), overlapped={n: sum(ph.get(n, 0) > 0 for _, ph in group) for n in names},
                   launch_median_ms=statistics.median(ph.get("launch", 0.0) for _, ph in group),
                   after_wait_median_ms=statistics.median(ph.get("_outputs", 0.0) + ph.get("untraced", 0.0)
                                                          for _, ph in group))
        row["threads_median_ms"] = {n: statistics.median(ph[n] for _, ph in group if n in ph)
                                    for n in THREAD_TIMES if group and any(n in ph for _, ph in group)}
        out[label] = row
        print(f"  {label} ({row['steps']}): launch {row['launch_median_ms']:.2f} ms, after the wait "
              f"{row['after_wait_median_ms']:.2f} ms; overlapped " + ", ".join(
                  f"{n} {k}" for n, k in sorted(row["overlapped"].items(), key=lambda kv: -kv[1]) if k))
        if row["threads_median_ms"]:
            print("    medians: " + ", ".join(f"{n} {ms:.2f} ms" for n, ms in row["threads_median_ms"].items()))
    after = [r["steps"][i + 1][0] for r in rounds for i, s in enumerate(r["steps"][:-1]) if s[0] > SLOW * wall]
    out["after_slow_wall_median_ms"] = statistics.median(after) if after else None
    if after:
        print(f"  the {len(after)} steps after a step whose wall ran over {SLOW} quiet medians: wall median "
              f"{out['after_slow_wall_median_ms']:.2f} ms")
    return out


def relative(steps: list[tuple], fit: tuple[float, float]) -> list[float]:
    """Each step's wall time over the quiet steps' fit at its KV tokens."""
    slope, intercept = fit
    return [wall / (intercept + slope * kv) for wall, kv, *_ in steps]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--cold", type=int, default=20, help="cold adapters loaded per round")
    p.add_argument("--methods", default="lora", help="the cold adapters' methods, in turn (of bench_engine.MIX)")
    p.add_argument("--interval", type=float, default=0.1, help="seconds between two asked loads")
    p.add_argument("--steps", type=int, default=150, help="decode steps of a quiet phase")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-loading-steps", type=int, default=400, help="steps a loading phase may take (sizes the "
                   "requests' lengths)")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (the test)")
    p.add_argument("--switch-interval", default="default")
    p.add_argument("--max-pause", type=float, default=None, help="Turns.max_pause in seconds (0: the loader never "
                   "waits for the step loop's turn; default: the engine's)")
    p.add_argument("--slice", type=float, default=None, help="Turns.slice_s in seconds (0: the loader waits at "
                   "every pause point inside the step loop's turn; default: the engine's)")
    p.add_argument("--gc", default="on", choices=["on", "off"], help="off: the garbage collector's automatic "
                   "collections are off while the phases run (what its collections cost the steps)")
    add_read_args(p)
    p.add_argument("--ablate", default="", help="comma-separated, of: " + "; ".join(
        f"{k}: {v}" for k, v in ABLATIONS.items()))
    p.add_argument("--root", default="/tmp/scute-bench-background")
    p.add_argument("--out", default="background_loads.json")
    p.add_argument("--phases-of", metavar="RESULT", help="no run: read a saved result's steps (`phases_of`)")
    args = p.parse_args(argv)
    if args.phases_of:
        return phases_of(args.phases_of)
    # the threads in use, saved with the result
    args.readers = set_reads(args.readers, args.part_kb, args.hash_programs)
    with ablated([a for a in args.ablate.split(",") if a], "cpu" if args.tiny else "cuda"):
        return run(args)


@contextlib.contextmanager
def ablated(names: list[str], device: str):
    """Within it, the parts of a load's work `names` says are changed (`ABLATIONS`); put back on exit."""
    from scute.adapters import safetensors_file
    from scute.adapters.safetensors_file import SpanLeaves
    from scute.engine.adapter_loader import Turns
    from scute.engine.adapter_manager import AdapterManager

    if unknown := set(names) - set(ABLATIONS):
        raise SystemExit(f"--ablate: unknown {sorted(unknown)}; known: {sorted(ABLATIONS)}")
    if "priority" in names and device != "cuda":
        raise SystemExit("--ablate priority needs CUDA (stream priorities)")
    saved = (safetensors_file.sha256_leaves, AdapterManager._host_copy, safetensors_file.LEAF, SpanLeaves.hash,
             Turns.gate)

    def stand_in(data, leaf, programs=None):
        return data.view(-1, leaf)[:, :32].contiguous()

    def on_readers(leaves, span):  # the file's own leaves, from its buffer once read
        if leaves._hashed is None:
            lo = leaves.first * leaves.leaf
            leaves.hash_on_readers(leaves.buffer[lo:lo + leaves.count * leaves.leaf])

    def no_host_copy(manager, key, adapter):
        if manager._by_path.get(key) is adapter:
            del manager._by_path[key]

    with contextlib.ExitStack() as stack:
        if "hash" in names:
            safetensors_file.sha256_leaves = stand_in
        if "cpu-hash" in names:
            safetensors_file.LEAF, SpanLeaves.hash = safetensors_file.CHUNK, on_readers
        if "host-copy" in names:
            AdapterManager._host_copy = no_host_copy
        if "ungated-readers" in names:
            Turns.gate = None  # the loads' `read_gate`: none
        if "priority" in names:
            stack.enter_context(torch.cuda.stream(torch.cuda.Stream(priority=-100)))
        try:
            yield
        finally:
            (safetensors_file.sha256_leaves, AdapterManager._host_copy, safetensors_file.LEAF, SpanLeaves.hash,
             Turns.gate) = saved


def run(args) -> dict:
    """The bench's phases and figures (`main`, within its ablations)."""
    from scute import Engine, SamplingParams

    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    model = B.random_llama({**(TINY if args.tiny else B.LLAMA3_8B), "num_hidden_layers": args.layers,
                            "max_position_embeddings": 8192}, device, dtype)
    cfg = model.config
    running = B.make_adapters(model, "lora", args.batch, os.path.join(args.root, "running"))
    methods = args.methods.split(",")
    count = args.cold * args.rounds
    per = {m: B.make_adapters(model, m, -(-count // len(methods)), os.path.join(args.root, "cold"), seed=500)
           for m in methods}
    cold = [per[methods[i % len(methods)]][i // len(methods)] for i in range(count)]
    new_tokens = 64 + args.rounds * (args.steps + args.max_loading_steps)
    kv = B.kv_bytes_per_token(cfg, dtype.itemsize)
    length = args.prompt + new_tokens + 16
    engine = Engine(model, device=device, dtype=str(dtype).split(".")[1], max_adapters=args.batch + count,
                    max_num_seqs=args.batch, max_model_len=length, max_adapter_rank=256, max_cpu_adapters=2 * count,
                    kv_cache_memory_bytes=int(1.2 * args.batch * length * kv))
    loader = engine.adapters.loader  # the loader's settings, on this engine's loader alone (not the classes')
    for name, value in (("max_pause", args.max_pause), ("slice_s", args.slice)):
        if value is not None:
            setattr(loader.turns, name, value)
    if args.switch_interval != "default":
        loader.switch_interval = None if args.switch_interval == "none" else float(args.switch_interval)
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i, path in enumerate(running):
        engine.add_request(f"run-{i}", torch.randint(0, cfg.vocab_size, (args.prompt,), generator=g).tolist(), sp, path)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    for _ in range(50):  # graphs captured, kernels compiled
        engine.step()
    print(f"{args.batch} requests decoding; {count} cold adapters of {methods}", flush=True)
    rounds = []
    if args.gc == "off":
        gc.collect()
        gc.disable()
    with Clock(engine) as clock:
        for r in range(args.rounds):
            x = dict(**quiet_phase(clock, args.steps),
                     **loading_phase(engine, clock, cold[r * args.cold:(r + 1) * args.cold], args))
            rounds.append(x)
            print(f"  round {r}: quiet median {1e3 * statistics.median(clock.marks[i][0] for i in x['quiet']):.2f} ms, "
                  f"loading median {1e3 * statistics.median(clock.marks[i][0] for i in x['steps']):.2f} / max "
                  f"{1e3 * max(clock.marks[i][0] for i in x['steps']):.2f} ms over {len(x['steps'])} steps",
                  flush=True)
            assert all(len(q.output_token_ids) < new_tokens for q in engine.scheduler.running), "raise new_tokens"
    for x in rounds:
        x["quiet"], x["steps"] = clock.rows(x["quiet"]), clock.rows(x["steps"])
    resident = set(engine.adapters._slot_of)
    placed = sum(engine.adapters.get_by_path(path).identity in resident for path in cold)
    result = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", torch=torch.__version__,
                  command=" ".join(sys.argv), layers=args.layers, batch=args.batch, methods=methods,
                  interval_s=args.interval, placed=placed, switch_interval=loader.switch_interval,
                  max_pause_s=loader.turns.max_pause, slice_s=loader.turns.slice_s,
                  gc=args.gc, ablate=[a for a in args.ablate.split(",") if a], readers=args.readers,
                  part_kb=args.part_kb, hash_programs=args.hash_programs)
    return B.save({**result, **summary(rounds)}, args.out, "rounds")


def summary(rounds: list[dict]) -> dict:
    """The figures of the rounds (each step a `Clock.rows` row), and the rounds themselves, rounded."""
    quiet = [s for x in rounds for s in x["quiet"]]
    loading = [s for x in rounds for s in x["steps"]]
    placing = [s for x in rounds for s, pl in zip(x["steps"], x["placing"]) if pl]
    latency = [t for x in rounds for t in x["latency"]]
    fit = statistics.linear_regression([s[1] for s in quiet], [s[0] for s in quiet])
    rel, rel_quiet = relative(loading, fit), relative(quiet, fit)
    walls, med = [s[0] for s in loading], statistics.median(s[0] for s in quiet)
    steps = [(s, ph) for x in rounds for s, ph in zip(x["steps"], x["phases"])]
    slow, others, slow_phases = slow_steps(steps, med, "loading")
    quiet_steps = [(s, ph) for x in rounds for s, ph in zip(x["quiet"], x["quiet_phases"])]
    quiet_slow, _, quiet_slow_phases = slow_steps(quiet_steps, med, "quiet")
    gpu_slow_phases = {}
    if all(s[3] is not None for s in quiet + loading):  # which of the loader's phases the GPU's slow steps overlap
        busy = statistics.median(s[3] for s in quiet)
        gpu_slow_phases = slow_steps(steps, busy, f"loading (GPU busy over {SLOW} quiet medians)", at=3)[2]
    gpu = {}
    for label, group in (("slow", slow), ("other", others), ("quiet", [(s, {}) for s in quiet])):
        rows = [s for s, _ in group if s[2] is not None]
        if rows:
            gpu[label] = dict(steps=len(rows), idle_median_ms=statistics.median(s[2] for s in rows),
                              idle_max_ms=max(s[2] for s in rows), busy_median_ms=statistics.median(s[3] for s in rows),
                              busy_max_ms=max(s[3] for s in rows), with_segments=sum(s[4] > 0 for s in rows))
            g = gpu[label]
            print(f"  GPU in the {label} steps ({g['steps']}): idle median {g['idle_median_ms']:.2f} / max "
                  f"{g['idle_max_ms']:.2f} ms, busy median {g['busy_median_ms']:.2f} / max {g['busy_max_ms']:.2f} ms, "
                  f"{g['with_segments']} with device allocations or frees")
    collections = {}
    for phase, key in (("quiet", "quiet_collections"), ("loading", "collections")):
        for gen, young, ms, thread in [c for x in rounds for c in x[key]]:
            collections.setdefault(f"{phase} gen{gen} on {thread}", []).append((young, ms))
    for key, rows in collections.items():
        collections[key] = dict(count=len(rows), young_median=statistics.median(y for y, _ in rows),
                                median_ms=statistics.median(ms for _, ms in rows), max_ms=max(ms for _, ms in rows))
        print(f"  collections, {key}: {len(rows)}, young objects median {collections[key]['young_median']:.0f}, "
              f"median {collections[key]['median_ms']:.2f} / max {collections[key]['max_ms']:.2f} ms")
    print("  the loader's longest stretches between pause points (bench/stretches.py):")
    stretches = stretch_summary([t for x in rounds for t in x["stretches"]])
    return dict(
        loads=len(latency), collections=collections, stretches=stretches, quiet_median_ms=1e3 * med,
        quiet_p99_ms=1e3 * percentile([s[0] for s in quiet], 99),
        loading_median_ms=1e3 * statistics.median(walls), loading_p90_ms=1e3 * percentile(walls, 90),
        loading_p99_ms=1e3 * percentile(walls, 99), loading_max_ms=1e3 * max(walls),
        p99_over_quiet_median=percentile(walls, 99) / med,
        p99_over_quiet_fit=percentile(rel, 99), quiet_p99_over_quiet_fit=percentile(rel_quiet, 99),
        loading_steps=len(walls), placement_steps=len(placing),
        placement_median_ms=1e3 * statistics.median(s[0] for s in placing) if placing else None,
        load_latency_median_ms=1e3 * statistics.median(latency), load_latency_max_ms=1e3 * max(latency),
        full_collections=len(full := [t for x in rounds for t in x["full_collections_ms"]]),
        full_collection_max_ms=max(full, default=0.0), slow_steps=len(slow), gpu=gpu, slow_step_phases=slow_phases,
        gpu_slow_step_phases=gpu_slow_phases,
        slow_quiet_steps=len(quiet_slow), slow_quiet_step_phases=quiet_slow_phases,
        rounds=[{k: [[round(1e3 * s[0], 3), s[1], *(None if t is None else round(t, 3) for t in s[2:4]), s[4]]
                     for s in v] if k in ("quiet", "steps") else
                 [round(1e3 * t, 2) for t in v] if k == "latency" else
                 [{n: round(ms, 2) for n, ms in o.items()} for o in v] if k in ("phases", "quiet_phases") else v
                 for k, v in x.items() if k not in ("collections", "quiet_collections", "stretches")} for x in rounds])


if __name__ == "__main__":
    main()
