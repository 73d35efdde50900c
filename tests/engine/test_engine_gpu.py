"""The engine on CUDA: the same greedy tokens as transformers + PEFT in float32, and a bfloat16 run."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.helpers import GREEDY, METHODS, NEW_TOKENS, Oracle, check, mixed_requests

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    return Oracle(tmp_path_factory.mktemp("adapters"))


def specs(oracle, adapters):
    return [None if a is None else oracle.paths[a] for a in adapters]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cuda_fp32_matches_peft(oracle, backend):
    prompts, adapters = mixed_requests()
    engine = oracle.engine(device="cuda", attention_backend=backend)
    outputs = engine.generate(prompts, GREEDY, specs(oracle, adapters), use_tqdm=False)
    check(oracle, outputs, prompts, adapters)


def test_cuda_fp32_chunked_prefill_preemption_prefix_cache(oracle):
    prompts, adapters = mixed_requests()
    bytes_per_block = 2 * 2 * 16 * 2 * 16 * 4  # K+V, 2 layers, 16 tokens, 2 kv heads, head_dim 16, fp32
    engine = oracle.engine(device="cuda", max_num_batched_tokens=32, max_num_seqs=8,
                           kv_cache_memory_bytes=6 * bytes_per_block, max_model_len=64)
    for _ in range(2):  # the second pass hits the prefix cache
        outputs = engine.generate(prompts, GREEDY, specs(oracle, adapters), use_tqdm=False)
        check(oracle, outputs, prompts, adapters)
    assert engine.stats["preemptions"] > 0


def bf16_margins(oracle, outputs, adapters) -> list[float]:
    """Per request, the largest amount by which a token the engine chose falls short of the best token's logit
    (end of sequence aside), under float32 transformers + PEFT with the request's adapter fed the engine's own
    tokens."""
    margins = []
    for out, adapter in zip(outputs, adapters, strict=True):
        prompt, tokens = out.prompt_token_ids, out.outputs[0].token_ids
        ref = oracle.logits(adapter, prompt + tokens[:-1])[len(prompt) - 1:]
        ref[:, oracle.eos_token_id] = -torch.inf  # GREEDY's min_tokens: no end of sequence
        chosen = ref.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        margins.append(float((ref.amax(1) - chosen).max()))
    return margins


# The tiny model's logits span ~0.8; a bf16 run's logits are within a few thousandths of float32's, and another
# adapter's greedy token falls short by more than this for most requests (checked below).
BF16_MARGIN = 0.02


def test_cuda_bf16_tokens_are_near_greedy_under_peft(oracle):
    """A bfloat16 run's tokens may part from float32 PEFT's at near-ties, so each token is checked as a choice:
    its float32 PEFT logit (with the request's own adapter, on the engine's own tokens) is within BF16_MARGIN of
    the best. The same check fails most requests when every adapter's requests are given another's."""
    prompts, adapters = mixed_requests()
    engine = oracle.engine(device="cuda", dtype="bfloat16")
    outputs = engine.generate(prompts, GREEDY, specs(oracle, adapters), use_tqdm=False)
    for out in outputs:
        assert out.error is None and len(out.outputs[0].token_ids) == NEW_TOKENS
    margins = bf16_margins(oracle, outputs, adapters)
    assert max(margins) <= BF16_MARGIN, [f"{a}: {m:.4f}" for a, m in zip(adapters, margins)]
    names = [None, *METHODS]
    swapped = [names[(names.index(a) + 1) % len(names)] for a in adapters]
    wrong = bf16_margins(oracle, outputs, swapped)
    assert sum(m > BF16_MARGIN for m in wrong) > len(wrong) // 2, "the check cannot tell adapters apart"


def test_a_steps_logprobs_are_read_once_written(oracle, monkeypatch):
    """A step's logprobs reach the host by kernels of their own, queued after its tokens' write (`to_host`); the
    host reads them once the event behind all of them has ended: with each such write held back on the GPU, the
    tokens and logprobs are those of a run without the delay."""
    import scute.engine.model_runner as runner_mod
    from scute import SamplingParams

    prompts, adapters = mixed_requests()
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)

    def run():
        engine = oracle.engine(device="cuda")
        assert engine.runner.graphs is not None
        outs = engine.generate(prompts, sp, specs(oracle, adapters), use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    want = run()
    to_host, delayed = runner_mod.to_host, []
    monkeypatch.setattr(runner_mod, "to_host",
                        lambda x: (delayed.append(1), torch.cuda._sleep(20_000_000), to_host(x))[2])
    got = run()
    assert delayed  # the writes were held back: otherwise this compares two alike runs
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert [list(s) for s in a] == [list(s) for s in b]
        assert [pytest.approx(list(s.values()), rel=1e-5) for s in b] == [list(s.values()) for s in a]


def test_decode_steps_in_flight_hold_the_step_loops_turn(oracle, monkeypatch):
    """With CUDA graphs, a step that launches behind a step in flight holds the step loop's turn at the interpreter
    lock (`Turns.step_loop`) and lets the loader run while it waits for the GPU (`Turns.waiting`); the adapters
    loaded by path meanwhile keep PEFT's tokens."""
    from scute.engine.adapter_loader import Turns

    entered, step_loop, waiting = [], Turns.step_loop, Turns.waiting
    monkeypatch.setattr(Turns, "step_loop", lambda self: (entered.append("turn"), step_loop(self))[1])
    monkeypatch.setattr(Turns, "waiting", lambda self: (entered.append("wait"), waiting(self))[1])
    prompts, adapters = mixed_requests()
    engine = oracle.engine(device="cuda")
    assert engine.runner.graphs is not None
    check(oracle, engine.generate(prompts, GREEDY, specs(oracle, adapters), use_tqdm=False), prompts, adapters)
    assert entered.count("turn") > 0 and entered.count("wait") >= entered.count("turn")


