"""The KV planner's reserve for the adapters' kernels: the profiling forward runs before any adapter is loaded, so
what one adapted layer call allocates on top of it (x', the shrink's partials, the shared group's products, the
float32 delta) is added."""

from __future__ import annotations

from scute.engine.kv_plan import adapter_transient_bytes
from scute.model.hf import swap_linears
from scute.ops.meta import max_tiles
from scute.ops.launch import choose_split_k
from scute.ops.triton_ops import call_transient_bytes
from tests.helpers import tiny_model

T, RANK, ELEM = 64, 32, 2


def test_call_transient_bytes_counts_each_buffer():
    outs = [64, 32, 32]
    split = choose_split_k(64, max_tiles(T, 8) * 3)
    shared = T * 3 * RANK * 2 * ELEM  # the shared group's A x and m ⊙ h (at most one of each per projection)
    expected = 3 * T * 64 * ELEM + split * T * 3 * RANK * 4 + shared + T * 128 * 4
    assert call_transient_bytes(T, 64, outs, 8, RANK, ELEM) == expected


def test_a_group_is_one_call_and_the_largest_call_counts():
    """tiny llama (hidden 64, intermediate 96, 2 kv heads of 16): the largest of the grouped calls (gate/up: 192
    outputs; q/k/v: three projections' rank buffers) is; without groups, the largest lone linear is."""
    grouped = swap_linears(tiny_model("llama"), 8)
    alone = swap_linears(tiny_model("llama"), 8, packed_modules_mapping={})
    gate_up = call_transient_bytes(T, 64, [96, 96], 8, RANK, ELEM)
    qkv = call_transient_bytes(T, 64, [64, 32, 32], 8, RANK, ELEM)
    assert adapter_transient_bytes(grouped, T, RANK, ELEM) == max(gate_up, qkv)
    lone = max(call_transient_bytes(T, lin.in_features, [lin.out_features], 8, RANK, ELEM) for lin in alone.values())
    assert adapter_transient_bytes(alone, T, RANK, ELEM) == lone < max(gate_up, qkv)
