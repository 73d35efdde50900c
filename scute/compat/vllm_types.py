"""vLLM's request and output types: `SamplingParams`, `LoRARequest`, `RequestOutput`, `CompletionOutput`,
`Logprob`, with vLLM's signatures and field names; `UnsupportedOptionError` for what Scute does not implement.
Import them from `scute.compat.vllm`, which re-exports them."""

from __future__ import annotations

import dataclasses
import enum
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import scute
from scute.engine.request import AdapterRequest

_SAMPLING_EPS = 1e-5  # vLLM: a temperature below this is greedy


class UnsupportedOptionError(ValueError):
    """A vLLM option or value that Scute does not implement."""


def unsupported(where: str, name: str, value, why: str = "") -> UnsupportedOptionError:
    return UnsupportedOptionError(f"{where}: vLLM option {name}={value!r} is not supported by Scute"
                                  + (f" ({why})" if why else "") + "; leave it at its default")


def check_defaults(func, values: dict, handled: set[str], where: str, why: dict[str, str] | None = None) -> None:
    """Raise for every parameter of `func` outside `handled` whose value differs from its default (with the
    reason in `why`, where it names the parameter)."""
    for p in inspect.signature(func).parameters.values():
        if p.name in handled or p.name == "self" or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        if p.default is not p.empty and not is_default(values[p.name], p.default):
            raise unsupported(where, p.name, values[p.name], (why or {}).get(p.name, ""))


def is_default(value, default) -> bool:
    """Whether `value` is (or equals) vLLM's `default`."""
    if value is default:
        return True
    try:
        return bool(value == default)
    except Exception:  # noqa: BLE001 - e.g. numpy arrays compare elementwise
        return False


# ---------------------------------------------------------------------------------------------- requests
class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingParams:
    """vLLM's `SamplingParams`. Honoured: n (sample i of a seeded request draws from seed + i), temperature
    (< 1e-5 = greedy), top_p, top_k, seed, stop, stop_token_ids, ignore_eos, max_tokens, min_tokens, logprobs,
    prompt_logprobs, presence_penalty, frequency_penalty, repetition_penalty, skip_special_tokens,
    include_stop_str_in_output; output_kind (`LLM.generate` returns final outputs whatever it is; `LLMEngine.step`
    reports a DELTA request's new tokens, text and logprobs each step, a FINAL_ONLY one once, finished);
    skip_clone (no effect). Any other option raises unless left at vLLM's default."""

    _HONOURED: ClassVar[set[str]] = {"temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens",
                 "min_tokens", "logprobs", "skip_special_tokens", "include_stop_str_in_output", "output_kind",
                 "skip_clone", "presence_penalty", "frequency_penalty", "repetition_penalty", "n",
                 "prompt_logprobs"}
    _WHY: ClassVar[dict[str, str]] = {}

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
        check_defaults(SamplingParams.__init__, values, self._HONOURED, "SamplingParams", self._WHY)
        self.__dict__.update(values)
        if temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {temperature}.")
        greedy = temperature < _SAMPLING_EPS
        self._scute = scute.SamplingParams(  # validates like vLLM (ValueError on a bad value)
            temperature=0.0 if greedy else temperature, top_p=1.0 if greedy else top_p,
            top_k=0 if greedy else top_k, seed=seed, max_tokens=max_tokens, min_tokens=min_tokens, stop=stop,
            stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, logprobs=logprobs,
            skip_special_tokens=skip_special_tokens, include_stop_str_in_output=include_stop_str_in_output,
            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty, n=n, prompt_logprobs=prompt_logprobs,
            output_kind=RequestOutputKind(output_kind).name.lower(),
        )

    def to_scute(self) -> scute.SamplingParams:
        """The equivalent `scute.SamplingParams`."""
        return self._scute

    def clone(self) -> SamplingParams:
        return SamplingParams(**{k: v for k, v in self.__dict__.items() if not k.startswith("_")})

    def __repr__(self) -> str:
        shown = ("n", "temperature", "top_p", "top_k", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids",
                 "ignore_eos", "logprobs", "prompt_logprobs")
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
        for name, value in kwargs.items():  # fields of later vLLM versions: kept as given, not dropped
            setattr(self, name, value)

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
                f"prompt_token_ids={self.prompt_token_ids}, outputs={self.outputs}, finished={self.finished}, "
                f"lora_request={self.lora_request}, num_cached_tokens={self.num_cached_tokens})")


