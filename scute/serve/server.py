"""`scute serve MODEL [options]`: the OpenAI-compatible server (uvicorn), with vLLM's flags.

Every `EngineConfig` option is a flag with vLLM's spelling (``--max-num-seqs``, ``--enforce-eager``, ...); vLLM's
LoRA flags are accepted under their names (``--lora-modules NAME=PATH``, ``--max-loras``, ``--max-lora-rank``,
``--enable-lora``: adapters are always on). An unknown flag is an error. Listens on 127.0.0.1 unless told.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import sys

from scute.config import EngineConfig

ALIASES = {"max_adapters": ["--max-loras"], "max_adapter_rank": ["--max-lora-rank"],
           "max_cpu_adapters": ["--max-cpu-loras"], "tensor_parallel_size": ["-tp"]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scute serve", description="OpenAI-compatible server of a base model and "
                                "its adapters (any PEFT method).")
    p.add_argument("model", help="a Hugging Face folder or a .gguf file")
    p.add_argument("--adapter", "--lora-modules", dest="adapters", action="extend", nargs="+", default=[],
                   metavar="NAME=PATH", help="serve the PEFT folder PATH as model NAME (repeatable)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the base model's name in the API (default: MODEL)")
    p.add_argument("--api-key", default=os.environ.get("SCUTE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default $SCUTE_API_KEY)")
    p.add_argument("--allow-runtime-adapters", metavar="DIR",
                   help="enable /v1/load_lora_adapter for folders inside DIR (off by default)")
    p.add_argument("--tokenizer", help="a tokenizer folder (default: the model's)")
    p.add_argument("--enable-lora", action="store_true", help="accepted for vLLM compatibility (always on)")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level")
    for f in dataclasses.fields(EngineConfig):
        if not f.init:
            continue
        flags = [f"--{f.name.replace('_', '-')}", *ALIASES.get(f.name, [])]
        if f.type in ("bool", bool):
            action = argparse.BooleanOptionalAction if f.default else "store_true"
            p.add_argument(*flags, dest=f.name, action=action, default=f.default)
        else:
            kind = {"float": float}.get(str(f.type), int if "int" in str(f.type) else str)
            p.add_argument(*flags, dest=f.name, type=kind, default=f.default, help=f"(default {f.default})")
    return p


def engine_options(args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if f.init}


def parse_adapters(items: list[str]) -> dict[str, str]:
    adapters = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"scute serve: --adapter {item!r}: expected NAME=PATH")
        if name in adapters:
            raise SystemExit(f"scute serve: --adapter {name!r} is given twice ({adapters[name]!r}, {path!r})")
        adapters[name] = path
    return adapters


def served_line(model: str, adapters: list[str], most: int = 8) -> str:
    """The base model's and the adapters' names for the start-up line, the adapters' cut after `most`."""
    if len(adapters) <= most:
        return ", ".join([model, *adapters])
    return ", ".join([model, *adapters[:most]]) + f" and {len(adapters) - most} more adapters (GET /v1/models)"


def make_state(engine, model: str, adapters: dict[str, str], served_model_name: str | None = None,
               api_key: str | None = None, runtime_adapter_dir: str | None = None):
    """The server's state over a built `Engine`: loads `adapters` (name -> PEFT folder) and starts the engine
    thread. Raises AdapterError for an adapter that cannot be served."""
    from scute.serve.api import ServerState
    from scute.serve.async_engine import AsyncEngine
    from scute.serve.metrics import Metrics

    from tqdm.auto import tqdm

    name = served_model_name or model
    for adapter, path in tqdm(adapters.items(), desc="Loading adapters", unit="adapter", disable=len(adapters) < 2):
        engine.load_adapter(adapter, path)
    metrics = Metrics(name)
    async_engine = AsyncEngine(engine, on_step=metrics.observe_step)
    metrics.observe_engine(engine)
    root = os.path.realpath(runtime_adapter_dir) if runtime_adapter_dir else None
    if root is not None and not os.path.isdir(root):
        raise SystemExit(f"scute serve: --allow-runtime-adapters {runtime_adapter_dir!r} is not a directory")
    state = ServerState(async_engine, name, model, dict(adapters), api_key, root, metrics)
    async_engine.start()
    return state


def serve_main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    import uvicorn

    from scute import Engine
    from scute.adapters import AdapterError
    from scute.serve.api import build_app

    adapters = parse_adapters(args.adapters)
    if taken := {args.served_model_name or args.model, args.model} & adapters.keys():  # `ServerState.base_names`
        print(f"scute serve: the adapter name {taken.pop()!r} is the base model's", file=sys.stderr)
        return 1
    if (taken := _port_taken(args.host, args.port)) is not None:  # before the minutes of loading, not after
        print(f"scute serve: cannot listen on {args.host}:{args.port}: {taken}", file=sys.stderr)
        return 1
    try:
        engine = Engine(args.model, tokenizer=args.tokenizer, **engine_options(args))
        state = make_state(engine, args.model, adapters, args.served_model_name, args.api_key,
                           args.allow_runtime_adapters)
    except (AdapterError, OSError, ValueError) as e:
        print(f"scute serve: {e}", file=sys.stderr)
        return 1
    if engine.tokenizer is None:
        print(f"scute serve: {args.model} has no tokenizer: token-id prompts only (--tokenizer DIR adds one)",
              file=sys.stderr)
    app = build_app(state)
    url = f"http://{args.host}:{args.port}/v1"
    print(f"scute serve: {url} serving {served_line(state.served_model_name, list(adapters))}", flush=True)
    # uvicorn shuts down gracefully on SIGINT or SIGTERM, then raises the signal again under the handler it found:
    # SIGTERM's default would end the process before the engine's shutdown below
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    except KeyboardInterrupt:
        pass
    finally:
        state.engine.shutdown()
        print("scute serve: stopped", file=sys.stderr, flush=True)
    return 0


def _port_taken(host: str, port: int) -> str | None:
    """Why `host`:`port` cannot be listened on now (None: it can): a bind of its first address, as uvicorn's
    would fail on a port in use; the port may still be taken before uvicorn binds it, minutes later."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        return str(e)
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            return e.strerror or str(e)
    return None


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(0)
