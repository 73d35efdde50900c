"""`scute convert ADAPTER --to lora --rank R --out DIR`: the command line of `scute.compat.convert`."""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

from scute.compat.convert import BIAS_POLICIES, convert_adapter, save_lora
from scute.model.loader import model_files

def load_base_model(spec: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A transformers causal LM from a local folder or a ``.gguf`` file (`model_files`: local files only)."""
    from transformers import AutoModelForCausalLM

    folder, file = model_files(spec)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=dtype, local_files_only=True).eval()


def _parser():
    import argparse

    p = argparse.ArgumentParser(
        prog="scute convert",
        description="Write any adapter Scute serves (LoRA, DoRA, IA3, VeRA, OFT ...) as a PEFT LoRA checkpoint of "
                    "rank R (truncated SVD of each layer's effective weight change), and print its error against "
                    "the exact adapter and the memory of both.")
    p.add_argument("adapter", help="PEFT adapter folder")
    p.add_argument("--to", default="lora", choices=["lora"], help="target format (only PEFT LoRA)")
    p.add_argument("--rank", type=int, required=True, help="LoRA rank R (every layer; narrower layers are padded)")
    p.add_argument("--out", required=True, help="output folder (adapter_config.json + adapter_model.safetensors)")
    p.add_argument("--model", help="base model: local HF folder or .gguf file (default: the adapter config's "
                                   "base_model_name_or_path, if it is a local path)")
    p.add_argument("--bias", default="keep", choices=BIAS_POLICIES,
                   help="a layer whose bias changes (IA3 on a biased layer): keep = write lora_bias; "
                        "drop = leave it out and count it in the error (for servers without lora_bias)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                   help="dtype of the written tensors")
    p.add_argument("--probe-tokens", type=int, default=256,
                   help="random tokens for the whole-model logits comparison (0 = skip it)")
    p.add_argument("--quiet", action="store_true", help="print the summary only, not every layer")
    return p


def convert_main(argv: list[str] | None = None) -> int:
    """`scute convert ADAPTER --to lora --rank R --out DIR`: returns the exit status."""
    from scute.adapters import AdapterError, load_adapter, read_checkpoint
    from scute.compat.evaluate import LogitsError, SlotModel, probe_ids

    parser = _parser()
    args = parser.parse_args(argv)
    if args.rank < 1:
        parser.error("--rank: at least 1")
    if args.probe_tokens < 0:
        parser.error("--probe-tokens: 0 (no logits comparison) or more")
    if os.path.realpath(args.out) == os.path.realpath(args.adapter):
        parser.error("--out is the adapter's own folder: the conversion would overwrite the original")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"--out {args.out!r} is a file, not a folder")
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
    try:
        spec = args.model or read_checkpoint(args.adapter).config.get("base_model_name_or_path") or ""
        if not spec:
            raise ValueError("the adapter's config names no base model (base_model_name_or_path): pass --model")
        model = load_base_model(spec)
        adapter = load_adapter(args.adapter, model)
        conv = convert_adapter(adapter, model, args.rank, args.bias)
        save_lora(conv, model, args.out, dtype, base_model_name_or_path=spec)
    except (AdapterError, FileNotFoundError, ValueError) as e:
        print(f"scute convert: {e}", file=sys.stderr)
        return 2
    esize = torch.empty(0, dtype=dtype).element_size()
    if not args.quiet:
        print(f"{'layer':<44} {'in':>6} {'out':>6} {'rank ΔW':>7} {'how':>7} {'rel err':>9} "
              f"{'exact KiB':>10} {'LoRA KiB':>9}")
        for name, l in conv.layers.items():
            lora_kib = esize * (l.A.numel() + l.B.numel()) / 1024
            print(f"{name:<44} {l.in_features:>6} {l.out_features:>6} {l.delta_rank:>7} {l.method:>7} "
                  f"{l.rel_error:>9.2e} {esize * l.exact_elems / 1024:>10.1f} {lora_kib:>9.1f}")
    print(f"{conv.peft_type} -> LoRA r={args.rank}: {len(conv.layers)} layers, "
          f"{sum(l.exact for l in conv.layers.values())} exact")
    print(f"weight error (whole model)  sqrt(Σ‖ΔW−BA‖²)/sqrt(Σ‖ΔW‖²) = {conv.rel_error:.3e}")
    if args.probe_tokens > 0:
        lora = load_adapter(args.out, model)
        runner = SlotModel(model, max_adapters=2)
        runner.place(0, adapter)
        runner.place(1, lora)
        ids = probe_ids(model.config.vocab_size, args.probe_tokens)
        base, exact, approx = runner.logits(ids, -1), runner.logits(ids, 0), runner.logits(ids, 1)
        e = LogitsError.of(approx, exact, base)
        print(f"logits error ({ids.numel()} random tokens): {e.effect_error:.3e} of the adapter's effect, "
              f"max |Δ| {e.max_abs:.3e}, top-1 agreement {100 * e.top1_agreement:.2f}%, KL {e.kl:.3e} nats")
    print(f"memory per adapter ({args.dtype}): exact {conv.exact_bytes(esize) / 2**20:.3f} MiB, "
          f"LoRA r={args.rank} {conv.lora_bytes(esize) / 2**20:.3f} MiB")
    for note in conv.notes:
        print(f"note: {note}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":  # python -m scute.compat.convert_cli ADAPTER --to lora --rank R --out DIR
    raise SystemExit(convert_main())
