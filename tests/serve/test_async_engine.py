"""`AsyncEngine` hands a step's outputs to their streams with one wake-up of each event loop, not one per output,
in the order the engine made them, and drops outputs of requests whose stream has closed."""

from __future__ import annotations

import asyncio

from scute.outputs import RequestOutput
from scute.serve.async_engine import AsyncEngine


class CountingLoop:
    """An event loop's `call_soon_threadsafe`, run at once and counted."""

    def __init__(self) -> None:
        self.calls = 0

    def call_soon_threadsafe(self, fn, *args) -> None:
        self.calls += 1
        fn(*args)


def test_a_steps_outputs_wake_each_loop_once():
    engine = AsyncEngine(engine=None)
    loops = [CountingLoop(), CountingLoop()]
    queues = {f"r{i}": asyncio.Queue() for i in range(5)}
    for i, (rid, q) in enumerate(queues.items()):
        engine._streams[rid] = (loops[i % 2], q)
    steps = [[RequestOutput(rid, None, [], finished=step == 1) for rid in [*queues, "gone"]] for step in range(2)]
    for outputs in steps:
        engine._deliver(outputs)
    assert [loop.calls for loop in loops] == [2, 2]  # a call per loop per step, for 3 and 2 streams
    for rid, q in queues.items():
        got = [q.get_nowait() for _ in range(q.qsize())]
        assert [(o.request_id, o.finished) for o in got] == [(rid, False), (rid, True)]
