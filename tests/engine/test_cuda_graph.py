"""The host side of decode CUDA graphs (runs on the CPU): capture sizes, the adapter layout that keys the graphs
and the slots a graph is captured for, and the merged q/k/v and gate/up parameters the merged GEMMs read."""

from __future__ import annotations

import torch

from scute.engine.cuda_graph import AdapterLayout, GraphShape, capture_sizes, mixed_rows, mixed_sizes
from scute.engine.step_inputs import graph_step
from scute.model.hf import swap_linears
from scute.ops.pool import SlotPool
from scute.ops.testing import random_slots
from tests.helpers import tiny_model


def build_pool(lin, num_slots: int = 4) -> SlotPool:
    """What the first forward does for `lin`'s call (`pool_for`), on the CPU: its pool (its group's), filled."""
    unit = lin.group or lin
    members = lin.group.members if lin.group else [lin]
    unit.pool = SlotPool(lin.in_features, [m.out_features for m in members], num_slots, "cpu", torch.float32)
    unit.pool.update([m.slots for m in members])
    return unit.pool


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]


def test_layout_keys_and_active_slots():
    model = tiny_model()
    linears = swap_linears(model, max_adapters=4)
    assert AdapterLayout(linears.values(), 4).key == ((), ())  # no adapter: no pool, the base graphs
    q, down = linears["model.layers.0.self_attn.q_proj"], linears["model.layers.0.mlp.down_proj"]
    q.set_slot(1, random_slots("lora", q.in_features, q.out_features, rank=4))
    down.set_slot(2, random_slots("ia3", down.in_features, down.out_features, feedforward=True))
    layout = AdapterLayout(linears.values(), 4)
    assert not layout.complete  # the pools are built by the first forward
    for lin in (q, down):
        build_pool(lin)
    layout = AdapterLayout(linears.values(), 4)
    assert layout.complete and layout.key != ((), ())
    lora, ia3 = layout.step_key([1, -1]), layout.step_key([2])
    assert lora and ia3 and lora != ia3 and layout.step_key([-1, 0, 3]) == 0
    assert layout.step_key([1, 2]) == lora | ia3
    # a graph of the LoRA key serves the LoRA slot and the empty ones, not the feed-forward IA3 one (its input
    # transform is a pass LoRA steps skip); the union serves both
    assert layout.active_slots(lora) == {-1, 0, 1, 3}
    assert layout.active_slots(lora | ia3) == {-1, 0, 1, 2, 3}
    assert layout.active_slots(0) == {-1, 0, 3}


def test_merged_parameters_are_views():
    model = tiny_model(family="qwen2")  # q/k/v with biases
    ref = tiny_model(family="qwen2")
    linears = swap_linears(model, max_adapters=2)
    q = linears["model.layers.1.self_attn.q_proj"]
    group = q.group
    weight, bias = group.merged()
    assert weight.shape[0] == sum(group.out_features) and bias is not None
    x = torch.randn(5, q.in_features)
    for member, name in zip(group.members, ("q_proj", "k_proj", "v_proj")):
        base = getattr(ref.model.layers[1].self_attn, name)
        torch.testing.assert_close(member.weight, base.weight, rtol=0, atol=0)
        torch.testing.assert_close(torch.nn.functional.linear(x, member.weight, member.bias), base(x))
    model.to(torch.float64)  # a cast after the swap: the members no longer view the merged matrix
    assert group.merged() is None


def _graph_inputs(runner, sched, shape):
    """Write a step's graph inputs as `ModelRunner.replay` does; returns the step."""
    step = graph_step(sched, shape, runner.block_size)
    runner._write_inputs(step)
    return step


