"""The KV planner's reserve for the adapters' kernels: the profiling forward runs before any adapter is loaded, so
what one adapted layer call allocates on top of it (x', the shrink's partials, the multi-token delta's m ⊙ h, the
float32 delta) is added."""

from __future__ import annotations

from scute.engine.kv_plan import adapter_transient_bytes
from scute.model.hf import swap_linears
from scute.ops.meta import max_tiles
from scute.ops.triton_ops import call_transient_bytes, choose_split_k
from tests.helpers import tiny_model

T, RANK, ELEM = 64, 32, 2


def test_call_transient_bytes_counts_each_buffer():
    outs = [64, 32, 32]
    split = choose_split_k(64, max_tiles(T, 8) * 3)
    expected = 3 * T * 64 * ELEM + split * T * 3 * RANK * 4 + T * 3 * RANK * 4 + T * 128 * 4  # x', h, hs, d
    assert call_transient_bytes(T, 64, outs, 8, RANK, ELEM) == expected


def test_a_group_is_one_call_and_the_largest_call_counts():
    """tiny llama (hidden 64, intermediate 96, 2 kv heads of 16): q/k/v and gate/up are one call each; without
    groups, every linear is its own call, and the largest lone one (down_proj: in 96) is less than a group."""
    grouped = swap_linears(tiny_model("llama"), 8)
    alone = swap_linears(tiny_model("llama"), 8, packed_modules_mapping={})
    calls = [(64, [64, 32, 32]), (64, [64]), (64, [96, 96]), (96, [64])]  # q/k/v, o, gate/up, down
    largest = max(call_transient_bytes(T, i, outs, 8, RANK, ELEM) for i, outs in calls)
    assert adapter_transient_bytes(grouped, T, RANK, ELEM) == largest
    lone = max(call_transient_bytes(T, lin.in_features, [lin.out_features], 8, RANK, ELEM) for lin in alone.values())
    assert adapter_transient_bytes(alone, T, RANK, ELEM) == lone < largest
