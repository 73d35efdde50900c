"""Public call signatures of vLLM's offline API as plain data, to check `scute.compat.vllm` against.

A record lists each parameter's name, kind and default (``repr``; absent when required). Type annotations are
left out: they name vLLM's own classes. Parameters whose names start with ``_`` are private to vLLM and left out.
Stdlib only, so the snapshot script runs in vLLM's own venv: ``bench/ab/snapshot_vllm_signatures.py``.
"""

from __future__ import annotations

import dataclasses
import inspect

# What the shim mirrors: name in the snapshot -> how to reach it from the classes by name (`api_records`).
API = {
    "LLM.__init__": ("LLM", "__init__"),
    "LLM.generate": ("LLM", "generate"),
    "SamplingParams": ("SamplingParams", None),
    "LoRARequest": ("LoRARequest", None),
    "RequestOutput.__init__": ("RequestOutput", "__init__"),
    "CompletionOutput": ("CompletionOutput", None),
    "LLM.chat": ("LLM", "chat"),
    "LLMEngine.from_engine_args": ("LLMEngine", "from_engine_args"),
    "LLMEngine.add_request": ("LLMEngine", "add_request"),
    "LLMEngine.step": ("LLMEngine", "step"),
    "LLMEngine.abort_request": ("LLMEngine", "abort_request"),
    "LLMEngine.has_unfinished_requests": ("LLMEngine", "has_unfinished_requests"),
    "LLMEngine.get_num_unfinished_requests": ("LLMEngine", "get_num_unfinished_requests"),
    "LLMEngine.get_tokenizer": ("LLMEngine", "get_tokenizer"),
}
# `EngineArgs` is compared field by field: `engine_arg_defaults`.


def signature_record(obj) -> list[dict]:
    """[{name, kind, default?}] for the public parameters of `obj` (``self`` dropped)."""
    record = []
    for p in inspect.signature(obj).parameters.values():
        if p.name == "self" or (p.name.startswith("_") and p.kind is not p.VAR_KEYWORD):
            continue
        entry = {"name": p.name, "kind": p.kind.name}
        if p.default is not p.empty:
            entry["default"] = repr(p.default)
        record.append(entry)
    return record


def api_records(classes: dict[str, type]) -> dict[str, list[dict]]:
    """Signature records of the mirrored API, given the classes by name (vLLM's or the shim's)."""
    out = {}
    for key, (cls, attr) in API.items():
        obj = classes[cls] if attr is None else getattr(classes[cls], attr)
        out[key] = signature_record(obj)
    return out


def engine_arg_defaults(engine_args_cls) -> dict[str, str | None]:
    """vLLM's `EngineArgs` fields (what `LLM(**kwargs)` accepts) -> repr of the default (None: a factory)."""
    out = {}
    for f in dataclasses.fields(engine_args_cls):
        if f.name.startswith("_"):
            continue
        out[f.name] = None if f.default is dataclasses.MISSING else repr(f.default)
    return out
