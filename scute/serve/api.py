"""The OpenAI-compatible HTTP API (vLLM's endpoints and field names) over an `AsyncEngine`.

`build_app` returns a FastAPI app: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream: true`` as server-sent events ending in ``data: [DONE]``), ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST
/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (only with an allowed directory), ``GET /health`` and
``GET /metrics``. ``model`` names the base model or a served adapter of any method. Every error is
OpenAI-shaped JSON with a 4xx status (bad input never gets a 500), and fails only its own request.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from scute.engine.utils import tokenize
from scute.sampling_params import SamplingParams
from scute.serve.async_engine import AsyncEngine, EngineDeadError
from scute.serve.metrics import Metrics
from scute.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest, LoadAdapterRequest,
                                  UnloadAdapterRequest)
from scute.serve.responses import Job, chat_prompt, completion_body, completion_params, run_job, stream_job


@dataclass
class ServerState:
    engine: AsyncEngine
    served_model_name: str
    model_root: str
    adapters: dict[str, str] = field(default_factory=dict)  # name -> folder, as `/v1/models` lists them
    api_key: str | None = None
    runtime_adapter_dir: str | None = None  # real path of --allow-runtime-adapters, None: runtime loads refused
    metrics: Metrics | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    loading: set[str] = field(default_factory=set)  # names of runtime loads under way (each name loads once)

    @property
    def base_names(self) -> tuple[str, str]:
        """The names a request gives the base model by: the served name and the model's path."""
        return self.served_model_name, self.model_root

    def adapter_for(self, model: str) -> str | None:
        """The adapter a request's ``model`` names (None: the base model); 404 for an unknown name."""
        if model in self.base_names:
            return None
        if model in self.adapters:
            return model
        raise APIError(404, f"The model `{model}` does not exist.", "model")


