"""vLLM's `EngineArgs` on Scute: the engine options of `EngineArgs(...)` and `LLM(**kwargs)`.

`EngineArgs` has every field of vLLM 0.32's, in its order and with its default (checked against vLLM or the
snapshot in ``tests/data/vllm_signatures.json``). The fields in `ENGINE_OPTIONS` set a `scute.Engine` option,
those in `ACCEPTED` are honoured as they are (or at the values listed); any other field raises
`UnsupportedOptionError` naming it unless it has vLLM's default. Where vLLM's default is built by a factory
(a config object) the field's default here is None, and None is the only value accepted.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
from typing import Any

import scute
from scute.compat.vllm_types import is_default, unsupported

# vLLM field -> the `scute.Engine` option it sets (None leaves Scute's default). max_loras, max_lora_rank and
# max_cpu_loras only bound capacity (adapters per step, rank, adapters kept in CPU memory), never outputs.
ENGINE_OPTIONS = {
    "dtype": "dtype", "seed": "seed", "gpu_memory_utilization": "gpu_memory_utilization",
    "enforce_eager": "enforce_eager", "kv_cache_memory_bytes": "kv_cache_memory_bytes",
    "max_model_len": "max_model_len", "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens", "block_size": "block_size",
    "enable_prefix_caching": "enable_prefix_caching", "max_loras": "max_adapters",
    "max_lora_rank": "max_adapter_rank", "max_cpu_loras": "max_cpu_adapters",
    "tensor_parallel_size": "tensor_parallel_size",
}
# Fields honoured without an engine option -> the values accepted (None: any). `model` and `tokenizer` pick
# the files; `enable_lora` gates LoRA requests; Scute chunks every long prefill and keeps no statistics log.
ACCEPTED = {"model": None, "tokenizer": None, "enable_lora": None, "disable_log_stats": None,
            "enable_chunked_prefill": (None, True), "runner": ("auto", "generate"), "convert": ("auto", "none"),
            "tokenizer_mode": ("auto", "hf")}

# vLLM 0.32's EngineArgs fields in order, name=default; a bare name has a factory default (None here).
_VLLM_FIELDS = """
model='Qwen/Qwen3-0.6B' enable_return_routed_experts=False return_sampling_mask=False model_weights=''
served_model_name=None tokenizer=None hf_config_path=None runner='auto' convert='auto' skip_tokenizer_init=False
enable_prompt_embeds=False tokenizer_mode='auto' trust_remote_code=False allowed_local_media_path=''
allowed_media_domains=None download_dir=None safetensors_load_strategy=None safetensors_prefetch_num_threads=8
safetensors_prefetch_block_size=16777216 load_format='auto' config_format='auto' dtype='auto'
kv_cache_dtype='auto' seed=0 max_model_len=None cudagraph_capture_sizes=None max_cudagraph_capture_size=None
ir_op_priority distributed_executor_backend=None pipeline_parallel_size=1 master_addr='127.0.0.1'
master_port=29501 nnodes=1 node_rank=0 distributed_timeout_seconds=None cpu_distributed_timeout_seconds=None
numa_bind=False numa_bind_nodes=None numa_bind_cpus=None device_ids=None tensor_parallel_size=1
prefill_context_parallel_size=1 decode_context_parallel_size=1 dcp_comm_backend=None dcp_q_replicate=None
dcp_kv_cache_interleave_size=1 cp_kv_cache_interleave_size=None data_parallel_size=1 data_parallel_rank=None
data_parallel_start_rank=None data_parallel_size_local=None data_parallel_address=None
data_parallel_rpc_port=None data_parallel_hybrid_lb=False data_parallel_external_lb=False
data_parallel_multi_port_external_lb=False data_parallel_backend='mp' enable_hc_sp=False
enable_expert_parallel=False enable_batch_sharded_sampling=None enable_ep_weight_filter=False moe_backend='auto'
linear_backend='auto' sparse_indexer_topk_backend='auto' all2all_backend='allgather_reducescatter'
enable_elastic_ep=False elastic_ep_max_dp_size=None enable_dbo=False ubatch_size=0 dbo_decode_token_threshold=32
dp_sync_interval=16 dbo_prefill_token_threshold=512 disable_nccl_for_dp_synchronization=None eplb_config
enable_eplb=False expert_placement_strategy='linear' max_parallel_loading_workers=None block_size=None
enable_prefix_caching=None prefix_caching_hash_algo='sha256' prefix_cache_retention_interval=0
disable_sliding_window=False disable_cascade_attn=None offload_backend='auto' cpu_offload_gb=0
cpu_offload_params offload_group_size=0 offload_num_in_group=1 offload_prefetch_step=1 offload_params
gpu_memory_utilization=0.92 kv_cache_memory_bytes=None max_num_batched_tokens=None max_num_scheduled_tokens=None
long_prefill_token_threshold=0 long_prefill_token_threshold_adaptive=False max_num_seqs=None
max_num_active_seqs=None max_num_queued_reqs=None max_num_queued_tokens=None max_logprobs=20
logprobs_mode='raw_logprobs' use_fp64_gumbel=False enable_trace_replay=False disable_log_stats=False
aggregate_engine_logging=False revision=None code_revision=None hf_token=None hf_overrides model_class_overrides
tokenizer_revision=None quantization=None quantization_config=None allow_deprecated_quantization=False
enforce_eager=False disable_custom_all_reduce=False enable_shm_tensor_arena=False language_model_only=False
limit_mm_per_prompt enable_mm_embeds=False interleave_mm_strings=False media_io_kwargs mm_processor_kwargs=None
mm_processor_cache_gb=4 mm_processor_cache_type='lru' mm_hasher_algorithm='blake3'
mm_shm_cache_max_object_size_mb=128 mm_encoder_only=False mm_encoder_tp_mode='weights'
mm_encoder_attn_backend=None mm_encoder_attn_dtype=None mm_encoder_fp8_scale_path=None
mm_encoder_fp8_scale_save_path=None mm_encoder_fp8_scale_save_margin=1.5 io_processor_plugin=None
renderer_num_workers=1 skip_mm_profiling=False video_pruning_rate=None video_pruning_method='evs'
mm_tensor_ipc='direct_rpc' mm_processor_device='auto' mm_ipc_gpu_memory_gb=0 mm_device_do_normalize=True
enable_lora=False max_loras=1 max_lora_rank=16 default_mm_loras=None fully_sharded_loras=False
max_cpu_loras=None lora_dtype='auto' lora_target_modules=None enable_tower_connector_lora=False
specialize_active_lora=False enable_mixed_moe_lora_format=False enable_moe_shared_loras=False
max_lora_cls_labels=None ray_workers_use_nsight=False num_gpu_blocks_override=None model_loader_extra_config
ignore_patterns enable_chunked_prefill=None disable_chunked_mm_input=False scheduler_reserve_full_isl=True
prefill_schedule_interval=1 watermark=0.0 disable_hybrid_kv_cache_manager=None structured_outputs_config
aux_output_config reasoning_parser='' reasoning_parser_plugin=None speculative_config=None spec_method=None
spec_model=None spec_tokens=None watermark_config=None diffusion_config=None
show_hidden_metrics_for_version=None otlp_traces_endpoint=None collect_detailed_traces=None
per_request_spec_decode_metrics='none' kv_cache_metrics=False kv_cache_metrics_sample=0.01
custom_histogram_buckets=None cudagraph_metrics=False enable_layerwise_nvtx_tracing=False
enable_mfu_metrics=False enable_logging_iteration_details=False jit_monitor_mode='warn'
jit_monitor_verbose=False enable_mm_processor_stats=False scheduling_policy='fcfs' scheduler_cls=None
pooler_config=None compilation_config attention_config engram_config=None mamba_config kernel_config
enable_flashinfer_autotune=None worker_cls='auto' worker_extension_cls='' profiler_config logging_config=None
log_level=None log_config_file=None kv_transfer_config=None kv_events_config=None ec_transfer_config=None
ec_manager_config reasoning_config=None generation_config='auto' enable_sleep_mode=False
sleep_mode_offload_cudagraph=False sleep_preserve_parameter_names enable_cumem_allocator=False
enable_nccl_comm_suspend=False override_generation_config model_impl='auto' attention_backend=None
kv_cache_dtype_skip_layers mamba_cache_dtype='auto' mamba_ssm_cache_dtype='auto' mamba_block_size=None
prefix_match_unit=None mamba_cache_mode='none' enable_mamba_shared_prefix_checkpoint=False
replayssm_buffer_len=16 use_replayssm=False mamba_backend mamba_ssu_algorithm=None
enable_mamba_cache_stochastic_rounding=False mamba_cache_philox_rounds=0 additional_config use_tqdm_on_load=True
pt_load_map_location='cpu' logits_processors=None async_scheduling=None stream_interval=1
kv_sharing_fast_prefill=False swa_bounded_replay=True optimization_level performance_mode='balanced'
fault_tolerance_config enable_fault_tolerance=False kv_offloading_size=None kv_offloading_backend='native'
tokens_only=False shutdown_timeout=0 weight_transfer_config=None fail_on_environ_validation=False
gdn_prefill_backend=None kda_prefill_backend=None kda_decode_backend=None
"""
VLLM_DEFAULTS: dict[str, Any] = {
    name: ast.literal_eval(default) if default else None
    for name, _, default in (tok.partition("=") for tok in _VLLM_FIELDS.split())
}


def engine_options(values: dict[str, Any], where: str) -> dict[str, Any]:
    """`scute.Engine` options for vLLM engine arguments `values` (name -> value); raises
    `UnsupportedOptionError` for a field Scute does not implement at a non-default value, or an unknown one."""
    options = {}
    for name, value in values.items():
        if name in ENGINE_OPTIONS:
            if value is not None:
                options[ENGINE_OPTIONS[name]] = value
        elif name in ACCEPTED:
            allowed = ACCEPTED[name]
            if allowed is not None and value not in allowed:
                raise unsupported(where, name, value, f"Scute accepts {allowed}")
        elif name not in VLLM_DEFAULTS:
            raise unsupported(where, name, value, "not a vLLM engine argument; Scute honours "
                              + ", ".join([*ENGINE_OPTIONS, *ACCEPTED]))
        elif not is_default(value, VLLM_DEFAULTS[name]):
            raise unsupported(where, name, value)
    return options


def auto_dtype(model) -> str:
    """vLLM's ``dtype="auto"``: the checkpoint's own dtype, except that a float32 checkpoint (or one naming none)
    runs in bfloat16, float16 on a GPU without bfloat16 (vLLM logs "Downcasting torch.float32 to
    torch.bfloat16"). A GGUF file keeps Scute's "auto"."""
    path = os.path.join(os.fspath(model), "config.json")
    if not os.path.isfile(path):
        return "auto"
    with open(path) as f:
        config = json.load(f)
    if (config.get("dtype") or config.get("torch_dtype") or "float32") != "float32":
        return "auto"
    import torch

    return "float16" if torch.cuda.is_available() and not torch.cuda.is_bf16_supported() else "bfloat16"


def make_engine(model, tokenizer: str | None, options: dict[str, Any]) -> scute.Engine:
    """A `scute.Engine` for a local model folder or GGUF file (`tokenizer`: a folder overriding the model's)."""
    if options.get("dtype", "auto") == "auto":
        options = {**options, "dtype": auto_dtype(model)}
    tok = None
    if tokenizer is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
    return scute.Engine(os.fspath(model), tokenizer=tok, **options)


def _post_init(self) -> None:
    engine_options(vars(self), "EngineArgs")  # validates every field


def _scute_options(self) -> dict[str, Any]:
    """The `scute.Engine` options these arguments set."""
    return engine_options(vars(self), "EngineArgs")


EngineArgs = dataclasses.make_dataclass(
    "EngineArgs", [(name, Any, dataclasses.field(default=default)) for name, default in VLLM_DEFAULTS.items()],
    namespace={"__post_init__": _post_init, "scute_options": _scute_options,
               "__doc__": "vLLM's `EngineArgs` (see the module docstring): `LLMEngine.from_engine_args` takes it."},
)
EngineArgs.__module__ = __name__