# ---------------------------------------------------------------------------------------------- conversions
def prompt_list(prompts, where: str) -> list:
    """vLLM's prompt forms (str, token ids, {"prompt": ...} or {"prompt_token_ids": ...}, or a list of them) ->
    the engine's (str or token-id list), one per request."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    items = []
    for p in prompts:
        if isinstance(p, dict):
            extra = set(p) - {"prompt", "prompt_token_ids"}
            if extra:
                raise unsupported(where, "prompts", sorted(extra), "text and token-id prompts only")
            p = p["prompt_token_ids"] if "prompt_token_ids" in p else p["prompt"]
        items.append(p if isinstance(p, str) else [int(t) for t in p])
    return items


def in_vocabulary(sp: scute.SamplingParams, vocab_size: int) -> scute.SamplingParams:
    """`sp` without the stop token ids outside the vocabulary (never sampled, so nothing changes; vLLM's
    examples pass a Llama-2 id to any model)."""
    kept = [t for t in sp.stop_token_ids if 0 <= t < vocab_size]
    return sp if len(kept) == len(sp.stop_token_ids) else dataclasses.replace(sp, stop_token_ids=kept)


def adapter_request(engine: scute.Engine, lora: LoRARequest | None) -> AdapterRequest | None:
    """The engine's request for a `LoRARequest` (any adapter); ``load_inplace`` reloads the folder first."""
    if lora is None:
        return None
    if lora.load_inplace:
        engine.load_adapter(lora.lora_name, lora.lora_path)
        return AdapterRequest(lora.lora_name)
    return AdapterRequest(lora.lora_name, lora.lora_path)


def to_vllm_output(out: scute.RequestOutput, lora: LoRARequest | None, k: int | None, tokenizer,
                   converted: dict | None = None, prompt_k: int | None = None) -> RequestOutput:
    """A `scute.RequestOutput` as vLLM's (its n completions, its prompt logprobs), with `k` top logprobs asked
    for (`prompt_k` for the prompt's). `converted`: the vLLM logprobs made by earlier calls for this request, per
    completion index and "prompt" (extended in place, so a stream of cumulative outputs converts each position
    once; None for a delta, whose positions are all new)."""
    converted = {} if converted is None else converted
    completions = []
    for c in out.outputs:
        logprobs = None
        if c.logprobs is not None:
            logprobs = _extend(converted.setdefault(c.index, []), c.logprobs, k, tokenizer)
        completions.append(CompletionOutput(c.index, c.text, list(c.token_ids), c.cumulative_logprob, logprobs,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                            lora_request=lora))
    prompt_logprobs = None
    if out.prompt_logprobs is not None:  # [None, {token: logprob}, ...]: the first prompt token has none
        prompt_logprobs = [None, *_extend(converted.setdefault("prompt", []), out.prompt_logprobs[1:], prompt_k,
                                          tokenizer)]
    return RequestOutput(out.request_id, out.prompt, list(out.prompt_token_ids), prompt_logprobs, completions,
                         out.finished, lora_request=lora, num_cached_tokens=out.num_cached_tokens)


def _extend(done: list, steps: list[dict[int, float]], k: int | None, tokenizer) -> list:
    """`done` (the first positions' vLLM logprobs) extended over the rest of `steps`; a copy of it."""
    done.extend(_logprobs(step, k or 0, tokenizer) for step in steps[len(done):])
    return list(done)


def _logprobs(step: dict[int, float], k: int, tokenizer) -> dict[int, Logprob]:
    """One position's {token: logprob} (the chosen token and the top k) with vLLM's ranks: the top k are
    ranked 1..k; a chosen token outside them gets rank None (its rank in the vocabulary is not computed)."""
    chosen = next(iter(step))  # the engine puts the chosen (or prompt) token first
    ranked = sorted(step, key=lambda t: -step[t])
    ranks = {t: i + 1 for i, t in enumerate(ranked[:k])}
    if len(step) > k:
        ranks[chosen] = None
    return {t: Logprob(lp, ranks.get(t), tokenizer.decode([t]) if tokenizer is not None else None)
            for t, lp in step.items()}
