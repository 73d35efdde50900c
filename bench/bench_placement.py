"""What placing one adapter costs a slot pool on the host: `SlotPool.update_slot` (the changed slot's rows) against
`SlotPool.update` (the whole table), for a q/k/v pool of the Llama-3-8B shape holding `--slots` adapters of a
method (LoRA r16, or VeRA r256 sharing one pair of matrices), in bf16. A placement updates 4 such pools a layer
(q/k/v, o, gate/up, down), 128 on the 8B shape. Median of `--repeats` placements into distinct slots.

Run: ``PYTHONPATH=. python3 bench/bench_placement.py [--device cuda] [--out placement.json]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from scute.ops.pool import SlotPool
from scute.ops.slots import Slots

OUTS = (4096, 1024, 1024)


def adapter(method: str, p: int, hidden: int, pair: list, gen: torch.Generator) -> Slots:
    out = OUTS[p] * hidden // 4096
    if method == "vera":
        a, b = pair[p]
        return Slots(hidden, out, A=a, B=b, m=torch.randn(a.shape[0], generator=gen), v=torch.randn(out, generator=gen),
                     shared=frozenset({"A", "B"}))
    return Slots(hidden, out, A=(torch.randn(16, hidden, generator=gen) * 0.01).bfloat16(),
                 B=(torch.randn(out, 16, generator=gen) * 0.01).bfloat16())


def measure(method: str, num_slots: int, hidden: int, device: str, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    pair = [((torch.randn(256, hidden, generator=gen) * 0.01).bfloat16(),
             (torch.randn(o * hidden // 4096, 256, generator=gen) * 0.01).bfloat16()) for o in OUTS]
    slots = [[adapter(method, p, hidden, pair, gen) for _ in range(num_slots)] for p in range(3)]
    pool = SlotPool(hidden, [o * hidden // 4096 for o in OUTS], num_slots, device, torch.bfloat16)
    pool.update(slots)

    def timed(fn) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    full, one = [], []
    for i in range(repeats):
        s = 1 + i % (num_slots - 1)
        for p in range(3):
            slots[p][s] = adapter(method, p, hidden, pair, gen)
        one.append(timed(lambda: pool.update_slot(slots, s)))
        full.append(timed(lambda: pool.update(slots)))
    return dict(method=method, slots=num_slots, update_slot_ms=1e3 * statistics.median(one),
                update_ms=1e3 * statistics.median(full))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--slots", default="64,256,1024")
    ap.add_argument("--methods", default="lora,vera")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [measure(m, int(n), args.hidden, args.device, args.repeats)
            for m in args.methods.split(",") for n in args.slots.split(",")]
    print(f"{'method':6s} {'slots':>6s} {'update_slot ms':>15s} {'update ms':>10s}")
    for r in rows:
        print(f"{r['method']:6s} {r['slots']:6d} {r['update_slot_ms']:15.2f} {r['update_ms']:10.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(command="PYTHONPATH=. python3 " + " ".join(sys.argv), device=args.device,
                           torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
