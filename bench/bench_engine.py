"""The served step, end to end: a burst of requests through `Engine`, decode time per step against its byte floor.

One Llama-3-8B-shaped `LlamaForCausalLM` (random bf16 weights; ``--layers`` fewer for a quick look) handed to
``Engine(model, device="cuda", dtype="bfloat16")``; requests of ``--prompt`` random tokens, greedy, ``ignore_eos``,
``--new-tokens`` each; adapters made by PEFT ``save_pretrained`` on all seven projections, every tensor
re-randomized (one PEFT save per method, the other adapters of that method written with fresh random tensors).

Cases: ``base`` (no adapter), ``lora`` (distinct LoRA r=16, one per request, up to 64), ``mix`` (the five methods in
equal shares: LoRA r16, DoRA r16, IA3, VeRA r256, OFT block 32; as many distinct adapters as ``lora``).

Per case and batch size: decode ms/step (median wall time of ``engine.step()`` over the steps in which every request
decodes), host ms/step (that wall time minus the time the step waits for the GPU), prefill tokens/s, total tokens/s
(prompt + generated over the whole burst), the byte floor of a decode step (every weight read once, with the LM
head; each distinct adapter's live tensors once; the KV cache read at the median step's lengths; over the copy
bandwidth measured in the same run: `bench/_device.py`) and the ratio. ``--eager`` adds the same rows with
``enforce_eager`` behaviour (graphs off) at the batch sizes it names. Baselines in the same process: ``--peft``
(transformers + PEFT ``generate(adapter_names=...)`` on the LoRA batch at ``--peft-batch``: decode tokens/s from two
generate calls of 1 and 1 + ``--peft-tokens`` new tokens) and ``--static`` (transformers with a static cache, whose
decode forward `generate` compiles with ``torch.compile`` in "reduce-overhead" mode, for the base model: ms per
decode step at 1 and 64 requests).

Run on a GPU: ``PYTHONPATH=. python3 bench/bench_engine.py --out bench/results/engine_h200.json`` (add
``--peft --static --eager 64`` for the baselines). Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _device import copy_bandwidth, matmul_rate  # noqa: E402

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                 rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MIX = ("lora", "dora", "ia3", "vera", "oft")


def peft_config(method: str, rank: int | None = None):
    """The bench's PEFT config of `method`; `rank`: a LoRA's or DoRA's other than 16 (alpha twice it)."""
    from peft import IA3Config, LoraConfig, OFTConfig, VeraConfig

    if rank is not None and method not in ("lora", "dora"):
        raise ValueError(f"a rank is for lora or dora, not {method}")
    r = rank or 16
    return {
        "lora": lambda: LoraConfig(r=r, lora_alpha=2 * r, target_modules=ALL_LINEAR),
        "dora": lambda: LoraConfig(r=r, lora_alpha=2 * r, use_dora=True, target_modules=ALL_LINEAR),
        "ia3": lambda: IA3Config(target_modules=ALL_LINEAR, feedforward_modules=["down_proj"]),
        "vera": lambda: VeraConfig(r=256, target_modules=ALL_LINEAR),
        "oft": lambda: OFTConfig(r=0, oft_block_size=32, target_modules=ALL_LINEAR),
    }[method]()


