"""The byte model (`scute.ops.cost`): what one layer call must move, counted by hand on small cases."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from scute.ops import launch
from scute.ops.cost import VEC_BYTES, CallBytes, layer_call_bytes, lora_floor_bytes
from scute.ops.meta import max_tiles
from scute.ops.launch import choose_split_k
from scute.ops.testing import random_slots, vera_pair

IN, OUT, R, E = 64, 48, 4, 2  # bf16-sized elements


def lora(seed: int):
    return random_slots("lora", IN, OUT, rank=R, generator=torch.Generator().manual_seed(seed))


def test_base_only_call():
    cost = layer_call_bytes([[lora(0), None]], IN, [OUT], [-1, -1, -1], E)
    assert cost == CallBytes(weights=OUT * IN * E, activations=3 * (IN + OUT) * E, launches=1)


def test_lora_adapters_read_once_each():
    """Two active LoRAs of 3 tokens: A and B of each once (not per token), the shrink's x read and split
    partials of h (written, read once), the delta in the model's dtype (written, read), the epilogue's
    read-modify-write of z for the adapter tokens; GEMM + shrink + 2 deltas + epilogue."""
    slots = [[lora(0), lora(1), lora(2)]]
    tokens = [0, 1, 0, -1]
    cost = layer_call_bytes(slots, IN, [OUT], tokens, E)
    split = choose_split_k(IN, max_tiles(len(tokens), 3))
    assert cost.adapters == 2 * R * (IN + OUT) * E == lora_floor_bytes(R, IN, OUT, 2, E)
    assert cost.weights == OUT * IN * E
    assert cost.activations == 4 * (IN + OUT) * E + 3 * (IN * E + 2 * split * R * 4 + 2 * OUT * E) + 3 * 2 * OUT * E
    # an idle DoRA slot in the pool makes its delta float32 (`SlotPool.delta_dtype`): 2 more bytes per element
    dora = random_slots("dora", IN, OUT, rank=R, generator=torch.Generator().manual_seed(9))
    exact = layer_call_bytes([[lora(0), lora(1), dora]], IN, [OUT], tokens, E)
    assert exact.activations - cost.activations == 3 * 2 * OUT * (4 - E)
    assert cost.launches == 1 + 1 + 2 + 1


def test_shared_vera_matrices_count_once():
    """Two VeRA adapters on one shared pair: the pair once, each adapter's own vectors (float32) once."""
    pair = vera_pair(8, IN, OUT, generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(4)
    a, b = (random_slots("vera", IN, OUT, vera_pair=pair, generator=g) for _ in range(2))
    one = layer_call_bytes([[a, b]], IN, [OUT], [0], E).adapters
    two = layer_call_bytes([[a, b]], IN, [OUT], [0, 1], E).adapters
    own = sum(x.numel() for name, x in b.tensors().items() if name not in b.shared) * VEC_BYTES
    assert two - one == own > 0
    assert one >= 8 * (IN + OUT) * E  # the shared A and B


@pytest.mark.parametrize("fused", [False, True])
def test_shared_group_passes(fused, monkeypatch):
    """The pool's shared group (two VeRA adapters of rank 8 on one pair) beside a LoRA: A x reads every token's x
    and writes h for every token; each member's row of h and of m (float32) is read, m ⊙ h written and read by the
    tile GEMM (unless the GEMM forms it: `SHARED_FUSED_TOKENS`), its row of d written and read by the epilogue;
    cuBLAS's product + scale + GEMM are 3 launches (2 fused). A step with no member does not run them
    (`SlotPool.step_kinds`): neither A nor B is read."""
    fused_tokens = 1 << 20 if fused else 0
    monkeypatch.setattr(launch, "CONFIG", dataclasses.replace(launch.CONFIG, shared_fused_tokens=fused_tokens))
    pair = vera_pair(8, IN, OUT, generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(4)
    slots = [[*(random_slots("vera", IN, OUT, vera_pair=pair, generator=g) for _ in range(2)), lora(5)]]
    tokens = [0, 1, 2, -1]
    cost = layer_call_bytes(slots, IN, [OUT], tokens, E)
    split = choose_split_k(IN, max_tiles(len(tokens), 3))
    table = IN * E + 2 * split * R * 4 + 2 * OUT * E  # the LoRA token: shrink, partials, delta
    shared = len(tokens) * (IN + 8) * E + 2 * 8 * ((1 if fused else 3) * E + VEC_BYTES) + 2 * 2 * OUT * E
    assert cost.activations == len(tokens) * (IN + OUT) * E + table + shared + 3 * 2 * OUT * E
    assert cost.launches == 1 + 3 + (2 if fused else 3) + 1
    idle = layer_call_bytes(slots, IN, [OUT], [2, -1], E)
    assert idle.adapters == R * (IN + OUT) * E
    assert idle.launches == 1 + 3 + 1
