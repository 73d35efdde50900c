"""Test fixtures: tiny transformers models built from configs, and real PEFT adapters with every tensor randomized.

PEFT's default inits are zero or identity (LoRA B = 0, OFT R = I, IA3 l = 1) and would hide bugs, so
`make_adapter` perturbs every trainable adapter tensor before `save_pretrained`.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable

import torch
from peft import IA3Config, LoraConfig, OFTConfig, VeraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

FAMILIES = ("llama", "qwen2")
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FIVE_METHODS = {  # one config of each core method, for tests that mix them
    "lora": lambda: LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR),
    "dora": lambda: LoraConfig(r=6, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj", "up_proj"]),
    "ia3": lambda: IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
    "vera": lambda: VeraConfig(r=8, target_modules=["q_proj", "v_proj", "up_proj"]),
    "oft": lambda: OFTConfig(r=0, oft_block_size=8, target_modules=ALL_LINEAR),
}


def tiny_model(family: str = "llama", dtype: torch.dtype = torch.float32, seed: int = 0, hidden: int = 64):
    """A 2-layer model with GQA (4 query heads, 2 kv heads); qwen2 has q/k/v biases. Deterministic per seed."""
    common = dict(
        vocab_size=128, hidden_size=hidden, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
        with torch.no_grad():  # transformers inits biases to zero: make them matter
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0, 0.1)
    else:
        raise ValueError(family)
    return model.to(dtype).eval()


def randomize_adapter(peft_model, seed: int = 1) -> None:
    """Give every trainable adapter tensor a random, non-trivial value (a perturbation of its init)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if not p.requires_grad:
                continue
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
            if "lora_magnitude_vector" in name or "ia3_l" in name:
                p.mul_(1 + 0.3 * noise)  # scales around their identity init
            elif "oft_R" in name:
                p.copy_(0.15 * noise)
            elif "vera_lambda" in name:
                p.copy_(0.5 * noise)
            elif ".ranknum." in name:
                continue  # AdaLoRA's rank number: a constant (init_r) that PEFT marks trainable but never saves
            elif "boft_s" in name or "road_alpha" in name or "delora_lambda" in name:
                p.mul_(1 + 0.3 * noise)  # scales around their init (ones; DeLoRA: the configured lambda)
            elif name.endswith("bias"):
                p.add_(0.1 * noise)
            else:
                p.copy_(0.2 * noise)


@contextlib.contextmanager
def perturbed_buffers(scale: Callable[[str], float]):
    """While active, `make_adapter` also multiplies each saved buffer (frozen, so `randomize_adapter` leaves it
    as PEFT built it) by ``1 + scale(name)·noise`` (scale 0: untouched): for methods whose saved buffers shape the
    forward, so that a converter recomputing them instead of reading them fails."""
    global randomize_adapter
    original = randomize_adapter

    def randomize(peft_model, seed: int = 1) -> None:
        original(peft_model, seed)
        g = torch.Generator().manual_seed(seed + 100)
        with torch.no_grad():
            for name, b in peft_model.named_buffers():
                if s := scale(name):
                    b.mul_(1 + s * torch.randn(b.shape, generator=g, dtype=torch.float64).to(b.dtype))

    randomize_adapter = randomize
    try:
        yield
    finally:
        randomize_adapter = original


def make_adapter(path: str, config, family: str = "llama", dtype: torch.dtype = torch.float32, seed: int = 1,
                 hidden: int = 64):
    """Build a PEFT model on a fresh tiny base, randomize its adapter, save it to `path`; returns the PEFT model."""
    peft_model = get_peft_model(tiny_model(family, dtype, hidden=hidden), config)
    randomize_adapter(peft_model, seed)
    peft_model.eval()
    os.makedirs(path, exist_ok=True)
    peft_model.save_pretrained(path)
    return peft_model


def edit_adapter_config(path, **changes) -> None:
    """Rewrite the adapter_config.json in the folder `path` with `changes` (a value of None deletes the key)."""
    file = os.path.join(path, "adapter_config.json")
    with open(file) as f:
        cfg = json.load(f)
    for key, value in changes.items():
        if value is None:
            cfg.pop(key)
        else:
            cfg[key] = value
    with open(file, "w") as f:
        json.dump(cfg, f)


def capture_layers(peft_model, input_ids: torch.Tensor):
    """Run the PEFT model once; returns (logits, {module name: (input, output)}) for every adapted layer,
    names as in the base model (without PEFT's ``base_model.model.`` prefix)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    records, hooks = {}, []
    prefix = "base_model.model."
    for name, module in peft_model.named_modules():
        if isinstance(module, BaseTunerLayer) and name.startswith(prefix):
            def hook(mod, args, out, name=name[len(prefix):]):
                records[name] = (args[0].detach(), out.detach())
            hooks.append(module.register_forward_hook(hook))
    with torch.no_grad():
        logits = peft_model(input_ids).logits
    for h in hooks:
        h.remove()
    return logits, records


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual − expected| / max |expected|."""
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def effect_err(actual: torch.Tensor, expected: torch.Tensor, base: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected − base‖: the error as a fraction of the adapter's effect."""
    return ((actual - expected).norm() / (expected - base).norm()).item()


def check_layers(layers: dict, slots: dict, base_model, tol: dict) -> float:
    """Each PEFT-adapted layer's captured (input, output) against the reference op with the converted slots,
    unfolded and folded; asserts `tol` ("rel" of the output, "effect" of the adapter's change) and returns the
    largest relative error."""
    from scute.ops.reference import scute_linear_ref

    assert set(layers) <= set(slots), "a layer PEFT adapts was not converted"
    modules, worst = dict(base_model.named_modules()), 0.0
    for name, (x, y_peft) in layers.items():
        lin = modules[name]
        x2 = x.reshape(-1, lin.in_features)
        zeros = torch.zeros(x2.shape[0], dtype=torch.long)
        y_base = torch.nn.functional.linear(x2, lin.weight, lin.bias)
        for s in (slots[name], slots[name].folded()):
            y = scute_linear_ref(x2, lin.weight, lin.bias, [s], zeros)
            expected = y_peft.reshape(y.shape)
            worst = max(worst, rel_err(y, expected))
            assert rel_err(y, expected) <= tol["rel"], name
            if not torch.equal(expected, y_base):
                assert effect_err(y, expected, y_base) <= tol["effect"], name
    return worst
