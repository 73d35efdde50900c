"""How many KV blocks the engine gets, and the max_model_len they allow.

CPU: `kv_cache_memory_bytes` (default 1 GiB). GPU: the same option if given, else
``gpu_memory_utilization × total`` minus what other processes hold minus the adapters' memory budget
(`adapter_memory_bytes`, `scute.engine.adapter_memory`) minus the peak of a profiling forward of
`max_num_batched_tokens` tokens (weights + activations; requests of at most PROFILE_SEQ_LEN tokens) minus what
the adapters' kernels allocate on top of it (the profiling forward runs before any adapter is loaded). Never more blocks than `max_num_seqs` requests of
`max_model_len` tokens can use. A tensor-parallel rank holds its share of the KV heads (`LoadedModel.num_kv_heads`),
so a block costs it that share of the bytes; the ranks agree on the fewest blocks any of them can hold.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from scute.config import EngineConfig
from scute.engine.adapter_memory import log_budget
from scute.model.context import ForwardContext, forward_context
from scute.model.attention import AttentionMetadata
from scute.model.linear import ScuteLinear
from scute.model.loader import LoadedModel
from scute.ops.triton_ops import call_transient_bytes

CPU_DEFAULT_BYTES = 1 << 30
PROFILE_SEQ_LEN = 1024


def plan_kv_cache(loaded: LoadedModel, config: EngineConfig, adapter_bytes: int = 0) -> tuple[int, int]:
    """Returns (num_blocks, max_model_len); raises ValueError if max_model_len cannot fit. `adapter_bytes`: the
    device memory kept for the adapters (out of a budget derived from gpu_memory_utilization)."""
    bs = config.block_size
    elem = loaded.dtype.itemsize
    block_bytes = 2 * loaded.num_layers * bs * loaded.num_kv_heads * loaded.head_dim * elem
    if config.max_model_len is not None and config.max_model_len > loaded.max_position_embeddings:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings "
                         f"({loaded.max_position_embeddings})")
    target_len = config.max_model_len or loaded.max_position_embeddings
    if config.kv_cache_memory_bytes is not None:
        budget = config.kv_cache_memory_bytes
    elif loaded.device.type == "cuda":
        budget = _gpu_budget(loaded, config) - adapter_bytes
    else:
        budget = CPU_DEFAULT_BYTES
    num_blocks = min(budget // block_bytes, config.max_num_seqs * -(-target_len // bs))
    if config.tensor_parallel_size > 1:  # rank 0's block ids index every rank's cache: the fewest any rank holds
        fewest = torch.tensor([num_blocks], device=loaded.device)
        dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
        num_blocks = int(fewest.item())
    if num_blocks < 1:
        raise ValueError(f"the KV budget ({budget} bytes) holds no block of {block_bytes} bytes: "
                         "raise kv_cache_memory_bytes or gpu_memory_utilization, or lower block_size or "
                         "adapter_memory_bytes")
    log_budget(adapter_bytes or None, loaded)
    capacity = num_blocks * bs
    if config.max_model_len is not None and config.max_model_len > capacity:
        raise ValueError(f"max_model_len={config.max_model_len} does not fit the KV cache ({capacity} tokens in "
                         f"{num_blocks} blocks): raise the KV budget or lower max_model_len")
    return num_blocks, min(target_len, capacity)


@torch.inference_mode()
def _gpu_budget(loaded: LoadedModel, config: EngineConfig) -> int:
    device, model = loaded.device, loaded.model
    num_tokens = min(config.max_num_batched_tokens, loaded.max_position_embeddings)
    num_sample = min(config.max_num_seqs, num_tokens)
    # The profile's tokens as requests of at most PROFILE_SEQ_LEN tokens each: the torch backend's per-request
    # mask and scores then stay small, as the Triton and flash kernels' temporaries are at any length.
    bs, seq = config.block_size, -(-min(PROFILE_SEQ_LEN, num_tokens) // config.block_size) * config.block_size
    lens = [min(seq, num_tokens - start) for start in range(0, num_tokens, seq)]
    width = seq // bs
    shape = (len(lens) * width, bs, loaded.num_kv_heads, loaded.head_dim)
    caches = [(torch.zeros(shape, dtype=loaded.dtype, device=device),) * 2 for _ in range(loaded.num_layers)]
    arange = torch.arange(num_tokens, device=device)
    starts = [0, *itertools.accumulate(lens)]
    meta = AttentionMetadata(
        slot_mapping=torch.cat([i * seq + torch.arange(n, device=device) for i, n in enumerate(lens)]),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=torch.arange(shape[0], dtype=torch.int32, device=device).view(len(lens), width),
        max_query_len=max(lens), max_seq_len=max(lens), query_start_loc_host=starts, seq_lens_host=lens,
        kv_caches=caches, backend="torch",
    )
    slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    with forward_context(ForwardContext(slots, slots[:num_sample], attn=meta)):
        logits = model(input_ids=torch.zeros_like(arange)[None], position_ids=arange[None],
                       logits_to_keep=arange[-num_sample:], use_cache=False).logits
        logits.float().softmax(-1).sort(dim=-1)  # the sampler's largest temporaries
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) + adapter_transient_bytes(
        loaded.linears, num_tokens, config.max_adapter_rank, loaded.dtype.itemsize)
    del caches, meta, logits
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    others = total - free - torch.cuda.memory_reserved(device)  # memory this process's allocator does not own
    return int(total * config.gpu_memory_utilization) - others - peak


def adapter_transient_bytes(linears: dict[str, ScuteLinear], num_tokens: int, max_rank: int, elem: int) -> int:
    """The most one adapted layer call (a `LinearGroup` or a lone `ScuteLinear`) allocates for its adapters at
    `num_tokens` tokens: `call_transient_bytes` of the largest call."""
    calls = {id(m[0]): m for m in ([lin] if lin.group is None else lin.group.members for lin in linears.values())}
    return max((call_transient_bytes(num_tokens, m[0].in_features, [lin.out_features for lin in m], len(m[0].slots),
                                     max_rank, elem) for m in calls.values()), default=0)
