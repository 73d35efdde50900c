"""A scheduled step's inputs as host lists: what the model runner copies into its buffers, and what rank 0 of a
tensor-parallel engine sends its workers (plain lists, no request objects).

An eager step (`StepInputs`) packs every scheduled token into one row with its position, KV slot and adapter
slot, its requests' query starts, lengths and block tables, and the LM head's kept rows: each sampling request's
last token, plus the prompt positions of requests owed prompt logprobs (`PromptRows`). A decode graph step
(`DecodeStep`) has one token per request, padded to its bucket when written. `device_inputs` copies an eager
step's lists into the runner's fixed-address buffers, one copy per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from scute.engine.prompt_logprobs import PromptRows
from scute.engine.request import Request
from scute.engine.scheduler import SchedulerOutput
from scute.engine.utils import host_to_device
from scute.model.attention import AttentionMetadata, kv_gather_index
from scute.model.context import ForwardContext
from scute.ops.groups import ActiveSlots


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
class DecodeStep:
    """A decode graph step's inputs (one row per request, padded to `bucket` when written), whether its graph is
    captured first, and the rows whose token comes from the step in flight (`gather`: rows, rows of its output)."""

    bucket: int
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    token_slots: list[int]
    block_tables: list[list[int]]
    gather: tuple[list[int], list[int]]
    capture: bool = False


def eager_inputs(sched: SchedulerOutput, block_size: int) -> tuple[StepInputs, PromptRows | None]:
    """An eager step's inputs, and the prompt positions whose logits it keeps for prompt logprobs (or None)."""
    bs = block_size
    x = StepInputs([], [], [], [], [0], [], [], [], [])
    prompt_rows: PromptRows | None = None
    for req, num_new in sched.scheduled:
        start, table = req.num_computed_tokens, req.block_table
        x.input_ids += req.all_token_ids[start:start + num_new]
        x.positions += range(start, start + num_new)
        x.slot_mapping += [table[p // bs] * bs + p % bs for p in range(start, start + num_new)]
        x.token_slots += req.token_adapter_slots(start, num_new)
        if req.needs_prompt_logprobs:  # the logits of its prompt positions too, in token order
            prompt_rows = prompt_rows or PromptRows()
            prompt_rows.add(req, start, num_new, x.query_start_loc[-1], x.logits_indices, x.sample_slots)
        x.query_start_loc.append(x.query_start_loc[-1] + num_new)
        x.seq_lens.append(start + num_new)
        x.block_tables.append(table)
        if start + num_new == req.num_tokens:
            x.logits_indices.append(x.query_start_loc[-1] - 1)
            x.sample_slots.append(req.token_adapter_slots(req.num_tokens - 1, 1)[0])
    width = max(len(t) for t in x.block_tables)
    x.block_tables = [t + [0] * (width - len(t)) for t in x.block_tables]
    return x, prompt_rows


def decode_step(sched: SchedulerOutput, bucket: int, block_size: int,
                flight_rows: dict[Request, int] | None = None) -> DecodeStep:
    """A decode step's inputs; a token the host does not have yet (sampled by the step in flight, whose output
    rows are `flight_rows`) is taken on the device from that step's output (`gather`)."""
    bs = block_size
    step = DecodeStep(bucket, [], [], [], [], [], ([], []))
    for row, (req, _) in enumerate(sched.scheduled):
        pos, table = req.num_computed_tokens, req.block_table
        if pos < len(req.all_token_ids):
            step.input_ids.append(req.all_token_ids[pos])
        else:
            step.input_ids.append(0)
            step.gather[0].append(row)
            step.gather[1].append(flight_rows[req])
        step.positions.append(pos)
        step.slot_mapping.append(table[pos // bs] * bs + pos % bs)
        step.token_slots.append(req.token_adapter_slots(pos, 1)[0])
        step.block_tables.append(table)
    return step


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