def test_decode_inputs_padded_to_the_bucket():
    """The decode step's inputs as a graph reads them: the eager `prepare`'s values for the real rows, padding
    rows that store no KV and use no adapter (checked on the CPU, where the same buffers are filled)."""
    from scute import Engine, SamplingParams

    engine = Engine(tiny_model(), device="cpu", dtype="float32", max_model_len=64, max_num_seqs=8)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i, n in enumerate([3, 17, 5]):
        engine.add_request(f"r{i}", list(range(1, n + 1)), sp)
    engine.step()  # the prompts
    sched = engine.scheduler.schedule()
    assert [n for _, n in sched.scheduled] == [1, 1, 1]
    runner, buf = engine.runner, engine.runner.buffers
    ids, positions, ctx, _, _ = runner.prepare(sched)
    want = [t.clone() for t in (ids, positions, ctx.attn.slot_mapping, ctx.token_adapter_slots, ctx.attn.seq_lens)]
    tables = ctx.attn.block_tables.clone()
    buf["slot_mapping"].fill_(7)  # stale values, which the padding must overwrite
    buf["block_tables"].fill_(9)  # stale entries the graph does not read, which are not copied either
    assert _graph_inputs(runner, sched, GraphShape(4)).token_slots == [-1, -1, -1]
    for name, w in zip(("input_ids", "positions", "slot_mapping", "token_slots", "seq_lens"), want):
        assert buf[name][:3].tolist() == w.tolist(), name
        assert buf[name][3].item() == {"input_ids": 0, "positions": 0, "seq_lens": 1}.get(name, -1), name
    assert buf["query_start_loc"][:5].tolist() == [0, 1, 2, 3, 4]
    assert buf["block_tables"][:3, : tables.shape[1]].tolist() == tables.tolist()
    assert buf["block_tables"][3, 0].item() == 0
    width = tables.shape[1]
    assert (buf["block_tables"][:, width:] == 9).all() and (buf["block_tables"][4:] == 9).all()
    # the next step writes the other host mirrors: this step's copies may still be queued behind the step in flight
    used = runner._mirrors[0]
    runner._pad_inputs(GraphShape(4))
    assert runner._mirrors[0] is not used and runner._mirrors[1] is used


def test_graph_block_tables_follow_the_requests_through_preemption_and_the_prefix_cache():
    """Step after step, with requests growing, preempted (their blocks freed) and admitted again onto cached
    blocks, the block tables a graph reads (written into each mirror only where they changed, `TableRows`) are
    the requests' tables."""
    from scute import Engine, SamplingParams

    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # K+V, 2 layers, 16 tokens, 2 kv heads, head_dim 16, fp32
    engine = Engine(tiny_model(), device="cpu", dtype="float32", max_model_len=64, max_num_seqs=4,
                    kv_cache_memory_bytes=9 * block_bytes, enable_prefix_caching=True)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", [1, 2, 3] * 6 + [i], sp)
    runner, checked, preempted = engine.runner, 0, 0
    while engine.has_unfinished_requests():
        sched = engine.scheduler.schedule()
        preempted += len(sched.preempted)
        if sched.scheduled and all(n == 1 for _, n in sched.scheduled):
            runner._write_inputs(graph_step(sched, GraphShape(len(sched.scheduled)), runner.block_size))
            tables = runner.buffers["block_tables"]
            for row, (req, _) in enumerate(sched.scheduled):  # the entries past a table's length are not read
                assert tables[row, : len(req.block_table)].tolist() == req.block_table
            checked += 1
        engine._run(sched, [r for r, n in sched.scheduled if r.num_computed_tokens + n == r.num_tokens], None)
    assert checked > 20 and preempted > 0


def test_tokens_sampled_in_flight_are_taken_on_the_device():
    """A graph step's tokens the host does not have yet (`GraphStep.gather`: token rows, rows of the step in
    flight's output) land in the ids from that output, through the other host mirrors' gather rows; the tokens the
    host has stay as written."""
    from types import SimpleNamespace

    from scute import Engine, SamplingParams

    engine = Engine(tiny_model(), device="cpu", dtype="float32", max_model_len=64, max_num_seqs=8)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i, n in enumerate([3, 17, 5]):
        engine.add_request(f"r{i}", list(range(1, n + 1)), sp)
    engine.step()
    sched = engine.scheduler.schedule()
    runner, buf = engine.runner, engine.runner.buffers
    step = graph_step(sched, GraphShape(4), runner.block_size)
    known = list(step.input_ids)
    flight = SimpleNamespace(result=SimpleNamespace(token_ids=torch.tensor([501, 502, 503])))
    for gather in [([0, 2], [2, 0]), ([1], [1])]:  # the second step writes the other mirrors
        step.gather = gather
        runner._write_inputs(step, flight)
        want = list(known)
        for row, out in zip(*gather):
            want[row] = 501 + out
        assert buf["input_ids"][:3].tolist() == want
    assert runner._mirrors[0].gather[0][:, :1].tolist() == [[1], [1]]


