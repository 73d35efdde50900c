"""`OutputProcessor`: append a step's sampled tokens to their requests, decide which requests stop, and build
the `RequestOutput`s (detokenized text, logprobs)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from scute.engine.request import Request
from scute.engine.sampler import SamplerOutput
from scute.outputs import CompletionOutput, RequestOutput


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: list[int], max_model_len: int, stats: dict) -> None:
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids
        self.max_model_len, self.stats = max_model_len, stats
        self.incremental = keeps_spaces(tokenizer)

    def append_tokens(self, sampling: list[Request], result: SamplerOutput) -> None:
        """Append each request's sampled token (and logprobs), then check its stop conditions. A request that
        finished meanwhile (stopped by the step before, or aborted) ignores its token."""
        tokens = result.token_ids.tolist()  # on the host: the runner read the step's output back
        chosen = result.logprobs.tolist() if result.logprobs is not None else None
        top = None if result.top_ids is None else (result.top_ids.tolist(), result.top_logprobs.tolist())
        now = time.monotonic()
        for row, (req, token) in enumerate(zip(sampling, tokens)):
            if req.is_finished:
                continue
            req.append_token(token)
            self.stats["generated_tokens"] += 1
            if req.num_output_tokens == 1:
                req.first_token_time = now
                if req.sample_index == 0:  # the n samples of a request: one prompt
                    self.stats["prompt_tokens"] += req.num_prompt_tokens
            k = req.sampling_params.logprobs
            if k is not None:
                req.cumulative_logprob += chosen[row]
                entry = {token: chosen[row]}  # the chosen token first, then the top k (vLLM's order)
                if top is not None:
                    entry.update(zip(top[0][row][:k], top[1][row][:k]))
                req.logprobs.append(entry)
            self.check_stop(req, token)

    def check_stop(self, req: Request, token: int) -> None:
        sp, count = req.sampling_params, req.num_output_tokens
        if count > sp.min_tokens:  # EOS and stop tokens were masked before min_tokens
            if not sp.ignore_eos and token in self.eos_token_ids:
                return req.finish("stop")
            if token in sp.stop_token_ids:
                return req.finish("stop", stop_reason=token)
            if sp.stop_strings and self._check_stop_strings(req):
                return None
        if (sp.max_tokens is not None and count >= sp.max_tokens) or req.num_tokens >= self.max_model_len:
            req.finish("length")
        return None

    def _check_stop_strings(self, req: Request) -> bool:
        seen = len(req.text)
        text = self.text(req)
        sp = req.sampling_params
        # only where the new text can end a stop string: what was searched before held none
        hits = [(i, s) for s in sp.stop_strings if (i := text.find(s, max(0, seen - len(s) + 1))) >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        req.text = text[: index + len(stop)] if sp.include_stop_str_in_output else text[:index]
        req.finish("stop", stop_reason=stop)
        return True

    def text(self, req: Request) -> str:
        """The request's output text so far, decoded incrementally: each call decodes its tokens since the last
        (and the few before them, for their context) instead of all of them, so that a stream's steps, and a stop
        string's check, cost a request the same whatever its length (vLLM's prefix and read
        offsets). A token that ends inside a character (a byte-level tokenizer's "\ufffd") waits for the next.
        A finished request's text is the full decode (`decode`), which the incremental one is a prefix of; so is
        every text of a tokenizer that cleans up spaces (`incremental`)."""
        if self.tokenizer is None:
            return ""
        ids, skip = req.output_token_ids, req.sampling_params.skip_special_tokens
        if req.is_finished or not self.incremental:
            return self.decode(req)
        if req.read_offset == len(ids):
            return req.text
        prefix = self.tokenizer.decode(ids[req.prefix_offset:req.read_offset], skip_special_tokens=skip)
        new = self.tokenizer.decode(ids[req.prefix_offset:], skip_special_tokens=skip)
        if new != prefix and new.startswith(prefix) and not new.endswith("\ufffd"):
            req.text += new[len(prefix):]
            req.prefix_offset, req.read_offset = req.read_offset, len(ids)
        return req.text

    def decode(self, req: Request) -> str:
        """The full decode of the request's output tokens."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(req.output_token_ids, skip_special_tokens=req.sampling_params.skip_special_tokens)

    def make_output(self, req: Request) -> RequestOutput:
        """The output of `req` and of the other samples of its request (`SamplingParams.n`), one completion each:
        whole, or with ``output_kind="delta"`` what is new since the last one (each call is a report)."""
        samples = req.samples
        sp = req.sampling_params
        prompt_logprobs = None
        if sp.prompt_logprobs is not None and req.error is None and not req.sent_prompt:
            prompt_logprobs = [None, *req.prompt_logprobs]  # a request is reported once its prompt is computed
            req.sent_prompt = sp.output_kind == "delta"
        if req.parent is None:  # one sample (n = 1): reported every step of a stream, so without the walks below
            finished, error, first = req.is_finished, req.error or None, req.first_token_time
        else:
            finished = all(s.is_finished for s in samples)
            error = next((s.error for s in samples if s.error), None)
            first = min((s.first_token_time for s in samples if s.first_token_time is not None), default=None)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [self._completion(s) for s in samples],
                             finished, error, req.adapter_name, req.num_cached_tokens, prompt_logprobs, first)

    def _completion(self, req: Request) -> CompletionOutput:
        sp = req.sampling_params
        text = req.text if isinstance(req.stop_reason, str) else self.text(req)  # a stop string cut the text
        end = len(text)  # what is reported ends here: a delta's slice never copies the text before it
        if not req.is_finished:  # only text the final output keeps: no unfinished character, no stop string's start
            end = len(text.rstrip("\ufffd"))
            if sp.stop_strings and not sp.include_stop_str_in_output:
                end -= stop_prefix_at_end(text, sp.stop_strings, end)
        tokens = chars = 0
        if sp.output_kind == "delta":  # every text reported is a prefix of the next (the stop strings' hold-back)
            tokens, chars = req.sent_tokens, req.sent_text
            req.sent_tokens, req.sent_text = len(req.output_token_ids), end
        return CompletionOutput(
            index=req.sample_index, text=text[chars:end], token_ids=req.output_token_ids[tokens:],
            cumulative_logprob=req.cumulative_logprob if sp.logprobs is not None else None,
            logprobs=req.logprobs[tokens:] if sp.logprobs is not None else None,
            finish_reason=req.finish_reason, stop_reason=req.stop_reason,
        )


