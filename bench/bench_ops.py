"""Benchmark of the six-slot op on the seven projections of one Llama-3-8B layer (bf16, random weights).

For B tokens and n distinct adapters (token i uses adapter i mod n), each timed as one CUDA graph of the whole
layer's seven projections (launch gaps dominate at small batch; graphs shrink them):
    base          the seven cuBLAS GEMMs alone
    lora ... oft  base + that method on all seven projections through Scute (LoRA/DoRA r=16, IA3 with down_proj
                  feed-forward, VeRA r=256 sharing one projection pair, OFT blocks of 32)
    mix           base + an equal mix of the five methods (adapter i has method i mod 5; ``--mix-methods``
                  picks a subset, to see what each method adds to the mix)
    *_grouped     the same with q/k/v and gate/up served by one launch each (pools of 3 and 2 projections)
    naive         base + LoRA r=16 by a PyTorch gathered bmm (A[ts], B[ts]), the baseline
The byte model (`scute.ops.cost`) predicts each row from the bytes it must move at the measured copy bandwidth,
alone and plus one measured launch latency per kernel. No fitted parameters.

Run: ``PYTHONPATH=. python bench/bench_ops.py --out results.json`` (``--sweep`` compares tile configs first;
``--repredict results.json`` re-scores a saved run with the current byte model, on the CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _device import copy_bandwidth  # noqa: E402

from scute.ops import LaunchResources, SlotPool, build_lora_meta, launch, scute_linears_triton
from scute.ops.cost import CallBytes, layer_call_bytes, lora_floor_bytes
from scute.ops.testing import random_slots, vera_pair

PROJ = {"q": (4096, 4096), "k": (4096, 1024), "v": (4096, 1024), "o": (4096, 4096),
        "gate": (4096, 14336), "up": (4096, 14336), "down": (14336, 4096)}
INPUT = {"q": "attn", "k": "attn", "v": "attn", "o": "o", "gate": "mlp", "up": "mlp", "down": "down"}
SINGLE = [(p,) for p in PROJ]
GROUPED = [("q", "k", "v"), ("o",), ("gate", "up"), ("down",)]
FIVE = ("lora", "dora", "ia3", "vera", "oft")
MAX_ADAPTERS, DT, ELEM = 64, torch.bfloat16, 2
DEVICE = "cuda"


# ---------------------------------------------------------------------------------------------- timing
def time_graph(fn, iters: int = 20, reps: int = 7) -> float:
    """Median µs of one replay of a CUDA graph of `fn` (warmed up and compiled outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(), fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    del graph
    return statistics.median(times)


def measure_bandwidth() -> float:
    """The copy bandwidth every floor uses (`bench/_device.py`: a 2 GiB device-to-device copy, read + write
    counted, median of 20 back to back after a second of warm-up). About 4.27 TB/s on the H200; replays of a 1 GiB copy in a
    CUDA graph read 2.76 TB/s side by side, which is why the graph is not used here."""
    return copy_bandwidth(DEVICE)


def measure_launch_latency() -> float:
    """Seconds per kernel node of a graph of tiny Triton kernels (one program, one store each)."""
    import triton
    import triton.language as tl

    @triton.jit
    def tiny(ptr):
        tl.store(ptr, 1.0)

    buf = torch.empty(1, device=DEVICE)
    us = time_graph(lambda: [tiny[(1,)](buf) for _ in range(100)])
    return us * 1e-6 / 100


# ---------------------------------------------------------------------------------------------- layer
class Layer:
    """One Llama-3-8B layer's seven projection weights and, per method, 64 random adapters."""

    def __init__(self, seed: int = 0, mix: tuple[str, ...] = FIVE) -> None:
        gen = torch.Generator(DEVICE).manual_seed(seed)  # drawn on the GPU: 250 M random numbers
        self.gen = gen
        self.w = {p: (torch.randn(o, i, generator=gen, device=DEVICE) / i ** 0.5).to(DEVICE, DT) for p, (i, o) in PROJ.items()}
        self.pair = vera_pair(256, 14336, 14336, dtype=DT, device=DEVICE, generator=gen)
        self.adapters = {m: [self._adapter(m) for _ in range(MAX_ADAPTERS)] for m in FIVE}
        self.mix = mix

    def _adapter(self, method: str) -> dict:
        kw = dict(dtype=DT, device=DEVICE, generator=self.gen, rank=16, vera_pair=self.pair, block=32)
        return {p: random_slots(method, i, o, feedforward=(p == "down"), **kw) for p, (i, o) in PROJ.items()}

    def slots(self, variant: str, n: int) -> list[dict]:
        """Adapter i of the variant for i < n ('mix': method i mod len(self.mix) of self.mix)."""
        methods = [self.mix[i % len(self.mix)] if variant == "mix" else variant for i in range(n)]
        return [self.adapters[m][i] for i, m in enumerate(methods)]

    def inputs(self, batch: int) -> dict:
        return {k: torch.randn(batch, 14336 if k == "down" else 4096, device=DEVICE, dtype=DT)
                for k in ("attn", "o", "mlp", "down")}


def build_pools(layer: Layer, variant: str, n: int, grouping) -> dict:
    adapters = layer.slots(variant, n)
    pools = {}
    for names in grouping:
        in_f = PROJ[names[0]][0]
        pool = SlotPool(in_f, [PROJ[p][1] for p in names], MAX_ADAPTERS, DEVICE, DT)
        pool.update([[a[p] for a in adapters] + [None] * (MAX_ADAPTERS - n) for p in names])
        pools[names] = pool
    return pools


def scute_fn(layer: Layer, pools: dict, xs: dict, ts: torch.Tensor, cfg: dict):
    metas = {}
    for pool in pools.values():  # built once per step in the engine: outside the timed layer
        metas.setdefault(pool.group_key, build_lora_meta(ts, pool.slot_group))
    active = frozenset(ts.tolist())  # the step's slots, which the engine knows on the host
    resources = LaunchResources()  # what one model's layer calls share (side streams, counters)

    def fn():
        for names, pool in pools.items():
            scute_linears_triton(xs[INPUT[names[0]]], [layer.w[p] for p in names], [None] * len(names), pool,
                                 metas[pool.group_key], resources, half_n=cfg["half_n"], block_k=cfg["block_k"],
                                 tile_half_n=cfg["tile_half_n"], active_slots=active)
    return fn


def base_fn(layer: Layer, xs: dict):
    return lambda: [F.linear(xs[INPUT[p]], layer.w[p]) for p in PROJ]


def naive_fn(layer: Layer, n: int, xs: dict, ts: torch.Tensor):
    """LoRA r=16 by gathering each token's A and B (what a plain PyTorch server does)."""
    lora = layer.slots("lora", n)
    a = {p: torch.stack([ad[p].A for ad in lora]) for p in PROJ}
    b = {p: torch.stack([ad[p].B for ad in lora]) for p in PROJ}
    idx = ts.long()

    def fn():
        for p in PROJ:
            x = xs[INPUT[p]]
            z = F.linear(x, layer.w[p])
            h = torch.bmm(a[p][idx], x[:, :, None])
            z += torch.bmm(b[p][idx], h).squeeze(-1)
    return fn


# ---------------------------------------------------------------------------------------------- byte model
def predicted_bytes(layer: Layer, variant: str, n: int, batch: int, grouping) -> CallBytes:
    tok = [i % n for i in range(batch)]
    total = CallBytes()
    if variant == "base":
        for p, (i, o) in PROJ.items():
            total += CallBytes(weights=o * i * ELEM, activations=batch * (i + o) * ELEM, launches=1)
        return total
    if variant == "naive":
        return naive_bytes(n, batch)
    adapters = layer.slots(variant, n)
    for names in grouping:
        slots = [[a[p] for a in adapters] for p in names]
        total += layer_call_bytes(slots, PROJ[names[0]][0], [PROJ[p][1] for p in names], tok, ELEM)
    return total


def naive_bytes(n: int, batch: int, r: int = 16) -> CallBytes:
    """The gathered bmm moves, per projection: each token's A and B gathered (read + write) and read again by
    bmm, plus the base call and the delta's read-modify-write; 5 kernels (linear, 2 gathers, 2 bmm) + add."""
    total = CallBytes()
    for i, o in PROJ.values():
        gathered = batch * r * (i + o) * ELEM
        total += CallBytes(weights=o * i * ELEM, adapters=min(n, batch) * r * (i + o) * ELEM,
                           activations=batch * (i + o) * ELEM + 2 * gathered + 4 * batch * o * ELEM, launches=6)
    return total


# ---------------------------------------------------------------------------------------------- runs
def run_rows(layer: Layer, batches, counts, variants, cfg: dict, bw: float, lat: float) -> list[dict]:
    rows = []
    pools_cache: dict = {}
    for batch in batches:
        xs = layer.inputs(batch)
        for n in counts:
            ts = torch.arange(batch, device=DEVICE) % n
            base_us = None
            for variant in variants:
                method, grouped = variant.removesuffix("_grouped"), variant.endswith("_grouped")
                grouping = GROUPED if grouped else SINGLE
                try:
                    if method == "base":
                        fn = base_fn(layer, xs)
                    elif method == "naive":
                        fn = naive_fn(layer, n, xs, ts)
                    else:
                        key = (method, n, grouped)
                        if key not in pools_cache:
                            pools_cache[key] = build_pools(layer, method, n, grouping)
                        fn = scute_fn(layer, pools_cache[key], xs, ts, cfg)
                    us = time_graph(fn)
                except Exception as e:  # record and go on: one broken variant must not hide the rest
                    rows.append(dict(batch=batch, adapters=n, variant=variant, error=repr(e)[:300]))
                    print(f"B={batch} n={n} {variant}: ERROR {e!r}"[:300], flush=True)
                    continue
                base_us = us if method == "base" else base_us
                row = dict(batch=batch, adapters=n, variant=variant, us=us,
                           delta_us=None if base_us is None or method == "base" else us - base_us)
                predict(layer, row, bw, lat)
                rows.append(row)
                print(fmt_row(row), flush=True)
    return rows


def predict(layer: Layer, row: dict, bw: float, lat: float) -> None:
    """Add the byte model's prediction of a measured row (bytes, launches, µs) and, for the LoRA and naive rows,
    the LoRA floor (each active adapter's A and B read once) at `bw`."""
    method, grouped = row["variant"].removesuffix("_grouped"), row["variant"].endswith("_grouped")
    pred = predicted_bytes(layer, method, row["adapters"], row["batch"], GROUPED if grouped else SINGLE)
    row.update(bytes=pred.total, adapter_bytes=pred.adapters, launches=pred.launches,
               pred_bytes_us=pred.seconds(bw) * 1e6, pred_us=pred.seconds(bw, lat) * 1e6)
    if method in ("lora", "naive"):
        active = min(row["adapters"], row["batch"])
        row["lora_floor_us"] = sum(lora_floor_bytes(16, i, o, active) for i, o in PROJ.values()) / bw * 1e6


def repredict(path: str) -> None:
    """Re-score a saved run with the current byte model at the file's own `bandwidth` and `launch_latency`
    (predictions, LoRA floors and bars), on the CPU: the model needs the adapters' shapes, not a GPU."""
    global DEVICE
    DEVICE = "cpu"
    with open(path) as f:
        result = json.load(f)
    layer = Layer(mix=tuple(result.get("mix_methods", FIVE)))
    for row in result["rows"] + result.get("sweep", []):
        if "error" not in row:
            predict(layer, row, result["bandwidth"], result["launch_latency"])
    result["bars"] = bars(result["rows"])
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    for r in result["rows"]:
        print(fmt_row(r))
    print(json.dumps({k: v for k, v in result["bars"].items() if k != "mix_vs_lora"}, indent=1))


def fmt_row(r: dict) -> str:
    if "error" in r:
        return f"{r['batch']:>4} {r['adapters']:>3} {r['variant']:<14} ERROR"
    delta = "" if r["delta_us"] is None else f"{r['delta_us']:8.1f}"
    floor = f"{r['lora_floor_us']:7.1f}" if "lora_floor_us" in r else ""
    return (f"{r['batch']:>4} {r['adapters']:>3} {r['variant']:<14} {r['us']:8.1f} {delta:>8} "
            f"{r['pred_bytes_us']:8.1f} {r['pred_us']:8.1f} {r['us'] / r['pred_us']:6.2f} {floor:>7}")


HEADER = (f"{'B':>4} {'n':>3} {'variant':<14} {'us':>8} {'delta':>8} {'pred_b':>8} {'pred':>8} "
          f"{'m/pred':>6} {'floor':>7}")


def bars(rows: list[dict]) -> dict:
    """The op's bars, from the measured rows: at 64 tokens of 64 adapters the LoRA delta within 1.3x its floor
    and 5x faster than the naive baseline; the mix within 1.05x of the LoRA layer with as many adapters (total
    time); the byte model within 25 % of each row."""
    def get(b, n, v, key="us"):
        for r in rows:
            if (r["batch"], r["adapters"], r["variant"]) == (b, n, v) and "error" not in r:
                return r[key]
        return None

    out = {}
    for suffix in ("", "_grouped"):
        d, floor = get(64, 64, "lora" + suffix, "delta_us"), get(64, 64, "lora" + suffix, "lora_floor_us")
        naive_d = get(64, 64, "naive", "delta_us")
        if d and floor and naive_d:
            out["lora" + suffix] = dict(delta_us=d, floor_us=floor, delta_over_floor=d / floor,
                                        naive_delta_us=naive_d, speedup_vs_naive=naive_d / d,
                                        floor_bar_met=d / floor <= 1.3, naive_bar_met=naive_d / d >= 5)
    mix = []
    for r in rows:
        if r["variant"].startswith("mix") and "error" not in r:
            lora = get(r["batch"], r["adapters"], r["variant"].replace("mix", "lora"))
            lora_d = get(r["batch"], r["adapters"], r["variant"].replace("mix", "lora"), "delta_us")
            if lora:
                mix.append(dict(batch=r["batch"], adapters=r["adapters"], variant=r["variant"],
                                total_ratio=r["us"] / lora, delta_ratio=r["delta_us"] / lora_d if lora_d else None))
    out["mix_vs_lora"] = mix
    out["mix_total_bar_met_all_rows"] = all(m["total_ratio"] <= 1.05 for m in mix)
    ok = [r for r in rows if "error" not in r]
    out["byte_model_rows_within_25pct"] = sum(abs(r["us"] / r["pred_us"] - 1) <= 0.25 for r in ok)
    out["byte_model_rows_within_25pct_bytes_only"] = sum(abs(r["us"] / r["pred_bytes_us"] - 1) <= 0.25 for r in ok)
    out["rows"] = len(ok)
    return out


_C = launch.LaunchConfig()
DEFAULT = dict(half_n=_C.half_n, tile_half_n=_C.tile_half_n, block_k=_C.block_k,
               target_programs=_C.target_programs, target_expand=_C.target_expand_programs,
               warps=_C.expand_warps, tile_items=_C.tile_items_per_program,
               tile_programs=_C.tile_programs_per_sm, tile_warps=_C.tile_warps,
               stages=(_C.shrink_stages, _C.expand_stages, _C.tile_stages),
               epilogue_half_n=_C.epilogue_half_n, epilogue_warps=_C.epilogue_warps)
# Other launch constants were swept against these defaults and lost (bench/results/sweep_*_h200.json): the
# one-token delta's half_n 128 at 2 warps; the shrink's rank tile capped at 16 or 32 and target_programs 2048; the
# multi-token delta's chunks at tile_half_n 64 and its rank loop pipelined (stages 2, 3); the epilogue at 2·128
# columns and 1 warp. This sweep: the multi-token delta's persistent programs per SM and items per program.
SWEEP = [dict(DEFAULT, tile_programs=3),
         dict(DEFAULT, tile_programs=4),
         dict(DEFAULT, tile_items=2),
         dict(DEFAULT, tile_items=8)]  # (software pipelining of the one-token delta's rank loop: num_stages 2
# or 3 compile to the same sm_90 code as 1, so its stages are not swept)


def apply(cfg: dict) -> None:
    """Make `cfg` the launch configuration the passes read (`scute.ops.launch.CONFIG`)."""
    launch.CONFIG = dataclasses.replace(
        launch.LaunchConfig(), half_n=cfg["half_n"], block_k=cfg["block_k"], target_programs=cfg["target_programs"],
        target_expand_programs=cfg["target_expand"], expand_warps=cfg["warps"], tile_half_n=cfg["tile_half_n"],
        shrink_stages=cfg["stages"][0], expand_stages=cfg["stages"][1], tile_stages=cfg["stages"][2],
        tile_items_per_program=cfg["tile_items"], tile_programs_per_sm=cfg["tile_programs"],
        tile_warps=cfg["tile_warps"], epilogue_half_n=cfg["epilogue_half_n"], epilogue_warps=cfg["epilogue_warps"])


def sweep(layer: Layer, bw: float, lat: float, default: dict) -> tuple[list[dict], dict]:
    """Time a few rows per config; the best has the least geometric mean, over the rows, of its time over the
    first config's (each row counts alike: a sum of times would be decided by the largest rows)."""
    rows, score, first = [], {}, {}
    for i, cfg in enumerate([default] + SWEEP):
        apply(cfg)
        print(f"--- sweep {cfg}", flush=True)
        for batch, n in [(1, 64), (64, 64), (64, 16), (256, 64)]:
            for r in run_rows(layer, [batch], [n], ["base", "lora_grouped", "mix_grouped", "vera"], cfg, bw, lat):
                rows.append(dict(r, **cfg))
                if "error" not in r and r["variant"] != "base":
                    key = (batch, n, r["variant"])
                    first.setdefault(key, r["us"])
                    score[i] = score.get(i, 0.0) + math.log(r["us"] / first[key])
    best = min(score, key=score.get)
    return rows, ([default] + SWEEP)[best]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--adapters", default="1,16,64")
    ap.add_argument("--variants", default="base,lora,dora,ia3,vera,oft,mix,naive,lora_grouped,mix_grouped")
    for key, value in DEFAULT.items():
        if key != "stages":
            ap.add_argument("--" + key.replace("_", "-"), type=int, default=value)
    ap.add_argument("--stages", type=int, nargs=3, default=DEFAULT["stages"], metavar=("SHRINK", "ROWS", "TILES"))
    ap.add_argument("--mix-methods", default=",".join(FIVE), help="the methods the mix rows cycle through")
    ap.add_argument("--sweep", action="store_true",
                    help="first compare tile configs on a few rows and run the table with the best")
    ap.add_argument("--out", default="bench_ops.json")
    ap.add_argument("--repredict", metavar="JSON",
                    help="re-score a saved run with the current byte model (no GPU needed) and exit")
    args = ap.parse_args()
    if args.repredict:
        return repredict(args.repredict)
    mix = tuple(args.mix_methods.split(","))
    if unknown := set(mix) - set(FIVE):
        ap.error(f"--mix-methods: unknown {sorted(unknown)}; known: {', '.join(FIVE)}")
    t0 = time.time()
    bw, lat = measure_bandwidth(), measure_launch_latency()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth {bw / 1e12:.2f} TB/s, "
          f"launch latency in a graph {lat * 1e6:.2f} us", flush=True)
    layer = Layer(mix=mix)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, bandwidth=bw, launch_latency=lat,
                  mix_methods=list(mix))
    cfg = {key: tuple(getattr(args, key)) if key == "stages" else getattr(args, key) for key in DEFAULT}
    if args.sweep:
        result["sweep"], cfg = sweep(layer, bw, lat, cfg)
    apply(cfg)
    result["config"] = cfg
    print(f"config {cfg}", flush=True)
    print(HEADER, flush=True)
    rows = run_rows(layer, [int(b) for b in args.batches.split(",")], [int(n) for n in args.adapters.split(",")],
                    args.variants.split(","), cfg, bw, lat)
    result["rows"], result["bars"] = rows, bars(rows)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(HEADER)
    for r in rows:
        print(fmt_row(r))
    print(json.dumps({k: v for k, v in result["bars"].items() if k != "mix_vs_lora"}, indent=1))
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