def test_mixed_inputs_padded_to_the_graph():
    """A mixed step (a prompt beside decode tokens) as its graph reads it: the eager inputs for the real tokens
    and requests, the padding tokens as one request of length 0 that stores no KV, empty requests up to the
    graph's, and the LM head's kept rows (each sampling request's last token) padded to the graph's row count."""
    from scute import Engine, SamplingParams

    engine = Engine(tiny_model(), device="cpu", dtype="float32", max_model_len=64, max_num_seqs=8)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i, n in enumerate([3, 5]):
        engine.add_request(f"r{i}", list(range(1, n + 1)), sp)
    engine.step()  # the prompts
    engine.add_request("new", list(range(1, 12)), sp)
    sched = engine.scheduler.schedule()
    assert [n for _, n in sched.scheduled] == [1, 1, 11]
    runner, buf = engine.runner, engine.runner.buffers
    ids, positions, ctx, logits, _ = runner.prepare(sched)
    want = [t.clone() for t in (ids, positions, ctx.attn.slot_mapping, ctx.token_adapter_slots)]
    qsl, lens, keep = ctx.attn.query_start_loc.tolist(), ctx.attn.seq_lens.tolist(), logits.tolist()
    buf["slot_mapping"].fill_(7)
    step = _graph_inputs(runner, sched, GraphShape(16, True))
    graph_seqs, graph_rows = mixed_rows(16, 8)
    assert (graph_seqs, graph_rows) == (9, 8)
    for name, w in zip(("input_ids", "positions", "slot_mapping", "token_slots"), want):
        assert buf[name][:13].tolist() == w.tolist(), name
        assert buf[name][13:16].tolist() == [{"input_ids": 0, "positions": 0}.get(name, -1)] * 3, name
    assert buf["query_start_loc"][: graph_seqs + 1].tolist() == qsl + [16] * (graph_seqs + 1 - len(qsl))
    assert buf["seq_lens"][:graph_seqs].tolist() == lens + [0] * (graph_seqs - len(lens))
    assert step.logits_rows == keep == [0, 1, 12]
    assert buf["logits_indices"][:graph_rows].tolist() == keep + [0] * (graph_rows - 3)
    assert buf["sample_slots"][:graph_rows].tolist() == [-1] * graph_rows


def test_mixed_sizes():
    assert mixed_sizes(8192) == [16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 768, 1024]
    assert mixed_sizes(100) == [16, 32, 64]


def test_graph_key_follows_what_the_plans_read():
    """A LoRA adapter placed into a free slot beside another keeps the layout and the LoRA graphs' key (their
    plans are unchanged: graphs stay); an IA3 one, whose slot joins the LoRA graphs' active slots but is not a
    plain low-rank delta, changes the key (a LoRA step's plan would now run the epilogue) and so does every plan
    that differs."""
    from scute.ops.plan import plan

    model = tiny_model()
    linears = swap_linears(model, max_adapters=4)
    q = linears["model.layers.0.self_attn.q_proj"]
    torch.manual_seed(0)
    q.set_slot(1, random_slots("lora", q.in_features, q.out_features, rank=4))
    build_pool(q)

    def state():
        layout = AdapterLayout(linears.values(), 4)
        key = layout.step_key([1])
        plans = [plan(q.group.pool.facts, n, q.in_features, 1, torch.device("cpu"), layout.active_slots(key),
                      consumer_adds=True)._replace(facts=None) for n in (1, 2, 64)]
        return layout.key, [layout.graph_key(key, n) for n in (1, 2, 64)], plans

    before = state()
    q.set_slot(3, random_slots("lora", q.in_features, q.out_features, rank=4))
    assert state() == before
    q.set_slot(0, random_slots("ia3", q.in_features, q.out_features))
    after = state()
    assert after[0] == before[0] and after[1] != before[1] and after[2] != before[2]


def test_vera_adapters_joining_their_shared_group_keep_the_layout():
    """VeRA adapters of one pair placed one after another join one group: each placement changes the grouping
    (which graphs read at replay from `slot_group`) but not the layout, so graphs stay. Which pools share a
    grouping is in the layout (the first pool of a grouping builds the tokens' order, the others reuse it)."""
    model = tiny_model()
    linears = swap_linears(model, max_adapters=4)
    q, down = linears["model.layers.0.self_attn.q_proj"], linears["model.layers.0.mlp.down_proj"]
    torch.manual_seed(0)
    pair = (torch.randn(4, 128), torch.randn(128, 4))
    for lin in (q, down):
        lin.set_slot(0, random_slots("vera", lin.in_features, lin.out_features, vera_pair=pair))
        lin.set_slot(1, random_slots("vera", lin.in_features, lin.out_features, vera_pair=pair))
        build_pool(lin)
    before, grouping = AdapterLayout(linears.values(), 4).key, q.group.pool.group_key
    for lin in (q, down):
        lin.set_slot(2, random_slots("vera", lin.in_features, lin.out_features, vera_pair=pair))
    assert q.group.pool.group_key != grouping and q.group.pool.group_key == down.pool.group_key == (0, 0, 0, 3)
    assert AdapterLayout(linears.values(), 4).key == before
    q.set_slot(3, random_slots("vera", q.in_features, q.out_features, vera_pair=pair))  # q's grouping alone
    assert AdapterLayout(linears.values(), 4).key != before


