"""Prompt logprobs (`SamplingParams.prompt_logprobs`): the log-probability of each prompt token after the first
given the tokens before it, from the logits of the position before it, computed in the steps that compute the
prompt (chunks included). Only the steps of such requests keep those rows of the LM head (`PromptRows`); the
others keep only their sampled rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from scute.engine.request import Request
from scute.ops.mapped import host_to_device, to_host


def prompt_logprobs(logits: Tensor, targets: Tensor, k: int, rows_per_chunk: int = 1024) -> tuple[list, list, list]:
    """Semantics: with logp = log_softmax(logits[i].float()) (raw logits, [R, V]), row i's logp[targets[i]] and
    its k largest logp values with their token ids (none for k = 0). The float32 copies are made
    `rows_per_chunk` rows at a time (a long prompt's rows times the vocabulary). Returns host lists: chosen [R],
    top ids [R][k], top logprobs [R][k] (read in one sync, on CUDA from pinned memory a kernel wrote: `to_host`)."""
    chosen, top_ids, top_values = [], [], []
    for start in range(0, logits.shape[0], rows_per_chunk):
        logp = logits[start:start + rows_per_chunk].float().log_softmax(dim=-1)
        chosen.append(logp.gather(-1, targets[start:start + rows_per_chunk, None])[:, 0])
        top = logp.topk(min(k, logp.shape[-1]), dim=-1)  # k = 0: [rows, 0]
        top_ids.append(top.indices)
        top_values.append(top.values)
    parts = [torch.cat(x) for x in (chosen, top_ids, top_values)]
    if logits.is_cuda:
        parts = [to_host(x) for x in parts]
        torch.cuda.current_stream(logits.device).synchronize()
    return tuple(x.tolist() for x in parts)


class PromptRows:
    """The prompt positions of a step whose logits give prompt logprobs (`SamplingParams.prompt_logprobs`): they
    are kept rows of the LM head beside the sampled ones, all in token order (so that the LM head's adapter slots
    follow the rows); `collect` stores their logprobs in their requests and returns the sampled rows' logits."""

    def __init__(self) -> None:
        self.requests: list[tuple[Request, int]] = []  # (request, number of its positions this step)
        self.rows: list[int] = []  # positions in the kept rows
        self.targets: list[int] = []  # the prompt token each row's logits predict
        self.k = 0
        self._index: Tensor | None = None  # [2, R] on the device: rows, targets
        self._samples: Tensor | None = None

    def add(self, req: Request, start: int, num_new: int, row0: int, kept: list[int], slots: list[int]) -> None:
        """The positions of `req`'s tokens [start, start + num_new) (packed from row `row0` on) that predict a
        prompt token with no logprob yet: from its first missing entry up to the one before the last prompt
        token (whose logits sample). Appends them to the kept rows and their slots."""
        first, end = max(start, len(req.prompt_logprobs)), min(start + num_new, req.num_prompt_tokens - 1)
        if first >= end:
            return
        self.requests.append((req, end - first))
        self.k = max(self.k, req.sampling_params.prompt_logprobs)
        self.rows += range(len(kept), len(kept) + end - first)
        kept += range(row0 + first - start, row0 + end - start)
        slots += req.token_adapter_slots(first, end - first)
        self.targets += req.prompt_token_ids[first + 1:end + 1]

    def to_device(self, device: torch.device, num_kept: int) -> None:
        """The rows' indices on the device; the kept rows that are not prompt rows are the sampled ones."""
        prompt = set(self.rows)
        self._index = host_to_device([self.rows, self.targets], torch.int64, device) if self.rows else None
        self._samples = host_to_device([i for i in range(num_kept) if i not in prompt], torch.int64, device)

    def collect(self, logits: Tensor) -> Tensor:
        if self._index is not None:
            chosen, top_ids, top_values = prompt_logprobs(logits[self._index[0]], self._index[1], self.k)
            row = 0
            for req, num in self.requests:
                k, entries = req.sampling_params.prompt_logprobs, []
                for i in range(row, row + num):
                    entry = {self.targets[i]: chosen[i]}  # the prompt token first, then the top k (vLLM's order)
                    entry.update(zip(top_ids[i][:k], top_values[i][:k]))
                    entries.append(entry)
                req.prompt_logprobs += entries
                row += num
        return logits[self._samples]
