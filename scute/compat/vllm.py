"""vLLM's offline API on Scute: ``from scute.compat.vllm import LLM, SamplingParams, LoRARequest``.

`LLM`, `SamplingParams`, `LoRARequest`, `RequestOutput` and `CompletionOutput` have the signatures and field
names of vLLM 0.32 (checked against vLLM itself, or its snapshot in ``tests/data/vllm_signatures.json``), so a
vLLM script runs unchanged. Differences:

* A `LoRARequest` may point at any adapter Scute serves (LoRA, DoRA, IA3, VeRA, OFT, ...), not only LoRA.
* An option Scute does not implement raises `UnsupportedOptionError` (a ValueError) naming it, unless it has
  vLLM's default value; nothing is silently ignored. `SUPPORTED_LLM_OPTIONS` lists what is honoured.
* `max_loras`, `max_lora_rank`, `max_cpu_loras` default to Scute's limits (8 adapters per step, rank 256, 64
  on CPU) rather than vLLM's (1, 16, max_loras) when not given; they never change outputs, only capacity.
* ``sampling_params=None`` means ``SamplingParams()``; vLLM would also fold in the model's generation config.
* A request that fails (a bad adapter, a prompt longer than max_model_len) raises from `generate`, as in vLLM.
"""

from __future__ import annotations

import enum
import inspect
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import scute
from scute.engine.request import AdapterRequest

_SAMPLING_EPS = 1e-5  # vLLM: a temperature below this is greedy


class UnsupportedOptionError(ValueError):
    """A vLLM option or value that Scute does not implement."""


def _unsupported(where: str, name: str, value, why: str = "") -> UnsupportedOptionError:
    return UnsupportedOptionError(f"{where}: vLLM option {name}={value!r} is not supported by Scute"
                                  + (f" ({why})" if why else "") + "; leave it at its default")


def _check_defaults(func, values: dict, handled: set[str], where: str) -> None:
    """Raise for every parameter of `func` outside `handled` whose value differs from its default."""
    for p in inspect.signature(func).parameters.values():
        if p.name in handled or p.name == "self" or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        value = values[p.name]
        if p.default is p.empty or value is p.default:
            continue
        try:
            same = bool(value == p.default)
        except Exception:  # noqa: BLE001 - e.g. numpy arrays compare elementwise
            same = False
        if not same:
            raise _unsupported(where, p.name, value)