def test_the_cpu_tier_keeps_no_pinned_memory(oracle):
    """Adapters loaded for a CUDA engine (converted on the GPU or on the CPU) leave the CPU tier pageable copies:
    pinned memory kept would be allocated anew for each load, and each such allocation stalls the step loop's
    CUDA calls. Their tokens stay PEFT's."""
    prompts, adapters = mixed_requests()
    engine = oracle.engine(device="cuda")
    check(oracle, engine.generate(prompts, GREEDY, specs(oracle, adapters), use_tqdm=False), prompts, adapters)
    assert engine.adapters.loader.wait_idle(60)  # the CPU tier's copies of those converted on the GPU: own jobs
    for name in METHODS:
        cached = engine.adapters.get_by_path(oracle.paths[name])
        tensors = [x for s in cached.layers.values() for x in s.tensors().values()]
        assert tensors and not any(x.is_cuda or x.is_pinned() for x in tensors), name


def test_the_loads_device_copies_come_from_the_memory_reserved_before_steps_run(oracle):
    """The engine reserves its adapter budget on the loader's stream once at start (`AdapterLoader.reserve`): the
    loads' large device allocations are cut from that one segment, never a device allocation of their own while
    steps run (each would take a lock of the CUDA driver that the step loop's launches wait for)."""
    prompts, adapters = mixed_requests()
    # torch hands out streams from a pool: the earlier tests' loaders may have used this one; their memory goes
    gc.collect()
    torch.cuda.empty_cache()
    before = {s["address"] for s in torch.cuda.memory_snapshot()}
    engine = oracle.engine(device="cuda", adapter_memory_bytes=64 << 20)
    stream = engine.adapters.loader._stream.cuda_stream

    def segments():
        return [(s["address"], s["total_size"]) for s in torch.cuda.memory_snapshot()
                if s["stream"] == stream and s["segment_type"] == "large" and s["address"] not in before]

    reserved = segments()
    assert len(reserved) == 1 and reserved[0][1] >= 64 << 20
    check(oracle, engine.generate(prompts, GREEDY, specs(oracle, adapters), use_tqdm=False), prompts, adapters)
    assert engine.adapters.loader.wait_idle(60) and segments() == reserved
    # the tiny model's adapters fit the allocator's small pool: an 8B LoRA's 84 MB copy, scaled down, does not
    (address, size), = reserved
    with torch.cuda.stream(engine.adapters.loader._stream):
        copy = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
    assert address <= copy.data_ptr() < address + size and segments() == reserved


