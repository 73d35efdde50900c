"""Steps replayed as CUDA graphs: one graph per (adapter layout, step kinds, padded shape).

A decode step of B requests (one new token each) runs as the replay of a graph captured for the smallest
bucket >= B (`capture_sizes`: 1, 2, 4, 8, then steps of 16, as nano-vllm does) with the rows past B padded:
slot −1 (no adapter, no KV store), a one-token sequence reading page 0. A mixed step (prompt chunks, possibly
beside decode tokens) of T tokens runs as the graph of the smallest `mixed_sizes` bucket >= T, its padding
tokens one request of length 0 (the attention gives it zeros) and its padding requests empty; its graph has
room for every request a step of that many tokens can hold, and its LM head reads the kept rows (each sampling
request's last token) through an index buffer. Every per-step input lives in the model runner's fixed-address
buffers, written before the replay; the adapter kernels' token metadata is computed inside the graph from the
token slots, and every grid is sized from the shape and the slot count, never from the data (the attention's
too: `scute.model.attention_triton`). So one replay launches the whole forward (224 adapted projections of a
Llama-3-8B: thousands of kernels) for a few microseconds of host time, where an eager step of a Llama-3-8B
with adapters spends tens of milliseconds launching them.

What a graph bakes in, and so what keys it:
* the adapter *layout*: each adapted call's `SlotPool.signature` (every size and buffer its launches are built
  from), and which calls share a slot grouping (the first of them builds the tokens' order by group inside the
  graph, the others reuse it). Placing an adapter rewrites only the pools' table contents and their groupings
  (`slot_group`), which graphs read at replay: a VeRA adapter joining the shared group of the VeRA adapters
  before it keeps every graph. A placement that changes a signature (a larger rank, a first OFT adapter in a
  layer) or which calls share a grouping changes the layout, and the graphs of the old layout are dropped;
* the step's *kinds*: which of the passes (input transform, shared products, low-rank, epilogue) the step's
  adapters need anywhere (`slot_kinds`), so that a step of base requests replays a graph of plain GEMMs even
  while adapters are resident. A graph is captured with every slot whose kinds are among the key's as the
  step's active slots, so it serves any step whose slots need no other pass;
* the shape: tokens, and whether the step is a decode or a mixed one.

A graph also records what its calls' plans read of those active slots (each pool's `StepFacts`: which passes
they need there, whether they are all plain low-rank deltas, which projections have deltas). A placement that
changes them (a first IA3 adapter among LoRA ones: the LoRA graphs' slots are no longer all plain) makes the
graph be captured again when a step next needs it; one that does not (a LoRA adapter into a free slot beside
other LoRA ones: the common case) keeps every graph.

Graphs are captured largest first into one shared memory pool (their intermediates overlap; one runs at a time), and
each writes its logits into the rows of one buffer that every graph shares (`StepGraphs.logits`: kept per graph, the
LM head's outputs alone would hold a gigabyte per step key on a 128k vocabulary). The base model's graphs are
captured at start-up; graphs of other kinds or layouts when a step first needs them (one eager forward first: it
builds any missing pool and compiles the kernels). Steps of more than `MIXED_MAX_TOKENS` tokens, and those computing
prompt logprobs, run eagerly.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import Tensor
from tqdm.auto import tqdm

from scute.model.linear import ScuteLinear
from scute.ops.groups import ActiveSlots
from scute.ops.plan import bucket_facts, step_facts
from scute.ops.pool import StepKinds

# mixed steps up to this many tokens replay graphs; longer ones run eagerly (each size is one more graph per step
# key, its memory kept while the graph lives)
MIXED_MAX_TOKENS = 1024


class GraphShape(NamedTuple):
    """The padded shape a graph is captured for: `tokens` rows; `mixed`: a mixed step's graph (requests of any
    query length) rather than a decode step's (one token per request, `tokens` requests)."""

    tokens: int
    mixed: bool = False


def mixed_sizes(max_num_batched_tokens: int) -> list[int]:
    """The padded token counts of mixed steps' graphs: 16, 32, 64, then every 64 to 512 and every 256 to
    `MIXED_MAX_TOKENS`, none above max_num_batched_tokens (padding costs GEMM rows: finer where they are cheap)."""
    sizes = [16, 32, *range(64, 513, 64), *range(768, MIXED_MAX_TOKENS + 1, 256)]
    return [s for s in sizes if s <= max_num_batched_tokens]


def mixed_rows(tokens: int, max_num_seqs: int) -> tuple[int, int]:
    """A mixed graph of `tokens` tokens: its requests (as many as such a step holds, plus the padding one) and the
    LM head's rows (one per sampling request at most: fewer than its tokens, since some request has two or more
    or does not sample, so that a layer tells the LM head's rows from the step's tokens by their count)."""
    return min(tokens, max_num_seqs + 1), min(tokens - 1, max_num_seqs)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The padded decode batch sizes a graph is captured for: 1, 2, 4, 8, then every 16 up to max_num_seqs."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16)) + [max_num_seqs]
    return sorted(set(sizes))


