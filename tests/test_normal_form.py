"""Every method and config variant against PEFT itself: per layer and whole model, float64 and float32."""

from __future__ import annotations

import pytest
import torch
from peft import IA3Config, LoraConfig, OFTConfig, VeraConfig

from scute.adapters import convert_checkpoint, load_adapter, read_checkpoint
from scute.adapters.conversion import linear_modules
from scute.model.context import ForwardContext, forward_context
from scute.model.hf import place_adapter, swap_linears
from tests.helpers import ALL_LINEAR, capture_layers, check_layers, effect_err, make_adapter, rel_err, tiny_model

QKV = ["q_proj", "k_proj", "v_proj"]
CASES = {
    "lora": lambda: LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR),
    "lora_rslora": lambda: LoraConfig(r=4, lora_alpha=6, use_rslora=True, target_modules=ALL_LINEAR),
    "lora_patterns": lambda: LoraConfig(
        r=4, lora_alpha=8, target_modules=ALL_LINEAR,
        rank_pattern={"q_proj": 2, "layers.1.mlp.down_proj": 6}, alpha_pattern={"v_proj": 3, "up_proj": 16},
    ),
    "lora_bias": lambda: LoraConfig(r=4, lora_alpha=8, lora_bias=True, target_modules=["q_proj", "v_proj"]),
    "lora_layers": lambda: LoraConfig(r=4, lora_alpha=8, target_modules=QKV + ["o_proj"], layers_to_transform=[1]),
    "dora": lambda: LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=ALL_LINEAR),
    "dora_rslora": lambda: LoraConfig(r=4, lora_alpha=8, use_dora=True, use_rslora=True, target_modules=QKV),
    "ia3": lambda: IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
    "ia3_output_only": lambda: IA3Config(target_modules=["q_proj", "o_proj", "up_proj"], feedforward_modules=[]),
    "vera": lambda: VeraConfig(r=8, target_modules=["q_proj", "v_proj", "up_proj"]),
    "vera_regenerated": lambda: VeraConfig(r=8, target_modules=["q_proj", "v_proj", "up_proj"],
                                           save_projection=False, projection_prng_key=7),
    "oft": lambda: OFTConfig(r=0, oft_block_size=8, target_modules=ALL_LINEAR),
    "oft_cayley": lambda: OFTConfig(r=0, oft_block_size=8, use_cayley_neumann=False, target_modules=QKV),
    "oft_neumann3": lambda: OFTConfig(r=0, oft_block_size=8, num_cayley_neumann_terms=3, target_modules=QKV),
    "oft_neumann8": lambda: OFTConfig(r=0, oft_block_size=16, num_cayley_neumann_terms=8, target_modules=QKV),
    "oft_coft": lambda: OFTConfig(r=0, oft_block_size=8, coft=True, eps=3.0, target_modules=QKV),
    "oft_block_share": lambda: OFTConfig(r=0, oft_block_size=8, block_share=True, target_modules=ALL_LINEAR),
    "oft_r": lambda: OFTConfig(r=4, oft_block_size=0, target_modules=["q_proj", "o_proj"]),
}
BIAS_CASES = {  # need a base with biases (qwen2: q/k/v)
    "lora_bias_all": lambda: LoraConfig(r=4, lora_alpha=8, bias="all", target_modules=["q_proj", "o_proj"]),
    "lora_bias_lora_only": lambda: LoraConfig(r=4, lora_alpha=8, bias="lora_only", target_modules=QKV),
    "dora_bias_all": lambda: LoraConfig(r=4, lora_alpha=8, use_dora=True, bias="all", target_modules=QKV),
    "ia3_bias": lambda: IA3Config(target_modules=["q_proj", "k_proj"], feedforward_modules=["k_proj"]),
}
GRID = [(c, f) for c in CASES for f in ("llama", "qwen2")] + [(c, "qwen2") for c in BIAS_CASES]
TOL = {torch.float64: dict(rel=1e-10, effect=1e-10), torch.float32: dict(rel=1e-5, effect=1e-3)}


def scute_model(family, dtype, adapter_path):
    """A fresh base with its linears swapped and the adapter in slot 0; returns (model, adapter)."""
    model = tiny_model(family, dtype)
    linears = swap_linears(model, max_adapters=2)
    adapter = load_adapter(adapter_path, model)
    place_adapter(linears, 0, adapter)
    return model, adapter


def run(model, input_ids, slots_per_row):
    token_slots = torch.tensor(slots_per_row).repeat_interleave(input_ids.shape[1])
    with torch.no_grad(), forward_context(ForwardContext(token_adapter_slots=token_slots)):
        return model(input_ids).logits


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case,family", GRID, ids=[f"{c}-{f}" for c, f in GRID])
def test_matches_peft(case, family, dtype, tmp_path):
    config = {**CASES, **BIAS_CASES}[case]()
    peft_model = make_adapter(str(tmp_path), config, family, dtype)
    input_ids = torch.randint(0, 128, (3, 7), generator=torch.Generator().manual_seed(0))
    peft_logits, layers = capture_layers(peft_model, input_ids)
    with torch.no_grad():
        base_logits = tiny_model(family, dtype)(input_ids).logits
    tol = TOL[dtype]
    assert rel_err(base_logits, peft_logits) > 1e-3, "the adapter has no visible effect: the test could not fail"

    # per layer, unfolded and folded, from the checkpoint alone
    base = tiny_model(family, dtype)
    slots = convert_checkpoint(read_checkpoint(tmp_path), linear_modules(base))
    check_layers(layers, slots, base, tol)

    # whole model through ScuteLinear, all rows on the adapter, then base rows
    model, _ = scute_model(family, dtype, tmp_path)
    logits = run(model, input_ids, [0, 0, 0])
    assert rel_err(logits, peft_logits) <= tol["rel"]
    assert effect_err(logits, peft_logits, base_logits) <= tol["effect"]
    assert torch.equal(run(model, input_ids, [-1, -1, -1]), base_logits)
