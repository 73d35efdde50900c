"""The mixed batch of `test_peft_equality` (rows of 19 adapters of 15 methods in shuffled slots, and base rows)
through the Triton kernels on the CPU, in Triton's interpreter (float32: its bf16 math is not the GPU's), against
PEFT with each adapter alone: every converter's slot forms through the kernels a GPU runs, without a GPU. The op
calls are counted and the reference op refused, so a forward any of whose layers silently took the reference path
fails. On CUDA the same batch runs on the
GPU (`test_mixed_batch_of_many_methods_triton`)."""

from __future__ import annotations

import pytest
import torch

from tests.interpreter import DEVICE, interpreter_module, use_interpreter

FRESH_PROCESS = use_interpreter()  # before triton is imported (tests/interpreter.py)
pytest.importorskip("triton")

import scute.model.linear as linear_mod
from tests.adapters.test_peft_equality import MIXED, ORDER, ROWS, mixed_adapters
from tests.helpers import TOL, assert_rows_match, mixed_forward, tiny_model

pytestmark = pytest.mark.skipif(DEVICE == "cuda", reason="on CUDA: test_mixed_batch_of_many_methods_triton")

_in_interpreter_process, test_in_a_fresh_interpreter_process = interpreter_module(__file__, FRESH_PROCESS,
                                                                                  triton_cpu=True)


def test_mixed_batch_of_many_methods_through_the_kernels(tmp_path, monkeypatch):
    calls = []
    for name in ("scute_linears_triton", "scute_linears_deferred"):  # the model's forwards call both
        op = getattr(linear_mod, name)
        monkeypatch.setattr(linear_mod, name, lambda *a, _op=op, **kw: calls.append(1) or _op(*a, **kw))
    monkeypatch.setattr(linear_mod, "scute_linear_cpu", lambda *a, **kw: pytest.fail("a layer took the reference op"))
    ids = torch.randint(0, 128, (len(MIXED) + 2, 2), generator=torch.Generator().manual_seed(3))
    refs, adapters = mixed_adapters(tmp_path, torch.float32, ids)
    model = tiny_model("qwen2", torch.float32)
    with torch.no_grad():
        base_logits = model(ids).logits
    logits = mixed_forward(model, adapters, ORDER, ROWS, ids)
    assert calls  # the Triton path ran
    assert_rows_match(logits, ROWS, refs, base_logits, TOL[torch.float32])
