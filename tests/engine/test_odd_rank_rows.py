"""A LoRA whose rank is not a multiple of 8, through the engine's adapter loader with the Triton path's slot pools:
its B is padded as the loader prepares its rows (on the path of a file in the serving dtype, before its values
land), so that its placement builds no row on the step loop, and its tokens are those of a placement that pads B
on the step loop.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (``tests/interpreter.py``), and the loader is
given the serving dtype as a GPU's has, so that the LoRA file takes the GPU's path (its own copy, arriving).
"""

from __future__ import annotations

import pytest
import torch

from tests.interpreter import DEVICE, interpreter_module, use_interpreter

FRESH_PROCESS = use_interpreter()  # before triton is imported (tests/interpreter.py)
pytest.importorskip("triton")

from peft import LoraConfig

from scute import Engine, SamplingParams
from scute.engine.adapter_loader import AdapterLoader
from scute.engine.adapter_manager import AdapterManager
from scute.ops.pool import SlotPool
from tests.helpers import ALL_LINEAR, make_adapter, tiny_model

_in_interpreter_process, test_in_a_fresh_interpreter_process = interpreter_module(__file__, FRESH_PROCESS,
                                                                                  triton_cpu=True)

PROMPTS = [[5, 17, 9, 3], [7, 7, 1]]
GREEDY = SamplingParams(temperature=0, max_tokens=3)


def test_a_rank_4_lora_is_padded_on_the_loader_and_keeps_its_tokens(tmp_path, monkeypatch):
    odd, warm = str(tmp_path / "r4"), str(tmp_path / "r8")
    make_adapter(odd, LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR), "llama", torch.float32, seed=3)
    make_adapter(warm, LoraConfig(r=8, lora_alpha=8, target_modules=ALL_LINEAR), "llama", torch.float32, seed=4)
    monkeypatch.setattr(AdapterLoader, "matrix_dtype", property(lambda loader: loader.dtype))
    built = []
    fill = SlotPool._fill_column
    monkeypatch.setattr(SlotPool, "_fill_column", lambda self, *a: built.append(self) or fill(self, *a))

    def tokens(engine: Engine, adapter: str | None) -> list[list[int]]:
        out = engine.generate(PROMPTS, GREEDY, [adapter] * len(PROMPTS), use_tqdm=False)
        return [o.outputs[0].token_ids for o in out]

    def engine() -> Engine:
        made = Engine(tiny_model("llama"), device=DEVICE, dtype="float32", max_adapters=4)
        made.generate([PROMPTS[0]], GREEDY, [warm], use_tqdm=False)  # the pools exist now
        del built[:]
        return made

    prepared = tokens(engine(), odd)
    assert built == []  # every pool's rows as the loader prepared them, the padded B's among them
    monkeypatch.setattr(AdapterManager, "_prepare", lambda self, adapter, pause, then: {})
    other = engine()
    assert tokens(other, odd) == prepared and built  # placed by the pools themselves, B padded there
    assert tokens(other, None) != prepared  # the adapter changes them: a B left at zeros would show
