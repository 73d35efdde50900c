"""Token selection for the rows of a step that reach the end of their request.

Rows with penalties (presence, frequency, repetition: `Penalties`) first have their logits penalized by their
request's earlier tokens, kept (`PenaltyTokens`) and counted on the device; the other rows' logits are not touched.
Greedy rows then take the argmax. Sampled rows apply temperature, top-k and top-p, then pick ``argmax(probs / E)``
with ``E ~ Exponential(1)`` per token (the exponential race: an exact draw from `probs`), where a request with a
seed draws its noise from its own generator, so its tokens do not depend on the rest of the batch. Everything stays
on the device; the runner's read of the output (`ModelRunner`: kernels into pinned memory, then one wait) is the
step's only host sync. Logprobs are those of the raw logits,
before penalties, masking and temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from scute.ops.mapped import host_to_device


ARGMAX_PARTS = 64  # a long row's argmax as this many partial maxima, then their argmax


def argmax_rows(logits: Tensor) -> Tensor:
    """Semantics: ``logits.argmax(-1)`` (the first maximum of each row). Shapes: logits [S, V]; returns [S] int64.

    A vocabulary that splits into `ARGMAX_PARTS` equal parts of 1024 or more takes two reductions: the maximum of
    each part (its first), then the first part holding the largest. PyTorch's one reduction over few long rows
    runs on few blocks: on an H200 a row of 128k logits took 36 µs of each decode step, more than a layer's norms."""
    rows, vocab = logits.shape
    if vocab % ARGMAX_PARTS or vocab // ARGMAX_PARTS < 1024:
        return logits.argmax(dim=-1)
    size = vocab // ARGMAX_PARTS
    values, within = logits.view(rows, ARGMAX_PARTS, size).max(dim=-1)
    part = values.argmax(dim=-1, keepdim=True)
    return (part * size + within.gather(-1, part)).squeeze(-1)


@dataclass
class SamplingBatch:
    """Per-row sampling options, built on the host for the S rows that sample this step."""

    temperatures: list[float]
    top_ks: list[int]  # 0 = disabled
    top_ps: list[float]
    generators: list[torch.Generator | None]
    masked: tuple[list[int], list[int]]  # (rows, token ids) forced to -inf (min_tokens)
    num_logprobs: int  # -1: none wanted; else the largest top-k asked for (0 = chosen token only)
    penalties: Penalties | None = None  # the rows with a penalty on, None if no row has one

    @property
    def all_greedy(self) -> bool:
        return all(t == 0.0 for t in self.temperatures)


@dataclass
class Penalties:
    """The rows of a step with a penalty on (vLLM's presence, frequency and repetition penalties): their rows in
    the step's logits, their requests' rows in the device table of `tokens` and the output position each samples
    (`PenaltyTokens.batch`), the three as one device tensor `index` [3, P]."""

    rows: list[int]
    presence: list[float]
    frequency: list[float]
    repetition: list[float]
    tokens: PenaltyTokens
    index: Tensor  # [3, P] int64 on the device: rows, table rows, positions

    def apply(self, logits: Tensor) -> Tensor:
        """`logits` [S, V] (float32) with the penalized rows replaced (a new tensor; the others copied as they are).
        One host-to-device copy (the penalties; `index` came with the batch) and no host sync."""
        rows = self.index[0]
        values = host_to_device([self.presence, self.frequency, self.repetition], torch.float32, logits.device)
        ids = self.tokens.ids[self.index[1]]  # [P, 2, W]
        penalized = apply_penalties(logits[rows], ids[:, 0], ids[:, 1], values[0], values[1], values[2])
        return logits.index_copy(0, rows, penalized)

    def record(self, token_ids: Tensor) -> None:
        """Write the step's sampled tokens [S] of the penalized rows into their requests' output rows, on the
        device: the next step counts them whether or not the host has read them yet."""
        rows, table_rows, positions = self.index
        self.tokens.ids[table_rows, 1, positions] = token_ids[rows]