# ---------------------------------------------------------------------------------------------- requests
class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingParams:
    """vLLM's `SamplingParams`. Honoured: temperature (< 1e-5 = greedy), top_p, top_k, seed, stop,
    stop_token_ids, ignore_eos, max_tokens, min_tokens, logprobs, skip_special_tokens,
    include_stop_str_in_output; output_kind CUMULATIVE or FINAL_ONLY (`generate` returns final outputs either
    way); skip_clone (no effect). Any other option raises unless left at vLLM's default."""

    _HONOURED: ClassVar[set[str]] = {"temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens",
                 "min_tokens", "logprobs", "skip_special_tokens", "include_stop_str_in_output", "output_kind",
                 "skip_clone"}

    def __init__(self, n: int = 1, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 repetition_penalty: float = 1.0, temperature: float = 1.0, watermarking: bool | None = None,
                 top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, seed: int | None = None,
                 stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
                 ignore_eos: bool = False, max_tokens: int | None = 16, min_tokens: int = 0,
                 logprobs: int | None = None, prompt_logprobs: int | None = None,
                 prompt_logprob_token_ids: Any = None, prompt_logprob_start: int | None = None,
                 logprob_token_ids: list[int] | None = None, flat_logprobs: bool = False, detokenize: bool = True,
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
                 include_stop_str_in_output: bool = False,
                 output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE, stream_interval: int | None = None,
                 skip_clone: bool = False, output_text_buffer_length: int = 0, structured_outputs: Any = None,
                 logit_bias: dict[int, float] | None = None, allowed_token_ids: list[int] | None = None,
                 extra_args: dict[str, Any] | None = None, bad_words: list[str] | None = None,
                 skip_reading_prefix_cache: bool | None = None, thinking_token_budget: int | None = None,
                 repetition_detection: Any = None, routed_experts_prompt_start: int = 0,
                 trace_decode_token_ids: list[int] | None = None) -> None:
        values = dict(locals())
        del values["self"]
        _check_defaults(SamplingParams.__init__, values, self._HONOURED, "SamplingParams")
        if output_kind is RequestOutputKind.DELTA:
            raise _unsupported("SamplingParams", "output_kind", output_kind, "LLM.generate returns whole outputs")
        self.__dict__.update(values)
        if temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {temperature}.")
        greedy = temperature < _SAMPLING_EPS
        self._scute = scute.SamplingParams(  # validates like vLLM (ValueError on a bad value)
            temperature=0.0 if greedy else temperature, top_p=1.0 if greedy else top_p,
            top_k=0 if greedy else top_k, seed=seed, max_tokens=max_tokens, min_tokens=min_tokens, stop=stop,
            stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, logprobs=logprobs,
            skip_special_tokens=skip_special_tokens, include_stop_str_in_output=include_stop_str_in_output,
        )

    def to_scute(self) -> scute.SamplingParams:
        """The equivalent `scute.SamplingParams`."""
        return self._scute

    def clone(self) -> SamplingParams:
        return SamplingParams(**{k: v for k, v in self.__dict__.items() if not k.startswith("_")})

    def __repr__(self) -> str:
        shown = ("temperature", "top_p", "top_k", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids",
                 "ignore_eos", "logprobs")
        return f"SamplingParams({', '.join(f'{k}={getattr(self, k)!r}' for k in shown)})"


@dataclass(eq=False)
class LoRARequest:
    """vLLM's `LoRARequest` — here for any adapter Scute serves (a PEFT folder of LoRA, DoRA, IA3, VeRA,
    OFT, ...). `load_inplace` reloads the folder under `lora_name`; `base_model_name` and
    `is_3d_lora_weight` (MoE layouts) do not change what Scute computes. Equal when the names are equal."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    load_inplace: bool = False
    is_3d_lora_weight: bool = False

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")
        if not self.lora_path:
            raise ValueError("lora_path cannot be empty")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)


# ---------------------------------------------------------------------------------------------- outputs
@dataclass
class Logprob:
    """vLLM's `Logprob`: a token's log-probability, its rank among the returned ones (1 = most likely;
    None for a chosen token outside the top-k asked for) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionOutput:
    """vLLM's `CompletionOutput` (one completion of a request)."""

    def __init__(self, index: int, text: str, token_ids: Sequence[int], cumulative_logprob: float | None,
                 logprobs: list[dict[int, Logprob]] | None, routed_experts: Any = None,
                 finish_reason: str | None = None, stop_reason: int | str | None = None,
                 lora_request: LoRARequest | None = None, sampling_mask: Any = None,
                 spec_decode_metrics: Any = None, weight_versions: list | None = None) -> None:
        self.index, self.text, self.token_ids = index, text, token_ids
        self.cumulative_logprob, self.logprobs, self.routed_experts = cumulative_logprob, logprobs, routed_experts
        self.finish_reason, self.stop_reason, self.lora_request = finish_reason, stop_reason, lora_request
        self.sampling_mask, self.spec_decode_metrics, self.weight_versions = (sampling_mask, spec_decode_metrics,
                                                                             weight_versions)

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
                f"cumulative_logprob={self.cumulative_logprob}, logprobs={self.logprobs}, "
                f"finish_reason={self.finish_reason}, stop_reason={self.stop_reason})")


