"""Scheduler: token budget, chunked prefill, adapter cap per step, preemption order, fairness."""

from __future__ import annotations

from types import SimpleNamespace

from scute.config import EngineConfig
from scute.engine.block_manager import BlockManager
from scute.engine.request import Request
from scute.engine.scheduler import STARVATION_STEPS, Scheduler
from scute.sampling_params import SamplingParams


class Slots:
    """A stand-in for AdapterManager: `cap` distinct adapters may be active."""

    def __init__(self, cap: int) -> None:
        self.cap, self.refs = cap, {}
        self.version = 0  # never bumped: `ready` refuses no request

    def ready(self, req) -> bool:  # every adapter is on the device at once
        return True

    prefetch = ready

    def can_activate(self, adapter) -> bool:
        return adapter is None or adapter.identity in self.refs or len(self.refs) < self.cap

    def acquire(self, adapter) -> int:
        if adapter is None:
            return -1
        self.refs[adapter.identity] = self.refs.get(adapter.identity, 0) + 1
        return 0

    def release(self, adapter) -> None:
        if adapter is not None:
            self.refs[adapter.identity] -= 1
            if not self.refs[adapter.identity]:
                del self.refs[adapter.identity]


def make(num_blocks=64, block_size=4, cap=8, **cfg):
    config = EngineConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 16, "block_size": block_size, **cfg})
    return Scheduler(config, BlockManager(num_blocks, block_size, False), Slots(cap))


_ids = iter(range(10**6))


def add(s: Scheduler, n: int, adapter: str | None = None) -> Request:
    ad = None if adapter is None else SimpleNamespace(identity=adapter, name=adapter, invocation_tokens=None)
    req = Request(f"r{next(_ids)}", None, list(range(n)), SamplingParams(), ad, adapter, 0)
    s.add_request(req)
    return req


def advance(s: Scheduler) -> dict[str, int]:
    """One step: schedule, mark tokens computed, 'sample' one token for requests that reached their end."""
    out = s.schedule()
    for req, n in out.scheduled:
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:
            req.append_token(7)
    return {req.request_id: n for req, n in out.scheduled}


def test_chunked_prefill_under_the_budget():
    s = make()
    long = add(s, 40)
    short = add(s, 3)
    steps = [advance(s) for _ in range(4)]
    assert steps[0] == {long.request_id: 16}
    assert steps[1] == {long.request_id: 16}
    assert steps[2] == {long.request_id: 8, short.request_id: 3}  # prefill done: the short one joins
    assert steps[3] == {long.request_id: 1, short.request_id: 1}  # both decode
    assert all(sum(step.values()) <= 16 for step in steps)


def test_decodes_are_never_starved_by_a_long_prompt():
    s = make()
    shorts = [add(s, 2) for _ in range(3)]
    advance(s)
    long = add(s, 200)
    for _ in range(10):
        step = advance(s)
        assert all(step[r.request_id] == 1 for r in shorts)  # every decode runs every step
        assert step[long.request_id] == 16 - 3


def test_adapter_cap_per_step_and_starvation_guard():
    s = make(cap=2)
    a = add(s, 2, "A")
    b = add(s, 2, "B")
    c = add(s, 2, "C")  # blocked: A and B hold the two slots
    d = add(s, 2, "A")  # may pass C: its adapter is already active
    step = advance(s)
    assert set(step) == {a.request_id, b.request_id, d.request_id}
    for _ in range(STARVATION_STEPS):
        add(s, 2, "A")  # a stream of A requests...
        advance(s)
    late = add(s, 2, "A")
    step = advance(s)
    assert late.request_id not in step  # ...no longer passes C once C has waited too long
    s.finish(a), s.finish(b), s.finish(d)
    for r in list(s.running):
        s.finish(r)
    assert c.request_id in advance(s)


def test_preemption_takes_the_newest_and_keeps_order():
    s = make(num_blocks=6, block_size=4, max_num_batched_tokens=32)  # 24 token slots
    old = add(s, 8)
    new = add(s, 8)
    advance(s)  # both prefilled: 4 blocks used
    for _ in range(8):
        advance(s)  # growing: someone must give blocks back
    assert new.num_preemptions > 0 and old.num_preemptions == 0
    assert all(r.num_computed_tokens <= r.num_tokens for r in (old, new))
    assert new.output_token_ids  # kept across preemption: recomputed, not dropped


def test_a_request_waiting_on_its_load_is_asked_again_only_after_a_load_or_placement_ends():
    """`ready` refusing a request (its adapter loading) parks it: later steps pass it without asking, and ask
    again once the adapters' `version` moves; it is then admitted, and a request behind it never waits for it."""
    s = make()
    asked, loading = [], set()

    def ready(req) -> bool:
        asked.append(req.request_id)
        return req.request_id not in loading

    slow, fast = add(s, 4, adapter="a"), add(s, 4, adapter="b")
    loading.add(slow.request_id)
    s.adapters.ready = ready
    first = s.schedule()
    assert [r for r, _ in first.scheduled] == [fast] and asked == [slow.request_id, fast.request_id]
    for _ in range(3):
        s.schedule()
    assert asked == [slow.request_id, fast.request_id]  # parked: not asked while nothing ended
    loading.clear()
    s.adapters.version += 1
    assert [r for r, _ in s.schedule().scheduled][-1] is slow and asked[-1] == slow.request_id