def test_filling_the_last_free_slot_keeps_the_graphs_of_many_tokens():
    """Once no slot of a LoRA graph's lacks A (the last free one filled), only the one-token graph's key changes:
    its deferral writes zeros where a slot has no A. Graphs of more tokens, which write them anyway beside the
    base model's padding rows, keep their key and their plans."""
    from scute.ops.plan import plan

    model = tiny_model()
    linears = swap_linears(model, max_adapters=4)
    q = linears["model.layers.0.self_attn.q_proj"]
    torch.manual_seed(0)
    for s in (0, 1, 2):
        q.set_slot(s, random_slots("lora", q.in_features, q.out_features, rank=4))
    build_pool(q)

    def state(n):
        layout = AdapterLayout(linears.values(), 4)
        key = layout.step_key([1])
        p = plan(q.group.pool.facts, n, q.in_features, 1, torch.device("cpu"), layout.active_slots(key),
                 consumer_adds=True)._replace(facts=None)
        return layout.key, layout.graph_key(key, n), p

    before = {n: state(n) for n in (1, 2, 64)}
    q.set_slot(3, random_slots("lora", q.in_features, q.out_features, rank=4))
    after = {n: state(n) for n in (1, 2, 64)}
    assert after[2] == before[2] and after[64] == before[64]
    assert after[1][0] == before[1][0] and after[1][1] != before[1][1] and after[1][2] != before[1][2]



def test_which_steps_run_at_a_graph_shape():
    """Decode steps at their batch's bucket; steps with prompt tokens at their token count's mixed bucket, unless
    they owe prompt logprobs or have more tokens than the largest mixed graph (then eager, `execute`). Shown on the
    CPU runner with the GPU's sizes set (its own are empty: the CPU runs every step eagerly)."""
    from scute import Engine, SamplingParams
    from scute.engine.scheduler import SchedulerOutput

    engine = Engine(tiny_model(), device="cpu", dtype="float32", max_model_len=128, max_num_seqs=8)
    runner = engine.runner
    assert runner.decode_sizes == runner.mixed_sizes == []
    runner.decode_sizes, runner.mixed_sizes = capture_sizes(8), mixed_sizes(64)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for name, n in (("decoding", 19), ("prompt", 4), ("long", 70), ("logprobs", 6)):
        engine.add_request(name, list(range(1, n + 1)), sp if name != "logprobs" else
                           SamplingParams(max_tokens=8, prompt_logprobs=1))
    req = engine.requests
    req["decoding"].num_computed_tokens = 18  # its last prompt token left: one token, which samples
    assert not any(r.is_finished for r in req.values())

    def shape(*scheduled):
        sched = SchedulerOutput(scheduled=[(req[name], n) for name, n in scheduled],
                                num_batched_tokens=sum(n for _, n in scheduled))
        sampling = [r for r, n in sched.scheduled if r.num_computed_tokens + n == r.num_tokens]
        return runner._graph_shape(sched, sampling)

    assert shape(("decoding", 1)) == GraphShape(1)
    assert shape(("decoding", 1), ("prompt", 4)) == GraphShape(16, True)
    assert shape(("prompt", 4)) == GraphShape(16, True)
    assert shape(("long", 64)) is None  # samples nothing: eager
    assert shape(("decoding", 1), ("long", 40)) == GraphShape(64, True)  # a chunk beside a sampling request
    assert shape(("logprobs", 6)) is None  # owes prompt logprobs: eager
    runner.mixed_sizes = mixed_sizes(16)
    assert shape(("decoding", 1), ("prompt", 4)) == GraphShape(16, True)
    assert shape(("decoding", 1), ("long", 40)) is None  # more tokens than the largest mixed graph: eager
