"""`fuse_layers`' decoder-layer forward (the residual add inside the post-attention RMSNorm's kernel) against
transformers' own layer, for each family it knows. The attention is a stub (the real one needs the engine's paged
KV cache; `tests/engine` runs it end to end against PEFT). Without CUDA the kernels run in Triton's interpreter,
as in `tests/interpreter.py`; the fused kernel's launches are counted, so a forward that silently fell back to
the add and the norm fails here."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from tests.interpreter import DEVICE, interpreter_module, spy_launches, use_interpreter

FRESH_PROCESS = use_interpreter()  # before triton is imported (tests/interpreter.py)
pytest.importorskip("triton")

from scute.model import layers  # noqa: E402
from scute.ops import elementwise as ew  # noqa: E402


_in_interpreter_process, test_in_a_fresh_interpreter_process = interpreter_module(__file__, FRESH_PROCESS,
                                                                                  triton_cpu=True)


class StubAttention(nn.Module):
    """x -> (tanh(x W), None), recording the keyword arguments it was called with."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.seen: list[dict] = []

    def forward(self, hidden_states, **kwargs):
        self.seen.append(kwargs)
        return torch.tanh(self.proj(hidden_states)), None


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_decoder_layer_forward_is_transformers(monkeypatch, family):
    from transformers import LlamaConfig, Qwen2Config
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    config_cls, layer_cls = {"llama": (LlamaConfig, LlamaDecoderLayer), "qwen2": (Qwen2Config, Qwen2DecoderLayer)}[family]
    config = config_cls(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                        num_hidden_layers=1, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    ref = layer_cls(config, 0).eval()
    for norm in (ref.input_layernorm, ref.post_attention_layernorm):
        nn.init.normal_(norm.weight, 1.0, 0.2)
    ref.self_attn = StubAttention(64)
    fused = copy.deepcopy(ref)
    holder = nn.Module()
    holder.layer = fused
    assert layers.fuse_layers(holder) >= 4  # the layer, its two norms, its MLP
    seen = spy_launches(monkeypatch, ew._kernels(), "add_rms_norm_kernel")
    x = 3 * torch.randn(1, 5, 64)
    with torch.no_grad():
        want = ref(x, position_ids=torch.arange(5)[None])
        got = fused.to(DEVICE)(x.to(DEVICE), position_ids=torch.arange(5, device=DEVICE)[None])
    assert seen, "the fused add + RMSNorm kernel did not run"
    assert set(fused.self_attn.seen[0]) == {"position_ids"}  # what the caller passed, for the attention
    torch.testing.assert_close(fused.self_attn.seen[0]["position_ids"].cpu(), ref.self_attn.seen[0]["position_ids"])
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_deferred_deltas_land_in_their_consumers(monkeypatch):
    """A decoder layer whose MLP holds plain LoRA slots, base tokens among the step's: gate/up's and down's deltas
    come back deferred and the SiLU·mul and the residual add complete them, with the bits the epilogues give (the
    same layer with deferral off), launching no epilogue. (Deferral is allowed up to 8 tokens here: by default
    one, where it pays.)"""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from scute.model.context import ForwardContext, forward_context
    from scute.model.hf import swap_linears
    from scute.ops import plan as plan_mod, triton_ops
    from scute.ops.epilogue import epilogue_
    from scute.ops.testing import random_slots

    from scute.ops import launch

    monkeypatch.setattr(launch, "CONFIG", dataclasses.replace(launch.CONFIG, defer_max_tokens=8))
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=1)
    torch.manual_seed(0)
    holder = nn.Module()
    holder.layer = LlamaDecoderLayer(config, 0).eval()
    holder.layer.self_attn = StubAttention(64)
    holder.to(DEVICE)
    linears = swap_linears(holder, 2)
    layers.fuse_layers(holder)
    gen = torch.Generator().manual_seed(1)
    lora = lambda i, o: random_slots("lora", i, o, rank=4, device=DEVICE, generator=gen)  # noqa: E731
    for slot in (0, 1):
        linears["layer.mlp.gate_proj"].group.set_slot(slot, [lora(64, 96), lora(64, 96)])
        linears["layer.mlp.down_proj"].set_slot(slot, lora(96, 64))
    token_slots = torch.tensor([0, 1, -1, 0, 1], device=DEVICE)
    x = 3 * torch.randn(1, 5, 64, device=DEVICE)
    epilogues = []
    monkeypatch.setattr(triton_ops, "epilogue_", lambda *a, **k: epilogues.append(1) or epilogue_(*a, **k))

    def run():
        ctx = ForwardContext(token_slots, active_adapter_slots=frozenset(token_slots.tolist()))
        with torch.no_grad(), forward_context(ctx):
            return holder.layer(x, position_ids=torch.arange(5, device=DEVICE)[None])

    deferred = run()
    assert not epilogues
    monkeypatch.setattr(plan_mod, "_defer_plan", lambda *a, **k: None)
    completed = run()
    assert len(epilogues) == 2  # gate/up's and down's
    assert torch.equal(deferred, completed)
    for linear in linears.values():
        linear.slots = [None] * 2
        linear.num_filled = 0
    assert not torch.allclose(run(), completed)  # the adapters had an effect: the test would see a lost delta
