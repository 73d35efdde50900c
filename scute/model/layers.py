"""Module surgery for the decoder layer's elementwise work: each RMSNorm, the residual add before each
post-attention RMSNorm, each attention's rotary embedding and each MLP's SiLU·mul as one kernel
(`scute.ops.elementwise`) instead of HF's chains of small ones.

Applied by `fuse_layers` to the classes whose forward it knows (Llama, Mistral, Qwen2, Qwen3); any other module
is left as transformers wrote it. The replaced forwards are HF's, line for line, except that the rotary
embedding runs in place on the q and k heads (the column slices of the merged q/k/v GEMM's output), the
engine's attention function is called directly (the engine always routes attention to it), and the decoder
layer's first residual add runs inside the post-attention RMSNorm's kernel. The layer's second residual add
stays: the next layer's input norm is called by the model's own loop, which passes one tensor between layers.
"""

from __future__ import annotations

import types

from torch import Tensor, nn

from scute.model.attention import scute_attention
from scute.model.linear import project
from scute.ops.elementwise import add_rms_norm, rms_norm, rope_, silu_mul

RMS_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}
ATTENTIONS = {"LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention"}
MLPS = {"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"}
DECODER_LAYERS = {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"}


class ScuteRMSNorm(nn.Module):
    """HF's RMSNorm (same `weight` parameter, same eps) as one kernel."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon)


def fuse_layers(model: nn.Module) -> int:
    """Replace the RMSNorms, attention forwards and MLP forwards of known classes in place; returns how many."""
    count = 0
    for name, module in list(model.named_modules()):
        cls = type(module).__name__
        if cls in RMS_NORMS:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, ScuteRMSNorm(module))
        elif cls in DECODER_LAYERS:
            module.forward = types.MethodType(decoder_layer_forward, module)
        elif cls in ATTENTIONS:
            module.forward = types.MethodType(attention_forward, module)
        elif cls in MLPS and type(getattr(module, "act_fn", None)).__name__ in ("SiLUActivation", "SiLU"):
            module.forward = types.MethodType(mlp_forward, module)
        else:
            continue
        count += 1
    return count


def decoder_layer_forward(self, hidden_states: Tensor, **kwargs) -> Tensor:
    """HF's Llama-family decoder layer: input norm, attention, residual add and post-attention norm (one kernel),
    MLP, residual add. `kwargs` go to the attention as HF passes them."""
    residual = hidden_states
    hidden_states, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
    norm = self.post_attention_layernorm
    hidden_states, residual = add_rms_norm(hidden_states, residual, norm.weight, norm.variance_epsilon)
    return residual + self.mlp(hidden_states)


def attention_forward(self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor],
                      attention_mask: Tensor | None = None, **kwargs) -> tuple[Tensor, None]:
    """HF's Llama-family attention over the packed row [1, T, hidden]: q/k/v (one call for their `LinearGroup`),
    (Qwen3: q/k norms), the rotary embedding in place, the paged attention, o."""
    num_tokens = hidden_states.shape[1]
    x = hidden_states[0]
    q, k, v = (y.view(num_tokens, -1, self.head_dim) for y in project(x, self.q_proj, self.k_proj, self.v_proj))
    if hasattr(self, "q_norm"):
        q, k = self.q_norm(q), self.k_norm(k)
    cos, sin = position_embeddings
    q, k = rope_(q, k, cos[0].to(q.dtype), sin[0].to(q.dtype))
    window = self.sliding_window if hasattr(self, "sliding_window") else getattr(self.config, "sliding_window", None)
    out, _ = scute_attention(self, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                             None, scaling=self.scaling, sliding_window=window)
    return self.o_proj(out.reshape(1, num_tokens, -1)), None


def mlp_forward(self, x: Tensor) -> Tensor:
    """HF's gated MLP with SiLU: down(silu(gate(x)) · up(x)), gate/up in one call for their `LinearGroup`, the
    activation and product in one kernel."""
    flat = x.reshape(-1, x.shape[-1])
    return self.down_proj(silu_mul(*project(flat, self.gate_proj, self.up_proj))).view(*x.shape[:-1], -1)
