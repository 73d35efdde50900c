"""What the engine returns, with vLLM's field names: `RequestOutput` holding its `CompletionOutput`s (one, or
`SamplingParams.n`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One completion of a request.

    finish_reason: None while running; "stop" (EOS, a stop token or a stop string), "length" (max_tokens or
        max_model_len), "abort", or "error" (see `RequestOutput.error`).
    stop_reason: the stop string or stop token id that ended it (None for EOS or other reasons).
    logprobs: per generated token, {token_id: log-probability} for the chosen token (and the top-k asked
        for); None unless `SamplingParams.logprobs` was set. cumulative_logprob likewise.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: its prompt, its completions so far, and `error` if it failed.

    outputs: one `CompletionOutput` per sample (`SamplingParams.n`, index 0..n-1); finished once all are.
    A failed request (bad adapter, prompt too long, ...) has finished=True, empty completions with
    finish_reason "error", and the reason in `error`; the other requests of the batch are unaffected.
    num_cached_tokens: prompt tokens whose KV came from the prefix cache.
    prompt_logprobs: None unless `SamplingParams.prompt_logprobs` was set; then None for the first prompt token
        and, for each later one, {token_id: log-probability} of that token (and the top-k asked for) given the
        tokens before it (while the prompt is being computed, the positions done so far).
    first_token_time: `time.monotonic()` on the engine's thread when its first output token (of any sample) was
        appended, None before.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    error: str | None = None
    adapter_name: str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    first_token_time: float | None = None
