"""A scheduled step's inputs as host lists: what the model runner copies into its buffers, and what rank 0 of a
tensor-parallel engine sends its workers (plain lists, no request objects).

An eager step (`StepInputs`) packs every scheduled token into one row with its position, KV slot and adapter
slot, its requests' query starts, lengths and block tables, and the LM head's kept rows: each sampling request's
last token, plus the prompt positions of requests owed prompt logprobs (`PromptRows`). A graph step
(`GraphStep`) holds the same for a step run at a CUDA graph's padded shape, padded when written (`write_padded`).
`device_inputs` copies an eager step's lists into the runner's fixed-address buffers, one copy per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from scute.engine.cuda_graph import GraphShape, mixed_rows
from scute.engine.prompt_logprobs import PromptRows
from scute.engine.request import Request
from scute.engine.scheduler import SchedulerOutput
from scute.model.attention import AttentionMetadata, kv_gather_index
from scute.model.context import ForwardContext
from scute.ops.groups import ActiveSlots
from scute.ops.mapped import host_to_device


@dataclass
class StepInputs:
    """An eager step's inputs. `block_tables` padded to one width; `logits_indices`: the LM head's kept rows,
    `sample_slots` their adapter slots."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    token_slots: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    logits_indices: list[int]
    sample_slots: list[int]


@dataclass
class GraphStep:
    """A step run at a CUDA graph's padded shape (`GraphShape`: a decode step, one token per request, or a mixed
    one, prompt chunks beside decode tokens), unpadded: its tokens, its requests' query lengths, lengths and block
    tables, the LM head's kept rows and their slots (each sampling request's last token), whether its graph is
    captured first, and the tokens the host does not have yet (`gather`: token rows, rows of the output of the
    step in flight that sampled them). Padding is added when the runner writes it."""

    shape: GraphShape
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    token_slots: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    logits_rows: list[int] = field(default_factory=list)
    sample_slots: list[int] = field(default_factory=list)
    gather: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))
    capture: bool = False


