"""One API request's engine requests (a `Job`: one per prompt) and the OpenAI-shaped bodies and stream chunks
built from their outputs."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from scute.outputs import RequestOutput
from scute.serve.protocol import APIError, ChatCompletionRequest, _Sampling, sampling_params, stream_usage
from scute.sampling_params import SamplingParams


@dataclass
class Job:
    state: object  # api.ServerState
    kind: str  # "cmpl" or "chatcmpl": the id prefix
    req: _Sampling
    prompts: list
    params: SamplingParams
    adapter: str | None
    chat: bool
    request_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    arrival: float = field(default_factory=time.monotonic)
    generated: list = field(default_factory=list)  # per prompt: the output tokens reported so far, per completion

    def __post_init__(self) -> None:
        self.request_id = f"{self.kind}-{uuid.uuid4().hex}"
        self.generated = [[0] * self.params.n for _ in self.prompts]
        self.include_usage = stream_usage(self.req)

    def streams(self) -> list[AsyncIterator[RequestOutput]]:
        engine = self.state.engine
        return [engine.generate(f"{self.request_id}-{i}", p, self.params, self.adapter)
                for i, p in enumerate(self.prompts)]

    def seen(self, index: int, out: RequestOutput) -> None:
        """Each output of prompt `index` (a stream's deltas, or a body's final output: each token reported once):
        its completions' token counts; metrics, the request's latencies once it finished."""
        for c in out.outputs:
            self.generated[index][c.index] += len(c.token_ids)
        if out.finished and out.error is None and self.state.metrics is not None:
            self.state.metrics.observe_latency(max(self.generated[index]), self.arrival, out.first_token_time,
                                               time.monotonic())

    def usage(self, finals: list[RequestOutput]) -> dict:
        """OpenAI's usage: the prompts' tokens (of their final outputs) and every token `seen`."""
        prompt, completion = sum(len(o.prompt_token_ids) for o in finals), sum(map(sum, self.generated))
        return dict(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def completion_params(req: _Sampling) -> SamplingParams:
    if isinstance(req, ChatCompletionRequest):
        k = (req.top_logprobs or 0) if req.logprobs else None
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return sampling_params(req, req.max_completion_tokens or req.max_tokens, k)
    return sampling_params(req, req.max_tokens or 16, req.logprobs)


def chat_prompt(tokenizer, req: ChatCompletionRequest) -> list[int]:
    """The conversation through the tokenizer's chat template, as token ids (the template writes the special
    tokens itself)."""
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer: start the server with --tokenizer DIR, or send token ids "
                       "to /v1/completions", "messages")
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model's tokenizer has no chat template: use /v1/completions", "messages")
    messages = []
    for i, m in enumerate(req.messages):
        content = m.get("content")
        if isinstance(content, list):  # parts: text only
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(m.get("role"), str) or not isinstance(content, str):
            raise APIError(400, f"messages[{i}] needs a string 'role' and text 'content'", "messages")
        messages.append({**m, "content": content})
    if not messages:
        raise APIError(400, "messages is empty", "messages")
    from jinja2 import TemplateError

    try:  # the template is the model's code: what it refuses, it refuses by raising
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=req.add_generation_prompt)
    except (TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
        raise APIError(400, f"the chat template refused the messages: {type(e).__name__}: {e}", "messages") from None
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return list(ids)


async def run_job(job: Job) -> list[RequestOutput]:
    """Every prompt's final output."""
    async def last(i, stream) -> RequestOutput:
        out = None
        async for out in stream:
            job.seen(i, out)
        return out
    outs = await asyncio.gather(*(last(i, s) for i, s in enumerate(job.streams())))
    _raise_errors(outs)
    return outs


def _raise_errors(outs) -> None:
    for out in outs:
        if out is not None and out.error is not None:  # "ValueError: ...": the engine's type is not the client's
            raise APIError(400, re.sub(r"^\w+Error: ", "", out.error))


def completion_body(job: Job, outs: list[RequestOutput]) -> dict:
    """The answer: prompt i's completion j (of n) is choice i·n + j, as OpenAI's."""
    choices = []
    for i, out in enumerate(outs):
        for c in out.outputs:
            choice = dict(index=i * job.params.n + c.index, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                          logprobs=_logprobs(job, c.token_ids, c.logprobs))
            if job.chat:
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = c.text
            choices.append(choice)
    return dict(id=job.request_id, object="chat.completion" if job.chat else "text_completion",
                created=job.created, model=job.req.model, choices=choices, usage=job.usage(outs))


