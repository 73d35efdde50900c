"""Continuous batching under a token budget, with no prefill/decode phases.

Every step each scheduled request computes some of its pending tokens (``num_tokens - num_computed_tokens``):
a whole prompt, a chunk of one (chunked prefill falls out of the token budget), or the one token sampled last
step. Running requests go first, oldest first; then waiting requests are admitted in arrival order while the
budget, `max_num_seqs`, the KV blocks and the adapter slots allow.

Fairness and liveness: when KV blocks run out, the newest running request is preempted (its blocks freed, its tokens
recomputed later, nothing dropped) and goes back to the head of the queue, so the oldest request always progresses.
A waiting request blocked only by the adapter cap lets later requests pass, but once it has waited
`STARVATION_STEPS` steps nothing passes it any more: the running adapters drain and it gets a slot. A request whose
adapter is not on the device yet (loading on the adapter loader since it arrived) is passed too, and counts no
steps: it waits for its own adapter only, and is asked again only once a load or a placement has ended
(`AdapterManager.version`): a thousand requests waiting on loads cost a step a glance each. The scheduler places
nothing: `acquire` gives a slot, the engine fills it between steps.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from scute.config import EngineConfig
from scute.engine.block_manager import BlockManager
from scute.engine.request import Request, RequestStatus

STARVATION_STEPS = 16


@dataclass
class SchedulerOutput:
    # (request, number of new tokens it computes this step), in the order of the packed batch.
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    # Requests preempted this step (blocks freed; they recompute from scratch when readmitted).
    preempted: list[Request] = field(default_factory=list)
    # Sum of the new tokens: the length T of the packed row.
    num_batched_tokens: int = 0


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, adapters) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.adapters = adapters  # AdapterManager: prefetch / ready / can_activate / acquire / release
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Free blocks kept back when admitting, so running requests can grow a little before preempting.
        self.watermark = max(1, block_manager.num_blocks // 100)
        self._blocked_steps: dict[str, int] = {}
        self._loading: dict[str, int] = {}  # request id -> the adapters' `version` when `ready` last refused it

    def add_request(self, req: Request) -> None:
        """Queue a request in arrival order: a parallel sample, queued once its first sample computed the
        prompt, goes ahead of the requests that arrived after its own."""
        if self.waiting and self.waiting[-1].arrival > req.arrival:
            later = next(i for i, r in enumerate(self.waiting) if r.arrival > req.arrival)
            self.waiting.insert(later, req)
        else:
            self.waiting.append(req)
        self.adapters.prefetch(req)  # a cold adapter starts loading now, while the requests ahead of it run

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.num_batched_tokens = sum(n for _, n in out.scheduled)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.block_manager.allocate_slots(req, num_new):
                victim = self.running.pop()  # the newest request gives its blocks back
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    return budget
            out.scheduled.append((req, num_new))
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        passed: list[Request] = []
        version = self.adapters.version
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if self._loading.get(req.request_id, -1) == version or not self.adapters.ready(req):
                self._loading[req.request_id] = version  # its adapter is loading: it waits for it alone
                passed.append(self.waiting.popleft())
                continue
            if not self.adapters.can_activate(req.adapter):
                waited = self._blocked_steps.get(req.request_id, 0) + 1
                self._blocked_steps[req.request_id] = waited
                if waited > STARVATION_STEPS:
                    break  # stop admitting behind it until an adapter slot frees up
                passed.append(self.waiting.popleft())
                continue
            computed = self.block_manager.get_computed_blocks(req)
            num_computed = len(computed) * self.block_manager.block_size
            num_new = min(req.num_tokens - num_computed, budget)
            reserve = self.watermark if self.running else 0  # alone, a request may use every block
            if not self.block_manager.allocate_slots(req, num_new, computed, reserve=reserve):
                break  # strict arrival order for KV: later requests wait too
            self._admit(req, num_computed, num_new, out)
            budget -= num_new
        self.waiting.extendleft(reversed(passed))

    def _admit(self, req: Request, num_computed: int, num_new: int, out: SchedulerOutput) -> None:
        self.waiting.popleft()
        self._blocked_steps.pop(req.request_id, None)
        self._loading.pop(req.request_id, None)
        req.num_computed_tokens = num_computed
        if req.num_preemptions == 0:
            req.num_cached_tokens = num_computed
        req.status = RequestStatus.RUNNING
        req.adapter_slot = self.adapters.acquire(req.adapter)
        self.running.append(req)
        out.scheduled.append((req, num_new))

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req)
        self.adapters.release(req.adapter)
        req.adapter_slot = -1
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        """Take a finished request out (running or waiting) and release its blocks and adapter slot."""
        if req in self.running:
            self.running.remove(req)
            self.block_manager.free(req)
            self.adapters.release(req.adapter)
            req.adapter_slot = -1
        elif req in self.waiting:
            self.waiting.remove(req)
            self._blocked_steps.pop(req.request_id, None)
            self._loading.pop(req.request_id, None)
