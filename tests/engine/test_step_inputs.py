"""A step's inputs, built on the host: a decoding request's one token (appended without the per-token lists a
multi-token request builds) gets the same id, position, KV slot and adapter slot as the same token computed as part
of a longer chunk, in the eager and the graph step, including a token the host does not have yet (the step in
flight sampled it) and an aLoRA's tokens before its invocation (base)."""

from __future__ import annotations

import dataclasses
import random

from scute import SamplingParams
from scute.engine.cuda_graph import GraphShape
from scute.engine.request import NEVER, Request
from scute.engine.scheduler import SchedulerOutput
from scute.engine.step_inputs import eager_inputs, graph_step

BLOCK = 16


def _requests(rng: random.Random, count: int) -> list[Request]:
    reqs = []
    for i in range(count):
        length = rng.randint(2, 70)
        req = Request(f"r{i}", None, [rng.randint(1, 999) for _ in range(length)], SamplingParams(), None, None, i)
        req.block_table = rng.sample(range(500), -(-length // BLOCK))
        req.num_computed_tokens = length - 1
        req.adapter_slot = rng.randint(0, 7)
        req.adapter_start = rng.choice([0, length - 1, length, NEVER])  # an aLoRA's gate, or none
        reqs.append(req)
    return reqs


def test_a_decoding_token_is_built_as_in_a_chunk():
    rng = random.Random(0)
    reqs = _requests(rng, 40)
    pending = reqs[::3]
    for req in pending:  # its last token is the step in flight's: not on the host yet
        req.all_token_ids.pop()
        req.num_pending = 1
    one = SchedulerOutput([(r, 1) for r in reqs], num_batched_tokens=len(reqs))
    flight_rows = {r: i for i, r in enumerate(pending)}
    step = graph_step(one, GraphShape(64), BLOCK, flight_rows)
    general = graph_step(one, GraphShape(64, True), BLOCK, flight_rows)  # the loop of mixed steps, on this step
    fields = [f.name for f in dataclasses.fields(step) if f.name != "shape"]
    assert [getattr(step, f) for f in fields] == [getattr(general, f) for f in fields]
    # the same tokens as the last of a two-token chunk of each request (the multi-token path)
    for req in reqs:
        req.num_computed_tokens -= 1
    two = graph_step(SchedulerOutput([(r, 2) for r in reqs], num_batched_tokens=2 * len(reqs)), GraphShape(128),
                     BLOCK, flight_rows)
    for name in ("input_ids", "positions", "slot_mapping", "token_slots"):
        assert getattr(step, name) == getattr(two, name)[1::2], name
    assert step.gather == ([reqs.index(r) for r in pending], list(range(len(pending))))
    assert step.sample_slots == step.token_slots and step.logits_rows == list(range(len(reqs)))
    assert any(s == -1 for s in step.token_slots) and any(s >= 0 for s in step.token_slots)  # both gates drawn
    for req in pending:  # the host has every token: the eager step's inputs are the graph step's
        req.all_token_ids.append(7)
        req.num_pending = 0
    for req in reqs:
        req.num_computed_tokens += 1
    eager, _ = eager_inputs(one, BLOCK)
    graph = graph_step(one, GraphShape(64), BLOCK)
    for name in ("input_ids", "positions", "slot_mapping", "token_slots"):
        assert getattr(eager, name) == getattr(graph, name), name
    assert eager.sample_slots == graph.sample_slots


def test_table_rows_write_what_changed_and_stay_equal_to_the_tables():
    """`TableRows` writes a row again only where its table changed since this mirror held it: grown in place (its
    new entries), or another list (all of it); rows given padding hold no table. After every write each row
    starts with its table, whatever the mirror held before."""
    import numpy as np

    from scute.engine.step_inputs import TableRows

    rows = TableRows(np.full((4, 6), -1, dtype=np.int32))
    a, b = [3, 4], [7]
    rows.write([a, b])
    a.append(5)  # grown in place: its new entry
    rows.array[0, :2] = -9  # what the row held stays: only the tail is written
    rows.write([a, b])
    assert rows.array[0, :3].tolist() == [-9, -9, 5]
    b2 = [8]  # another, shorter list (freed and admitted again): written whole
    rows.write([b2, a])
    assert rows.array[0, :1].tolist() == [8] and rows.array[1, :3].tolist() == [3, 4, 5]
    rows.fill_first(0, 2, 0)
    rows.write([b2, a])  # padding overwrote them: written whole again
    assert rows.array[0, :1].tolist() == [8] and rows.array[1, :3].tolist() == [3, 4, 5]
    a.append(6)
    rows.write([b2, a, [1, 2]])
    assert rows.array[1, :4].tolist() == [3, 4, 5, 6] and rows.array[2, :2].tolist() == [1, 2]
    rows.write([b2, [9, 8, 7, 6], [1, 2]])  # another list of the held one's length: written whole
    assert rows.array[1, :4].tolist() == [9, 8, 7, 6]
