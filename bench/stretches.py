"""The adapter loader's stretches: its runs of work between two pause points (`Turns.pause`), by where they begin
and end. Inside one the loader does not wait for the step loop's turn: a step loop whose turn begins while the
loader is inside a stretch shares the interpreter lock with it (each at about half speed) until the stretch ends,
so the longest stretches bound what a load adds to a step's host work. Each is timed by the wall clock and by the
loader thread's CPU time (`time.thread_time`: without its waits, for a read or the GPU, which hold no lock).
Used by `profile_load.py` (one load at a time) and `bench_background_loads.py` (loads beside decode steps).
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from contextlib import contextmanager


class Stretches:
    """While entered: each stretch of a loader job (`AdapterLoader.submit`'s, or one run inside `job`) as
    (from, to, start, end, cpu): `from` and `to` the pause points' code locations (or the job's start and end),
    `start` and `end` perf_counter seconds, `cpu` the thread's CPU seconds in it."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str, float, float, float]] = []
        self._resumed: dict[int, tuple[str, float, float]] = {}  # a job's thread: its last pause point, when it
        # left it (perf_counter) and its CPU time then
        self._saved: list[tuple[object, str, object]] = []

    @contextmanager
    def job(self, name: str = "job"):
        """Record the stretches of the work inside, on this thread (a job run without the loader)."""
        ident = threading.get_ident()
        self._resumed[ident] = f"start of {name}", time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            where, start, cpu = self._resumed.pop(ident)
            self.records.append((where, "end of the job", start, time.perf_counter(), time.thread_time() - cpu))

    def _paused(self, pause):
        def paused(turns):
            ident, now, cpu_now = threading.get_ident(), time.perf_counter(), time.thread_time()
            if ident not in self._resumed:
                return pause(turns)
            f = sys._getframe(1)
            while f.f_back is not None and f.f_code.co_name == "paused":  # past `adapter.paused`, `landing`'s
                f = f.f_back
            here = f"{f.f_code.co_name}:{f.f_lineno} < {f.f_back.f_code.co_name if f.f_back else '?'}"
            where, start, cpu = self._resumed[ident]
            self.records.append((where, here, start, now, cpu_now - cpu))
            try:
                return pause(turns)
            finally:
                self._resumed[ident] = here, time.perf_counter(), time.thread_time()
        return paused

    def _submitted(self, submit):
        def submitted(loader, fn, *args):
            def job(*a):
                with self.job(getattr(fn, "__name__", "job")):
                    return fn(*a)
            return submit(loader, job, *args)
        return submitted

    def __enter__(self) -> Stretches:
        from scute.engine.adapter_loader import AdapterLoader, Turns

        for owner, attr, wrap in ((Turns, "pause", self._paused), (AdapterLoader, "submit", self._submitted)):
            self._saved.append((owner, attr, getattr(owner, attr)))
            setattr(owner, attr, wrap(getattr(owner, attr)))
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, fn in reversed(self._saved):
            setattr(owner, attr, fn)
        self._saved = []

    def longest_within(self, start: float, end: float) -> float:
        """The longest stretch (ms) overlapping [start, end] (perf_counter seconds), 0 if none."""
        return max((1e3 * (b - a) for *_, a, b, _ in self.records if a < end and b > start), default=0.0)


def summary(records: list[tuple[str, str, float, float, float]], top: int = 12) -> dict[str, dict]:
    """Each kind of stretch (from -> to), the longest CPU time first: count, median and max of the wall and CPU ms;
    the first `top` printed."""
    kinds: dict[str, list[tuple[float, float]]] = {}
    for where, here, start, end, cpu in records:
        kinds.setdefault(f"{where} -> {here}", []).append((1e3 * (end - start), 1e3 * cpu))
    rows = [(k, dict(count=len(v), wall_median_ms=statistics.median(w for w, _ in v), wall_max_ms=max(w for w, _ in v),
                     cpu_median_ms=statistics.median(c for _, c in v), cpu_max_ms=max(c for _, c in v)))
            for k, v in kinds.items()]
    rows = sorted(rows, key=lambda kv: -kv[1]["cpu_max_ms"])
    for key, st in rows[:top]:
        print(f"  {key}: {st['count']}, CPU median {st['cpu_median_ms']:.3f} / max {st['cpu_max_ms']:.3f} ms, wall "
              f"median {st['wall_median_ms']:.3f} / max {st['wall_max_ms']:.3f} ms")
    return dict(rows)
