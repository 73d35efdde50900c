"""vLLM's streaming `LLMEngine` on `scute.Engine`: ``LLMEngine.from_engine_args(EngineArgs(...))``, then
`add_request` / `step` / `abort_request` / `has_unfinished_requests`, as in vLLM's offline examples.

Differences from vLLM: a request that cannot be served (a bad adapter, a prompt longer than max_model_len)
raises `ValueError` from `add_request`. As in vLLM, `step` reports every request it advanced with its whole output
so far (``RequestOutputKind.CUMULATIVE``), what is new (``DELTA``) or, for ``FINAL_ONLY``, once when it finishes;
an aborted request is not reported again.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import scute
from scute.compat.vllm_args import EngineArgs, make_engine
from scute.compat.vllm_types import (LoRARequest, RequestOutput, SamplingParams,
                                     adapter_request, check_defaults, in_vocabulary, prompt_list, to_vllm_output, unsupported)


class UsageContext(enum.Enum):
    """vLLM's `UsageContext` (what created the engine); Scute keeps no usage statistics."""

    UNKNOWN_CONTEXT = "UNKNOWN_CONTEXT"
    LLM_CLASS = "LLM_CLASS"
    API_SERVER = "API_SERVER"
    OPENAI_API_SERVER = "OPENAI_API_SERVER"
    OPENAI_BATCH_RUNNER = "OPENAI_BATCH_RUNNER"
    ENGINE_CONTEXT = "ENGINE_CONTEXT"


@dataclass
class _Tracked:
    """What `LLMEngine` keeps per request to shape its outputs like vLLM's."""

    lora: LoRARequest | None
    logprobs: int | None  # top-k asked for
    delta: bool  # its outputs are deltas (`RequestOutputKind.DELTA`): each converted alone
    prompt_logprobs: int | None = None
    prompt_text: str | None = None  # the outputs' prompt, where the caller gave it (`add_request`'s prompt_text)
    converted: dict = field(default_factory=dict)  # the positions' vLLM logprobs made so far (`to_vllm_output`)


class LLMEngine:
    """vLLM's `LLMEngine` on a `scute.Engine` (reachable as `.engine`). Build it with `from_engine_args`."""

    def __init__(self, engine: scute.Engine, enable_lora: bool = False) -> None:
        self.engine = engine
        self.enable_lora = enable_lora
        self._tracked: dict[str, _Tracked] = {}

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, usage_context: UsageContext = UsageContext.ENGINE_CONTEXT,
                         stat_loggers: list | None = None, enable_multiprocessing: bool = False) -> LLMEngine:
        """An engine for `engine_args` (a Scute `EngineArgs`: its fields were checked when it was built).
        `usage_context` is accepted and has no effect (vLLM reports it to its usage statistics; Scute keeps none)."""
        if not isinstance(engine_args, EngineArgs):
            raise TypeError(f"engine_args must be scute.compat.vllm.EngineArgs, got {type(engine_args).__name__}")
        if stat_loggers is not None:
            raise unsupported("LLMEngine.from_engine_args", "stat_loggers", stat_loggers, "Scute keeps no stats log")
        if enable_multiprocessing:
            raise unsupported("LLMEngine.from_engine_args", "enable_multiprocessing", enable_multiprocessing,
                              "Scute runs in one process")
        engine = make_engine(engine_args.model, engine_args.tokenizer, engine_args.scute_options())
        return cls(engine, enable_lora=bool(engine_args.enable_lora))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def add_request(self, request_id: str, prompt, params: SamplingParams | scute.SamplingParams,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                    tokenization_kwargs: dict[str, Any] | None = None, trace_headers: Mapping[str, str] | None = None,
                    priority: int = 0, session_id: str | None = None, prompt_text: str | None = None) -> str:
        """Queue a request: `prompt` is a str, token ids, {"prompt": ...} or {"prompt_token_ids": ...};
        `lora_request` any adapter Scute serves. `arrival_time` is accepted and not used (Scute admits requests
        in the order they are added); `prompt_text` is the outputs' prompt, as in vLLM (for a prompt given as
        token ids). Returns `request_id`."""
        values = dict(locals())
        del values["self"]
        check_defaults(LLMEngine.add_request, values, {"request_id", "prompt", "params", "arrival_time",
                                                       "lora_request", "prompt_text"}, "LLMEngine.add_request")
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        items = prompt_list(prompt, "LLMEngine.add_request")
        if len(items) != 1:
            raise ValueError(f"LLMEngine.add_request takes one prompt, got {len(items)}")
        if lora_request is not None and not self.enable_lora:
            raise ValueError(f"Got lora_request {lora_request} but LoRA is not enabled! "
                             "Pass enable_lora=True to EngineArgs")
        if request_id in self._tracked:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(params, SamplingParams):
            sp = params.to_scute()
        elif isinstance(params, scute.SamplingParams):
            sp = params
        else:
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        sp = in_vocabulary(sp, self.engine.vocab_size)
        self.engine.add_request(request_id, items[0], sp, adapter_request(self.engine, lora_request))
        req = self.engine.requests.get(request_id)
        if req is not None and req.is_finished and req.error is not None:  # failed before it could run
            raise ValueError(f"request {request_id!r} failed: {req.error}")
        self._tracked[request_id] = _Tracked(lora_request, sp.logprobs, sp.output_kind == "delta", sp.prompt_logprobs,
                                             prompt_text)
        return request_id

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns vLLM's `RequestOutput` for each request it advanced (``finished`` set
        on the last one of a request)."""
        outputs = []
        for out in self.engine.step():
            tracked = self._tracked.get(out.request_id)
            if tracked is None:  # aborted, or refused by add_request
                continue
            if out.finished:
                del self._tracked[out.request_id]
            converted = to_vllm_output(out, tracked.lora, tracked.logprobs, self.engine.tokenizer,
                                       None if tracked.delta else tracked.converted, tracked.prompt_logprobs)
            if tracked.prompt_text is not None:
                converted.prompt = tracked.prompt_text
            outputs.append(converted)
        return outputs

    def abort_request(self, request_ids: str | Iterable[str], internal: bool = False) -> None:
        """Stop requests (one id or several); `step` does not report them again. `internal` (vLLM's mark of an
        abort the engine itself made) changes nothing: every abort is the same here."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.engine.abort_request(ids)
        for rid in ids:
            self._tracked.pop(rid, None)

    def get_num_unfinished_requests(self) -> int:
        return len(self._tracked)

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked) or self.engine.has_unfinished_requests()
