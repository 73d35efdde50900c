"""Request bodies of the OpenAI-compatible endpoints (OpenAI's and vLLM's field names), their checks, and the
OpenAI-shaped error.

Every field a client may send is declared: an unknown one is refused (400, naming it), and a known one that
Scute does not serve is refused unless it has its default value (`UNSERVED`), so no option is ever dropped
silently.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from scute.sampling_params import SamplingParams


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with HTTP status `status`."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
             503: "ServiceUnavailable"}

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "APIError"),
                          "param": self.param, "code": self.status}}


class _Sampling(BaseModel):
    """The sampling fields both endpoints take: JSON's types as they are (``"max_tokens": true`` or ``"5"`` is a
    400, not 1 or 5)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_tokens: int = Field(default=0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class LoadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


# Known fields Scute does not serve, with their defaults: any other value is a 400 naming the field.
UNSERVED = {"n": 1, "best_of": None, "logit_bias": None, "echo": False, "suffix": None, "tools": None,
            "tool_choice": None, "response_format": None, "parallel_tool_calls": None,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
_ENGINE_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def sampling_params(req: _Sampling, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The engine's options for `req`; raises APIError(400) for an option Scute does not serve. A stream gets
    each step's new tokens (``output_kind="delta"``), an answer in one body its request's final output alone."""
    for name, default in UNSERVED.items():
        value = getattr(req, name, default)
        if value != default and value not in ({}, []) and name not in _ENGINE_FIELDS:
            raise APIError(400, f"{name}={value!r} is not supported by this server (only {default!r})", name)
    options = dict(max_tokens=max_tokens, min_tokens=req.min_tokens, seed=req.seed, stop=req.stop,
                   stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, logprobs=logprobs,
                   skip_special_tokens=req.skip_special_tokens,
                   include_stop_str_in_output=req.include_stop_str_in_output,
                   output_kind="delta" if req.stream else "final_only")
    options.update({k: getattr(req, k) for k in ("temperature", "top_p", "top_k") if getattr(req, k) is not None})
    options.update({k: getattr(req, k) for k in ("presence_penalty", "frequency_penalty", "repetition_penalty", "n")
                    if k in _ENGINE_FIELDS})
    try:
        return SamplingParams(**options)
    except ValueError as e:
        raise APIError(400, str(e)) from None


def stream_usage(req: _Sampling) -> bool:
    """Whether a stream ends with a usage chunk (``stream_options: {"include_usage": true}``)."""
    options = req.stream_options or {}
    if unknown := set(options) - {"include_usage"}:
        raise APIError(400, f"stream_options {sorted(unknown)} not supported", "stream_options")
    return bool(options.get("include_usage"))
