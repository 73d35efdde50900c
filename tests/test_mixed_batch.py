"""One forward over a batch mixing rows of all five methods and base rows: every row equals its own PEFT run.

PEFT cannot run this batch itself (it ignores `adapter_names` for IA3, VeRA and OFT and raises for DoRA), so
each row's reference is PEFT with that adapter alone.
"""

from __future__ import annotations

import pytest
import torch

from scute.adapters import load_adapter
from scute.model.context import ForwardContext, forward_context
from scute.model.hf import place_adapter, swap_linears
from tests.helpers import FIVE_METHODS as CONFIGS
from tests.helpers import effect_err, make_adapter, rel_err, tiny_model


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_mixed_batch_matches_each_adapter_alone(family, dtype, tmp_path):
    input_ids = torch.randint(0, 128, (7, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base_logits = tiny_model(family, dtype)(input_ids).logits
    refs, paths = {}, {}
    for i, (name, config) in enumerate(CONFIGS.items()):
        paths[name] = str(tmp_path / name)
        peft_model = make_adapter(paths[name], config(), family, dtype, seed=10 + i)
        with torch.no_grad():
            refs[name] = peft_model(input_ids).logits

    model = tiny_model(family, dtype)
    linears = swap_linears(model, max_adapters=8)
    order = ["oft", "lora", "vera", "dora", "ia3"]  # slots in another order than the rows
    for slot, name in enumerate(order):
        place_adapter(linears, slot, load_adapter(paths[name], model, name=name))
    rows = ["ia3", None, "lora", "oft", "vera", None, "dora"]
    row_slots = torch.tensor([-1 if r is None else order.index(r) for r in rows])
    ctx = ForwardContext(token_adapter_slots=row_slots.repeat_interleave(input_ids.shape[1]))
    with torch.no_grad(), forward_context(ctx):
        logits = model(input_ids).logits

    tol, effect_tol = (1e-10, 1e-10) if dtype == torch.float64 else (1e-5, 1e-3)
    for i, name in enumerate(rows):
        if name is None:
            assert torch.equal(logits[i], base_logits[i])
            continue
        assert rel_err(logits[i], refs[name][i]) <= tol, name
        assert effect_err(logits[i], refs[name][i], base_logits[i]) <= effect_tol, name
