"""Thousands of adapters resident: a decode step over a few of them, with the rest of the slots empty and full.

One Llama-3-8B-shaped `LlamaForCausalLM` (random bf16 weights; ``--layers`` fewer for a quick look) served by
``Engine(model, device="cuda", dtype="bfloat16", max_adapters=2 * --per-method)`` with CUDA graphs. One IA3 and
one VeRA r256 adapter made by PEFT ``save_pretrained`` on all seven projections (`bench_engine.make_adapters`),
loaded once; ``--per-method`` distinct adapters of each are that adapter with every per-adapter tensor scaled by
its own factor (VeRA's shared projections stay shared, as in PEFT; the adapters reach the device through the
engine's loader, as by-object requests do).

The measured step: ``--batch`` requests, half over IA3 adapters and half over VeRA ones (``--batch`` distinct
adapters), ``--prompt`` random tokens, ``--new-tokens`` generated greedily; decode ms/step is the median wall time
of the steps in which every request decodes (`bench_engine.StepClock`). First with only those adapters resident,
then after one request per adapter has placed all 2 x ``--per-method`` (the fill's time per adapter reported),
then the measured step again ``--repeats`` times. The figure: the full engine's decode step over the first's.
Also recorded: how many adapters of each method the adapter budget holds (`Engine.adapter_capacity`).

Run on a GPU: ``PYTHONPATH=. python3 bench/bench_resident.py --out resident.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_engine as B  # noqa: E402
from bench_request_rate import TINY  # noqa: E402


def copies(adapter, count: int) -> list:
    """`count` distinct adapters: `adapter` with every tensor it does not share scaled by 1 + 0.01 (i + 1)."""
    out = []
    for i in range(count):
        f = 1 + 0.01 * (i + 1)
        layers = {name: dataclasses.replace(sl, **{k: x * f for k, x in sl.tensors().items() if k not in sl.shared})
                  for name, sl in adapter.layers.items()}
        out.append(dataclasses.replace(adapter, name=f"{adapter.name}-{i}", identity=f"{adapter.identity}-{i}",
                                       layers=layers))
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--per-method", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (the test)")
    p.add_argument("--root", default="/tmp/scute-bench-resident")
    p.add_argument("--out", default="resident.json")
    args = p.parse_args(argv)
    from scute import Engine, SamplingParams

    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    model = B.random_llama({**(TINY if args.tiny else B.LLAMA3_8B), "num_hidden_layers": args.layers}, device, dtype)
    cfg = model.config
    folders = {m: B.make_adapters(model, m, 1, args.root)[0] for m in ("ia3", "vera")}
    kv = B.kv_bytes_per_token(cfg, dtype.itemsize)
    length = args.prompt + args.new_tokens + 16
    engine = Engine(model, device=device, dtype=str(dtype).split(".")[1], max_adapters=2 * args.per_method,
                    max_num_seqs=args.batch, max_model_len=length, max_adapter_rank=256,
                    adapter_memory_bytes=40 * 2**30, kv_cache_memory_bytes=int(1.2 * args.batch * length * kv))
    t = time.perf_counter()
    pool = {m: copies(engine.adapters.get_by_path(f), args.per_method) for m, f in folders.items()}
    print(f"{2 * args.per_method} adapters made in {time.perf_counter() - t:.1f} s", flush=True)
    capacity = {m: engine.adapter_capacity(pool[m][0]) for m in pool}  # how many of each the budget holds alone
    print(f"adapters the {engine.adapters.memory.budget / 2**30:.0f} GiB budget holds: {capacity}", flush=True)
    half = args.batch // 2
    specs = pool["ia3"][:half] + pool["vera"][:args.batch - half]
    clock = B.StepClock(engine)
    g = torch.Generator().manual_seed(0)

    def measured() -> dict:
        prompts = [torch.randint(0, cfg.vocab_size, (args.prompt,), generator=g).tolist() for _ in specs]
        clock.run(prompts, specs, 8)  # graphs of this batch, kernels of its launches
        prompts = [torch.randint(0, cfg.vocab_size, (args.prompt,), generator=g).tolist() for _ in specs]
        row = clock.run(prompts, specs, args.new_tokens)
        row["resident"] = len(engine.adapters._slot_of)
        print(f"  {row['resident']:5d} resident: decode {row['decode_ms']} ms/step over {row['decode_steps']} steps",
              flush=True)
        return row

    rows = [measured()]
    t = time.perf_counter()
    everything = [a for m in ("ia3", "vera") for a in pool[m]]
    sp = SamplingParams(max_tokens=1)
    for start in range(0, len(everything), args.batch):
        if start % 512 == 0:
            print(f"  fill: {start} placed, {time.perf_counter() - t:.1f} s", flush=True)
        chunk = everything[start:start + args.batch]
        engine.generate([[1, 2, 3]] * len(chunk), sp, chunk, use_tqdm=False)
    fill = time.perf_counter() - t
    print(f"fill: {len(everything)} adapters in {fill:.1f} s ({1e3 * fill / len(everything):.1f} ms each)", flush=True)
    rows += [measured() for _ in range(args.repeats)]
    full = min(r["decode_ms"] for r in rows[1:])
    result = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", torch=torch.__version__,
                  command=" ".join(sys.argv),
                  layers=args.layers, batch=args.batch, per_method=args.per_method, capacity=capacity,
                  adapter_memory_held_gib=engine.adapters.memory.held.bytes / 2**30,
                  fill_ms_per_adapter=1e3 * fill / len(everything), rows=rows,
                  ratio_full_over_few=full / rows[0]["decode_ms"],
                  ratio_worst=max(r["decode_ms"] for r in rows[1:]) / rows[0]["decode_ms"])
    return B.save(result, args.out, "rows")


if __name__ == "__main__":
    main()
