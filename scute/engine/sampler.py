"""Token selection for the rows of a step that reach the end of their request.

Greedy rows take the argmax. Sampled rows apply temperature, top-k and top-p, then pick
``argmax(probs / E)`` with ``E ~ Exponential(1)`` per token (the exponential race: an exact draw from
`probs`), where a request with a seed draws its noise from its own generator, so its tokens do not depend on
the rest of the batch. Everything stays on the device; the caller's single `.tolist()` is the step's only
host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from scute.engine.utils import host_to_device


@dataclass
class SamplingBatch:
    """Per-row sampling options, built on the host for the S rows that sample this step."""

    temperatures: list[float]
    top_ks: list[int]  # 0 = disabled
    top_ps: list[float]
    generators: list[torch.Generator | None]
    masked: tuple[list[int], list[int]]  # (rows, token ids) forced to -inf (min_tokens)
    num_logprobs: int  # -1: none wanted; else the largest top-k asked for (0 = chosen token only)

    @property
    def all_greedy(self) -> bool:
        return all(t == 0.0 for t in self.temperatures)


@dataclass
class SamplerOutput:
    token_ids: Tensor  # [S] int64
    logprobs: Tensor | None  # [S] float32: log-probability of the chosen token
    top_logprobs: Tensor | None  # [S, k]
    top_ids: Tensor | None  # [S, k]


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator  # the engine's seeded generator, for rows without their own seed

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        if batch.all_greedy and not batch.masked[0] and batch.num_logprobs < 0:  # argmax needs no float32 copy
            return SamplerOutput(logits.argmax(dim=-1), None, None, None)
        logits = logits.float()
        raw = logits
        rows, cols = batch.masked
        if rows:
            logits = logits.clone()
            index = host_to_device([rows, cols], torch.int64, logits.device)
            logits[index[0], index[1]] = float("-inf")
        if batch.all_greedy:
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, batch)
        return self._with_logprobs(raw, tokens, batch.num_logprobs)

    def _sample(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        device = logits.device
        temps = host_to_device(batch.temperatures, torch.float32, device)
        greedy = temps == 0
        scaled = logits / torch.where(greedy, 1.0, temps)[:, None]
        if any(k > 0 for k in batch.top_ks) or any(p < 1.0 for p in batch.top_ps):
            scaled = self._top_k_top_p(scaled, batch)
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs)
        noise.exponential_(generator=self.generator)
        for row, gen in enumerate(batch.generators):  # seeded requests: their own noise
            if gen is not None:
                noise[row].exponential_(generator=gen)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)

    @staticmethod
    def _top_k_top_p(logits: Tensor, batch: SamplingBatch) -> Tensor:
        vocab, device = logits.shape[-1], logits.device
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ks = host_to_device([k if k > 0 else vocab for k in batch.top_ks], torch.int64, device)
        rank = torch.arange(vocab, device=device)[None, :]
        drop = rank >= ks[:, None]
        ps = host_to_device(batch.top_ps, torch.float32, device)
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability mass ranked above each token
        drop |= before >= ps[:, None]  # the top token always stays (before = 0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(-1, order, sorted_logits)

    @staticmethod
    def _with_logprobs(raw: Tensor, tokens: Tensor, k: int) -> SamplerOutput:
        if k < 0:
            return SamplerOutput(tokens, None, None, None)
        logp = raw.log_softmax(dim=-1)
        chosen = logp.gather(-1, tokens[:, None])[:, 0]
        if k == 0:
            return SamplerOutput(tokens, chosen, None, None)
        top = logp.topk(k, dim=-1)
        return SamplerOutput(tokens, chosen, top.values, top.indices)
