"""`SamplingParams`: how one request picks its tokens and when it stops (vLLM's names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field

OUTPUT_KINDS = ("cumulative", "delta", "final_only")


@dataclass
class SamplingParams:
    """Sampling and stopping options of one request.

    temperature: 0 = greedy (argmax); otherwise logits are divided by it before sampling.
    top_k: keep the k most likely tokens (0 or -1 = all). top_p: keep the smallest set of tokens whose
        probability reaches p (1.0 = all).
    seed: a per-request seed: the same request with the same seed samples the same tokens, whatever else
        is in the batch. None = the engine's generator.
    max_tokens: most tokens to generate (None = up to max_model_len). min_tokens: EOS and stop_token_ids
        are masked until this many tokens have been generated.
    stop: strings that end the request (not included in the text unless include_stop_str_in_output).
    stop_token_ids: token ids that end the request (included in token_ids, like EOS).
    ignore_eos: keep generating after EOS.
    logprobs: None = no logprobs; k >= 0 = the log-probability of each chosen token plus the k most likely
        (log-softmax of the raw logits: the penalties below change which token is chosen, not its logprob).
    presence_penalty, frequency_penalty (in [-2, 2], 0 = off), repetition_penalty (> 0, 1 = off): vLLM's
        penalties, applied to the raw logits before temperature / top-k / top-p / greedy. With count[v] the
        occurrences of token v among the tokens generated so far: a token that occurs in the prompt or the
        output has its logit divided by repetition_penalty if positive, multiplied by it otherwise; then
        logit[v] -= frequency_penalty * count[v] + presence_penalty * (count[v] > 0). Positive values
        discourage repeats, negative ones (or repetition_penalty < 1) encourage them.
    skip_special_tokens: leave special tokens out of the output text.
    n: the number of completions of the prompt (`RequestOutput.outputs` holds n, index 0..n-1). The prompt is
        computed once: the first sample prefills it, the others then start from its full KV blocks (shared
        by reference count) and compute only the rest. With a seed s, sample i draws from seed s + i (sample
        0 is the request alone with seed s); greedy gives n identical completions.
    prompt_logprobs: None = none; k >= 0 = for every prompt token after the first, its log-probability given
        the tokens before it plus the k most likely tokens at that position (log-softmax of the raw logits), in
        `RequestOutput.prompt_logprobs`. Such a request reads no KV from the prefix cache (cached tokens would
        have no logits): its whole prompt is computed.
    output_kind: what `Engine.step` reports of a running request (vLLM's `RequestOutputKind`): "cumulative" =
        every step, its whole output so far; "delta" = every step, what is new since its last report (token_ids,
        text, logprobs; prompt_logprobs in the first report only; cumulative_logprob stays cumulative); "final_only"
        = nothing until it finishes. A stream of deltas costs a step the same whatever the outputs' lengths.
        `Engine.generate` returns whole outputs whatever the kind (it reports requests only once finished).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1
    prompt_logprobs: int | None = None
    output_kind: str = "cumulative"
    _stop: tuple[str, ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be None or >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be None or >= 0, got {self.prompt_logprobs}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty}")
        self._stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not s for s in self._stop):
            raise ValueError("stop strings must be non-empty")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {self.output_kind!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether a penalty is on: the request's tokens then depend on all of its earlier tokens."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stop
