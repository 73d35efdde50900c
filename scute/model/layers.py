"""Module surgery for the decoder layer's elementwise work: each RMSNorm, the residual add before each
post-attention RMSNorm, each attention's rotary embedding and each MLP's SiLU·mul as one kernel
(`scute.ops.elementwise`) instead of HF's chains of small ones.

Applied by `fuse_layers` to the classes whose forward it knows (Llama, Mistral, Qwen2, Qwen3); any other module
is left as transformers wrote it. The replaced forwards are HF's, line for line, except that the rotary
embedding runs in place on the q and k heads (the column slices of the merged q/k/v GEMM's output), the
engine's attention function is called directly (the engine always routes attention to it), and the decoder
layer's first residual add runs inside the post-attention RMSNorm's kernel. The layer's second residual add
stays: the next layer's input norm is called by the model's own loop, which passes one tensor between layers.

Inside the decoder layer, o, gate/up and down are called deferred (`project_deferred`): on a one-token decode step
of a plain LoRA adapter their deltas come back beside their base outputs, and the kernel that consumes each output adds
them (the add + RMSNorm, the SiLU·mul, the residual add), with the epilogue's rounding: the same tokens, three
launches fewer a layer. q/k/v keep their epilogue (their consumers are the rotary embedding and the KV store).
"""

from __future__ import annotations

import types

from torch import Tensor, nn

from scute.model.attention import scute_attention
from scute.model.linear import project, project_deferred
from scute.ops.elementwise import add_rms_norm, plus, residual_add, rms_norm, rope_, silu_mul

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
    MLP, residual add, the deferred deltas of o and down added by the adds. `kwargs` go to the attention as HF
    passes them."""
    residual = hidden_states
    hidden_states, delta = attention_deferred(self.self_attn, self.input_layernorm(hidden_states), **kwargs)
    norm = self.post_attention_layernorm
    hidden_states, residual = add_rms_norm(hidden_states, residual, norm.weight, norm.variance_epsilon, delta)
    return residual_add(residual, *mlp_deferred(self.mlp, hidden_states))


def attention_forward(self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor],
                      attention_mask: Tensor | None = None, **kwargs) -> tuple[Tensor, None]:
    """HF's Llama-family attention over the packed row [1, T, hidden]: q/k/v (one call for their `LinearGroup`),
    (Qwen3: q/k norms), the rotary embedding in place, the paged attention, o."""
    return plus(*_attention(self, hidden_states, position_embeddings)), None


def attention_deferred(attn: nn.Module, hidden_states: Tensor, **kwargs) -> tuple[Tensor, Tensor | None]:
    """The attention's output before o's deferred delta, and the delta (`project_deferred`); `kwargs` as HF's
    decoder layer passes them. An attention whose forward is not `attention_forward` gives its complete output."""
    if not _runs(attn, attention_forward):
        return attn(hidden_states=hidden_states, **kwargs)[0], None
    return _attention(attn, hidden_states, kwargs["position_embeddings"])


def _attention(self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor],
               ) -> tuple[Tensor, Tensor | None]:
    """The attention's body: its output before o's deferred delta, and the delta."""
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
    (z,), (d,) = project_deferred(out.reshape(1, num_tokens, -1), self.o_proj)
    return z, d


def mlp_forward(self, x: Tensor) -> Tensor:
    """HF's gated MLP with SiLU: down(silu(gate(x)) · up(x)), gate/up in one call for their `LinearGroup`, the
    activation and product in one kernel."""
    return plus(*mlp_deferred(self, x))


def mlp_deferred(mlp: nn.Module, x: Tensor) -> tuple[Tensor, Tensor | None]:
    """The MLP's output before down's deferred delta, and the delta; gate/up's deltas go to the SiLU·mul. An MLP
    whose forward is not `mlp_forward` (another activation) gives its complete output."""
    if not _runs(mlp, mlp_forward):
        return mlp(x), None
    flat = x.reshape(-1, x.shape[-1])
    (gate, up), (d_gate, d_up) = project_deferred(flat, mlp.gate_proj, mlp.up_proj)
    (z,), (d,) = project_deferred(silu_mul(gate, up, d_gate, d_up), mlp.down_proj)
    return z.view(*x.shape[:-1], -1), d


def _runs(module: nn.Module, forward) -> bool:
    """Whether `fuse_layers` gave `module` this forward."""
    return getattr(module.forward, "__func__", None) is forward
