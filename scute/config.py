"""`EngineConfig`: every option of the engine, with vLLM's names. Unknown options raise, never silently drop."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

DTYPES = {  # the dtype spellings the engine, `scute serve` and `scute explain` take
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


@dataclass
class EngineConfig:
    """Options of `scute.Engine` (pass them as keywords: ``Engine(model, max_num_seqs=64)``)."""

    # Weights and activations dtype: "auto" keeps the model's own (a GGUF file dequantizes to float32),
    # or one of float32 / float16 / bfloat16 (or a torch.dtype).
    dtype: str | torch.dtype = "auto"
    # "auto" = "cuda" when a GPU is visible, else "cpu"; or any torch device string ("cuda:1").
    device: str = "auto"
    # Most requests in one step (the decode batch size).
    max_num_seqs: int = 256
    # Token budget of one step: decode tokens plus prefill chunks. Long prompts are prefilled in chunks of
    # at most this many tokens, so a step's cost stays bounded. None: 8192 on a GPU (vLLM's offline default; a
    # step of prompt tokens is launched from Python, and at 2048 tokens that costs about as long as the GPU takes
    # to run it, docs/performance.md), 2048 on the CPU.
    max_num_batched_tokens: int | None = None
    # Longest sequence (prompt + output) a request may reach; None = the model's max_position_embeddings,
    # capped by what the KV cache holds. A prompt this long or longer fails (alone) with an error.
    max_model_len: int | None = None
    # Tokens per paged KV block (the prefix-cache granularity). The Triton attention needs a power of 2 >= 16.
    block_size: int = 16
    # GPU: the fraction of the device's memory the engine may fill (weights, activations, KV cache).
    gpu_memory_utilization: float = 0.9
    # KV cache budget in bytes; None = derived from gpu_memory_utilization on GPU, 1 GiB on CPU.
    kv_cache_memory_bytes: int | None = None
    # False (vLLM's default): on CUDA with the Triton attention, decode steps and mixed steps of up to 1024 tokens
    # replay CUDA graphs captured per padded size (the base model's at start-up, others when first needed); True:
    # every step eager.
    enforce_eager: bool = False
    # Distinct adapters resident on the device at once, hence the most distinct adapters in one step.
    max_adapters: int = 8
    # Device memory the adapters in device slots may hold (their tensors; shared ones once), in bytes; on a GPU
    # it is kept out of the KV cache's budget. None: on a GPU room for max_adapters + 4 (staged) LoRA adapters of
    # rank 16 on every adapted layer, capped at 0.1 of the device's memory; on the CPU no limit. An adapter that
    # does not fit beside the running requests' waits for unused ones to be evicted; one larger than the whole
    # budget fails alone.
    adapter_memory_bytes: int | None = None
    # Largest adapter rank accepted (after folding: LoRA r, VeRA's shared rank, ...); larger ones fail alone.
    max_adapter_rank: int = 256
    # Adapters loaded by path kept in CPU memory (LRU); adapters named with `Engine.load_adapter` are kept
    # until unloaded and do not count.
    max_cpu_adapters: int = 64
    # Reuse the KV of full blocks whose tokens (and adapter content) match an earlier request's.
    enable_prefix_caching: bool = True
    # Seed of the engine's sampling generator (requests with their own `seed` use their own generator).
    seed: int = 0
    # Attention backend: "auto" (Triton on CUDA, flash-attn when installed and block_size % 256 == 0,
    # PyTorch SDPA on CPU), or "torch" / "triton" / "flash" to force one.
    attention_backend: str = "auto"
    # Ranks the base model is sharded over (vLLM's tensor parallelism): one process per rank, rank 0 the
    # caller's; the model must be given as a path. Must divide the attention heads, KV heads and intermediate size.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 8192 if self.torch_device().type == "cuda" else 2048
        positive = ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_adapters", "max_adapter_rank",
                    "tensor_parallel_size")
        for name in positive:
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"EngineConfig.{name} must be positive, got {getattr(self, name)}")
        if self.adapter_memory_bytes is not None and self.adapter_memory_bytes <= 0:
            raise ValueError(f"EngineConfig.adapter_memory_bytes must be positive, got {self.adapter_memory_bytes}")
        if self.max_cpu_adapters < 0:
            raise ValueError(f"EngineConfig.max_cpu_adapters must be >= 0, got {self.max_cpu_adapters}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) < max_num_seqs ({self.max_num_seqs}): "
                "every running request needs at least one token per step; raise the token budget"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.attention_backend not in ("auto", "torch", "triton", "flash"):
            raise ValueError(f"attention_backend {self.attention_backend!r}: use auto, torch, triton or flash")
        self.torch_dtype()  # validates dtype
        self.torch_device()  # validates device

    @classmethod
    def from_kwargs(cls, options: dict) -> EngineConfig:
        """Build a config from keyword options; an unknown name raises TypeError listing the known ones."""
        known = [f.name for f in dataclasses.fields(cls) if f.init]
        if unknown := sorted(set(options) - set(known)):
            raise TypeError(f"unknown engine option {unknown[0]!r}; known options: {', '.join(known)}")
        return cls(**options)

    def torch_dtype(self) -> torch.dtype | None:
        """The requested dtype, or None for "auto"."""
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype == "auto":
            return None
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: use auto, float32, float16 or bfloat16")
        return DTYPES[self.dtype]

    def torch_device(self) -> torch.device:
        """The device to serve on; raises ValueError for one this process cannot use."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device {self.device!r}: {e}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r}: this torch ({torch.__version__}) sees no CUDA device; "
                             "use device='cpu' or 'auto'")
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {self.device!r}: this process sees {torch.cuda.device_count()} CUDA devices")
        return device
