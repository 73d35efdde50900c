"""Every served method's live cost and memory on one 4096×4096 layer, against LoRA r=16: a table, JSON and a plot.

Each method is a real PEFT adapter (typical hyperparameters, those of `docs/normal_form.md` §5) on a one-layer
model, saved, and read back through `scute.adapters.explain` — the same numbers `scute explain` prints: bytes one
adapter adds (bf16 matrices, float32 vectors), live FLOPs per token, and the byte model's predicted time of the
adapter part of a layer call at B tokens over B distinct adapters (H200, 4.2 TB/s). No timing is measured here.

Run: ``PYTHONPATH=. python bench/plot_methods.py [--out docs/method_costs.png] [--batch 64]``. matplotlib is
optional: without it the table and JSON are still written, and the plot is skipped with a message.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
from peft import (
    AdaLoraConfig,
    BOFTConfig,
    DeloraConfig,
    FourierFTConfig,
    GloraConfig,
    HiraConfig,
    HRAConfig,
    IA3Config,
    LoHaConfig,
    LoKrConfig,
    LoraConfig,
    MissConfig,
    OFTConfig,
    PveraConfig,
    RoadConfig,
    VBLoRAConfig,
    VeraConfig,
    get_peft_model,
)
from torch import nn

from scute.adapters.explain import explain

D = 4096
T = ["q_proj"]
METHODS = {  # label -> (PEFT config, dense opt-in)
    "LoRA r=16": (LoraConfig(r=16, target_modules=T), False),
    "DoRA r=16": (LoraConfig(r=16, use_dora=True, target_modules=T), False),
    "IA3": (IA3Config(target_modules=T, feedforward_modules=[]), False),
    "VeRA r=256": (VeraConfig(r=256, target_modules=T), False),
    "OFT b=32": (OFTConfig(r=0, oft_block_size=32, target_modules=T), False),
    "BOFT b=8": (BOFTConfig(boft_block_size=8, target_modules=T), False),
    "HRA r=8": (HRAConfig(r=8, target_modules=T), False),
    "LoHa r=8": (LoHaConfig(r=8, target_modules=T), False),
    "LoKr r=8": (LoKrConfig(r=8, target_modules=T), False),
    "AdaLoRA r=12": (AdaLoraConfig(init_r=12, target_r=8, total_step=10, target_modules=T), False),
    "RoAd-1": (RoadConfig(variant="road_1", target_modules=T), False),
    "VB-LoRA r=4": (VBLoRAConfig(r=4, num_vectors=256, vector_length=256, target_modules=T), False),
    "FourierFT n=1000": (FourierFTConfig(n_frequency=1000, target_modules=T), False),
    "DeLoRA r=16": (DeloraConfig(r=16, target_modules=T), False),
    "GLoRA vector": (GloraConfig(config_A_B="vector", config_C="none", config_D_E="none", target_modules=T), False),
    "MiSS r=64": (MissConfig(r=64, target_modules=T), False),
    "PVeRA r=256": (PveraConfig(r=256, target_modules=T), False),
    "HiRA (dense)": (HiraConfig(r=32, target_modules=T), True),
    "GLoRA lora (dense)": (GloraConfig(r=4, init_weights=False, target_modules=T), True),  # B=0 at init: no ΔW
}


class OneLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(D, D, bias=False)

    def forward(self, x):
        return self.q_proj(x)


def measure(batch: int) -> dict[str, dict]:
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, (config, dense) in METHODS.items():
            torch.manual_seed(0)
            peft_model = get_peft_model(OneLayer(), config)
            path = os.path.join(tmp, label.replace(" ", "_"))
            peft_model.save_pretrained(path)
            table = explain(path, OneLayer(), batch=batch, dense=dense)
            r = table.rows[0]
            rows[label] = dict(live=r.slots_text, rank=r.rank, bytes=r.adapter_bytes, shared_bytes=table.shared_bytes,
                               flops=r.flops, base_flops=r.base_flops, seconds=r.seconds, base_seconds=r.base_seconds)
    ref = rows["LoRA r=16"]
    for r in rows.values():
        r.update(bytes_vs_lora=r["bytes"] / ref["bytes"], flops_vs_lora=r["flops"] / ref["flops"],
                 seconds_vs_lora=r["seconds"] / ref["seconds"])
    return rows


def plot(rows: dict[str, dict], batch: int, out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    labels = list(rows)[::-1]
    panels = [("bytes_vs_lora", "bytes per adapter"), ("flops_vs_lora", "live FLOPs per token"),
              ("seconds_vs_lora", f"predicted adapter time, B={batch} distinct")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 6.2), sharey=True)
    for ax, (key, title) in zip(axes, panels):
        values = [rows[k][key] for k in labels]
        ax.barh(labels, values, color=["#c44" if v > 1.5 else "#4a4" if v < 0.67 else "#888" for v in values])
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_xscale("log")
        ax.set_title(f"{title}\n(× LoRA r=16)", fontsize=10)
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:.3g}", va="center", fontsize=7)
    fig.suptitle(f"Scute normal form on one {D}×{D} layer (bf16 matrices, fp32 vectors; H200 byte model)", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/method_costs.png")
    ap.add_argument("--json", default="bench/method_costs.json")
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    rows = measure(args.batch)
    print(f"{'method':18} {'live slots':34} {'rank':>5} {'bytes':>12} {'×LoRA':>7} {'FLOPs/tok':>12} {'×LoRA':>7} "
          f"{'µs@B':>8} {'×LoRA':>7}")
    for label, r in rows.items():
        print(f"{label:18} {r['live'][:34]:34} {r['rank']:5} {r['bytes']:12,} {r['bytes_vs_lora']:7.3g} "
              f"{r['flops']:12,} {r['flops_vs_lora']:7.3g} {r['seconds'] * 1e6:8.2f} {r['seconds_vs_lora']:7.3g}")
    with open(args.json, "w") as f:
        json.dump({"layer": [D, D], "batch": args.batch, "dtype": "bf16", "bandwidth": 4.2e12, "methods": rows}, f,
                  indent=1)
    print(f"wrote {args.json}")
    plot(rows, args.batch, args.out)


if __name__ == "__main__":
    main()
