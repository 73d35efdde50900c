"""The decode step against the number of requests, per case, with each row's byte floor: a plot of a
`bench/bench_engine.py` result (graph rows).

Run: ``python3 bench/plot_engine.py [bench/results/engine_h200.json] [--out docs/decode_step.png]`` (needs
matplotlib, which Scute itself does not).
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("result", nargs="?", default="bench/results/engine_h200.json")
    p.add_argument("--out", default="docs/decode_step.png")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.load(open(args.result))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for case, color in (("base", "tab:gray"), ("lora", "tab:blue"), ("mix", "tab:orange")):
        rows = sorted((r for r in result["rows"] if r["case"] == case and r["graphs"]), key=lambda r: r["batch"])
        if not rows:
            continue
        batches = [r["batch"] for r in rows]
        ax.plot(batches, [r["decode_ms"] for r in rows], "o-", color=color, label=f"{case}: decode step")
        ax.plot(batches, [r["floor_ms"] for r in rows], "--", color=color, alpha=0.6, label=f"{case}: byte floor")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests decoding together")
    ax.set_ylabel("ms per decode step")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Scute Engine, Llama-3-8B shape, bf16, {result['device']}\n"
                 f"(lora, mix: 64 distinct adapters; floor at {result['copy_bandwidth'] / 1e12:.2f} TB/s)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
