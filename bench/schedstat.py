"""Where threads of this process spent a stretch of time, from Linux's scheduler statistics.

``/proc/self/task/TID/schedstat`` holds, per thread, the nanoseconds it has run on a CPU and the nanoseconds it
was runnable but waiting on a run queue for a core (then the number of its time slices). Between two samples
(`ThreadTimes.sample`), a thread's wall time is its time on a CPU, its time on a run queue (the cores were taken:
too many threads runnable at once) and the rest, blocked (on a lock, such as the interpreter lock, or a wait of
its own). Where a step's host work grows, this tells which: the step loop ran longer itself (its code, or memory
shared with busy threads), waited for a core, or waited for a lock; and how much the adapter loader's threads ran
meanwhile. Threads are grouped by name (`GROUPS`). Elsewhere than Linux, `sample` returns nothing.
"""

from __future__ import annotations

import os
import threading

# name prefix -> group: the engine's adapter loader thread, the threads that read a file (`READERS`)
GROUPS = {"scute-adapter-loader": "loader", "scute-read": "readers"}


def schedstat(fd: int) -> tuple[int, int] | None:
    """(ns on a CPU, ns runnable on a run queue) so far of the thread whose schedstat file `fd` is open, or None."""
    try:
        on_cpu, queued, *_ = os.pread(fd, 128, 0).split()
        return int(on_cpu), int(queued)
    except (OSError, ValueError):
        return None


class ThreadTimes:
    """Samples of the scheduler statistics of the calling thread (``step loop``) and of the `GROUPS` threads;
    `delta` of two samples: per group, ms on a CPU and ms on a run queue between them. Each thread's file is
    opened once and read again at each sample (tens of µs a sample, taken between the steps it times)."""

    def __init__(self) -> None:
        self._files: dict[int, int | None] = {}  # tid -> its schedstat file, None where it cannot be opened

    def sample(self) -> dict[int, tuple[str, int, int]]:
        """tid -> (group, ns on a CPU, ns on a run queue), for the threads alive now ({} without schedstat)."""
        out = {}
        me = threading.get_native_id()
        for thread in threading.enumerate():
            tid = thread.native_id
            group = "step loop" if tid == me else next(
                (g for prefix, g in GROUPS.items() if thread.name.startswith(prefix)), None)
            if group is None or tid is None or (fd := self._file(tid)) is None or (stat := schedstat(fd)) is None:
                continue
            out[tid] = (group, *stat)
        return out

    def _file(self, tid: int) -> int | None:
        if tid not in self._files:
            try:
                self._files[tid] = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
            except OSError:
                self._files[tid] = None
        return self._files[tid]

    @staticmethod
    def delta(before: dict, after: dict) -> dict[str, float]:
        """``"<group> CPU"`` and ``"<group> run queue"`` ms between two samples, summed over the group's threads (a
        thread started since `before` counts from its start)."""
        out: dict[str, float] = {}
        for tid, (group, on_cpu, queued) in after.items():
            _, on0, q0 = before.get(tid, (group, 0, 0))
            out[f"{group} CPU"] = out.get(f"{group} CPU", 0.0) + (on_cpu - on0) / 1e6
            out[f"{group} run queue"] = out.get(f"{group} run queue", 0.0) + (queued - q0) / 1e6
        return out
