"""The `scute` command. `scute demo`: five adapters of five PEFT methods plus the base model, one batch;
`scute serve`: the OpenAI-compatible server; `scute explain`, `scute convert`."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_SCRIPT = os.path.join(REPO_ROOT, "examples", "train_demo_adapters.py")
METHOD_NAMES = {"lora": "LoRA", "dora": "DoRA", "ia3": "IA3", "vera": "VeRA", "oft": "OFT"}


def _demo_module():
    """examples/train_demo_adapters.py (the demo's model and adapters), loaded from the checkout."""
    if not os.path.isfile(TRAIN_SCRIPT):
        sys.exit(f"scute demo needs the repository checkout ({TRAIN_SCRIPT} is missing): "
                 "install Scute with `pip install -e .` from a clone")
    spec = importlib.util.spec_from_file_location("train_demo_adapters", TRAIN_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def demo(args: argparse.Namespace) -> int:
    import torch

    from scute import Engine, SamplingParams

    if args.threads:
        # Decode steps of a 135M model are latency-bound: on a busy 2-core machine a second OpenMP thread
        # that must wait for a core can make every small op ~10x slower.
        torch.set_num_threads(args.threads)
    demo_mod = _demo_module()
    cache = args.cache_dir or demo_mod.default_cache_dir()
    try:
        base = demo_mod.ensure_base(cache)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    paths = demo_mod.train_demo_adapters(cache, force=args.retrain)
    engine = Engine(base, device=args.device, dtype="float32" if args.device in ("cpu", None) else "auto",
                    max_model_len=512)
    tokenizer = engine.tokenizer
    questions = args.question or demo_mod.DEMO_QUESTIONS
    adapters = [None, *paths]  # the base model, then one adapter per method
    prompts, specs, labels = [], [], []
    for question in questions:
        for method in adapters:
            prompts.append(demo_mod.chat_prompt(tokenizer, question))
            specs.append(None if method is None else paths[method])
            labels.append("base model" if method is None
                          else f"{METHOD_NAMES[method]} ({demo_mod.PERSONAS[method][0]})")
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, specs, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for i, (out, label) in enumerate(zip(outputs, labels)):
        if i % len(adapters) == 0:
            print(f"\n=== {questions[i // len(adapters)]}")
        text = out.error or out.outputs[0].text.strip().replace("\n", " ")
        print(f"  [{label:>20s}] {text}")
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\n{len(prompts)} requests, {len(adapters) - 1} adapters of {len(adapters) - 1} PEFT methods plus the base "
          f"model, in one batch on {engine.runner.device}: {generated} tokens in {elapsed:.1f} s = "
          f"{generated / elapsed:.1f} tok/s ({engine.stats['steps']} steps)")
    return 0


def _explain(argv: list[str]) -> int:
    from scute.adapters.explain import explain_main

    return explain_main(argv)


def _convert(argv: list[str]) -> int:
    from scute.compat.convert_cli import convert_main

    return convert_main(argv)


def _serve(argv: list[str]) -> int:
    from scute.serve.server import serve_main

    return serve_main(argv)


# Subcommands with their own argument parsers: `scute explain -h`, `scute convert -h`.
DELEGATED = {
    "explain": (_explain, "per layer: slots filled, merged and live, bytes, FLOPs and predicted cost of an adapter"),
    "serve": (_serve, "an OpenAI-compatible server (vLLM's endpoints and flags) of a model and its adapters"),
    "convert": (_convert, "convert an adapter of any method to a PEFT LoRA checkpoint (truncated SVD) for LoRA-only "
                          "servers, with its error"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in DELEGATED:
        return DELEGATED[argv[0]][0](argv[1:])
    parser = argparse.ArgumentParser(prog="scute", description="Serve many PEFT adapters on one base model.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_text) in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    p = sub.add_parser("demo", help="SmolLM2-135M with a LoRA, DoRA, IA3, VeRA and OFT adapter in one batch")
    p.add_argument("--cache-dir", help="base model and adapter cache (default ~/.cache/scute/demo or $SCUTE_CACHE)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--question", action="append", help="ask this instead of the default questions (repeatable)")
    p.add_argument("--retrain", action="store_true", help="train the demo adapters again")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1; 0 = torch's default)")
    p.set_defaults(run=demo)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