class RequestOutput:
    """vLLM's `RequestOutput` (a request's prompt and completions)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                 prompt_logprobs: list | None, outputs: list[CompletionOutput], finished: bool,
                 metrics: Any = None, lora_request: LoRARequest | None = None, encoder_prompt: str | None = None,
                 encoder_prompt_token_ids: list[int] | None = None, num_cached_tokens: int | None = None,
                 num_cache_creation_tokens: int | None = None, *, prompt_token_id_logprobs: Any = None,
                 kv_transfer_params: dict[str, Any] | None = None,
                 ec_transfer_params: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.prompt_logprobs, self.outputs, self.finished = prompt_logprobs, outputs, finished
        self.metrics, self.lora_request = metrics, lora_request
        self.encoder_prompt, self.encoder_prompt_token_ids = encoder_prompt, encoder_prompt_token_ids
        self.num_cached_tokens, self.num_cache_creation_tokens = num_cached_tokens, num_cache_creation_tokens
        self.prompt_token_id_logprobs = prompt_token_id_logprobs
        self.kv_transfer_params, self.ec_transfer_params = kv_transfer_params, ec_transfer_params

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
                f"prompt_token_ids={self.prompt_token_ids}, outputs={self.outputs}, finished={self.finished}, "
                f"lora_request={self.lora_request}, num_cached_tokens={self.num_cached_tokens})")


# ---------------------------------------------------------------------------------------------- the LLM
# LLM(**kwargs) options (vLLM's EngineArgs) that Scute honours -> the `scute.Engine` option they set.
_ENGINE_KWARGS = {
    "max_model_len": "max_model_len", "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens", "block_size": "block_size",
    "enable_prefix_caching": "enable_prefix_caching", "max_loras": "max_adapters",
    "max_lora_rank": "max_adapter_rank", "max_cpu_loras": "max_cpu_adapters",
}
# Options accepted for what they promise, with no engine setting: Scute chunks every long prefill and keeps
# no statistics log.
_ACCEPTED_KWARGS = {"enable_lora": None, "enable_chunked_prefill": (None, True), "disable_log_stats": None}
SUPPORTED_LLM_OPTIONS = ("model", "tokenizer", "dtype", "seed", "gpu_memory_utilization", "enforce_eager",
                         "kv_cache_memory_bytes", "runner", "convert", "tokenizer_mode",
                         *_ENGINE_KWARGS, *_ACCEPTED_KWARGS)


class LLM:
    """vLLM's offline `LLM` on `scute.Engine` (reachable as `.engine`). `model`: a local Hugging Face folder
    or a ``.gguf`` file (Scute never downloads). See the module docstring for what differs from vLLM."""

    def __init__(self, model: str, *, runner: str = "auto", convert: str = "auto", tokenizer: str | None = None,
                 tokenizer_mode: str = "auto", skip_tokenizer_init: bool = False, trust_remote_code: bool = False,
                 allowed_local_media_path: str = "", allowed_media_domains: list[str] | None = None,
                 tensor_parallel_size: int = 1, dtype: str = "auto", quantization: str | None = None,
                 revision: str | None = None, tokenizer_revision: str | None = None,
                 chat_template: str | None = None, seed: int = 0, gpu_memory_utilization: float = 0.92,
                 cpu_offload_gb: float = 0, offload_group_size: int = 0, offload_num_in_group: int = 1,
                 offload_prefetch_step: int = 1, offload_params: set[str] | None = None,
                 enforce_eager: bool = False, enable_return_routed_experts: bool = False,
                 return_sampling_mask: bool = False, disable_custom_all_reduce: bool = False,
                 hf_token: bool | str | None = None, hf_overrides: Any = None,
                 mm_processor_kwargs: dict[str, Any] | None = None, pooler_config: Any = None,
                 structured_outputs_config: Any = None, profiler_config: Any = None, attention_config: Any = None,
                 kv_cache_memory_bytes: int | None = None, compilation_config: Any = None,
                 quantization_config: Any = None, logits_processors: list | None = None,
                 spec_method: str | None = None, spec_model: str | None = None, spec_tokens: int | None = None,
                 **kwargs: Any) -> None:
        values = dict(locals())
        for name in ("self", "kwargs", "__class__"):
            values.pop(name, None)
        handled = {"model", "tokenizer", "dtype", "seed", "gpu_memory_utilization", "enforce_eager",
                   "kv_cache_memory_bytes", "runner", "convert", "tokenizer_mode"}
        _check_defaults(LLM.__init__, values, handled, "LLM")
        for name, value, allowed in (("runner", runner, ("auto", "generate")), ("convert", convert, ("auto", "none")),
                                     ("tokenizer_mode", tokenizer_mode, ("auto", "hf"))):
            if value not in allowed:
                raise _unsupported("LLM", name, value, f"Scute runs text generation: use one of {allowed}")
        options = {"dtype": dtype, "seed": seed, "gpu_memory_utilization": gpu_memory_utilization,
                       "enforce_eager": enforce_eager, "kv_cache_memory_bytes": kv_cache_memory_bytes}
        self.enable_lora = bool(kwargs.pop("enable_lora", False))
        for name, value in kwargs.items():
            if name in _ENGINE_KWARGS:
                if value is not None:
                    options[_ENGINE_KWARGS[name]] = value
            elif name in _ACCEPTED_KWARGS:
                allowed = _ACCEPTED_KWARGS[name]
                if allowed is not None and value not in allowed:
                    raise _unsupported("LLM", name, value)
            else:
                raise _unsupported("LLM", name, value, f"Scute honours {', '.join(SUPPORTED_LLM_OPTIONS)}")
        tok = None
        if tokenizer is not None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(tokenizer)
        self.engine = scute.Engine(os.fspath(model), tokenizer=tok, **options)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest] | None = None,
                 priority: int | Sequence[int] | None = None, tokenization_kwargs: dict[str, Any] | None = None,
                 mm_processor_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.generate`: prompts (str, token ids, {"prompt": ...} or {"prompt_token_ids": ...}, or a
        list of them), one SamplingParams or one per prompt, one LoRARequest (any adapter) or one per prompt."""
        for name, value in (("tokenization_kwargs", tokenization_kwargs), ("mm_processor_kwargs", mm_processor_kwargs)):
            if value is not None:
                raise _unsupported("LLM.generate", name, value)
        if not isinstance(use_tqdm, bool):
            raise _unsupported("LLM.generate", "use_tqdm", use_tqdm, "give True or False")
        items = _prompt_list(prompts)
        if priority is not None and any(p != 0 for p in ([priority] if isinstance(priority, int) else priority)):
            raise _unsupported("LLM.generate", "priority", priority, "Scute schedules first come, first served")
        params = _per_prompt(sampling_params, len(items), (SamplingParams, scute.SamplingParams), "sampling_params")
        loras = _per_prompt(lora_request, len(items), LoRARequest, "lora_request")
        if any(lora is not None for lora in loras) and not self.enable_lora:
            raise ValueError(f"Got lora_request {next(l for l in loras if l)} but LoRA is not enabled! "
                             "Pass enable_lora=True to LLM")
        adapters = [self._adapter(lora) for lora in loras]
        sps = [p if isinstance(p, scute.SamplingParams) else (p or SamplingParams()).to_scute() for p in params]
        outs = self.engine.generate(items, sps, adapters, use_tqdm=use_tqdm)
        if failed := [o for o in outs if o.error is not None]:
            raise ValueError(f"{len(failed)} of {len(outs)} requests failed; the first: {failed[0].error}")
        return [self._output(o, lora, sp.logprobs) for o, lora, sp in zip(outs, loras, sps)]

    def _adapter(self, lora: LoRARequest | None) -> AdapterRequest | None:
        if lora is None:
            return None
        if lora.load_inplace:
            self.engine.load_adapter(lora.lora_name, lora.lora_path)
            return AdapterRequest(lora.lora_name)
        return AdapterRequest(lora.lora_name, lora.lora_path)

    def _output(self, out: scute.RequestOutput, lora: LoRARequest | None, k: int | None) -> RequestOutput:
        completions = []
        for c in out.outputs:
            logprobs = None if c.logprobs is None else [self._logprobs(step, k or 0) for step in c.logprobs]
            completions.append(CompletionOutput(c.index, c.text, list(c.token_ids), c.cumulative_logprob, logprobs,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                                lora_request=lora))
        return RequestOutput(out.request_id, out.prompt, list(out.prompt_token_ids), None, completions,
                             out.finished, lora_request=lora, num_cached_tokens=out.num_cached_tokens)

    def _logprobs(self, step: dict[int, float], k: int) -> dict[int, Logprob]:
        """One position's {token: logprob} (the chosen token and the top k) with vLLM's ranks: the top k are
        ranked 1..k; a chosen token outside them gets rank None (its rank in the vocabulary is not computed)."""
        tok = self.engine.tokenizer
        chosen = next(iter(step))  # the engine puts the chosen token first
        ranked = sorted(step, key=lambda t: -step[t])
        ranks = {t: i + 1 for i, t in enumerate(ranked[:k])}
        if len(step) > k:
            ranks[chosen] = None
        return {t: Logprob(lp, ranks.get(t), tok.decode([t]) if tok is not None else None) for t, lp in step.items()}