class PenaltyTokens:
    """The prompt and output token ids of the requests with a penalty on, kept on the device in one table `ids`
    [rows, 2, width] (prompt, output; padded with -1), a row per request from its first sampled step until it
    finishes. A request's prompt and the output tokens the host has are copied there once, when it gets its row;
    each later token is written there by the step that samples it (`Penalties.record`), before the host reads it.
    So a step copies only indices to the device, however long its requests, and a step can sample a penalized
    request whose newest token is still in flight (the engine overlaps it like any other). The table grows by
    doubling; the rows of finished requests are reused (a step still in flight that writes to one does so before
    the reuse's writes, which queue behind it on the stream)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rows: dict = {}  # Request -> its row
        self._free: list[int] = []
        self.ids = torch.full((0, 2, 0), -1, dtype=torch.int64, device=device)

    def batch(self, sampling: list) -> Penalties | None:
        """The penalized rows among a step's sampling `Request`s, None if there are none."""
        rows = [row for row, req in enumerate(sampling) if req.sampling_params.has_penalties]
        if not rows:
            return None
        for req in [r for r in self.rows if r.is_finished]:
            self._free.append(self.rows.pop(req))
        requests = [sampling[row] for row in rows]
        positions = [req.num_output_tokens for req in requests]  # each samples its output token at this index
        self._grow(width=max(positions) + 1)
        table_rows = [self.rows[req] if req in self.rows else self._admit(req) for req in requests]
        sps = [r.sampling_params for r in requests]
        index = host_to_device([rows, table_rows, positions], torch.int64, self.device)
        return Penalties(rows, [sp.presence_penalty for sp in sps], [sp.frequency_penalty for sp in sps],
                         [sp.repetition_penalty for sp in sps], self, index)

    def _admit(self, req) -> int:
        """A row for `req`, holding its prompt and the output tokens the host has (all of them: its first sampled
        step has none in flight)."""
        if req.num_pending:
            raise RuntimeError(f"request {req.request_id!r} has a penalty and a token in flight but no row of "
                               "tokens on the device: its first sampled step was not given one")
        row = self._free.pop() if self._free else len(self.rows)  # no row free: rows 0..len-1 are all held
        self._grow(rows=row + 1, width=len(req.prompt_token_ids))
        self.rows[req] = row
        self.ids[row] = -1
        for part, ids in enumerate((req.prompt_token_ids, req.output_token_ids)):
            if ids:
                self.ids[row, part, : len(ids)] = host_to_device(ids, torch.int64, self.device)
        return row

    def _grow(self, rows: int = 0, width: int = 0) -> None:
        """At least `rows` rows and `width` columns, each doubling when it grows, the new entries -1."""
        have_rows, have_width = self.ids.shape[0], self.ids.shape[2]
        if rows <= have_rows and width <= have_width:
            return
        rows = max(rows, 2 * have_rows) if rows > have_rows else have_rows
        width = max(width, 2 * have_width) if width > have_width else have_width
        grown = torch.full((rows, 2, width), -1, dtype=torch.int64, device=self.device)
        grown[:have_rows, :, :have_width] = self.ids
        self.ids = grown


def apply_penalties(logits: Tensor, prompt_ids: Tensor, output_ids: Tensor, presence: Tensor, frequency: Tensor,
                    repetition: Tensor) -> Tensor:
    """Semantics: for each row i and token v, with count[i, v] = occurrences of v in output_ids[i] and
    seen[i, v] = v in prompt_ids[i] or count[i, v] > 0 (ids -1 are padding):
    x = logits[i, v]; if seen[i, v]: x = x / repetition[i] if x > 0 else x * repetition[i];
    x = x - frequency[i] * count[i, v]; x = x - presence[i] * (count[i, v] > 0).
    logits [P, V] float32; prompt_ids, output_ids [P, L] int64; presence, frequency, repetition [P]."""
    num_rows, vocab = logits.shape
    ids = torch.cat([prompt_ids, output_ids])  # [2P, L]: one scatter for both counts
    counts = torch.zeros(2 * num_rows, vocab, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, ids.clamp(min=0), (ids >= 0).to(logits.dtype))  # padding adds 0 to token 0
    in_prompt, count = counts[:num_rows] > 0, counts[num_rows:]
    present = count > 0
    r = repetition[:, None]
    logits = torch.where(in_prompt | present, torch.where(logits > 0, logits / r, logits * r), logits)
    return logits - frequency[:, None] * count - presence[:, None] * present


@dataclass
class SamplerOutput:
    token_ids: Tensor  # [S] int64
    logprobs: Tensor | None  # [S] float32: log-probability of the chosen token
    top_logprobs: Tensor | None  # [S, k]
    top_ids: Tensor | None  # [S, k]


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator  # the engine's seeded generator, for rows without their own seed
        self.penalty_tokens = PenaltyTokens(generator.device)

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        plain = not batch.masked[0] and batch.num_logprobs < 0 and batch.penalties is None
        if batch.all_greedy and plain:  # argmax needs no float32 copy
            return SamplerOutput(argmax_rows(logits), None, None, None)
        logits = logits.float()
        raw = logits
        if batch.penalties is not None:  # on the raw logits, before the mask and temperature (as vLLM)
            logits = batch.penalties.apply(logits)
        rows, cols = batch.masked
        if any(c >= logits.shape[1] for c in cols):  # a stop id beyond the logits can never be sampled anyway
            keep = [(r, c) for r, c in zip(rows, cols) if c < logits.shape[1]]
            rows, cols = [r for r, _ in keep], [c for _, c in keep]
        if rows:
            index = host_to_device([rows, cols], torch.int64, logits.device)
            logits = logits.index_put((index[0], index[1]), logits.new_tensor(float("-inf")))
        if batch.all_greedy:
            tokens = argmax_rows(logits)
        else:
            tokens = self._sample(logits, batch)
        if batch.penalties is not None:
            batch.penalties.record(tokens)
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
