"""Decode CUDA graphs on the GPU: the same greedy tokens as the eager path, for all five methods mixed in one
batch, in float32 and bfloat16, with chunked prefill, preemption and prefix caching on, and across adapter
placements that change the layout (graphs dropped and captured again)."""

from __future__ import annotations

import pytest
import torch

from scute import SamplingParams
from tests.helpers import Oracle, mixed_requests

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    return Oracle(tmp_path_factory.mktemp("adapters"))


def _run(oracle, prompts, adapters, params, **options):
    """The engine and its greedy tokens. Every adapter is placed first (one short request each): a load on the
    loader thread lands after a number of steps that depends on timing, which would change the batches, and a
    token's rounding depends on its batch (GEMM shapes, split-K, the adapter tiles)."""
    engine = oracle.engine(device="cuda", **options)
    specs = [None if a is None else oracle.paths[a] for a in adapters]
    names = sorted({a for a in adapters if a is not None})
    engine.generate([prompts[0]] * len(names), SamplingParams(max_tokens=1), [oracle.paths[a] for a in names],
                    use_tqdm=False)
    outputs = engine.generate(prompts, params, specs, use_tqdm=False)
    for out in outputs:
        assert out.error is None, out.error
    return engine, [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("pressure", [False, True], ids=["roomy", "chunked-preempted"])
def test_graph_tokens_equal_eager(oracle, dtype, pressure):
    prompts, adapters = mixed_requests()
    # requests of different lengths finish at different steps: the batch shrinks through several buckets
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * (i % 5), ignore_eos=True) for i in range(len(prompts))]
    options = dict(dtype=dtype)
    if pressure:
        bytes_per_block = 2 * 2 * 16 * 2 * 16 * torch.tensor([], dtype=getattr(torch, dtype)).element_size()
        options.update(max_num_batched_tokens=32, max_num_seqs=8, kv_cache_memory_bytes=8 * bytes_per_block,
                       max_model_len=64)
    graphed = _run(oracle, prompts, adapters, params, **options)
    eager = _run(oracle, prompts, adapters, params, enforce_eager=True, **options)
    engine, got = graphed
    assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0
    assert eager[0].runner.graphs is None
    assert got == eager[1]
    if pressure:
        assert engine.stats["preemptions"] > 0


def test_graphs_follow_adapter_placements(oracle):
    """Two adapter slots, five methods: each batch evicts and places adapters, so the layout (and the set of
    passes a step needs) changes between batches; every batch's tokens still equal the eager engine's, and every
    graph writes its logits into the one buffer the graphs share."""
    # the second adapter's requests run on alone at the end of a batch: in the last one, whose adapters are placed
    # before it starts, a step key of both adapters' passes and one of the second's (when a batch's adapters become
    # ready depends on its loads: the first's requests may end before the second's start)
    params = [SamplingParams(temperature=0, max_tokens=8 + 4 * (i % 2), ignore_eos=True) for i in range(6)]
    prompts = mixed_requests()[0][:6]
    graphed = oracle.engine(device="cuda", max_adapters=2)
    eager = oracle.engine(device="cuda", max_adapters=2, enforce_eager=True)
    for pair in [("lora", "ia3"), ("oft", "vera"), ("dora", None), (None, None), ("lora", "oft"), ("lora", "oft")]:
        specs = [None if pair[i % 2] is None else oracle.paths[pair[i % 2]] for i in range(len(prompts))]
        got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, specs, use_tqdm=False)]
        want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, specs, use_tqdm=False)]
        assert got == want, pair
    graphs = graphed.runner.graphs
    assert graphs.num_replays > 0 and graphs.num_captured > len(graphs.shapes)  # captured again after placements
    # every graph (of every step key and shape) writes its logits into the one shared buffer
    assert len({key for key, _ in graphs.graphs}) > 1
    assert all(logits.data_ptr() == graphs.logits.data_ptr() for _, logits, _ in graphs.graphs.values())


@pytest.mark.parametrize("method", ["lora", "vera"])
def test_placements_that_keep_the_plans_keep_the_graphs(oracle, tmp_path, method):
    """Adapters placed into free slots beside an adapter of their method replay its graphs (nothing is captured
    again): LoRA ones, and VeRA ones of the same pair, which join its shared group (the grouping changes, the
    layout does not; only the second VeRA adapter, which makes the pools' first group of two slots, changes which
    pools share a grouping, and so the layout). An IA3 adapter joining LoRA ones changes what the LoRA graphs'
    plans read, and its batch is captured again. Every batch's tokens equal the eager engine's."""
    from tests.helpers import FIVE_METHODS, make_adapter

    paths = [oracle.paths[method]]
    for seed in (1, 2):
        paths.append(str(tmp_path / f"{method}-{seed}"))
        make_adapter(paths[-1], FIVE_METHODS[method](), "llama", seed=seed)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = mixed_requests()[0][:4]
    graphed = oracle.engine(device="cuda", max_adapters=4)
    eager = oracle.engine(device="cuda", max_adapters=4, enforce_eager=True)
    captured = []
    for batch in ([paths[0]], [paths[0], paths[1]], [paths[1], paths[2]], [paths[2], oracle.paths["ia3"]]):
        specs = [batch[i % len(batch)] for i in range(len(prompts))]
        for engine in (graphed, eager):  # placed first, as `_run` does: the batches, and so the rounding, match
            # (two requests each time: the same shapes, so that a capture comes only from the placements)
            engine.generate([prompts[0]] * 2, SamplingParams(max_tokens=1), (batch * 2)[:2], use_tqdm=False)
        got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, specs, use_tqdm=False)]
        want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, specs, use_tqdm=False)]
        assert got == want, batch
        captured.append(dict(graphed.runner.graphs.graphs))  # (step key, shape) -> (graph, logits, graph key)
    # every graph of a batch is kept by the placements of its method after it (a batch may add graphs of new
    # shapes: the prefix cache shortens its prompts), and the IA3 adapter's batch beside LoRA captures graphs
    kept = captured[:3] if method == "lora" else captured[1:3]
    for before, after in zip(kept, kept[1:]):
        assert all(after.get(k) is v for k, v in before.items())
    if method == "lora":
        assert {id(v) for v in captured[3].values()} - {id(v) for v in captured[2].values()}


def test_capture_graphs_of_an_adapters_steps(oracle):
    """`capture_graphs(slots)` captures every shape for the step key of the adapters in those slots: the steps of
    a batch over that adapter then replay graphs and capture none, and their tokens equal the eager engine's."""
    prompts = mixed_requests()[0][:5]
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    specs = [oracle.paths["vera"]] * len(prompts)
    graphed = _run(oracle, prompts[:1], ["vera"], params[:1])[0]  # places the adapter
    eager = _run(oracle, prompts[:1], ["vera"], params[:1], enforce_eager=True)[0]
    graphs = graphed.runner.graphs
    slot = graphed.adapters.slot_of(graphed.adapters.get_by_path(specs[0]))
    assert slot is not None and slot >= 0
    graphed.runner.capture_graphs([slot], progress=False)
    key = graphed.runner.layout().step_key([slot])
    assert key != 0 and {(key, shape) for shape in graphs.shapes} <= set(graphs.graphs)
    captured, replays = graphs.num_captured, graphs.num_replays
    got, want = ([o.outputs[0].token_ids for o in engine.generate(prompts, params, specs, use_tqdm=False)]
                 for engine in (graphed, eager))
    assert graphs.num_captured == captured and graphs.num_replays > replays
    assert got == want
