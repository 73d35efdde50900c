"""Adapter loads: a PEFT folder in the page cache to an adapter servable from a device slot, per method.

One Llama-3-8B-shaped `LlamaForCausalLM` (random weights; ``--layers`` fewer for a quick look, ``--tiny`` a 2-layer
toy on the CPU) served by ``Engine(enforce_eager=True)``; one adapter per method made by PEFT ``save_pretrained``
on all seven projections, every tensor re-randomized (`bench_engine.make_adapters`: LoRA r16, DoRA r16, IA3,
VeRA r256, OFT block 32; bf16 files).

Per method, the median of ``--repeats`` timed runs after a warm-up (which reads every file once: the page cache is
warm, and places the adapter once so that the layers' slot pools exist): ``read_s``, the file read into memory
with ``safetensors.torch.load_file`` (the floor: what just reading it costs); ``read_checkpoint_s``, Scute's read
of it (`read_checkpoint`, into pinned memory on a GPU) until its hash is done; ``servable_s``, what a request's
load on the adapter loader does (`AdapterManager._job` on the loader thread, `AdapterLoader.call`, as the engine
runs it: read, validate and convert where W0 is, copy to the
device in the serving dtype, its rows in the slot pools prepared: `prepare_adapter`) and then the placement in a
device slot with those rows (`place_adapter`, as the engine's `Placer` does), synchronized; its split
``load_s`` (read + convert, the CPU tier's adapter), ``move_s`` (to the device, when the conversion ran on the
CPU) and ``place_s``; ``ratio`` = servable / read. The placement goes into slot 2 with two other adapters of the
method in slots 0 and 1 (a server that serves the method already; the slot above theirs, as the engine gives a
VeRA adapter: `AdapterManager._free_slot`). cProfile of one load on the loader thread (by own and by
cumulative time): ``--profile METHOD``; ``--readers N``, ``--part-kb K``: how a file is read (the JSON's
``readers``).

Run on a GPU: ``PYTHONPATH=. python3 bench/bench_adapter_load.py --device cuda --out bench/results/adapter_load.json``.
On the CPU: ``PYTHONPATH=. python3 bench/bench_adapter_load.py --device cpu --layers 4`` (fp32; ~8 GiB of memory).
Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_engine as B  # noqa: E402
from bench_request_rate import TINY  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def add_read_args(p: argparse.ArgumentParser) -> None:
    """``--readers``, ``--part-kb`` and ``--hash-programs``: how the engine's loads read and hash a file
    (`set_reads`)."""
    p.add_argument("--readers", type=int, default=None, help="threads that read a file (default: the engine's, "
                   "`safetensors_file.READERS`)")
    p.add_argument("--part-kb", type=int, default=None, help="bytes a reader thread reads between two calls of "
                   "the loader's gate, in KiB (default: `safetensors_file.PART`)")
    p.add_argument("--hash-programs", type=int, default=None, help="programs of the GPU's hash kernel at most "
                   "(default: the engine's, `safetensors_file.HASH_PROGRAMS`)")


def set_reads(readers: int | None, part_kb: int | None = None, hash_programs: int | None = None) -> int:
    """The threads that read a file (`safetensors_file.READERS`, its pool made anew), the part they read between
    two calls of the gate (`safetensors_file.PART`) and the hash kernel's programs at most
    (`safetensors_file.HASH_PROGRAMS`), where given; call before the first read. Returns the readers in use."""
    from scute.adapters import safetensors_file

    if hash_programs is not None:
        safetensors_file.HASH_PROGRAMS = hash_programs
    if readers is not None:
        safetensors_file._readers.cache_clear()
        safetensors_file.READERS = readers
    if part_kb is not None:
        safetensors_file.PART = part_kb << 10
    return safetensors_file.READERS


def timed(fn, device: torch.device) -> tuple[float, object]:
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t, out


def measure(engine, path: str, resident: list[str], repeats: int) -> dict:
    from safetensors.torch import load_file

    from scute.adapters import read_checkpoint
    from scute.model.hf import place_adapter

    manager, device = engine.adapters, engine.adapters.device
    file = os.path.join(path, "adapter_model.safetensors")
    # two other adapters of the method in slots 0 and 1, as in a server that serves the method already: the
    # placement then changes no pool's passes, and a VeRA adapter joins the shared group the others formed (a
    # first adapter of a method, or a first pair of VeRA adapters, changes what the pools bake into CUDA graphs:
    # each pool's rows are then applied alone, and the graphs captured again)
    mine = len(resident)  # the measured adapter's slot, above theirs
    for slot, other in enumerate(resident):
        _, staged = manager.loader.call(manager._job, other)
        place_adapter(manager.linears, slot, staged.use(), staged.prepared)
    rows = []
    for i in range(repeats + 1):  # the first is the warm-up
        read_s, _ = timed(lambda: load_file(file), device)
        read_checkpoint_s, _ = timed(lambda: read_checkpoint(path, pin_memory=device.type == "cuda").identity, device)
        call = manager.loader.call  # on the loader thread (its side stream, its thread switch interval), as the
        # engine runs a load
        total, (adapter, staged) = timed(lambda: call(manager._job, path), device)
        load_s, (_, on_device) = timed(lambda: call(manager._load, path), device)
        move_s = timed(lambda: call(manager.loader.move, adapter, manager._moved), device)[0] if on_device is None \
            else 0.0
        # with the rows the loader prepared as it staged the copy, as the engine places it (`Placer`)
        units = manager._units  # the pools, walked once (as the engine's Placer does)
        place_s, _ = timed(lambda: place_adapter(manager.linears, mine, staged.use(), staged.prepared, units), device)
        if i == 0:  # one step on the adapter: the layers' slot pools exist from now on, as in a server
            from scute import SamplingParams

            engine.generate([[1, 2, 3]], SamplingParams(max_tokens=1), [adapter], use_tqdm=False)
            place_adapter(manager.linears, mine, None)
            continue
        place_adapter(manager.linears, mine, None)
        rows.append(dict(read_s=read_s, read_checkpoint_s=read_checkpoint_s, servable_s=total + place_s,
                         load_s=load_s, move_s=move_s, place_s=place_s))
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    from scute.adapters.registry import get_method

    return dict(file_bytes=os.path.getsize(file), **med, ratio=med["servable_s"] / med["read_s"],
                converted_where_w0_is=get_method(adapter.peft_type).on_device, repeats=repeats)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--tiny", action="store_true", help="a 2-layer toy model (the CPU test)")
    p.add_argument("--methods", default=",".join(B.MIX))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", default="", help="a method whose load is profiled on the loader thread (cProfile, "
                   "top 40 by own time, 50 by cumulative)")
    p.add_argument("--root", default="/tmp/scute-bench-adapter-load")
    p.add_argument("--out", default="adapter_load.json")
    add_read_args(p)
    args = p.parse_args(argv)
    readers = set_reads(args.readers, args.part_kb, args.hash_programs)
    from transformers import LlamaConfig, LlamaForCausalLM

    from scute import Engine

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = LlamaConfig(**(TINY if args.tiny else {**B.LLAMA3_8B, "num_hidden_layers": args.layers}))
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype).eval()
    methods = args.methods.split(",")
    paths = {m: B.make_adapters(model, m, 3, args.root) for m in methods}
    engine = Engine(model, device=args.device, dtype=str(dtype).split(".")[1], enforce_eager=True, max_adapters=3,
                    max_adapter_rank=256, max_model_len=64, max_num_seqs=4, kv_cache_memory_bytes=64 << 20)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    result = dict(device=name, torch=torch.__version__, command="PYTHONPATH=. python3 " + " ".join(sys.argv),
                  layers=cfg.num_hidden_layers, dtype=str(dtype), threads=torch.get_num_threads(),
                  readers=readers, rows=[])
    import peft
    import safetensors
    import transformers

    result.update(transformers=transformers.__version__, peft=peft.__version__, safetensors=safetensors.__version__)
    print(f"{name}, {cfg.num_hidden_layers} layers, {dtype}")
    print("method  file_MB  read_ms  servable_ms  load_ms  move_ms  place_ms  ratio  converted")
    for method in methods:
        r = dict(method=method, **measure(engine, paths[method][0], paths[method][1:], args.repeats))
        result["rows"].append(r)
        print(f"{method:<7} {r['file_bytes'] / 1e6:7.1f} {1e3 * r['read_s']:8.1f} {1e3 * r['servable_s']:12.1f} "
              f"{1e3 * r['load_s']:8.1f} {1e3 * r['move_s']:8.1f} {1e3 * r['place_s']:9.1f} {r['ratio']:6.1f}  "
              f"{'where W0 is' if r['converted_where_w0_is'] else 'on the CPU'}", flush=True)
        with open(args.out, "w") as f:  # after every row: a run cut short keeps what it measured
            json.dump(result, f, indent=1)
        if method == args.profile:
            prof = cProfile.Profile()

            def profiled(path: str):  # on the loader thread: cProfile sees the thread that enables it alone
                prof.enable()
                try:
                    return engine.adapters._job(path)
                finally:
                    prof.disable()

            engine.adapters.loader.call(profiled, paths[method][0])
            sync(device)
            pstats.Stats(prof).sort_stats("tottime").print_stats(40)
            pstats.Stats(prof).sort_stats("cumulative").print_stats(50)
    return result


if __name__ == "__main__":
    main()