def _prompt_list(prompts) -> list:
    """vLLM's prompt forms -> the engine's (str or token-id list), one per request."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    items = []
    for p in prompts:
        if isinstance(p, dict):
            extra = set(p) - {"prompt", "prompt_token_ids"}
            if extra:
                raise _unsupported("LLM.generate", "prompts", sorted(extra), "text and token-id prompts only")
            p = p["prompt_token_ids"] if "prompt_token_ids" in p else p["prompt"]
        items.append(p if isinstance(p, str) else [int(t) for t in p])
    return items


def _per_prompt(value, n: int, single: type, what: str) -> list:
    if value is None or isinstance(value, single):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"The lengths of prompts and {what} must be the same: {n} prompts, {len(values)} {what}")
    return values


# ---------------------------------------------------------------------------------------------- unchanged scripts
_MODULES = ("vllm", "vllm.lora", "vllm.lora.request", "vllm.outputs", "vllm.sampling_params", "vllm.logprobs")


def install_as_vllm() -> None:
    """Make ``import vllm`` (and ``vllm.lora.request``, ``vllm.outputs``, ``vllm.sampling_params``,
    ``vllm.logprobs``) resolve to this module, so that a vLLM script runs on Scute unchanged. Refuses if the
    real vLLM is already imported."""
    import sys

    this = sys.modules[__name__]
    for name in _MODULES:
        if sys.modules.get(name, this) is not this:
            raise RuntimeError(f"the real {name} is already imported: install Scute's shim before importing vLLM")
    for name in _MODULES:
        sys.modules[name] = this


def uninstall_as_vllm() -> None:
    import sys

    this = sys.modules[__name__]
    for name in _MODULES:
        if sys.modules.get(name) is this:
            del sys.modules[name]


def main(argv: list[str] | None = None) -> int:
    """``python -m scute.compat.vllm SCRIPT [ARGS...]``: run a vLLM offline script on Scute, unchanged."""
    import runpy
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m scute.compat.vllm SCRIPT [ARGS...]  (runs a vLLM script on Scute, unchanged)")
        return 0 if argv else 2
    install_as_vllm()
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")
    return 0


__all__ = ["LLM", "CompletionOutput", "LoRARequest", "Logprob", "RequestOutput", "RequestOutputKind",
           "SamplingParams", "UnsupportedOptionError", "install_as_vllm", "uninstall_as_vllm"]

if __name__ == "__main__":  # run as a script: install the importable module, not this __main__ copy
    from scute.compat.vllm import main as _main

    raise SystemExit(_main())
