"""One forward over a batch mixing rows of all five core methods and base rows: every row equals its own PEFT run.

PEFT cannot run this batch itself (it ignores `adapter_names` for IA3, VeRA and OFT and raises for DoRA), so
each row's reference is PEFT with that adapter alone (`tests/helpers.peft_alone`). A batch of every method is in
`tests/adapters/test_peft_equality.py`.
"""

from __future__ import annotations

import pytest
import torch

from scute.adapters import load_adapter
from tests.helpers import FIVE_METHODS, TOL, assert_rows_match, mixed_forward, peft_alone, tiny_model


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_mixed_batch_matches_each_adapter_alone(family, dtype, tmp_path):
    input_ids = torch.randint(0, 128, (7, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base_logits = tiny_model(family, dtype)(input_ids).logits
    refs, paths = peft_alone(tmp_path, FIVE_METHODS, family, dtype, input_ids)

    model = tiny_model(family, dtype)
    adapters = {name: load_adapter(path, model, name=name) for name, path in paths.items()}
    order = ["oft", "lora", "vera", "dora", "ia3"]  # slots in another order than the rows
    rows = ["ia3", None, "lora", "oft", "vera", None, "dora"]
    logits = mixed_forward(model, adapters, order, rows, input_ids, max_adapters=8)
    assert_rows_match(logits, rows, refs, base_logits, TOL[dtype])
