"""What placing one adapter costs the step loop's host: `place_adapter` over every slot pool of a model, alone and
beside a thread that runs Python all the time (as the adapter loader does while it converts the next adapter),
with the adapter's rows prepared ahead (`prepare_adapter`, what the loader does as it stages an adapter) or not.

A Llama-shaped model of ``--layers`` layers with tiny widths (the host work of a placement depends on the number
of pools, 4 a layer: q/k/v, o, gate/up, down, not on their widths), ``--slots`` adapter slots, adapters of
``--method`` (LoRA r16 by default; any of `bench_engine.MIX`) on all seven projections (PEFT saves, re-randomized:
`bench_engine.make_adapters`). The pools are the Triton
path's: on the CPU Triton's CPU tables (``SCUTE_TRITON_CPU=1`` with the interpreter, set here), where
`TableWrites` writes each row by itself; on a GPU its device tables, written in one copy and one kernel. The
thread beside: ``sys.setswitchinterval`` as the loader sets it during a job (`AdapterLoader.switch_interval`).
Median of ``--repeats`` placements into rotating slots.

Run: ``PYTHONPATH=. python3 bench/bench_place_adapter.py [--device cuda] [--out place_adapter.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--method", default="lora", help="the adapters' method (lora, dora, ia3, vera, oft)")
    p.add_argument("--rank", type=int, default=None, help="a LoRA's or DoRA's rank other than 16 (one not a "
                   "multiple of 8 has its B padded, by the loader as it prepares the rows)")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--root", default="/tmp/scute-bench-place-adapter")
    p.add_argument("--out", default="place_adapter.json")
    args = p.parse_args(argv)
    if args.device == "cpu":  # before triton is imported: the pools of the Triton path, on the CPU
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ["SCUTE_TRITON_CPU"] = "1"
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_engine as B
    from bench_request_rate import TINY
    from scute import Engine, SamplingParams
    from scute.engine.adapter_loader import AdapterLoader
    from scute.model.hf import layer_pools, place_adapter, prepare_adapter
    from scute.ops.pool_rows import at_once

    cfg = LlamaConfig(**{**TINY, "num_hidden_layers": args.layers})
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM._from_config(cfg, dtype=torch.float32).eval()
    paths = B.make_adapters(model, args.method, 4, os.path.join(args.root, args.method), rank=args.rank)
    engine = Engine(model, device=args.device, dtype="float32", max_adapters=args.slots, enforce_eager=True)
    adapters = [engine.adapters.loader.to_device(engine.adapters.get_by_path(p), engine.adapters._moved)
                for p in paths]
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=1), [paths[0]], use_tqdm=False)  # the pools exist now
    linears = engine.adapters.linears
    pools = {id(x.pool) for x in linears.values() if x.pool is not None}
    pools |= {id(x.group.pool) for x in linears.values() if x.group is not None and x.group.pool is not None}
    units = list(layer_pools(linears))
    prepared = [prepare_adapter(units, a, then=at_once) for a in adapters]  # as the loader stages them

    def placements(ready: bool) -> float:
        times = []
        for i in range(args.repeats):
            t = time.perf_counter()
            place_adapter(linears, 1 + i % (args.slots - 1), adapters[i % 4], prepared[i % 4] if ready else None,
                          units)  # the pools walked once, as the engine's Placer does
            if args.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return 1e3 * statistics.median(times)

    rows = {"alone": {}, "beside a Python thread": {}}
    for ready in (False, True):
        rows["alone"]["prepared" if ready else "built"] = placements(ready)
    stop, interval = False, sys.getswitchinterval()

    def busy() -> None:
        while not stop:
            sum(range(1000))

    sys.setswitchinterval(AdapterLoader.switch_interval or interval)
    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    for ready in (False, True):
        rows["beside a Python thread"]["prepared" if ready else "built"] = placements(ready)
    stop = True
    thread.join()
    sys.setswitchinterval(interval)
    result = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", torch=torch.__version__,
                  command=" ".join(sys.argv), method=args.method, rank=args.rank, layers=args.layers,
                  pools=len(pools), slots=args.slots, prepared_pools=len(prepared[0]),
                  switch_interval=AdapterLoader.switch_interval, ms=rows)
    print(f"{len(pools)} pools, {args.slots} slots; ms per placement (median of {args.repeats})")
    print(f"{'':24s} {'rows built':>10s} {'prepared':>10s}")
    for name, row in rows.items():
        print(f"{name:24s} {row['built']:10.2f} {row['prepared']:10.2f}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