def randomized(name: str, x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A random, non-trivial value for one saved adapter tensor (scales near 1, deltas small)."""
    if name.startswith("base_model.vera_"):  # VeRA's shared projections: as PEFT made them (seeded)
        return x
    noise = torch.randn(x.shape, generator=g, dtype=torch.float32)
    if "magnitude" in name or "ia3_l" in name:
        return (x.float() * (1 + 0.1 * noise)).to(x.dtype)
    if "vera_lambda" in name:
        return (0.1 * noise).to(x.dtype)
    if "oft_R" in name:
        return (0.02 * noise).to(x.dtype)
    return (0.01 * noise).to(x.dtype)


def make_adapters(model, method: str, count: int, root: str, seed: int = 0, rank: int | None = None) -> list[str]:
    """`count` adapter folders of `method` for `model`: one PEFT save, then copies with fresh random tensors
    (adapter i's drawn with seed ``1000 * MIX.index(method) + seed + i``); `rank` as for `peft_config`."""
    from peft import get_peft_model
    from safetensors.torch import load_file, save_file

    kind = method if rank is None else f"{method}-r{rank}"
    first = os.path.join(root, f"{kind}-0")
    peft_model = get_peft_model(model, peft_config(method, rank))
    peft_model.save_pretrained(first)
    peft_model.unload()  # the base model back, unchanged
    tensors = load_file(os.path.join(first, "adapter_model.safetensors"))
    paths = []
    for i in range(count):
        g = torch.Generator().manual_seed(1000 * MIX.index(method) + seed + i)
        folder = os.path.join(root, f"{kind}-{i}")
        os.makedirs(folder, exist_ok=True)
        if i:
            with open(os.path.join(first, "adapter_config.json")) as src, \
                    open(os.path.join(folder, "adapter_config.json"), "w") as dst:
                dst.write(src.read())
        # bf16 files: half the bytes to write and read; the loaders compute in float32 either way
        save_file({k: randomized(k, v, g).to(torch.bfloat16).contiguous() for k, v in tensors.items()},
                  os.path.join(folder, "adapter_model.safetensors"))
        paths.append(folder)
    return paths


def random_llama(config: dict, device: str = "cuda", dtype: torch.dtype = torch.bfloat16):
    """A `LlamaForCausalLM` of `config` (a `LlamaConfig`'s fields) with random weights (seed 0), on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM._from_config(LlamaConfig(**config), dtype=dtype).eval()


def kv_bytes_per_token(cfg, itemsize: int = 2) -> int:
    """The KV cache's bytes for one token of `cfg`'s model (keys and values of every layer)."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * itemsize


def lora_burst_engine(layers: int, root: str):
    """The 8B-shaped model of `layers` layers, 64 LoRA r16 folders and an engine for bursts of up to 64 requests of
    128 + 128 tokens over them, with a `StepClock` and a maker of random 128-token prompts: (engine, paths, clock,
    prompts)."""
    from scute import Engine

    model = random_llama({**LLAMA3_8B, "num_hidden_layers": layers})
    paths = {"lora": make_adapters(model, "lora", 64, root)}
    engine = Engine(model, device="cuda", dtype="bfloat16", max_adapters=64, max_num_seqs=64, max_model_len=272,
                    max_adapter_rank=256, max_cpu_adapters=128,
                    kv_cache_memory_bytes=int(1.2 * 64 * 272 * kv_bytes_per_token(model.config)))
    g = torch.Generator().manual_seed(0)
    prompts = lambda n: [torch.randint(0, model.config.vocab_size, (128,), generator=g).tolist()  # noqa: E731
                         for _ in range(n)]
    return engine, paths, StepClock(engine), prompts


def save(result: dict, out: str, leave_out: str | None = None) -> dict:
    """Print `result` (but its `leave_out` field) as JSON and write it whole to `out`; returns it."""
    print(json.dumps({k: v for k, v in result.items() if k != leave_out}, indent=1))
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return result


def weight_bytes(model) -> int:
    """Every weight a decode step reads once: all parameters but the input embeddings (a few rows of them)."""
    embed = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)


def adapter_bytes(engine, specs: list) -> int:
    """Live tensor bytes of the distinct adapters of a batch as the device holds them (`AdapterMemory`'s
    count: matrices in the serving dtype, vectors in float32, tensors shared between adapters counted once)."""
    from scute.engine.adapter_memory import StorageUnion, adapter_storages

    union = StorageUnion()
    for spec in dict.fromkeys(s for s in specs if s is not None):
        adapter = engine.adapters.get_by_path(spec)
        union.add(adapter.identity, adapter_storages(adapter, engine.adapters.memory.matrix_bytes))
    return union.bytes


class StepClock:
    """Wraps an engine so that each step's wall time and the part of it spent waiting for the GPU are known: an
    eager step's wait where its tokens are read, a graph step's as the engine counts it (`device_wait_s`)."""

    def __init__(self, engine) -> None:
        self.engine, self.wait = engine, 0.0
        processor = engine.output_processor
        original = processor.append_tokens

        def append_tokens(sampling, result):
            start = time.perf_counter()
            if result.token_ids.is_cuda:
                torch.cuda.synchronize()
            self.wait += time.perf_counter() - start
            return original(sampling, result)

        processor.append_tokens = append_tokens

    def run(self, prompts: list[list[int]], specs: list, max_tokens: int) -> dict:
        from scute import SamplingParams

        engine = self.engine
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for i, (prompt, spec) in enumerate(zip(prompts, specs)):
            engine.add_request(f"bench-{time.monotonic_ns()}-{i}", prompt, sp, spec)
        decode, host, seq_lens, prefill = [], [], [], []
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            batched, lens = engine.stats["batched_tokens"], [r.num_tokens for r in engine.scheduler.running]
            self.wait, waited, t0 = 0.0, engine.stats["device_wait_s"], time.perf_counter()
            engine.step()
            self.wait += engine.stats["device_wait_s"] - waited  # an overlapped decode step's tokens
            new = engine.stats["batched_tokens"] - batched
            if new != len(lens) and torch.cuda.is_available():  # prompt tokens: a step launched from a graph
                torch.cuda.synchronize()  # returns before its GPU work ends, and its time is the prompt's
            wall = time.perf_counter() - t0
            if new == len(lens) == len(prompts):  # every request decodes
                decode.append(wall)
                host.append(wall - self.wait)
                seq_lens.append(sum(lens))
            elif new != len(lens):  # a step with prompt tokens
                prefill.append(wall)
        total = time.perf_counter() - start
        tokens = len(prompts) * (len(prompts[0]) + max_tokens)
        return dict(decode_ms=1e3 * statistics.median(decode) if decode else None,
                    host_ms=1e3 * statistics.median(host) if host else None,
                    kv_tokens=statistics.median(seq_lens) if seq_lens else 0, decode_steps=len(decode),
                    prefill_tok_s=len(prompts) * len(prompts[0]) / sum(prefill) if prefill else None,
                    prefill_steps_ms=[round(1e3 * w, 2) for w in prefill],  # each prompt step's wall time
                    total_tok_s=tokens / total)


def peft_baseline(model_cfg, paths: list[str], batch: int, prompt_len: int, new_tokens: int) -> dict:
    """transformers + PEFT generate with adapter_names: decode tokens/s on `batch` requests of distinct LoRAs."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    with torch.device("cuda"):
        base = LlamaForCausalLM._from_config(model_cfg, dtype=torch.bfloat16).eval()
    model = PeftModel.from_pretrained(base, paths[0], adapter_name="a0", low_cpu_mem_usage=True)
    names = ["a0"]
    for i, path in enumerate(paths[1:batch], start=1):
        model.load_adapter(path, adapter_name=f"a{i}", low_cpu_mem_usage=True)
        names.append(f"a{i}")
    ids = torch.randint(0, model_cfg.vocab_size, (batch, prompt_len), device="cuda")
    adapter_names = [names[i % len(names)] for i in range(batch)]

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, adapter_names=adapter_names)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    timed(2)
    t1, tn = timed(1), timed(1 + new_tokens)
    del model, base
    torch.cuda.empty_cache()
    return dict(batch=batch, decode_tok_s=batch * new_tokens / (tn - t1), decode_ms=1e3 * (tn - t1) / new_tokens)


def static_baseline(model_cfg, batches: list[int], prompt_len: int, new_tokens: int) -> list[dict]:
    """transformers with a static KV cache, no adapters: ms/step. `generate` compiles the decode forward itself
    when the cache is static (transformers' auto-compile: torch.compile in "reduce-overhead" mode, CUDA graphs)."""
    from transformers import LlamaForCausalLM

    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(model_cfg, dtype=torch.bfloat16).eval()
    rows = []
    for batch in batches:
        ids = torch.randint(0, model_cfg.vocab_size, (batch, prompt_len), device="cuda")

        def timed(n: int) -> float:
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, cache_implementation="static")
            torch.cuda.synchronize()
            return time.perf_counter() - t

        timed(1 + new_tokens), timed(1 + new_tokens)  # compiles (and recompiles once for the decode shapes)
        t1, tn = timed(1), timed(1 + new_tokens)
        rows.append(dict(batch=batch, decode_ms=1e3 * (tn - t1) / new_tokens))
    del model
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="base,lora,mix")
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--adapters", type=int, default=64, help="distinct adapters of the lora and mix cases (at most)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="the engine's token budget per step "
                   "(default: the engine's)")
    p.add_argument("--eager", default="", help="batch sizes to run with graphs off too (e.g. 64)")
    p.add_argument("--eager-tokens", type=int, default=16)
    p.add_argument("--peft", action="store_true")
    p.add_argument("--peft-batch", type=int, default=64)
    p.add_argument("--peft-tokens", type=int, default=8)
    p.add_argument("--static", action="store_true")
    p.add_argument("--root", default="/tmp/scute-bench-engine")
    add_launch_option(p)
    p.add_argument("--out", default="engine.json")
    args = p.parse_args()
    apply_launch(args.launch)
    from transformers import LlamaConfig, LlamaForCausalLM

    from scute import Engine

    bw, flops = copy_bandwidth(), matmul_rate()
    print(f"device: {torch.cuda.get_device_name()}; copy {bw / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} "
          f"TFLOP/s", flush=True)
    cfg = LlamaConfig(**{**LLAMA3_8B, "num_hidden_layers": args.layers})
    baseline_cfg = LlamaConfig(**{**LLAMA3_8B, "num_hidden_layers": args.layers})  # the engine sets cfg's attention
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16).eval()
    cases, batches = args.cases.split(","), [int(b) for b in args.batches.split(",")]
    paths = {}
    t = time.perf_counter()
    for method in sorted({"lora"} & set(cases) | (set(MIX) if "mix" in cases else set()) | ({"lora"} if args.peft else set())):
        count = args.adapters if method == "lora" else -(-args.adapters // len(MIX))
        paths[method] = make_adapters(model, method, count, args.root)
    print(f"adapters written in {time.perf_counter() - t:.0f} s", flush=True)
    w_bytes = weight_bytes(model)
    kv_per_token = kv_bytes_per_token(cfg)
    max_batch = max(batches)
    t = time.perf_counter()
    budget = {} if args.max_num_batched_tokens is None else dict(max_num_batched_tokens=args.max_num_batched_tokens)
    engine = Engine(model, device="cuda", dtype="bfloat16", max_adapters=args.adapters, max_num_seqs=max_batch, **budget,
                    max_model_len=args.prompt + args.new_tokens + 16, max_adapter_rank=256, max_cpu_adapters=2 * args.adapters,
                    kv_cache_memory_bytes=int(1.2 * max_batch * (args.prompt + args.new_tokens + 16) * kv_per_token))
    print(f"engine ready in {time.perf_counter() - t:.1f} s", flush=True)
    clock = StepClock(engine)
    g = torch.Generator().manual_seed(0)
    rows = []
    eager = {int(b) for b in args.eager.split(",") if b}
    for case in cases:
        for batch in batches:
            prompts = [torch.randint(0, cfg.vocab_size, (args.prompt,), generator=g).tolist() for _ in range(batch)]
            specs = case_specs(case, batch, paths, args.adapters)
            t = time.perf_counter()
            # warm-up on other prompts (the measured prompts must miss the prefix cache): the first run loads the
            # adapters and captures this batch's decode graphs; its prompts are admitted as their adapters arrive,
            # so a second run, all admitted at once as in the measured one, compiles the Triton kernels of that
            # prefill's launch parameters (else the measured prefill pays their JIT compilation, seconds)
            for tokens in (24, 4):
                other = [torch.randint(0, cfg.vocab_size, (args.prompt,), generator=g).tolist() for _ in range(batch)]
                clock.run(other, specs, tokens)
            warm = time.perf_counter() - t
            for graphs in ([True, False] if batch in eager else [True]):
                saved = engine.runner.graphs
                if not graphs:
                    engine.runner.graphs = None
                fresh = prompts if graphs else [[(t + 1) % cfg.vocab_size for t in p] for p in prompts]
                r = clock.run(fresh, specs, args.new_tokens if graphs else args.eager_tokens)
                engine.runner.graphs = saved
                floor_bytes = w_bytes + adapter_bytes(engine, specs) + r["kv_tokens"] * kv_per_token
                r.update(case=case, batch=batch, graphs=graphs, warmup_s=warm, floor_ms=1e3 * floor_bytes / bw,
                         floor_bytes=floor_bytes, ratio=(r["decode_ms"] or 0) / (1e3 * floor_bytes / bw))
                rows.append(r)
                print(fmt(r), flush=True)
                with open(args.out, "w") as f:  # after every row: a run cut short keeps what it measured
                    json.dump(dict(device=torch.cuda.get_device_name(), copy_bandwidth=bw, rows=rows), f, indent=1)
    import peft
    import transformers
    import triton

    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  transformers=transformers.__version__, peft=peft.__version__,
                  command="PYTHONPATH=. python3 " + " ".join(sys.argv), copy_bandwidth=bw,
                  matmul_flops=flops, layers=args.layers, prompt=args.prompt, new_tokens=args.new_tokens,
                  max_num_batched_tokens=engine.config.max_num_batched_tokens,
                  weight_bytes=w_bytes, rows=rows, graphs_captured=engine.runner.graphs.num_captured
                  if engine.runner.graphs else 0)
    params = w_bytes / 2
    for r in rows:
        if r["case"] == "base" and r["prefill_tok_s"]:
            r["prefill_mfu"] = r["prefill_tok_s"] * 2 * params / flops
    del engine, model
    torch.cuda.empty_cache()
    for name, wanted, baseline in (
            ("peft_generate", args.peft, lambda: peft_baseline(baseline_cfg, paths["lora"], args.peft_batch, args.prompt,
                                                      args.peft_tokens)),
            ("static_compile", args.static, lambda: static_baseline(baseline_cfg, [1, 64], args.prompt, 32))):
        if wanted:
            result[name] = baseline()
            print(f"{name}: {result[name]}", flush=True)
        with open(args.out, "w") as f:  # after each baseline, as after each row
            json.dump(result, f, indent=1)
    print_table(result)