CLEANUP_PROBE = "a . b , c ! d ? e"  # text that transformers' clean-up of spaces changes (" ." -> ".", ...)


def keeps_spaces(tokenizer) -> bool:
    """Whether the tokenizer's decode keeps the spaces its tokens decode to, so that `OutputProcessor.text` may
    decode a few tokens at a time: one that cleans them up (" ." -> ".") can join tokens across a window's start,
    and its text is then decoded in full every time (as a tokenizer unknown to transformers' is). Asked of the
    decode itself where `clean_up_tokenization_spaces` is set: transformers ignores the flag for BPE tokenizers,
    Llama 3's among them (which set it), and a full decode every step costs a request time in its length."""
    flag = getattr(tokenizer, "clean_up_tokenization_spaces", None)
    if flag is not True:  # False: it keeps them; None: not a transformers tokenizer
        return flag is False
    try:
        ids = tokenizer.encode(CLEANUP_PROBE, add_special_tokens=False)
        kept = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
        return " ." in kept and tokenizer.decode(ids) == kept  # else it cleans up, or the probe cannot tell
    except Exception:  # noqa: BLE001 - a tokenizer whose decode takes no such option: decode in full
        return False


def stop_prefix_at_end(text: str, stops: Sequence[str], end: int) -> int:
    """The length of the longest end of ``text[:end]`` that begins one of `stops` (a proper prefix of it): what a
    running request's output holds back, since a stop string completed by later tokens cuts the text where it
    starts, and a stream shows only text the final output keeps (vLLM holds back the longest stop string's length
    less one)."""
    for k in range(min(end, max(map(len, stops)) - 1), 0, -1):
        if any(len(s) > k and text.endswith(s[:k], 0, end) for s in stops):
            return k
    return 0