@pytest.mark.parametrize("nbytes", [0, 1, 999, 1000, 4567])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
def test_staging_copies_both_ways_in_chunks(nbytes, dtype):
    """The loader's copies through its two pinned buffers (`Staging`, 1000 bytes each here: several chunks, the
    last one short) give the source's bytes on the other side, from pageable memory and to it."""
    from scute.engine.adapter_loader import Staging

    staging = Staging(1000)
    size = nbytes - nbytes % dtype.itemsize
    src = torch.randint(0, 255, (size,), dtype=torch.uint8).view(dtype)
    on_device = staging.copy(src, torch.device("cuda"))
    torch.cuda.synchronize()
    assert on_device.is_cuda and on_device.dtype == dtype
    assert torch.equal(on_device.cpu().view(torch.uint8), src.view(torch.uint8))  # bytes: random bf16 holds NaNs
    back = staging.copy(on_device, torch.device("cpu"))
    assert not back.is_cuda and not back.is_pinned() and torch.equal(back.view(torch.uint8), src.view(torch.uint8))


WARM_SCRIPT = r'''
import sys, torch
sys.path.insert(0, "bench")
from bench_request_rate import COMPILES, STEP_LOOP_COMPILES, count_compiles
from scute import Engine, SamplingParams
from tests.helpers import FIVE_METHODS, make_adapter, tiny_model

count_compiles()  # Triton's JIT cache hook: compiles in all, on the adapter loader, the others' kernel names
make_adapter(sys.argv[1], FIVE_METHODS[sys.argv[2]](), "llama", torch.float32, seed=3)
engine = Engine(tiny_model("llama"), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=16,
                max_num_batched_tokens=256)
sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
prompts = [[1 + i] * n for i, n in enumerate((3, 5, 40, 130, 7, 2))]  # graph and eager steps of several sizes
engine.generate(prompts, sp, use_tqdm=False)  # the base model's kernels of these steps
base, named = list(COMPILES), len(STEP_LOOP_COMPILES)
outs = engine.generate(prompts, sp, [sys.argv[1]] * len(prompts), use_tqdm=False)
assert all(o.error is None for o in outs), [o.error for o in outs]
loader = COMPILES[1] - base[1]
print("COMPILES", loader, COMPILES[0] - base[0] - loader, *STEP_LOOP_COMPILES[named:])
'''


@pytest.mark.parametrize("method", ["ia3", "oft"])
def test_a_new_methods_kernels_compile_on_the_loader(tmp_path, method):
    """With an empty Triton cache (a fresh process), the first requests on an adapter of a method compile its
    kernel variants on the adapter loader's thread (`scute.model.warmup`), none on the step loop."""
    import os
    import subprocess
    import sys

    from tests.interpreter import ROOT

    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", WARM_SCRIPT, str(tmp_path / method), method], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    loader, step_loop, *kernels = proc.stdout.split("COMPILES")[-1].split()
    assert int(loader) > 0 and int(step_loop) == 0, (loader, step_loop, kernels)


def test_named_loads_from_another_thread_beside_background_loads_keep_tokens(oracle):
    """Named loads from a worker thread (as a server's runtime loads run) while the engine loads the same
    adapters by path in the background: both go through the loader (its staging buffers and stream are its own),
    and requests by name and by path get PEFT's tokens."""
    import threading

    prompts, adapters = mixed_requests()
    engine = oracle.engine(device="cuda")
    names = {m: f"named-{m}" for m in METHODS}
    worker = threading.Thread(target=lambda: [engine.load_adapter(names[m], oracle.paths[m]) for m in METHODS])
    worker.start()
    by_path = engine.generate(prompts, GREEDY, specs(oracle, adapters), use_tqdm=False)
    worker.join(120)
    assert not worker.is_alive()
    check(oracle, by_path, prompts, adapters)
    by_name = engine.generate(prompts, GREEDY, [None if a is None else names[a] for a in adapters], use_tqdm=False)
    check(oracle, by_name, prompts, adapters)