class Authenticate:
    """``Authorization: Bearer KEY`` required on /v1/* when the server has a key: a plain ASGI middleware (one built
    on Starlette's BaseHTTPMiddleware hides a client's disconnect from the handlers, and a non-streamed request
    whose client went away would then run to its end)."""

    def __init__(self, app, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        key = self.state.api_key
        if scope["type"] == "http" and key and scope["path"].startswith("/v1"):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            if given != f"Bearer {key}".encode():
                response = JSONResponse(APIError(401, "missing or wrong API key").body(), status_code=401)
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="Scute", docs_url=None, redoc_url=None)
    app.state.scute = state

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        kind = err.get("type", "")
        if kind == "extra_forbidden":
            message = f"unknown parameter {'.'.join(loc)!r}"
        elif kind == "json_invalid" or not loc:
            message = "the request body is not a valid JSON object"
        else:
            message = f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid value')}"
        return JSONResponse(APIError(400, message, ".".join(loc) or None).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_, e: EngineDeadError):
        return JSONResponse(APIError(503, str(e)).body(), status_code=503)

    app.add_middleware(Authenticate, state=state)

    @app.get("/health")
    async def health():
        if state.engine.error is not None:
            raise EngineDeadError(f"the engine stopped: {state.engine.error!r}")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    def cards() -> list[dict]:
        base = dict(id=state.served_model_name, object="model", created=state.created, owned_by="scute",
                    root=state.model_root, parent=None, max_model_len=state.engine.engine.max_model_len)
        return [base] + [dict(id=name, object="model", created=state.created, owned_by="scute", root=path,
                              parent=state.served_model_name) for name, path in state.adapters.items()]

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": cards()}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):  # OpenAI's retrieve
        adapter = state.adapter_for(model)  # 404 for an unknown name
        return next(c for c in cards() if c["id"] == (adapter or state.served_model_name))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        adapter = state.adapter_for(req.model)
        params = completion_params(req)
        prompts = [req.prompt] if isinstance(req.prompt, str) or _is_ids(req.prompt) else list(req.prompt)
        if not prompts:
            raise APIError(400, "prompt is empty", "prompt")
        prompts = [await _prompt_ids(state, p, params) for p in prompts]
        job = Job(state, "cmpl", req, prompts, params, adapter, chat=False)
        return await _respond(job, raw)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request):
        adapter = state.adapter_for(req.model)
        params = completion_params(req)
        # the template and the tokenizer on a worker thread: a long conversation holds neither the event loop nor
        # the engine's steps
        prompt = await asyncio.to_thread(chat_prompt, state.engine.engine.tokenizer, req)
        _check_length(state, prompt, params, "messages")
        job = Job(state, "chatcmpl", req, [prompt], params, adapter, chat=True)
        return await _respond(job, raw)

    @app.post("/v1/load_lora_adapter")
    async def load_adapter(req: LoadAdapterRequest):
        path = _allowed_path(state, req.lora_path)
        if req.lora_name in state.base_names:
            raise APIError(400, f"{req.lora_name!r} is the base model's name", "lora_name")
        if req.lora_name in state.adapters or req.lora_name in state.loading:  # as vLLM: not taken over silently
            raise APIError(400, f"the adapter {req.lora_name!r} is already loaded: unload it first", "lora_name")
        state.loading.add(req.lora_name)  # claimed before the load's await: a second load of the name is refused
        try:
            # read and converted on a worker thread: the engine keeps stepping (it reads `named` only by key)
            await asyncio.to_thread(state.engine.engine.load_adapter, req.lora_name, path)
        except (OSError, ValueError, TypeError) as e:  # AdapterError is a ValueError
            state.metrics.adapter_loads.labels(state.metrics.model_name, "error").inc()
            raise APIError(400, f"adapter {req.lora_name!r} cannot be loaded: {e}", "lora_path") from None
        finally:
            state.loading.discard(req.lora_name)
        state.metrics.adapter_loads.labels(state.metrics.model_name, "ok").inc()
        state.adapters[req.lora_name] = path
        return Response(f"Success: adapter {req.lora_name!r} loaded.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_adapter(req: UnloadAdapterRequest):
        if state.runtime_adapter_dir is None:
            raise APIError(403, "runtime adapters are disabled: start the server with --allow-runtime-adapters DIR")
        if req.lora_name not in state.adapters:
            raise APIError(404, f"The model `{req.lora_name}` does not exist.", "lora_name")
        await state.engine.call(lambda: state.engine.engine.unload_adapter(req.lora_name))
        del state.adapters[req.lora_name]
        return Response(f"Success: adapter {req.lora_name!r} unloaded.", media_type="text/plain")

    return app


async def _respond(job: Job, raw: Request):
    if not job.req.stream:
        work = asyncio.ensure_future(run_job(job))
        while not work.done():  # a client that goes away aborts its requests (the stream's close aborts them)
            await asyncio.wait({work}, timeout=0.25)
            if not work.done() and await raw.is_disconnected():
                work.cancel()
                return Response(status_code=499)
        return JSONResponse(completion_body(job, work.result()))
    events = await stream_job(job)  # the first outputs are awaited here: an error is still a 4xx
    return StreamingResponse(events, media_type="text/event-stream")


async def _prompt_ids(state: ServerState, prompt, params: SamplingParams) -> list[int]:
    """A completion's prompt as token ids (text tokenized on a worker thread: a long prompt holds neither the event
    loop nor the engine's steps), checked as the engine checks it and against the context (`_check_length`)."""
    engine = state.engine.engine
    if isinstance(prompt, str) and engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer: send token ids, or start the server with --tokenizer DIR",
                       "prompt")
    try:
        ids = await asyncio.to_thread(tokenize, engine.tokenizer, engine.vocab_size, prompt)
    except (ValueError, TypeError) as e:
        raise APIError(400, f"prompt: {e}", "prompt") from None
    _check_length(state, ids, params, "prompt")
    return ids


def _check_length(state: ServerState, ids: list[int], params: SamplingParams, param: str) -> None:
    """vLLM's check: the prompt and the tokens asked for fit the context (400 otherwise, not a silent cut)."""
    limit, n = state.engine.engine.max_model_len, len(ids)
    asked = n + (params.max_tokens if params.max_tokens is not None else 1)
    if asked > limit:
        wanted = "" if params.max_tokens is None else f" ({n} in the {param}, {params.max_tokens} in the completion)"
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested {asked} "
                       f"tokens{wanted}. Please reduce the length of the {param} or completion.", param)


def _allowed_path(state: ServerState, path: str) -> str:
    """`path` resolved (symlinks too) inside the runtime adapter directory, or a 403 saying why not."""
    root = state.runtime_adapter_dir
    if root is None:
        raise APIError(403, "runtime adapters are disabled: start the server with --allow-runtime-adapters DIR")
    if "\0" in path:
        raise APIError(400, f"lora_path {path!r} holds a null byte", "lora_path")
    if ".." in path.replace("\\", "/").split("/"):
        raise APIError(403, f"lora_path {path!r}: '..' is not allowed", "lora_path")
    real = os.path.realpath(os.path.join(root, path))
    if real == root:
        raise APIError(400, f"lora_path {path!r} is the allowed adapter directory itself, not a folder in it",
                       "lora_path")
    if os.path.commonpath([real, root]) != root:
        raise APIError(403, f"lora_path {path!r} resolves outside the allowed adapter directory", "lora_path")
    return real


def _is_ids(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) for t in prompt)