def add_launch_option(parser: argparse.ArgumentParser) -> None:
    """``--launch FIELD=INT`` (repeatable): a `LaunchConfig` field overridden for the run (`apply_launch`)."""
    parser.add_argument("--launch", action="append", default=[], metavar="FIELD=INT",
                        help="override a LaunchConfig field (scute/ops/launch.py), e.g. defer_max_tokens=0")


def apply_launch(overrides: list[str]) -> None:
    """Run under the launch configuration with these ``FIELD=INT`` overrides."""
    from dataclasses import replace

    from scute.ops import launch

    launch.CONFIG = replace(launch.CONFIG, **{k: int(v) for k, v in (a.split("=") for a in overrides)})


def case_specs(case: str, batch: int, paths: dict, num_adapters: int) -> list:
    if case == "base":
        return [None] * batch
    if case == "lora":
        return [paths["lora"][i % min(num_adapters, len(paths["lora"]))] for i in range(batch)]
    mix = [paths[m][j] for j in range(max(len(paths[m]) for m in MIX)) for m in MIX if j < len(paths[m])]
    mix = mix[:num_adapters]
    return [mix[i % len(mix)] for i in range(batch)]


def fmt(r: dict) -> str:
    def f(x, spec):
        return format(x, spec) if x is not None else "-"
    return (f"{r['case']:<5} {r['batch']:>4} {'graph' if r['graphs'] else 'eager':<5} {f(r['decode_ms'], '8.2f')} "
            f"{f(r['host_ms'], '7.2f')} {f(r['prefill_tok_s'], '9.0f')} {f(r['total_tok_s'], '8.0f')} "
            f"{r['floor_ms']:7.2f} {r['ratio']:6.2f}")


def print_table(result: dict) -> None:
    print(f"\n{result['device']}, {result['layers']} layers, copy {result['copy_bandwidth'] / 1e12:.2f} TB/s, "
          f"prompt {result['prompt']}, {result['new_tokens']} new tokens")
    print("case  reqs mode  decode_ms host_ms prefill/s  total/s floor_ms  ratio")
    for r in result["rows"]:
        print(fmt(r))
    lora64 = {r["batch"]: r for r in result["rows"] if r["case"] == "lora" and r["graphs"]}
    mix = {r["batch"]: r for r in result["rows"] if r["case"] == "mix" and r["graphs"]}
    for b in sorted(set(lora64) & set(mix)):
        print(f"mix / lora decode at {b}: {mix[b]['decode_ms'] / lora64[b]['decode_ms']:.3f}")
    peft = result.get("peft_generate")  # ("peft" is the library's version)
    if peft is not None and peft["batch"] in lora64:
        b = peft["batch"]
        print(f"Scute / PEFT decode tokens/s at {b} LoRAs: "
              f"{b / (lora64[b]['decode_ms'] / 1e3) / peft['decode_tok_s']:.0f}x")


if __name__ == "__main__":
    main()
