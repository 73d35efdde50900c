"""vLLM's offline API on Scute: ``from scute.compat.vllm import LLM, SamplingParams, LoRARequest`` (and
`EngineArgs`, `LLMEngine`, `RequestOutput`, `CompletionOutput`, ...).

These have the signatures and field names of vLLM 0.32 (checked against vLLM itself, or its snapshot in
``tests/data/vllm_signatures.json``), so a vLLM script runs with its import changed, or unchanged through
``python -m scute.compat.vllm SCRIPT``. Differences:

* A `LoRARequest` may point at any adapter Scute serves (LoRA, DoRA, IA3, VeRA, OFT, ...), not only LoRA.
* An option Scute does not implement raises `UnsupportedOptionError` (a ValueError) naming it, unless it has
  vLLM's default value; nothing is silently ignored. `SUPPORTED_LLM_OPTIONS` lists what is honoured.
* In `LLM(...)`, `max_loras`, `max_lora_rank`, `max_cpu_loras` default to Scute's limits (8 adapters per
  step, rank 256, 64 on CPU) rather than vLLM's (1, 16, max_loras) when not given; `EngineArgs` keeps vLLM's.
  They never change outputs, only capacity.
* ``sampling_params=None`` means ``SamplingParams()``; vLLM would also fold in the model's generation config.
* A request that fails (a bad adapter, a prompt longer than max_model_len) raises from `generate` and `chat`,
  as in vLLM, and from `LLMEngine.add_request`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import scute
from scute.compat.vllm_args import ACCEPTED, ENGINE_OPTIONS, EngineArgs, engine_options, make_engine
from scute.compat.vllm_engine import LLMEngine, UsageContext
from scute.compat.vllm_types import (CompletionOutput, Logprob, LoRARequest, RequestOutput, RequestOutputKind,
                                     SamplingParams, UnsupportedOptionError, adapter_request, check_defaults,
                                     in_vocabulary, prompt_list, to_vllm_output, unsupported)
from scute.engine.request import AdapterRequest
from scute.engine.utils import per_prompt

# LLM(...) parameters honoured besides its **kwargs (vLLM's EngineArgs, see `scute.compat.vllm_args`).
_LLM_HANDLED = ("model", "tokenizer", "dtype", "seed", "gpu_memory_utilization", "enforce_eager",
                "kv_cache_memory_bytes", "runner", "convert", "tokenizer_mode", "chat_template",
                "tensor_parallel_size")
SUPPORTED_LLM_OPTIONS = tuple(dict.fromkeys((*_LLM_HANDLED, *ENGINE_OPTIONS, *ACCEPTED)))


# ---------------------------------------------------------------------------------------------- the LLM
class LLM:
    """vLLM's offline `LLM` on `scute.Engine` (reachable as `.engine`). `model`: a local Hugging Face folder
    or a ``.gguf`` file (Scute never downloads). See the module docstring for what differs from vLLM."""

    def __init__(self, model: str, *, runner: str = "auto", convert: str = "auto", tokenizer: str | None = None,
                 tokenizer_mode: str = "auto", skip_tokenizer_init: bool = False, trust_remote_code: bool = False,
                 allowed_local_media_path: str = "", allowed_media_domains: list[str] | None = None,
                 tensor_parallel_size: int = 1, dtype: str = "auto", quantization: str | None = None,
                 revision: str | None = None, tokenizer_revision: str | None = None,
                 chat_template: str | None = None, seed: int = 0, gpu_memory_utilization: float = 0.92,
                 cpu_offload_gb: float = 0, offload_group_size: int = 0, offload_num_in_group: int = 1,
                 offload_prefetch_step: int = 1, offload_params: set[str] | None = None,
                 enforce_eager: bool = False, enable_return_routed_experts: bool = False,
                 return_sampling_mask: bool = False, disable_custom_all_reduce: bool = False,
                 hf_token: bool | str | None = None, hf_overrides: Any = None,
                 mm_processor_kwargs: dict[str, Any] | None = None, pooler_config: Any = None,
                 structured_outputs_config: Any = None, profiler_config: Any = None, attention_config: Any = None,
                 kv_cache_memory_bytes: int | None = None, compilation_config: Any = None,
                 quantization_config: Any = None, logits_processors: list | None = None,
                 spec_method: str | None = None, spec_model: str | None = None, spec_tokens: int | None = None,
                 **kwargs: Any) -> None:
        values = dict(locals())
        for name in ("self", "kwargs", "__class__"):
            values.pop(name, None)
        check_defaults(LLM.__init__, values, set(_LLM_HANDLED), "LLM")
        given = {name: values[name] for name in _LLM_HANDLED if name not in ("model", "tokenizer", "chat_template")}
        options = engine_options({**given, **kwargs}, "LLM")
        self.enable_lora = bool(kwargs.get("enable_lora", False))
        self.chat_template = chat_template  # the default of `chat`'s chat_template
        self.engine = make_engine(model, tokenizer, options)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest] | None = None,
                 priority: int | Sequence[int] | None = None, tokenization_kwargs: dict[str, Any] | None = None,
                 mm_processor_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.generate`: prompts (str, token ids, {"prompt": ...} or {"prompt_token_ids": ...}, or a
        list of them), one SamplingParams or one per prompt, one LoRARequest (any adapter) or one per prompt."""
        for name, value in (("tokenization_kwargs", tokenization_kwargs), ("mm_processor_kwargs", mm_processor_kwargs)):
            if value is not None:
                raise unsupported("LLM.generate", name, value)
        if not isinstance(use_tqdm, bool):
            raise unsupported("LLM.generate", "use_tqdm", use_tqdm, "give True or False")
        items = prompt_list(prompts, "LLM.generate")
        if priority is not None and any(p != 0 for p in ([priority] if isinstance(priority, int) else priority)):
            raise unsupported("LLM.generate", "priority", priority, "Scute schedules first come, first served")
        params = _per_prompt(sampling_params, len(items), (SamplingParams, scute.SamplingParams), "sampling_params")
        loras = _per_prompt(lora_request, len(items), LoRARequest, "lora_request")
        if any(lora is not None for lora in loras) and not self.enable_lora:
            raise ValueError(f"Got lora_request {next(l for l in loras if l)} but LoRA is not enabled! "
                             "Pass enable_lora=True to LLM")
        adapters = [self._adapter(lora) for lora in loras]
        sps = [in_vocabulary(p if isinstance(p, scute.SamplingParams) else (p or SamplingParams()).to_scute(),
                             self.engine.vocab_size) for p in params]
        outs = self.engine.generate(items, sps, adapters, use_tqdm=use_tqdm)
        if failed := [o for o in outs if o.error is not None]:
            raise ValueError(f"{len(failed)} of {len(outs)} requests failed; the first: {failed[0].error}")
        return [to_vllm_output(o, lora, sp.logprobs, self.engine.tokenizer, prompt_k=sp.prompt_logprobs)
                for o, lora, sp in zip(outs, loras, sps)]

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request: LoRARequest | None = None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, tokenization_kwargs: dict[str, Any] | None = None,
             mm_processor_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: `messages` is one conversation (a list of {"role", "content"} dicts) or a list of
        them; each is rendered with the tokenizer's chat template (or `chat_template`), its text tokenized
        without special tokens (the template writes them) and generated as `generate` does. Text content
        only: a content list of {"type": "text"} parts is joined with newlines."""
        values = dict(locals())
        del values["self"]
        check_defaults(LLM.chat, values, {"messages", "sampling_params", "use_tqdm", "lora_request", "chat_template",
                                          "chat_template_content_format", "add_generation_prompt",
                                          "continue_final_message", "tools", "chat_template_kwargs"}, "LLM.chat")
        if chat_template_content_format not in ("auto", "string"):
            raise unsupported("LLM.chat", "chat_template_content_format", chat_template_content_format,
                              "text content only: use 'auto' or 'string'")
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be True")
        tok = self.get_tokenizer()
        template = chat_template if chat_template is not None else self.chat_template
        if tok is None or (template is None and getattr(tok, "chat_template", None) is None):
            raise ValueError("LLM.chat needs a chat template: the model's tokenizer has none; pass chat_template= "
                             "(a Jinja template) to LLM or to chat")
        batched = isinstance(messages, (list, tuple)) and len(messages) > 0 and isinstance(messages[0], (list, tuple))
        texts = [tok.apply_chat_template([_text_message(m) for m in conversation], tools=tools, chat_template=template,
                                         add_generation_prompt=add_generation_prompt, tokenize=False,
                                         continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
                 for conversation in (messages if batched else [messages])]
        prompts = [{"prompt_token_ids": tok(text, add_special_tokens=False)["input_ids"]} for text in texts]
        outs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        for out, text in zip(outs, texts):
            out.prompt = text
        return outs

    def _adapter(self, lora: LoRARequest | None) -> AdapterRequest | None:
        return adapter_request(self.engine, lora)


def _text_message(message: dict) -> dict:
    """A chat message with its content as one string."""
    content = message.get("content")
    if isinstance(content, list):
        if any(not isinstance(part, dict) or part.get("type") != "text" for part in content):
            raise unsupported("LLM.chat", "messages", content, "text content only")
        message = {**message, "content": "\n".join(part["text"] for part in content)}
    return message


def _per_prompt(value, n: int, single: type, what: str) -> list:
    """`scute.engine.utils.per_prompt` with vLLM's message for a count that does not match."""
    values = value if value is None or isinstance(value, single) else list(value)
    try:
        return per_prompt(values, n, what, single)
    except ValueError:
        raise ValueError(f"The lengths of prompts and {what} must be the same: {n} prompts, {len(values)} {what}") \
            from None