def bucket_of(sizes: Sequence[int], num_seqs: int) -> int | None:
    """The smallest of the (sorted) capture `sizes` holding `num_seqs` rows (None: more than the largest)."""
    for size in sizes:
        if size >= num_seqs:
            return size
    return None


class AdapterLayout:
    """What the graphs of the current adapter placement bake in: `key` (hashable; graphs of another key are
    dropped), `graph_key(step_key)` (what a graph of a step key records of its active slots) and `slot_kinds(s)`
    (the passes slot s needs in some layer, a bit per `StepKinds` field). Each is worked out when first asked."""

    def __init__(self, linears: Iterable[ScuteLinear], num_slots: int) -> None:
        units = {}  # the calls a forward makes with adapters: a group with an adapted member, or a lone layer
        for lin in linears:
            if lin.group is not None and any(m.num_filled for m in lin.group.members):
                units[id(lin.group)] = lin.group
            elif lin.num_filled:
                units[id(lin)] = lin
        pools = [u.pool for u in units.values()]
        self.complete = None not in pools  # else: an eager step builds the missing pools first
        self.pools = [p for p in pools if p is not None]
        groupings: dict[tuple, int] = {}  # each distinct grouping's index: which pools share one, not what it is
        self.key = (tuple(p.signature for p in self.pools),
                    tuple(-1 if p.group_key is None else groupings.setdefault(p.group_key, len(groupings))
                          for p in self.pools))
        masks = [0] * len(StepKinds._fields)  # per pass: the slots that need it in some layer
        for p in self.pools:
            masks = [m | pm for m, pm in zip(masks, p.kind_masks)]
        self.num_slots, self._masks, self._kinds, self._active = num_slots, masks, {}, {}
        self._step_facts: dict[int, tuple] = {}  # step key -> each pool's StepFacts for its active slots
        self._graph_keys: dict[tuple[int, int], tuple] = {}  # (step key, bucket) -> `graph_key`

    def slot_kinds(self, s: int) -> int:
        kinds = self._kinds.get(s)
        if kinds is None:
            kinds = self._kinds[s] = sum((m >> s & 1) << k for k, m in enumerate(self._masks))
        return kinds

    def step_key(self, slots: Iterable[int]) -> int:
        """The passes a step with these token slots needs (−1, the base model, needs none)."""
        key = 0
        for s in set(slots):
            if s >= 0:
                key |= self.slot_kinds(s)
        return key

    def active_slots(self, step_key: int) -> ActiveSlots:
        """The slots a graph of `step_key` is captured for: every slot that needs no other pass, and −1."""
        active = self._active.get(step_key)
        if active is None:
            other = 0  # the slots that need a pass the key has not
            for k, m in enumerate(self._masks):
                other |= 0 if step_key >> k & 1 else m
            active = self._active[step_key] = ActiveSlots(
                [-1] + [s for s in range(self.num_slots) if not other >> s & 1])
        return active

    def graph_key(self, step_key: int, tokens: int) -> tuple:
        """Each pool's `StepFacts` for the active slots of `step_key`, as far as the plans of a step of `tokens`
        tokens read them (`bucket_facts`): a graph captured under another key would launch other passes than
        this layout's step does. Worked out once per layout (`rekey`: again)."""
        key = self._graph_keys.get((step_key, tokens))
        if key is None:
            facts = self._step_facts.get(step_key)
            if facts is None:
                active = self.active_slots(step_key)
                facts = self._step_facts[step_key] = tuple(step_facts(p.facts, active) for p in self.pools)
            key = self._graph_keys[step_key, tokens] = tuple(bucket_facts(f, tokens) for f in facts)
        return key

    def rekey(self, step_key: int) -> None:
        """Forget `graph_key`s of `step_key`, so that they follow the pools' facts now (a capture: its key must be
        that of the facts its plans read, and a placement in progress changes pools' facts before the layout
        follows: `scute.model.hf.placing`)."""
        self._step_facts.pop(step_key, None)
        for k in [k for k in self._graph_keys if k[0] == step_key]:
            del self._graph_keys[k]