def _append_tokens(x: StepInputs | GraphStep, req: Request, start: int, num: int, block_size: int) -> int:
    """Append the request's tokens at positions [start, start + num) to the token lists of `x`: ids (0 where the
    host does not have one yet), positions, KV slots, adapter slots; returns how many ids the host has (the first
    ones). A decoding request's one token (most of a step's) is appended as it is, without per-token lists."""
    ids = req.all_token_ids
    if num == 1:
        known = start < len(ids)  # a bool: 1 or 0
        x.input_ids.append(ids[start] if known else 0)
        x.positions.append(start)
        x.slot_mapping.append(req.block_table[start // block_size] * block_size + start % block_size)
        x.token_slots.append(req.adapter_slot if start >= req.adapter_start else -1)
        return known
    table, have, bs = req.block_table, ids[start:start + num], block_size
    x.input_ids += have + [0] * (num - len(have))
    x.positions += range(start, start + num)
    x.slot_mapping += [table[p // bs] * bs + p % bs for p in range(start, start + num)]
    x.token_slots += req.token_adapter_slots(start, num)
    return len(have)


def eager_inputs(sched: SchedulerOutput, block_size: int) -> tuple[StepInputs, PromptRows | None]:
    """An eager step's inputs, and the prompt positions whose logits it keeps for prompt logprobs (or None)."""
    bs = block_size
    x = StepInputs([], [], [], [], [0], [], [], [], [])
    prompt_rows: PromptRows | None = None
    for req, num_new in sched.scheduled:
        start, table = req.num_computed_tokens, req.block_table
        _append_tokens(x, req, start, num_new, bs)  # an eager step's tokens are all on the host
        if req.needs_prompt_logprobs:  # the logits of its prompt positions too, in token order
            prompt_rows = prompt_rows or PromptRows()
            prompt_rows.add(req, start, num_new, x.query_start_loc[-1], x.logits_indices, x.sample_slots)
        x.query_start_loc.append(x.query_start_loc[-1] + num_new)
        x.seq_lens.append(start + num_new)
        x.block_tables.append(table)
        if start + num_new == req.num_tokens:
            x.logits_indices.append(x.query_start_loc[-1] - 1)
            x.sample_slots.append(x.token_slots[-1])  # the request's last token is the step's last
    width = max(len(t) for t in x.block_tables)
    x.block_tables = [t + [0] * (width - len(t)) for t in x.block_tables]
    return x, prompt_rows


def graph_step(sched: SchedulerOutput, shape: GraphShape, block_size: int,
               flight_rows: dict[Request, int] | None = None) -> GraphStep:
    """A graph step's inputs; a token the host does not have yet (sampled by the step in flight, whose output
    rows are `flight_rows`) is taken on the device from that step's output (`gather`)."""
    if not shape.mixed and sched.num_batched_tokens == len(sched.scheduled):  # a decode graph's step
        return _decode_step(sched, shape, block_size, flight_rows)
    bs = block_size
    step = GraphStep(shape)
    for req, num_new in sched.scheduled:
        start, table, row = req.num_computed_tokens, req.block_table, len(step.input_ids)
        known = _append_tokens(step, req, start, num_new, bs)
        if known < num_new:  # the rest was sampled by the step in flight
            step.gather[0].extend(range(row + known, row + num_new))
            step.gather[1].extend([flight_rows[req]] * (num_new - known))
        step.query_lens.append(num_new)
        step.seq_lens.append(start + num_new)
        step.block_tables.append(table)
        if start + num_new == req.num_tokens:
            step.logits_rows.append(len(step.input_ids) - 1)
            step.sample_slots.append(step.token_slots[-1])
    return step


def _decode_step(sched: SchedulerOutput, shape: GraphShape, bs: int,
                 flight_rows: dict[Request, int] | None) -> GraphStep:
    """`graph_step` of a decode graph's step (every request computes its one next token and samples, as
    `ModelRunner` runs a decode graph only for such a step): `_append_tokens`' one-token branch and the rest of the
    loop inlined, each list appended to as a bound method, in the step loop's host work every step (the build
    column of `bench/bench_host_step.py`)."""
    step = GraphStep(shape)
    ids, positions, kv_slots, slots = (step.input_ids.append, step.positions.append, step.slot_mapping.append,
                                       step.token_slots.append)
    seq_lens, tables = step.seq_lens.append, step.block_tables.append
    for row, (req, _) in enumerate(sched.scheduled):
        start, table, have = req.num_computed_tokens, req.block_table, req.all_token_ids
        if start < len(have):
            ids(have[start])
        else:  # sampled by the step in flight
            ids(0)
            step.gather[0].append(row)
            step.gather[1].append(flight_rows[req])
        positions(start)
        kv_slots(table[start // bs] * bs + start % bs)
        slots(req.adapter_slot if start >= req.adapter_start else -1)
        seq_lens(start + 1)
        tables(table)
    n = len(step.input_ids)
    step.query_lens, step.logits_rows, step.sample_slots = [1] * n, list(range(n)), list(step.token_slots)
    return step


class TableRows:
    """A host mirror's block tables ([rows, width] int32) and the request table each row holds, up to which length:
    a step writes only what changed since this mirror was last written (a request's table grows in place, a block
    at a time; any other change is a new list: `BlockManager`), not a numpy write per row every step (the write
    column of `bench/bench_host_step.py`)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self._held: list[tuple[list[int] | None, int]] = [(None, 0)] * array.shape[0]

    def write(self, tables: list[list[int]]) -> None:
        """Rows 0.. hold `tables` (each from its first entry; the entries past its length are left as they are)."""
        array, held = self.array, self._held
        for row, table in enumerate(tables):
            had, n = held[row]
            if had is not table or len(table) < n:
                array[row, : len(table)] = table
            elif len(table) == n:
                continue
            else:
                array[row, n: len(table)] = table[n:]
            held[row] = (table, len(table))

    def fill_first(self, start: int, end: int, value: int) -> None:
        """Rows start..end hold `value` in their first entry (and no request's table)."""
        self.array[start:end, 0] = value
        self._held[start:end] = [(None, 0)] * (end - start)


def write_padded(step: GraphStep, mirrors: list, max_num_seqs: int) -> None:
    """Write a graph step's inputs and its padding up to its shape into the runner's host mirrors (numpy arrays:
    tokens [4, ·]: ids, positions, KV slots, adapter slots; requests [2, ·]: query starts, lengths; block tables
    (`TableRows`); LM head rows [2, ·]: kept rows, their slots). Padding tokens are token 0 at position 0, no
    adapter, no KV store; a decode step's padding rows are one-token requests reading page 0, a mixed step's one
    request of length 0 (zeros from the attention), then empty requests; the LM head's padding rows read row 0."""
    tokens, seqs, tables, rows = mirrors
    num_tokens, num_seqs, num_rows = len(step.input_ids), len(step.seq_lens), len(step.logits_rows)
    size = step.shape.tokens
    tokens[0, :num_tokens], tokens[1, :num_tokens] = step.input_ids, step.positions
    tokens[2, :num_tokens], tokens[3, :num_tokens] = step.slot_mapping, step.token_slots
    tokens[:2, num_tokens:size], tokens[2:, num_tokens:size] = 0, -1
    seqs[0, 0] = 0
    np.cumsum(step.query_lens, out=seqs[0, 1 : num_seqs + 1])
    seqs[1, :num_seqs] = step.seq_lens
    tables.write(step.block_tables)
    if step.shape.mixed:
        graph_seqs, graph_rows = mixed_rows(size, max_num_seqs)
        seqs[0, num_seqs + 1 : graph_seqs + 1], seqs[1, num_seqs:graph_seqs] = size, 0
        rows[0, :num_rows], rows[1, :num_rows] = step.logits_rows, step.sample_slots
        rows[0, num_rows:graph_rows], rows[1, num_rows:graph_rows] = 0, -1
    else:
        seqs[0, num_seqs + 1 : size + 1] = range(num_seqs + 1, size + 1)
        seqs[1, num_seqs:size] = 1
        tables.fill_first(num_seqs, size, 0)


def device_inputs(x: StepInputs, buffers: dict[str, Tensor], device: torch.device,
                  kv_caches: list[tuple[Tensor, Tensor]], backend: str,
                  ) -> tuple[Tensor, Tensor, ForwardContext, Tensor]:
    """The step's input ids, positions, forward context and kept rows, each copied into its buffer (a prefix)."""
    buf = buffers
    meta = AttentionMetadata(
        slot_mapping=host_to_device(x.slot_mapping, torch.int64, device, buf["slot_mapping"]),
        query_start_loc=host_to_device(x.query_start_loc, torch.int32, device, buf["query_start_loc"]),
        seq_lens=host_to_device(x.seq_lens, torch.int32, device, buf["seq_lens"]),
        block_tables=host_to_device(x.block_tables, torch.int32, device, buf["block_tables"]),
        max_query_len=max(b - a for a, b in zip(x.query_start_loc, x.query_start_loc[1:])),
        max_seq_len=max(x.seq_lens), query_start_loc_host=x.query_start_loc, seq_lens_host=x.seq_lens,
        kv_caches=kv_caches, backend=backend,
    )
    if backend == "torch":  # its gather index, once for every layer
        meta.kv_index = kv_gather_index(meta, kv_caches[0][0].shape[1])
    ctx = ForwardContext(
        token_adapter_slots=host_to_device(x.token_slots, torch.int64, device, buf["token_slots"]),
        sample_adapter_slots=host_to_device(x.sample_slots, torch.int64, device,
                                            _fits(buf["sample_slots"], x.sample_slots)),
        active_adapter_slots=ActiveSlots(x.token_slots),
        attn=meta,
    )
    ids = host_to_device(x.input_ids, torch.int64, device, buf["input_ids"])
    pos = host_to_device(x.positions, torch.int64, device, buf["positions"])
    logits = host_to_device(x.logits_indices, torch.int64, device, _fits(buf["logits_indices"], x.logits_indices))
    return ids, pos, ctx, logits


def _fits(buffer: Tensor, values: list) -> Tensor | None:
    """`buffer` if it can hold `values` (a step's sampled rows always fit; prompt-logprob rows may not)."""
    return buffer if len(values) <= buffer.shape[0] else None
