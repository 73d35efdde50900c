"""`ModelRunner`: owns the paged KV cache; turns a scheduled step into one packed forward and samples.

A step's tokens (prompt chunks and decode tokens of many requests) are one row ``[1, T]`` fed to the HF model
with their positions; the adapter slot of every token and the paged-attention metadata travel in the forward
context. Logits are computed only at each sampling request's last token (``logits_to_keep``). Host-side inputs
are built as Python lists, then copied into buffers allocated at start-up (fixed addresses: what CUDA graphs
need). On CUDA with the Triton attention, unless `enforce_eager`, decode steps and mixed steps (prompt chunks
beside decode tokens) of up to `MIXED_MAX_TOKENS` tokens replay CUDA graphs (`scute.engine.cuda_graph`); longer
steps, and steps computing prompt logprobs, run eagerly (`execute`). A graph step is the same either way: padded
to a graph's shape (the same GEMM shapes, grids and split-K choices, so the same rounding) and launched ahead of
the previous step's tokens (the same batches: see `Engine._step`), so `enforce_eager` changes how its kernels
are launched, never its tokens.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from scute.config import EngineConfig
from scute.model.context import ForwardContext, forward_context
from scute.engine.cuda_graph import (AdapterLayout, GraphShape, StepGraphs, bucket_of, capture_sizes, mixed_rows,
                                     mixed_sizes)
from scute.engine.prompt_logprobs import PromptRows
from scute.engine.request import Request
from scute.engine.sampler import Sampler, SamplerOutput, SamplingBatch
from scute.engine.scheduler import SchedulerOutput
from scute.engine.step_inputs import (GraphStep, StepInputs, TableRows, device_inputs, eager_inputs, graph_step,
                                      write_padded)
from scute.model.attention import AttentionMetadata, flash_attn_available
from scute.model.loader import LoadedModel
from scute.ops.mapped import copy_by_kernel, device_view, keep, to_host


@dataclass
class InFlight:
    """A decode step launched on the GPU whose sampled tokens the host has not read yet: kernels behind the step's
    write its output into pinned host memory (`event` marks their end)."""

    sampling: list[Request]
    result: SamplerOutput  # on the device
    host: SamplerOutput  # in pinned host memory, once `event` has ended
    event: torch.cuda.Event
    rows: dict[Request, int]  # each sampling request's row of result

    def wait(self) -> SamplerOutput:
        """The step's sampler output on the host (waits for the GPU if needed)."""
        self.event.synchronize()
        return self.host


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, num_blocks: int, max_model_len: int,
                 broadcast: Callable[[StepInputs | GraphStep], None] | None = None) -> None:
        """`broadcast`: tensor parallelism, rank 0: sends each step's inputs to the workers before it runs."""
        self.model, self.device, self.dtype = loaded.model, loaded.device, loaded.dtype
        self.block_size = config.block_size
        self.backend = self._pick_backend(config)
        shape = (num_blocks, config.block_size, loaded.num_kv_heads, loaded.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(loaded.num_layers)
        ]
        max_tokens, max_seqs = config.max_num_batched_tokens, config.max_num_seqs
        self.max_blocks_per_seq = -(-max_model_len // config.block_size)
        # Fixed-address inputs; each step fills a prefix of each. The per-token int64 ones are the rows of one
        # tensor, the per-sequence int32 ones (room for a mixed graph's padding request) of another and the LM
        # head's kept rows and their slots of a third, so that a graph step writes all of them from three pinned
        # host mirrors, four for a mixed step (`_write_inputs`).
        self._tokens = self._zeros((4, max_tokens), torch.int64)
        self._seqs = self._zeros((2, max_seqs + 2), torch.int32)
        self._rows = self._zeros((2, max_seqs), torch.int64)
        self.buffers = {
            "input_ids": self._tokens[0], "positions": self._tokens[1], "slot_mapping": self._tokens[2],
            "token_slots": self._tokens[3], "query_start_loc": self._seqs[0], "seq_lens": self._seqs[1],
            "block_tables": self._zeros((max_seqs + 1, self.max_blocks_per_seq), torch.int32),
            "logits_indices": self._rows[0], "sample_slots": self._rows[1],
        }
        # Two sets of pinned host mirrors, used in turn: a graph step's reads of them may still be queued behind
        # the step in flight when the next step writes its inputs, but the reads of the step before it are done
        # (the host waited for that step's tokens). A kernel reads them where they are (`device_view`): a copy
        # would queue on a copy engine behind an adapter load's copies (`scute.ops.mapped`).
        self._inputs = (self._tokens, self._seqs, self.buffers["block_tables"], self._rows)
        self._mirrors = [_MirrorSet.like(self._inputs, max_tokens, self.device) for _ in range(2)]
        seed_gen = torch.Generator(device=self.device).manual_seed(config.seed)
        self.sampler = Sampler(seed_gen)
        self.max_model_len = max_model_len
        self.linears = list(loaded.linears.values())
        self.num_slots = config.max_adapters
        self._layout: AdapterLayout | None = None
        self._layout_version = -1
        padded = self.device.type == "cuda" and self.backend == "triton"
        self.decode_sizes = capture_sizes(max_seqs) if padded else []  # decode steps run at these batch sizes
        # mixed steps at these token counts (tensor parallelism: decode steps only, as its workers run them)
        self.mixed_sizes = mixed_sizes(max_tokens) if padded and config.tensor_parallel_size == 1 else []
        self.max_num_seqs, self.max_num_batched_tokens = max_seqs, max_tokens
        use_graphs = padded and not config.enforce_eager
        shapes = [GraphShape(n) for n in self.decode_sizes] + [GraphShape(n, True) for n in self.mixed_sizes]
        self.graphs = StepGraphs(self._graph_forward, self._pad_inputs, shapes, self.device, max_seqs) \
            if use_graphs else None
        tokens_out = [torch.zeros(max_seqs, dtype=torch.int64, pin_memory=True) for _ in range(2)] if padded else []
        self._host_token_bufs = [(h, device_view(h, self.device)) for h in tokens_out]  # written by a kernel
        self.broadcast = broadcast

    def step_sizes(self) -> tuple[int, ...]:
        """Token counts that stand for the steps this runner runs, for the kernel warm-up
        (`AdapterManager.warm_tokens`): each decode and mixed graph's, then eager steps from twice the largest
        graph's, doubling, up to the token budget (the kernels' token and row counts are not specialized on; what
        else a step's size decides changes at thresholds these cover). Empty where the Triton kernels do not run
        (no graph sizes)."""
        sizes = {*self.decode_sizes, *self.mixed_sizes}
        if not sizes:
            return ()
        n = 2 * max(sizes)
        while n < self.max_num_batched_tokens:
            sizes.add(n)
            n *= 2
        return tuple(sorted(sizes | {self.max_num_batched_tokens}))

    def _zeros(self, shape, dtype: torch.dtype) -> Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def _pick_backend(self, config: EngineConfig) -> str:
        backend = config.attention_backend
        if backend == "auto":
            if self.device.type != "cuda":
                return "torch"
            if flash_attn_available() and config.block_size % 256 == 0 and self.dtype != torch.float32:
                return "flash"
            backend = "triton"
        if backend in ("triton", "flash") and self.device.type != "cuda":
            raise ValueError(f"attention_backend={backend!r} needs a CUDA device; use 'torch' on {self.device}")
        if backend == "triton" and (config.block_size < 16 or config.block_size & (config.block_size - 1)):
            raise ValueError(f"the Triton attention needs block_size a power of 2 >= 16, got {config.block_size}")
        return backend

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, sampling: list[Request]) -> SamplerOutput | None:
        """Run one step eagerly, to its end; returns the sampler's output for the requests in `sampling` (in that
        order). Decode steps on CUDA go through `launch` instead."""
        inputs, prompt_rows = eager_inputs(sched, self.block_size)
        if self.broadcast is not None:
            self.broadcast(inputs)
        if prompt_rows is not None:
            prompt_rows.to_device(self.device, len(inputs.logits_indices))
        logits = self.forward(inputs)
        if prompt_rows is not None:  # only in steps computing prompt tokens of a request with prompt_logprobs
            logits = prompt_rows.collect(logits)
        if not sampling:
            return None
        result = self.sampler(logits, self.sampling_batch(sampling))
        if self.device.type != "cuda":
            return result
        host = _to_host(result)
        torch.cuda.current_stream(self.device).synchronize()
        return host

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, sampling: list[Request], flight: InFlight | None) -> InFlight | None:
        """Start a graph step on the GPU (its graph, or with `enforce_eager` the same forward launched from
        Python, and the sampler) without waiting for it: the caller reads its tokens later (`InFlight.wait`),
        after preparing other work. `flight`: the step launched before, whose tokens are this step's inputs
        (taken on the device). None if the step has no graph shape (`execute` runs it)."""
        shape = self._graph_shape(sched, sampling)
        if shape is None:
            return None
        logits = self._replay(sched, shape, flight)[: len(sampling)]
        result = self.sampler(logits, self.sampling_batch(sampling))
        self._host_token_bufs.reverse()  # two buffers: the other one may still hold the previous step's tokens
        host, view = self._host_token_bufs[0]
        copy_by_kernel(view[: len(sampling)], result.token_ids)
        on_host = _to_host(result, host[: len(sampling)])  # the logprobs, if asked for, by kernels of their own
        event = keep(host, self.device)  # behind every write; the buffer outlives them even if the runner does not
        return InFlight(sampling, result, on_host, event, {req: row for row, req in enumerate(sampling)})

    # ------------------------------------------------------------------ graph steps
    def layout(self) -> AdapterLayout:
        """The adapter layout of the graphs, rebuilt after any `ScuteLinear.set_slot`."""
        version = sum(lin.version for lin in self.linears)
        if self._layout is None or version != self._layout_version or not self._layout.complete:
            self._layout, self._layout_version = AdapterLayout(self.linears, self.num_slots), version
        return self._layout

    def _graph_shape(self, sched: SchedulerOutput, sampling: list[Request]) -> GraphShape | None:
        """The padded shape a step runs at: a decode step (every request computes one token and samples), or a
        mixed one of at most the largest `mixed_sizes` tokens, with a sampling request and no prompt logprobs
        owed; else None."""
        tokens = sched.num_batched_tokens
        if not self.decode_sizes or not sampling or not self.layout().complete:
            return None
        if tokens == len(sched.scheduled) == len(sampling):
            return GraphShape(bucket_of(self.decode_sizes, tokens))
        size = bucket_of(self.mixed_sizes, tokens)
        if size is None or any(req.needs_prompt_logprobs for req, _ in sched.scheduled):
            return None
        return GraphShape(size, True)

    def capture_graphs(self, slots: Iterable[int] = (), progress: bool = True) -> None:
        """Capture the graphs of every shape for steps over the adapters in `slots` (their step key; none: the base
        model's, at start-up), and log what they took. Steps capture the graphs they miss one at a time as they
        first need them, each stalling the running requests; this takes them all out of the way at once."""
        torch.cuda.empty_cache()  # capturing empties the allocator's cache: count only what the graphs keep
        before, graphs = torch.cuda.memory_reserved(self.device), self.graphs
        count, seconds = graphs.num_captured, graphs.capture_seconds
        layout = self.layout()
        graphs.capture(layout, layout.step_key(slots), graphs.shapes, progress=progress)
        used = torch.cuda.memory_reserved(self.device) - before  # on stderr
        mixed = f", mixed steps of {self.mixed_sizes[0]}-{self.mixed_sizes[-1]} tokens" if self.mixed_sizes else ""
        print(f"scute: captured {graphs.num_captured - count} CUDA graphs (decode batch sizes {self.decode_sizes[0]}-"
              f"{self.decode_sizes[-1]}{mixed}) on {self.device} in {graphs.capture_seconds - seconds:.1f} s, "
              f"{used / 2**30:.2f} GiB; enforce_eager=True runs without them", file=sys.stderr)

    def _replay(self, sched: SchedulerOutput, shape: GraphShape, flight: InFlight | None = None) -> Tensor:
        step = graph_step(sched, shape, self.block_size, flight and flight.rows)
        layout = self.layout()
        step.capture = self.graphs is not None and not self.graphs.has(layout, layout.step_key(step.token_slots),
                                                                          shape)
        if self.broadcast is not None:
            self.broadcast(step)
        return self.replay(step, flight)

    def replay(self, step: GraphStep, flight: InFlight | None = None) -> Tensor:
        """Run a graph step's graph over its inputs, capturing it first if `step.capture`; returns the logits of
        its kept rows. A tensor-parallel worker captures when rank 0 does (the collectives of the warm-up
        match); one without the graph then (its layout changed when rank 0's did not) runs the step eagerly."""
        layout = self.layout()
        key = layout.step_key(step.token_slots)
        if step.capture:
            self.graphs.capture(layout, key, [step.shape])
        self._write_inputs(step, flight)
        if self.graphs is None or not self.graphs.has(layout, key, step.shape):
            return self._graph_forward(step.shape, layout.active_slots(key))
        return self.graphs.replay(layout, key, step.shape)

    def _pad_inputs(self, shape: GraphShape) -> None:
        """Inputs of padding alone (what the eager warm-up and a capture run over)."""
        self._write_inputs(GraphStep(shape))

    def _write_inputs(self, step: GraphStep, flight: InFlight | None = None) -> None:
        """A graph step's inputs and padding (`write_padded`) into the next host mirrors, of which kernels queued on
        the current stream read what the graph reads, across the bus ahead of the graph: its tokens, requests and
        LM head rows, and of the block tables the requests' rows up to the longest table (the whole tables of a
        128k context at 256 requests are ~8 MB; a slice's copy costs the host more than a whole one, a strided
        kernel's set-up), then the tokens sampled by the step in `flight` taken into the ids (`step.gather`, read
        where it is)."""
        self._mirrors.reverse()
        m = self._mirrors[0]
        write_padded(step, m.arrays, self.max_num_seqs)
        size = step.shape.tokens
        seqs, num_rows = mixed_rows(size, self.max_num_seqs) if step.shape.mixed else (size, 0)
        width = max(map(len, step.block_tables), default=1)
        tokens, requests, tables, rows = self._inputs
        copy_by_kernel(tokens[:, :size], m.views[0][:, :size])
        copy_by_kernel(requests[:, :seqs + 1], m.views[1][:, :seqs + 1])
        copy_by_kernel(tables[:seqs, :width], m.views[2][:seqs, :width])
        if step.shape.mixed:  # a decode graph keeps every row
            copy_by_kernel(rows[:, :num_rows], m.views[3][:, :num_rows])
        n = len(step.gather[0])
        if n:
            array, view = m.gather
            array[:, :n] = step.gather
            self.buffers["input_ids"].index_copy_(0, view[0, :n], flight.result.token_ids[view[1, :n]])

    def _graph_forward(self, shape: GraphShape, active_slots: frozenset[int]) -> Tensor:
        """The forward a graph captures, over the buffers at `shape`: the logits of every row (decode), or of the
        kept rows (mixed). The host lists of the attention's metadata only give the request count (all the
        Triton attention reads of them)."""
        buf, size = self.buffers, shape.tokens
        num_seqs, num_rows = mixed_rows(size, self.max_num_seqs) if shape.mixed else (size, size)
        meta = AttentionMetadata(
            slot_mapping=buf["slot_mapping"][:size], query_start_loc=buf["query_start_loc"][: num_seqs + 1],
            seq_lens=buf["seq_lens"][:num_seqs], block_tables=buf["block_tables"][:num_seqs],
            max_query_len=size if shape.mixed else 1, max_seq_len=self.max_model_len,
            query_start_loc_host=[0] * (num_seqs + 1), seq_lens_host=[0] * num_seqs, kv_caches=self.kv_caches,
            backend=self.backend,
        )
        ctx = ForwardContext(token_adapter_slots=buf["token_slots"][:size],
                             sample_adapter_slots=buf["sample_slots"][:num_rows] if shape.mixed else None,
                             active_adapter_slots=active_slots, attn=meta)
        keep = buf["logits_indices"][:num_rows] if shape.mixed else 0
        with forward_context(ctx):
            return self.model(input_ids=buf["input_ids"][None, :size], position_ids=buf["positions"][None, :size],
                              logits_to_keep=keep, use_cache=False).logits[0]

    def prepare(self, sched: SchedulerOutput) -> tuple[Tensor, Tensor, ForwardContext, Tensor, PromptRows | None]:
        """An eager step's `device_inputs`, and its `PromptRows` (or None)."""
        inputs, prompt_rows = eager_inputs(sched, self.block_size)
        if prompt_rows is not None:
            prompt_rows.to_device(self.device, len(inputs.logits_indices))
        return (*self.device_inputs(inputs), prompt_rows)

    def device_inputs(self, inputs: StepInputs) -> tuple[Tensor, Tensor, ForwardContext, Tensor]:
        return device_inputs(inputs, self.buffers, self.device, self.kv_caches, self.backend)

    def forward(self, inputs: StepInputs) -> Tensor:
        """One eager forward over a step's inputs; returns the logits of its kept rows [rows, vocab]."""
        ids, positions, ctx, logits_indices = self.device_inputs(inputs)
        with forward_context(ctx):
            return self.model(input_ids=ids[None], position_ids=positions[None], logits_to_keep=logits_indices,
                              use_cache=False).logits[0]

    def sampling_batch(self, sampling: list[Request]) -> SamplingBatch:
        temps, top_ks, top_ps, gens, rows, cols, num_logprobs = [], [], [], [], [], [], -1
        for row, req in enumerate(sampling):
            sp = req.sampling_params
            temps.append(sp.temperature)
            top_ks.append(max(sp.top_k, 0))
            top_ps.append(sp.top_p)
            if sp.seed is not None and req.generator is None:
                req.generator = torch.Generator(device=self.device).manual_seed(sp.seed)
            gens.append(req.generator)
            if sp.min_tokens and req.num_output_tokens < sp.min_tokens:  # EOS and stop tokens may not end it yet
                stops = ([] if sp.ignore_eos else req.eos_token_ids) + sp.stop_token_ids
                rows += [row] * len(stops)
                cols += stops
            if sp.logprobs is not None:
                num_logprobs = max(num_logprobs, sp.logprobs)
        return SamplingBatch(temps, top_ks, top_ps, gens, (rows, cols), num_logprobs,
                             self.sampler.penalty_tokens.batch(sampling))