# ---------------------------------------------------------------------------------------------- unchanged scripts
_MODULES = ("vllm", "vllm.lora", "vllm.lora.request", "vllm.outputs", "vllm.sampling_params", "vllm.logprobs",
            "vllm.engine", "vllm.engine.arg_utils", "vllm.engine.llm_engine")


def install_as_vllm() -> None:
    """Make ``import vllm`` (and ``vllm.lora.request``, ``vllm.outputs``, ``vllm.sampling_params``,
    ``vllm.logprobs``, ``vllm.engine.arg_utils``, ``vllm.engine.llm_engine``) resolve to this module, so that a vLLM script runs on Scute unchanged. Refuses if the
    real vLLM is already imported."""
    import sys

    this = sys.modules[__name__]
    for name in _MODULES:
        if sys.modules.get(name, this) is not this:
            raise RuntimeError(f"the real {name} is already imported: install Scute's shim before importing vLLM")
    for name in _MODULES:
        sys.modules[name] = this


def uninstall_as_vllm() -> None:
    import sys

    this = sys.modules[__name__]
    for name in _MODULES:
        if sys.modules.get(name) is this:
            del sys.modules[name]


def main(argv: list[str] | None = None) -> int:
    """``python -m scute.compat.vllm SCRIPT [ARGS...]``: run a vLLM offline script on Scute, unchanged."""
    import runpy
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m scute.compat.vllm SCRIPT [ARGS...]  (runs a vLLM script on Scute, unchanged)")
        return 0 if argv else 2
    install_as_vllm()
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")
    return 0


__all__ = ["LLM", "CompletionOutput", "EngineArgs", "LLMEngine", "LoRARequest", "Logprob", "RequestOutput",
           "RequestOutputKind", "SamplingParams", "UnsupportedOptionError", "UsageContext", "install_as_vllm",
           "uninstall_as_vllm"]

if __name__ == "__main__":  # run as a script: install the importable module, not this __main__ copy
    from scute.compat.vllm import main as _main

    raise SystemExit(_main())
