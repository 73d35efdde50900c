"""`Request`: one prompt's state inside the engine; `AdapterRequest`: how a caller names an adapter."""

from __future__ import annotations

import dataclasses
import enum
import sys
from dataclasses import dataclass

import torch

from scute.adapters import Adapter, alora_start
from scute.sampling_params import SamplingParams

NEVER = sys.maxsize  # `Request.adapter_start` of an aLoRA whose invocation tokens are not in the prompt


@dataclass(frozen=True)
class AdapterRequest:
    """An adapter for a request (vLLM's `LoRARequest`, for any PEFT method).

    name: the adapter's name; with `path` the PEFT folder is loaded (and cached) under that name, without it
    the name must have been loaded with `Engine.load_adapter(name, path)`.
    """

    name: str
    path: str | None = None


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """A request's tokens, KV blocks and progress.

    all_token_ids = prompt + output. Each step the scheduler gives it some new tokens to compute; once
    num_computed_tokens reaches len(all_token_ids) a token is sampled and appended. Preemption resets
    num_computed_tokens to 0 and frees the blocks: the request is recomputed later, its output kept.
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        adapter: Adapter | None,
        adapter_name: str | None,
        arrival: int,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.adapter = adapter
        self.adapter_name = adapter_name
        self.arrival = arrival  # admission order: the scheduler's FIFO and preemption priority
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # Tokens sampled on the GPU by a launched step whose values the host has not read yet (0 or 1): they
        # count in num_tokens, so the next step can be scheduled before they land (`Engine` overlaps steps).
        self.num_pending = 0
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # hash chain of the full blocks of all_token_ids
        self.num_hashed_blocks = 0  # leading blocks of block_table registered in the prefix cache
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.adapter_slot = -1  # slot in the ScuteLinear layers while running (-1 = base model)
        # Position of the first token the adapter applies to: 0, or for an aLoRA the start of its invocation
        # tokens' last occurrence in the prompt (never, if they do not occur); earlier tokens run on the base.
        self.adapter_start = _gate(self.prompt_token_ids, adapter)
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.num_preemptions = 0
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, float]] = []
        # SamplingParams.prompt_logprobs: one entry per prompt token after the first, filled as the prompt is computed.
        self.prompt_logprobs: list[dict[int, float]] = []
        # SamplingParams.n > 1: the `ParentRequest` of the n samples (this request is sample `sample_index`; sample 0
        # carries the request's id); `prompt_source` is sample 0 for the others, whose prompt blocks they share.
        self.parent = None
        self.sample_index = 0
        self.prompt_source: Request | None = None
        self.generator: torch.Generator | None = None
        # the output text decoded so far, a few tokens at a time (`OutputProcessor.text`): of the output tokens up
        # to `read_offset`; the tokens from `prefix_offset` to there are decoded again with the next ones
        self.text, self.prefix_offset, self.read_offset = "", 0, 0
        # what outputs of kind "delta" reported already: output tokens, characters of text, the prompt's logprobs
        self.sent_tokens, self.sent_text, self.sent_prompt = 0, 0, False
        self.first_token_time: float | None = None  # time.monotonic() when its first output token was appended
        self.eos_token_ids: list[int] = []  # the model's EOS ids (they end it unless ignore_eos)

    def bind_adapter(self, adapter: Adapter) -> Adapter:
        """Serve the request with the adapter its `PendingAdapter` loaded, named as the request names it, and set
        the adapter's gate as for an adapter known on arrival; returns it."""
        if self.adapter_name not in (None, adapter.name):
            adapter = dataclasses.replace(adapter, name=self.adapter_name)
        self.adapter, self.adapter_start = adapter, _gate(self.prompt_token_ids, adapter)
        return adapter

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids) + self.num_pending

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.num_pending

    @property
    def adapter_identity(self) -> str | None:
        return None if self.adapter is None else self.adapter.identity

    @property
    def samples(self) -> list[Request]:
        """The samples reported together with this one: the n of its parent request, or itself."""
        return [self] if self.parent is None else self.parent.samples

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether some prompt logprobs are still to be computed (then no prompt KV may come from the cache)."""
        return self.sampling_params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def fork(self, index: int) -> Request:
        """Sample `index` of this request (SamplingParams.n): the same prompt and adapter, n = 1, seed s + index,
        no prompt logprobs (the request's come from sample 0); it shares this request's prompt blocks."""
        sp = self.sampling_params
        seed = None if sp.seed is None else sp.seed + index
        child = Request(f"{self.request_id}#{index}", self.prompt, self.prompt_token_ids,
                        dataclasses.replace(sp, n=1, seed=seed, prompt_logprobs=None), self.adapter, self.adapter_name,
                        self.arrival)
        child.eos_token_ids, child.sample_index, child.prompt_source = self.eos_token_ids, index, self
        return child

    def token_adapter_slots(self, start: int, num: int) -> list[int]:
        """The adapter slots of the tokens at positions [start, start + num) (−1: the base model)."""
        if start >= self.adapter_start:
            return [self.adapter_slot] * num
        before = min(self.adapter_start - start, num)
        return [-1] * before + [self.adapter_slot] * (num - before)

    @property
    def status(self) -> RequestStatus:
        return self._status

    @status.setter
    def status(self, value: RequestStatus) -> None:
        # `is_finished` is read several times per request per step: an attribute, kept here, not a property
        self._status, self.is_finished = value, value is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def finish(self, reason: str, stop_reason: int | str | None = None, error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason, self.stop_reason, self.error = reason, stop_reason, error

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"status={self.status.value})")


def _gate(prompt_token_ids: list[int], adapter) -> int:
    """`Request.adapter_start` for this adapter: 0, an aLoRA's invocation start in the prompt, or NEVER."""
    inv = getattr(adapter, "invocation_tokens", None)
    start = 0 if inv is None else alora_start(prompt_token_ids, inv)
    return NEVER if start is None else start