def _logprobs(job: Job, ids, steps):
    """OpenAI's logprobs of tokens `ids` from their engine logprobs `steps` (completions: tokens / token_logprobs /
    top_logprobs; chat: content)."""
    if steps is None:
        return None
    tok = job.state.engine.engine.tokenizer
    text = (lambda t: tok.decode([t])) if tok is not None else str
    if job.chat:
        k = job.req.top_logprobs or 0
        return {"content": [dict(token=text(t), logprob=lp[t], bytes=list(text(t).encode()),
                                 top_logprobs=[dict(token=text(u), logprob=v, bytes=list(text(u).encode()))
                                               for u, v in _top(lp, k)]) for t, lp in zip(ids, steps)]}
    k = job.req.logprobs or 0
    return dict(tokens=[text(t) for t in ids], token_logprobs=[lp[t] for t, lp in zip(ids, steps)],
                top_logprobs=[_by_text(text, _top(lp, k)) for lp in steps])


def _top(step: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(step.items(), key=lambda kv: -kv[1])[:k]


def _by_text(text, top: list[tuple[int, float]]) -> dict[str, float]:
    """OpenAI's completions format keys the top tokens by text: of ids that decode alike, the likeliest."""
    out: dict[str, float] = {}
    for token, logprob in top:
        out.setdefault(text(token), logprob)
    return out


async def stream_job(job: Job) -> AsyncIterator[str]:
    """Server-sent events of the job. The first output of every prompt is awaited before this returns, so a
    request that fails at once (bad adapter, prompt too long) is still answered with a 4xx, not a broken stream."""
    queue: asyncio.Queue = asyncio.Queue()
    streams = job.streams()

    async def pump(i, stream):
        try:
            async for out in stream:
                await queue.put((i, out))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    pending, first = [], set()
    try:
        while len(first) < len(streams):
            i, out = await queue.get()
            if isinstance(out, BaseException):
                raise out
            pending.append((i, out))
            first.add(i)
            _raise_errors([out])
    except BaseException:
        for t in tasks:
            t.cancel()
        raise
    return _events(job, queue, pending, tasks)


async def _events(job: Job, queue: asyncio.Queue, pending: list, tasks: list) -> AsyncIterator[str]:
    """A chunk per output a completion's tokens advance (the engine's deltas, `sampling_params`; as vLLM, one even
    for a token whose text is held back), its finish reason on its last."""
    n = job.params.n  # prompt i's completion j is choice i·n + j
    ended, finals = set(), {}
    try:
        if job.chat:
            for index in range(n):
                yield _sse(job, [dict(index=index, delta={"role": "assistant", "content": ""}, logprobs=None,
                                      finish_reason=None)])
        while len(finals) < len(tasks):
            i, out = pending.pop(0) if pending else await queue.get()
            if isinstance(out, BaseException):
                raise out
            job.seen(i, out)
            if out.finished:
                finals[i] = out
            for c in out.outputs:
                index, finished = i * n + c.index, c.finish_reason is not None
                if index in ended:
                    continue
                if not finished and not c.token_ids:
                    continue  # another sample of the request advanced
                delta = "" if out.error is not None else c.text
                choice = dict(index=index, logprobs=_logprobs(job, c.token_ids, c.logprobs),
                              finish_reason=c.finish_reason if finished else None)
                choice.update(delta={"content": delta} if job.chat else {}, **({} if job.chat else {"text": delta}))
                if finished:
                    choice["stop_reason"] = c.stop_reason
                    ended.add(index)
                yield _sse(job, [choice])
        if job.include_usage:
            yield _sse(job, [], usage=job.usage(list(finals.values())))
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:  # a client gone mid-stream: the pumps' streams close, which aborts their requests
            t.cancel()


def _sse(job: Job, choices: list, usage: dict | None = None) -> str:
    chunk = dict(id=job.request_id, object="chat.completion.chunk" if job.chat else "text_completion",
                 created=job.created, model=job.req.model, choices=choices)
    if usage is not None:
        chunk["usage"] = usage
    return f"data: {json.dumps(chunk)}\n\n"