class CaptureGuard:
    """Graph captures and the adapter loaders' work kept apart, process-wide. A loader's job holds the guard
    (`job`) except at its pause points, where it lets a capture that waits go first (`pause`); a capture
    (`capturing`) waits for the job's next pause point. Launches, sorts and pageable copies of a loader thread
    made while another thread captured broke the capture, failed the load or crashed the process (torch 2.11,
    thread-local capture mode), and anything a job does may launch (a method's first adapter warms its kernels).
    A job waits at most for one capture (milliseconds); a capture for the job's work up to its next pause point
    (a layer's conversion or rows, or a first kernel's compile)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # held by a job between its pause points, or by a capture
        self._cond = threading.Condition()
        self._waiting = 0  # captures waiting for the lock
        self._owner: int | None = None  # the thread of the job that holds it

    @contextmanager
    def job(self) -> Iterator[None]:
        self._lock.acquire()
        self._owner = threading.get_ident()
        try:
            yield
        finally:
            self._owner = None
            self._lock.release()

    def pause(self) -> None:
        """A pause point of a job (on its thread; elsewhere nothing): a capture waiting runs before it goes on."""
        if self._waiting and self._owner == threading.get_ident():
            with self.released():
                with self._cond:  # the capture takes the lock before it stops waiting: the job cannot take it first
                    self._cond.wait_for(lambda: self._waiting == 0)

    @contextmanager
    def released(self) -> Iterator[None]:
        """Within it, a job (on its thread; elsewhere nothing) lets captures run: while it waits for its turn."""
        if self._owner != threading.get_ident():
            yield
            return
        self._owner = None
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()
            self._owner = threading.get_ident()

    @contextmanager
    def capturing(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._cond:
                self._waiting -= 1
                self._cond.notify_all()
        try:
            yield
        finally:
            self._lock.release()


CAPTURE_GUARD = CaptureGuard()


class StepGraphs:
    """The captured graphs of steps. `forward(shape, active_slots)` runs the model's forward over the runner's
    buffers at a `GraphShape` and returns the logits of its kept rows (at most `max_rows`); `pad(shape)` writes
    inputs of padding alone at a shape into them (what a capture runs over: it stores no KV of real requests);
    `replay` runs a step. Every graph copies its logits into the first rows of `logits`, allocated at the first
    capture outside the graphs' pool."""

    def __init__(self, forward: Callable[[GraphShape, frozenset[int] | None], Tensor],
                 pad: Callable[[GraphShape], None], shapes: Sequence[GraphShape], device: torch.device,
                 max_rows: int) -> None:
        self.forward, self.pad, self.device, self.max_rows = forward, pad, device, max_rows
        self.shapes = sorted(shapes)
        self.logits: Tensor | None = None  # [max_rows, vocab]: the logits every graph writes
        self.pool = torch.cuda.graph_pool_handle()
        self.layout_key: tuple | None = None
        self.graphs: dict[tuple[int, GraphShape], tuple[torch.cuda.CUDAGraph, Tensor, tuple]] = {}  # + graph key
        self.capture_seconds, self.num_captured, self.num_replays = 0.0, 0, 0

    def has(self, layout: AdapterLayout, step_key: int, shape: GraphShape) -> bool:
        """Whether the graph of this layout, step key and shape is captured (under its current graph key)."""
        self._use(layout)
        entry = self.graphs.get((step_key, shape))
        return entry is not None and entry[2] == layout.graph_key(step_key, shape.tokens)

    def replay(self, layout: AdapterLayout, step_key: int, shape: GraphShape) -> Tensor:
        """Replay a captured graph over the inputs in the buffers; returns its logits (rows of `logits`: valid
        until the next replay of any graph)."""
        self._use(layout)
        graph, logits, _ = self.graphs[(step_key, shape)]
        graph.replay()
        self.num_replays += 1
        return logits

    def _use(self, layout: AdapterLayout) -> None:
        if layout.key != self.layout_key:  # new signatures: the old graphs bake in sizes and buffers now gone
            self.graphs.clear()  # their memory pool goes with them: the next captures start a new one
            self.pool = torch.cuda.graph_pool_handle()
            self.layout_key = layout.key

    @torch.inference_mode()
    def capture(self, layout: AdapterLayout, step_key: int, shapes: Sequence[GraphShape], progress: bool = False,
                ) -> None:
        """Capture the graphs of `shapes` (largest first, into the shared pool) for a step key (replacing any
        captured under another graph key)."""
        self._use(layout)
        start = time.perf_counter()
        active = layout.active_slots(step_key)
        layout.rekey(step_key)
        with CAPTURE_GUARD.capturing():  # the adapter loader parked at a pause point meanwhile
            self._capture(layout, step_key, active, shapes, progress)
        torch.cuda.synchronize(self.device)
        self.capture_seconds += time.perf_counter() - start

    def _capture(self, layout: AdapterLayout, step_key: int, active: ActiveSlots, shapes: Sequence[GraphShape],
                 progress: bool) -> None:
        for shape in tqdm(sorted(shapes, reverse=True), desc="Capturing CUDA graphs", unit="graph",
                          disable=not progress, file=sys.stderr):
            self.pad(shape)
            eager = self.forward(shape, active)  # compiles the kernels, builds missing pools and per-shape state
            if self.logits is None:
                self.logits = torch.empty((self.max_rows, eager.shape[-1]), dtype=eager.dtype, device=self.device)
            del eager
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA calls of other threads meanwhile do not fail this capture (the default, global,
            # would fail them); the adapter loaders' jobs are parked at a pause point (`CAPTURE_GUARD`)
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                rows = self.forward(shape, active)
                logits = self.logits[: rows.shape[0]].copy_(rows)
                del rows  # the graph's own copy: its pool memory is free for the next capture's intermediates
            self.graphs[(step_key, shape)] = (graph, logits, layout.graph_key(step_key, shape.tokens))
            self.num_captured += 1
