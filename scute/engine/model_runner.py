"""`ModelRunner`: owns the paged KV cache; turns a scheduled step into one packed forward and samples.

A step's tokens (prompt chunks and decode tokens of many requests) are one row ``[1, T]`` fed to the HF model
with their positions; the adapter slot of every token and the paged-attention metadata travel in the forward
context. Logits are computed only at each sampling request's last token (``logits_to_keep``). Host-side inputs
are built as Python lists, then copied once per tensor into buffers allocated at start-up (fixed addresses:
what decode CUDA graphs will need).
"""

from __future__ import annotations

import torch
from torch import Tensor

from scute.config import EngineConfig
from scute.model.context import ForwardContext, forward_context
from scute.engine.request import Request
from scute.engine.sampler import Sampler, SamplerOutput, SamplingBatch
from scute.engine.scheduler import SchedulerOutput
from scute.engine.utils import host_to_device
from scute.model.attention import AttentionMetadata, flash_attn_available
from scute.model.loader import LoadedModel


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, num_blocks: int, max_model_len: int) -> None:
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
        self.buffers = {  # fixed-address inputs; each step fills a prefix of each
            "input_ids": self._zeros(max_tokens, torch.int64),
            "positions": self._zeros(max_tokens, torch.int64),
            "slot_mapping": self._zeros(max_tokens, torch.int64),
            "token_slots": self._zeros(max_tokens, torch.int64),
            "query_start_loc": self._zeros(max_seqs + 1, torch.int32),
            "seq_lens": self._zeros(max_seqs, torch.int32),
            "block_tables": self._zeros((max_seqs, self.max_blocks_per_seq), torch.int32),
            "logits_indices": self._zeros(max_seqs, torch.int64),
            "sample_slots": self._zeros(max_seqs, torch.int64),
        }
        seed_gen = torch.Generator(device=self.device).manual_seed(config.seed)
        self.sampler = Sampler(seed_gen)

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
        """Run one step; returns the sampler's output for the requests in `sampling` (in that order)."""
        ids, positions, ctx, logits_indices = self.prepare(sched, sampling)
        with forward_context(ctx):
            out = self.model(input_ids=ids[None], position_ids=positions[None], logits_to_keep=logits_indices,
                             use_cache=False)
        if not sampling:
            return None
        return self.sampler(out.logits[0], self.sampling_batch(sampling))

    def prepare(self, sched: SchedulerOutput, sampling: list[Request]):
        bs, buf = self.block_size, self.buffers
        input_ids, positions, slot_mapping, token_slots = [], [], [], []
        query_start_loc, seq_lens, block_tables, logits_indices = [0], [], [], []
        for req, num_new in sched.scheduled:
            start, table = req.num_computed_tokens, req.block_table
            input_ids += req.all_token_ids[start:start + num_new]
            positions += range(start, start + num_new)
            slot_mapping += [table[p // bs] * bs + p % bs for p in range(start, start + num_new)]
            token_slots += req.token_adapter_slots(start, num_new)
            query_start_loc.append(query_start_loc[-1] + num_new)
            seq_lens.append(start + num_new)
            block_tables.append(table)
            if start + num_new == req.num_tokens:
                logits_indices.append(query_start_loc[-1] - 1)
        width = max(len(t) for t in block_tables)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        meta = AttentionMetadata(
            slot_mapping=host_to_device(slot_mapping, torch.int64, self.device, buf["slot_mapping"]),
            query_start_loc=host_to_device(query_start_loc, torch.int32, self.device, buf["query_start_loc"]),
            seq_lens=host_to_device(seq_lens, torch.int32, self.device, buf["seq_lens"]),
            block_tables=host_to_device(padded, torch.int32, self.device, buf["block_tables"]),
            max_query_len=max(n for _, n in sched.scheduled), max_seq_len=max(seq_lens),
            query_start_loc_host=query_start_loc, seq_lens_host=seq_lens, kv_caches=self.kv_caches,
            backend=self.backend,
        )
        ctx = ForwardContext(
            token_adapter_slots=host_to_device(token_slots, torch.int64, self.device, buf["token_slots"]),
            sample_adapter_slots=host_to_device([r.token_adapter_slots(r.num_tokens - 1, 1)[0] for r in sampling],
                                                torch.int64, self.device, buf["sample_slots"]),
            active_adapter_slots=frozenset(token_slots),
            attn=meta,
        )
        ids = host_to_device(input_ids, torch.int64, self.device, buf["input_ids"])
        pos = host_to_device(positions, torch.int64, self.device, buf["positions"])
        logits_idx = host_to_device(logits_indices, torch.int64, self.device, buf["logits_indices"])
        return ids, pos, ctx, logits_idx

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
        return SamplingBatch(temps, top_ks, top_ps, gens, (rows, cols), num_logprobs)
