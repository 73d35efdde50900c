"""LoRA variants that share PEFT's peft_type "LORA": which are plain LoRA at inference, and which are refused.

Plain LoRA at inference (the normal form of `lora.py` applies unchanged):
* VeLoRA (`velora_config`): a training-time memory trick; its saved `lora_velora_embed` buffer is unused in eval.
* MonteCLoRA (`monteclora_config`): Monte Carlo sampling of A in training only; its sampler tensors are unused.
* MiCA (``init_lora_weights="mica"``): an init with a frozen B; the checkpoint is plain LoRA.
* BD-LoRA (`use_bdlora`): A [r, in/nb] (modules matching `target_modules_bd_a`, a substring match on the module
  name) or B [out, r/nb] (`target_modules_bd_b`) stored as nb blocks: expanded here with
  ``block_diag(*W.chunk(nb, 0))``, which is what PEFT multiplies by.

Plain LoRA tensors with a per-token gate:
* aLoRA (`alora_invocation_tokens`): the LoRA applies only from the start of the last occurrence of the
  invocation tokens in the prompt on (and to every generated token); never if they do not occur. The tensors
  load as plain LoRA and `Adapter.invocation_tokens` carries the gate, which the engine applies per token
  (`scute.adapters.adapter.alora_start`; the tokens before it run, and share their KV cache, with the base
  model). Paths that run an adapter on every token (`SlotModel`, `scute convert`) refuse aLoRA adapters.

Refused, with the reason (serving them as plain LoRA would be silently wrong): KaSA, Arrow, QALoRA, layer
replication — see `REFUSED`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from scute.adapters.conversion import LayerCheckpoint

TRAINING_ONLY_KEYS = (
    "lora_velora_embed",
    "lora_monteclora_sampler.expert_weights",
    "lora_monteclora_sampler.expert_weights_prior",
    "lora_monteclora_sampler.gaussian_var_prior",
    "lora_monteclora_sampler.std_prior",
)

REFUSED = {
    "kasa_config": (
        "KaSA replaces the base weight by its truncated SVD at init: exact serving needs a dense correction of "
        "the base, which Scute does not build"
    ),
    "arrow_config": "Arrow routes every token over several LoRAs by its hidden state: no static form exists",
    "use_qalora": "QALoRA pools the input in groups for GPTQ-quantized bases, which Scute does not serve",
    "layer_replication": "layer_replication duplicates base layers, which Scute's shared base cannot do",
}


def lora_factors(layer: LayerCheckpoint, r: int) -> tuple[Tensor, Tensor]:
    """(A [r, in], B [out, r]) of a LoRA layer, whatever the variant; raises for refused variants."""
    for key, why in REFUSED.items():
        if layer.config.get(key):
            raise layer.error(f"{key} is set: {why}")
    for key in TRAINING_ONLY_KEYS:
        if layer.has(key):
            layer.tensor(key)  # read (so it counts as used), not needed at inference
    bd = layer.config.get("use_bdlora") or {}
    nb = int(bd.get("nblocks", 1))
    block_a = any(p in layer.name for p in bd.get("target_modules_bd_a") or [])
    block_b = any(p in layer.name for p in bd.get("target_modules_bd_b") or [])
    i, o = layer.in_features, layer.out_features
    A = layer.tensor("lora_A.weight", (r, i // nb) if block_a else (r, i))
    B = layer.tensor("lora_B.weight", (o, r // nb) if block_b else (o, r))
    if block_a:
        A = torch.block_diag(*A.chunk(nb, 0))
    if block_b:
        B = torch.block_diag(*B.chunk(nb, 0))
    return A, B