def _to_host(result: SamplerOutput, token_ids: Tensor | None = None) -> SamplerOutput:
    """`result` in pinned host memory, written by kernels queued on the current stream (`scute.ops.mapped.to_host`;
    `.tolist()` of a device tensor copies on a copy engine, behind whatever an adapter load queued there), for the
    host to read once the stream has run them. `token_ids`: the tokens' host copy, already queued."""
    def host(x: Tensor | None) -> Tensor | None:
        return None if x is None else to_host(x)

    return SamplerOutput(host(result.token_ids) if token_ids is None else token_ids, host(result.logprobs),
                         host(result.top_logprobs), host(result.top_ids))


@dataclass
class _MirrorSet:
    """One set of a graph step's host mirrors (pinned on CUDA): of the runner's inputs (tokens, requests, block
    tables, LM head rows) and of its `gather` (token rows, rows of the step in flight's output: read by the index
    kernels alone). `views`: what the device reads each input's mirror through (a pinned one's `device_view`, else
    itself); `arrays`: what `write_padded` writes, the tables' as `TableRows`."""

    views: list[Tensor]
    arrays: list
    gather: tuple[np.ndarray, Tensor]  # (what the host writes, what the device reads)

    @classmethod
    def like(cls, inputs: tuple[Tensor, ...], max_tokens: int, device: torch.device) -> _MirrorSet:
        pinned = device.type == "cuda"
        hosts = [torch.zeros_like(t, device="cpu", pin_memory=pinned) for t in inputs]
        hosts.append(torch.zeros(2, max_tokens, dtype=torch.int64, pin_memory=pinned))
        views = [device_view(h, device) if pinned else h for h in hosts]
        arrays = [h.numpy() for h in hosts]
        arrays[2] = TableRows(arrays[2])
        return cls(views[:4], arrays[:4], (arrays[4], views[4]))

