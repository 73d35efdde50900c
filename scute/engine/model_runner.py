"""`ModelRunner`: owns the paged KV cache; turns a scheduled step into one packed forward and samples.

A step's tokens (prompt chunks and decode tokens of many requests) are one row ``[1, T]`` fed to the HF model
with their positions; the adapter slot of every token and the paged-attention metadata travel in the forward
context. Logits are computed only at each sampling request's last token (``logits_to_keep``). Host-side inputs
are built as Python lists, then copied once per tensor into buffers allocated at start-up (fixed addresses:
what decode CUDA graphs need). On CUDA with the Triton attention, unless `enforce_eager`, decode steps replay
CUDA graphs (`scute.engine.cuda_graph`); prefill and mixed steps run eagerly. There a decode step is the same
either way: padded to a graph's batch size (the same GEMM shapes, grids and split-K choices, so the same
rounding) and launched ahead of the previous step's tokens (the same batches: see `Engine._step`), so
`enforce_eager` changes how its kernels are launched, never its tokens.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from scute.config import EngineConfig
from scute.model.context import ForwardContext, forward_context
from scute.engine.cuda_graph import AdapterLayout, DecodeGraphs, bucket_of, capture_sizes
from scute.engine.request import Request
from scute.engine.sampler import Penalties, Sampler, SamplerOutput, SamplingBatch
from scute.engine.scheduler import SchedulerOutput
from scute.engine.step_inputs import DecodeStep, StepInputs, decode_step, device_inputs, eager_inputs
from scute.engine.utils import host_to_device
from scute.model.attention import AttentionMetadata, flash_attn_available
from scute.model.loader import LoadedModel


@dataclass
class InFlight:
    """A decode step launched on the GPU whose sampled tokens the host has not read yet: they are being copied
    into pinned host memory behind the step's kernels (`event` marks the end of the copy)."""

    sampling: list[Request]
    result: SamplerOutput  # on the device
    host_tokens: Tensor
    event: torch.cuda.Event
    rows: dict[Request, int]  # each sampling request's row of result

    def wait(self) -> SamplerOutput:
        """The step's sampler output, its tokens read from the host copy (waits for the GPU if needed)."""
        self.event.synchronize()
        return replace(self.result, token_ids=self.host_tokens[: len(self.sampling)])


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, num_blocks: int, max_model_len: int,
                 broadcast: Callable[[StepInputs | DecodeStep], None] | None = None) -> None:
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
        # tensor, and the per-sequence int32 ones of another, so that a decode step writes all of them with three
        # copies from pinned host mirrors (`_write_decode_inputs`).
        self._tokens, self._seqs = self._zeros((4, max_tokens), torch.int64), self._zeros((2, max_seqs + 1), torch.int32)
        self.buffers = {
            "input_ids": self._tokens[0], "positions": self._tokens[1], "slot_mapping": self._tokens[2],
            "token_slots": self._tokens[3], "query_start_loc": self._seqs[0], "seq_lens": self._seqs[1][:max_seqs],
            "block_tables": self._zeros((max_seqs, self.max_blocks_per_seq), torch.int32),
            "logits_indices": self._zeros(max_seqs, torch.int64),
            "sample_slots": self._zeros(max_seqs, torch.int64),
        }
        # Two sets of pinned host mirrors, used in turn: a decode step's copies may still be queued behind the step
        # in flight when the next step writes its inputs, but the copies of the step before it are done (the host
        # waited for that step's tokens).
        self._inputs = (self._tokens, self._seqs, self.buffers["block_tables"])
        pinned = self.device.type == "cuda"
        self._mirrors = [[torch.zeros(t.shape, dtype=t.dtype, pin_memory=pinned) for t in self._inputs]
                         for _ in range(2)]
        seed_gen = torch.Generator(device=self.device).manual_seed(config.seed)
        self.sampler = Sampler(seed_gen)
        self.max_model_len = max_model_len
        self.linears = list(loaded.linears.values())
        self.num_slots = config.max_adapters
        self._layout: AdapterLayout | None = None
        self._layout_version = -1
        padded = self.device.type == "cuda" and self.backend == "triton"
        self.decode_sizes = capture_sizes(max_seqs) if padded else []  # decode steps run at these batch sizes
        use_graphs = padded and not config.enforce_eager
        self.graphs = DecodeGraphs(self._graph_forward, max_seqs, self.device) if use_graphs else None
        self._host_token_bufs = [torch.zeros(max_seqs, dtype=torch.int64, pin_memory=True) for _ in range(2)] \
            if padded else []
        self.broadcast = broadcast

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
        return self.sampler(logits, self.sampling_batch(sampling))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, sampling: list[Request], flight: InFlight | None) -> InFlight | None:
        """Start a decode step on the GPU (its graph, or with `enforce_eager` the same forward launched from
        Python, and the sampler) without waiting for it: the caller reads its tokens later (`InFlight.wait`),
        after preparing other work. `flight`: the step launched before, whose tokens are this step's inputs
        (taken on the device). None if this is not a decode step on CUDA (`execute` runs it)."""
        bucket = self._decode_bucket(sched, sampling)
        if bucket is None:
            return None
        logits = self._replay(sched, bucket, flight)[: len(sampling)]
        result = self.sampler(logits, self.sampling_batch(sampling))
        self._host_token_bufs.reverse()  # two buffers: the other one may still hold the previous step's tokens
        host = self._host_token_bufs[0]
        host[: len(sampling)].copy_(result.token_ids, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return InFlight(sampling, result, host, event, {req: row for row, req in enumerate(sampling)})

    # ------------------------------------------------------------------ decode graphs
    def layout(self) -> AdapterLayout:
        """The adapter layout of the graphs, rebuilt after any `ScuteLinear.set_slot`."""
        version = sum(lin.version for lin in self.linears)
        if self._layout is None or version != self._layout_version or not self._layout.complete:
            self._layout, self._layout_version = AdapterLayout(self.linears, self.num_slots), version
        return self._layout

    def _decode_bucket(self, sched: SchedulerOutput, sampling: list[Request]) -> int | None:
        """The padded size of a decode step (every request computes one token and samples), else None."""
        if not self.decode_sizes or len(sampling) != len(sched.scheduled) or sched.num_batched_tokens != len(sampling):
            return None
        return bucket_of(self.decode_sizes, len(sampling)) if self.layout().complete else None

    def capture_graphs(self, progress: bool = True) -> None:
        """Capture the base model's decode graphs for every size (start-up), and log what they took."""
        torch.cuda.empty_cache()  # capturing empties the allocator's cache: count only what the graphs keep
        before = torch.cuda.memory_reserved(self.device)
        self._pad_inputs(max(self.graphs.sizes))
        self.graphs.capture(self.layout(), 0, self.graphs.sizes, progress=progress)
        used, graphs = torch.cuda.memory_reserved(self.device) - before, self.graphs  # on stderr: a start-up log
        print(f"scute: captured {graphs.num_captured} decode CUDA graphs (batch sizes {graphs.sizes[0]}-"
              f"{graphs.sizes[-1]}) on {self.device} in {graphs.capture_seconds:.1f} s, {used / 2**30:.2f} GiB; "
              "enforce_eager=True runs without them", file=sys.stderr)

    def _replay(self, sched: SchedulerOutput, bucket: int, flight: InFlight | None = None) -> Tensor:
        step = decode_step(sched, bucket, self.block_size, flight and flight.rows)
        layout = self.layout()
        step.capture = self.graphs is not None and not self.graphs.has(layout, layout.step_key(step.token_slots),
                                                                          bucket)
        if self.broadcast is not None:
            self.broadcast(step)
        return self.replay(step, flight)

    def replay(self, step: DecodeStep, flight: InFlight | None = None) -> Tensor:
        """Run a decode step's graph over its inputs, capturing it first if `step.capture`; returns its logits
        [bucket, vocab]. A tensor-parallel worker captures when rank 0 does (the collectives of the warm-up
        match); one without the graph then (its layout changed when rank 0's did not) runs the step eagerly."""
        layout = self.layout()
        key = layout.step_key(step.token_slots)
        if step.capture:
            self._pad_inputs(step.bucket)  # the eager warm-up and the capture must store no KV of real requests
            self.graphs.capture(layout, key, [step.bucket])
        self._write_decode_inputs(step.bucket, step.input_ids, step.positions, step.slot_mapping, step.token_slots,
                                  step.block_tables)
        if step.gather[0]:
            index = host_to_device(list(step.gather), torch.int64, self.device)
            self.buffers["input_ids"].index_copy_(0, index[0], flight.result.token_ids[index[1]])
        if self.graphs is None or not self.graphs.has(layout, key, step.bucket):
            return self._graph_forward(step.bucket, layout.active_slots(key))
        return self.graphs.replay(layout, key, step.bucket)

    def _prepare_decode(self, sched: SchedulerOutput, bucket: int) -> list[int]:
        """Write a decode step's inputs into the buffers, padded to `bucket` rows; returns the token slots."""
        step = decode_step(sched, bucket, self.block_size)
        self._write_decode_inputs(bucket, step.input_ids, step.positions, step.slot_mapping, step.token_slots,
                                  step.block_tables)
        return step.token_slots

    def _pad_inputs(self, rows: int) -> None:
        """Inputs of `rows` padding rows (what the eager warm-up and a capture run over)."""
        self._write_decode_inputs(rows, [], [], [], [], [])

    def _write_decode_inputs(self, bucket: int, ids: list[int], positions: list[int], slot_mapping: list[int],
                             token_slots: list[int], tables: list[list[int]]) -> None:
        """The rows given, then padding rows up to `bucket` (token 0 at position 0, no adapter, no KV store, one
        token of page 0), written into the next host mirrors (numpy views) and copied whole, asynchronously."""
        n = len(ids)
        self._mirrors.reverse()
        mirrors = self._mirrors[0]
        tokens, seqs, host_tables = (m.numpy() for m in mirrors)
        tokens[0, :n], tokens[1, :n], tokens[2, :n], tokens[3, :n] = ids, positions, slot_mapping, token_slots
        tokens[:2, n:bucket], tokens[2:, n:bucket] = 0, -1
        seqs[0, : bucket + 1] = range(bucket + 1)
        seqs[1, :n] = positions
        seqs[1, :n] += 1
        seqs[1, n:bucket] = 1
        for row, table in enumerate(tables):
            host_tables[row, : len(table)] = table
        host_tables[n:bucket, 0] = 0
        for dst, src in zip(self._inputs, mirrors):
            dst.copy_(src, non_blocking=True)

    def _graph_forward(self, rows: int, active_slots: frozenset[int]) -> Tensor:
        """The forward a decode graph captures: the first `rows` rows of the buffers, logits of every row."""
        buf = self.buffers
        meta = AttentionMetadata(
            slot_mapping=buf["slot_mapping"][:rows], query_start_loc=buf["query_start_loc"][: rows + 1],
            seq_lens=buf["seq_lens"][:rows], block_tables=buf["block_tables"][:rows], max_query_len=1,
            max_seq_len=self.max_model_len, query_start_loc_host=list(range(rows + 1)), seq_lens_host=[1] * rows,
            kv_caches=self.kv_caches, backend=self.backend,
        )
        ctx = ForwardContext(token_adapter_slots=buf["token_slots"][:rows], active_adapter_slots=active_slots,
                             attn=meta)
        with forward_context(ctx):
            return self.model(input_ids=buf["input_ids"][None, :rows], position_ids=buf["positions"][None, :rows],
                              logits_to_keep=0, use_cache=False).logits[0]

    def prepare(self, sched: SchedulerOutput, sampling: list[Request]):
        """`device_inputs` of the step, and its `PromptRows` (or None)."""
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
            if req.num_output_tokens < sp.min_tokens:  # EOS and stop tokens may not end it yet
                stops = ([] if sp.ignore_eos else req.eos_token_ids) + sp.stop_token_ids
                rows += [row] * len(stops)
                cols += stops
            if sp.logprobs is not None:
                num_logprobs = max(num_logprobs, sp.logprobs)
        return SamplingBatch(temps, top_ks, top_ps, gens, (rows, cols), num_logprobs, Penalties.of(sampling))

