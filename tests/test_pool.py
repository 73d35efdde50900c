"""The slot pool's tables are plain PyTorch: built inside the engine's inference mode, updated outside it."""

from __future__ import annotations

import torch

from scute.adapters import Slots
from scute.ops.pool import SlotPool


def lora(r: int) -> Slots:
    return Slots(8, 6, A=torch.randn(r, 8), B=torch.randn(6, r))


def test_pool_built_in_inference_mode_updates_outside_it():
    slots = [[lora(2), None, None]]
    with torch.inference_mode():  # the first forward of an engine step creates the pool
        pool = SlotPool(8, (6,), 3, "cpu", torch.float32)
        pool.update(slots)
    before = pool.table.clone()
    slots[0][1] = lora(4)
    pool.update(slots)  # set_slot, between steps
    assert not pool.table.is_inference() and not torch.equal(pool.table, before)
    with torch.inference_mode():
        slots[0][2] = Slots(8, 6, o=torch.rand(6))
        pool.update(slots)
