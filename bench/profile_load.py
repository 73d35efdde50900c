"""One adapter load, phase by phase: where the time from a PEFT folder to a servable adapter goes.

The model and adapters of `bench/bench_adapter_load.py` (Llama-3-8B shape, random weights; ``--layers`` fewer
for a quick look). Per method, two tables of medians over ``--repeats``:

* *synchronized*: each phase of `AdapterManager._job` and the placement run one after the other, the device
  synchronized after each: ``read`` (`read_checkpoint` and its hash), ``convert`` (`convert_checkpoint` without
  the serving dtype, the path of every adapter but a plain LoRA in the serving dtype: the file's tensors to the
  converter's device and float32, checked, converted), ``fold`` (`fold_layers`),
  ``device`` (the serving copy: `AdapterLoader.to_device`), ``prepare`` (`prepare_adapter`), ``place``
  (`place_adapter` with the prepared rows); then cProfile of the placement (own time, top 25);
* *as run*: `AdapterManager._job` itself, as the loader runs it (nothing synchronized inside; its read and hash
  run on beside the conversion), with the wall time spent inside each of its parts: ``read`` (`read_checkpoint`,
  the rest of the file and the hash left running), ``checked`` (`AdapterCheckpoint.tensors_on`: the file's
  transfer, check and views, within ``convert``) or, for a LoRA file in the serving dtype, ``arriving`` (the
  views made before the values, within ``convert``), ``convert``, ``fold``, ``prepare``, ``land``
  (`AdapterCheckpoint.land`: the transfer, check and in-place fold of an ``arriving`` file queued),
  ``read_wait`` (what its parts waited for the file's read, `AdapterCheckpoint.buffer`, within those parts),
  ``verify`` (the wait for that check), ``hash_wait`` (what the load waited for the hash), ``device``
  (`AdapterLoader.device_copy`), ``job`` (the whole, synchronized at its end) and ``place`` (synchronized): the
  critical path of a load. The job runs on the loader thread (`AdapterLoader.call`), as the engine runs it;
* the *timeline* of the run whose job took the median time: each part's first start and last end from the job's
  start, and when each reader thread's run of the file ended (``--readers``: how many read it).

Run on a GPU: ``PYTHONPATH=. python3 bench/profile_load.py --methods lora``. The host's part of each phase
(its Python, with the slot pools the GPU path has) on a CPU, with a narrower model of the same 32 layers and
projections: ``SCUTE_TRITON_CPU=1 TRITON_INTERPRET=1 PYTHONPATH=. python3 bench/profile_load.py --device cpu
--hidden 256`` (the pools exist once a step has run on the adapter, in the interpreter: a few seconds); with
``--served`` the CPU takes the GPU's path for a LoRA file in the serving dtype (its own copy, folded in place,
its slot rows prepared while it lands), whose Python is the GPU path's but for the read into pinned memory, the
transfer and the hash kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_engine as B  # noqa: E402
from bench_adapter_load import add_read_args, set_reads, sync  # noqa: E402
from stretches import Stretches  # noqa: E402
from stretches import summary as stretch_summary  # noqa: E402


def phases(engine, path: str, other: str, repeats: int) -> dict[str, float]:
    from scute import SamplingParams
    from scute.adapters import Adapter, read_checkpoint
    from scute.adapters.conversion import convert_checkpoint
    from scute.model.hf import place_adapter, prepare_adapter
    from scute.ops.pool_rows import at_once
    from scute.ops.slots import fold_layers

    manager, device = engine.adapters, engine.adapters.device
    _, staged = manager._job(other)
    place_adapter(manager.linears, 0, staged.use(), staged.prepared)  # below the measured slot
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=1), [staged.adapter], use_tqdm=False)  # pools exist
    rows = []
    for _ in range(repeats + 1):
        times, t = {}, time.perf_counter()

        def lap(name: str) -> None:
            nonlocal t
            sync(device)
            now = time.perf_counter()
            times[name], t = now - t, now

        ckpt = read_checkpoint(path, pin_memory=device.type == "cuda")
        identity = ckpt.identity
        lap("read")
        slots = convert_checkpoint(ckpt, manager.model_layers.linears, interned=manager._interned)
        lap("convert")
        folded = fold_layers(slots)
        lap("fold")
        adapter = Adapter("a", path, ckpt.peft_type, ckpt.config, identity, folded)
        loader = manager.loader
        moved = loader.to_device(adapter, manager._moved)
        lap("device")
        prepared = prepare_adapter(manager._units, moved, then=at_once)  # as the loader stages it
        lap("prepare")
        place_adapter(manager.linears, 1, moved, prepared, manager._units)
        lap("place")
        place_adapter(manager.linears, 1, None)
        rows.append(times)
    med = {k: statistics.median(r[k] for r in rows[1:]) for k in rows[0]}
    prof = cProfile.Profile()
    prepared = prepare_adapter(manager._units, moved, then=at_once)  # as the loader stages it
    prof.enable()
    place_adapter(manager.linears, 1, moved, prepared, manager._units)
    sync(device)
    prof.disable()
    place_adapter(manager.linears, 1, None)
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return med


@contextlib.contextmanager
def timing_parts(manager, spent: dict[str, float], calls: list | None = None):
    """Within it, the wall time of each call of a part of a load is added to ``spent[part]``; `calls`, if given,
    gets (part, start, end) of each call (perf_counter), and ("read k", start, end) of each reader thread's run of
    the file (from the read's start to its future's end)."""
    import scute.adapters.checkpoint as checkpoint
    import scute.adapters.conversion as conversion
    from scute.adapters.checkpoint import AdapterCheckpoint
    from scute.adapters.safetensors_file import Digest
    from scute.engine.adapter_loader import AdapterLoader

    parts = [(conversion, "read_checkpoint", "read"), (AdapterCheckpoint, "tensors_on", "checked"),
             (AdapterCheckpoint, "arriving", "arriving"), (conversion, "convert_checkpoint", "convert"),
             (conversion, "fold_layers", "fold"), (manager.loader, "prepare", "prepare"),
             (AdapterCheckpoint, "land", "land"), (AdapterCheckpoint, "buffer", "read_wait"),
             (AdapterCheckpoint, "verify", "verify"),
             (Digest, "hexdigest", "hash_wait"), (AdapterLoader, "device_copy", "device")]
    if calls is not None:
        parts.append((checkpoint, "read_safetensors", None))  # its reader threads' runs (`reads`)
    saved = [(owner, name, vars(owner)[name] if name in vars(owner) else None) for owner, name, _ in parts]

    def timed(fn, part):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                end = time.perf_counter()
                spent[part] = spent.get(part, 0.0) + end - t
                if calls is not None:
                    calls.append((part, t, end))
        return call

    def reads(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            for k, future in enumerate(out[2]):
                future.add_done_callback(lambda _, k=k: calls.append((f"read {k}", t, time.perf_counter())))
            return out
        return call

    for owner, name, part in parts:
        attr = vars(owner).get(name)
        setattr(owner, name, reads(attr) if part is None else property(timed(attr.fget, part))
                if isinstance(attr, property) else timed(getattr(owner, name), part))
    try:
        yield
    finally:
        for owner, name, fn in saved:
            if fn is None:
                delattr(owner, name)
            else:
                setattr(owner, name, fn)


def as_run(engine, path: str, repeats: int) -> tuple[dict[str, float], list, list, int]:
    """`AdapterManager._job` as the loader runs it, its parts timed inside (`timing_parts`), then the placement;
    the job's stretches between pause points (`Stretches`, the first job's left out); and the timeline of the
    run whose job took the median time: (part, start, end) in seconds from the job's start, its reader threads'
    runs among them, then ``job`` (synchronized) and ``place``; and the number of slot pools whose rows the loader
    prepared."""
    manager, device = engine.adapters, engine.adapters.device
    rows, timelines = [], []
    with Stretches() as stretches:
        first = 0
        for _ in range(repeats + 1):
            spent: dict[str, float] = {}
            calls: list[tuple[str, float, float]] = []
            sync(device)
            with timing_parts(manager, spent, calls):
                t = time.perf_counter()
                _, staged = manager.loader.call(manager._job, path)  # on the loader thread, as the engine runs it
                sync(device)
                spent["job"] = time.perf_counter() - t
            first = first or len(stretches.records)
            pools = len(staged.prepared)  # whose rows the loader prepared (the others': at the placement)
            rows.append(place_timed(manager, staged, spent))
            calls += [("job", t, t + spent["job"]), ("place", t + spent["job"], t + spent["job"] + spent["place"])]
            timelines.append(sorted((part, a - t, b - t) for part, a, b in calls))
    names = ["read", "checked", "arriving", "convert", "fold", "prepare", "land", "read_wait", "verify", "hash_wait",
             "device", "job", "place"]
    med = {k: statistics.median(r.get(k, 0.0) for r in rows[1:]) for k in names}
    timed_runs = sorted(range(1, len(rows)), key=lambda i: rows[i]["job"])
    timeline = timelines[timed_runs[len(timed_runs) // 2]] if timed_runs else []
    return med, stretches.records[first:], timeline, pools


def print_timeline(method: str, timeline: list[tuple[str, float, float]], pools: int) -> None:
    """The parts of one load by start: the reader threads' runs as one line (first start, each end), the rest a
    line per call (a part called often, as the ``buffer`` wait is: its calls summed, first start to last end)."""
    print(f"{method}: the load of the median job, ms from its start (start - end, wall)")
    print(f"  its rows prepared on the loader for {pools} slot pools")
    reads = [(a, b) for part, a, b in timeline if part.startswith("read ")]
    if reads:
        ends = sorted(b for _, b in reads)
        print(f"  {'readers':<10} {1e3 * min(a for a, _ in reads):7.2f} - {1e3 * ends[-1]:7.2f}   "
              f"{len(reads)} runs ending at {', '.join(f'{1e3 * b:.1f}' for b in ends)}")
    merged: dict[str, list[float]] = {}
    for part, a, b in timeline:
        if not part.startswith("read "):
            m = merged.setdefault(part, [a, b, 0.0, 0])
            m[0], m[1], m[2], m[3] = min(m[0], a), max(m[1], b), m[2] + b - a, m[3] + 1
    for part, (a, b, total, n) in sorted(merged.items(), key=lambda kv: kv[1][0]):
        calls = f"   {n} calls, {1e3 * total:.2f} in them" if n > 1 else ""
        print(f"  {part:<10} {1e3 * a:7.2f} - {1e3 * b:7.2f}{calls}")


def place_timed(manager, staged, spent: dict[str, float]) -> dict[str, float]:
    """`spent` with the placement of `staged` in slot 1 timed (synchronized); the slot is then emptied."""
    from scute.model.hf import place_adapter

    t = time.perf_counter()
    place_adapter(manager.linears, 1, staged.use(), staged.prepared, manager._units)
    sync(manager.device)
    spent["place"] = time.perf_counter() - t
    place_adapter(manager.linears, 1, None)
    return spent


def llama_8b_shape(layers: int, hidden: int | None, device: torch.device, dtype: torch.dtype):
    """A random `LlamaForCausalLM` of the Llama-3-8B shape with `layers` layers; `hidden`: a narrower one of the
    same ratios (MLP 3.5x, heads of 64, 4 query heads per KV head) and a 1000-token vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = {**B.LLAMA3_8B, "num_hidden_layers": layers}
    if hidden:
        heads = max(4, hidden // 64)
        shape.update(hidden_size=hidden, intermediate_size=hidden * 7 // 2, num_attention_heads=heads,
                      num_key_value_heads=heads // 4, head_dim=hidden // heads, vocab_size=1000)
    with torch.device(device):
        return LlamaForCausalLM._from_config(LlamaConfig(**shape), dtype=dtype).eval()


def print_table(title: str, table: dict[str, dict[str, float]]) -> None:
    names = list(next(iter(table.values())))
    print(f"{title}\nmethod  " + "".join(f"{n:>10}" for n in names) + "  (ms)")
    for m, med in table.items():
        print(f"{m:<7} " + "".join(f"{1e3 * med[n]:10.2f}" for n in names))


def main(argv: list[str] | None = None) -> dict[str, dict[str, dict[str, float]]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--methods", default="lora")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--hidden", type=int, default=None, help="a narrower model: this hidden size, the 8B shape's "
                   "ratios (MLP 3.5x, heads of 64, 4 query heads per KV head), a 1000-token vocabulary")
    p.add_argument("--served", action="store_true", help="on the CPU: load as a GPU's loader does, a LoRA file in "
                   "the serving dtype served as its own copy (the loader's matrix dtype the files' bf16)")
    p.add_argument("--root", default="/tmp/scute-bench-adapter-load")
    add_read_args(p)
    args = p.parse_args(argv)
    set_reads(args.readers, args.part_kb, args.hash_programs)
    from scute.engine.adapter_loader import AdapterLoader

    served = vars(AdapterLoader)["matrix_dtype"]  # the property itself, put back after
    if args.served:  # bench-only: the engine on the CPU serves its adapters as converted
        AdapterLoader.matrix_dtype = property(lambda loader: torch.bfloat16)
    try:
        return run(args)
    finally:
        AdapterLoader.matrix_dtype = served


def run(args) -> dict[str, dict[str, dict[str, float]]]:
    """The tables and stretches of `main` (the loader's matrix dtype as it set it)."""
    from scute import Engine

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = llama_8b_shape(args.layers, args.hidden, device, dtype)
    paths = {m: B.make_adapters(model, m, 2, args.root) for m in args.methods.split(",")}
    engine = Engine(model, device=args.device, dtype=str(dtype).split(".")[1], enforce_eager=True, max_adapters=3,
                    max_adapter_rank=256, max_model_len=64, max_num_seqs=4, kv_cache_memory_bytes=64 << 20)
    synchronized = {m: phases(engine, *paths[m], args.repeats) for m in paths}
    run = {m: as_run(engine, paths[m][0], args.repeats) for m in paths}
    print_table("synchronized: each phase alone", synchronized)
    print_table("as run: the parts of one load on the loader, unsynchronized", {m: r[0] for m, r in run.items()})
    for m, (_, _, timeline, pools) in run.items():
        print_timeline(m, timeline, pools)
    stretches = {}
    for m, (_, records, _, _) in run.items():
        print(f"{m}: the job's longest stretches between pause points (as run)")
        stretches[m] = stretch_summary(records, top=8)
    return {"synchronized": synchronized, "as_run": {m: r[0] for m, r in run.items()}, "stretches": stretches,
            "timeline": {m: r[2] for m, r in run.items()}}


if __name__ == "__main__":
    main()
