"""MiSS (matrix shard sharing).

PEFT forward (eval), by `init_weights`:
* balance (True/False): ``y = W0 x + b0 + Mᵀ S x`` with M = `miss_block` [r, out] and S [r, in] summing the
  input's r-chunks (``S[j mod r, j] = 1``; PEFT zero-pads x to a multiple of r, which S does by itself).
* mini: the same with M [r, mini_r] tiled along the outputs (``M.repeat(1, out // mini_r)``).
* bat: M [out/r, r, r], one r×r block per output block a, and ``W_eff[a, b] = W0[a, b](I + M_a) + M_a`` for every
  r×r block (a, b) of W0. The input transform depends on the output block: no form with a shared W0 exists, so
  it is served only as the dense ΔW (opt-in, `dense.py`).
Normal form (balance, mini): A = S — a fixed 0/1 matrix, interned and *shared* by every adapter with the same
(r, in) —, B = Mᵀ per adapter. Rank r.
"""

from __future__ import annotations

import torch

from scute.adapters.conversion import LayerCheckpoint
from scute.adapters.methods.dense import full_rank_slots, require_dense
from scute.adapters.registry import register_method
from scute.ops.slots import Slots


@register_method("MISS", keys=("miss_block",))
def convert_miss(layer: LayerCheckpoint) -> Slots:
    cfg, i, o = layer.config, layer.in_features, layer.out_features
    M = layer.tensor("miss_block")
    if cfg.get("init_weights") == "bat":
        require_dense(layer, "MiSS 'bat' transforms the input differently for every output block "
                             "(W[a, b] ← W[a, b](I + M_a) + M_a)")
        r = M.shape[-1]
        M = layer.tensor("miss_block", (o // r, r, r))
        W = layer.weight.reshape(o // r, r, i // r, r)  # [a, p, b, q]
        delta = torch.einsum("apbq,aqs->apbs", W, M) + M[:, :, None, :]
        return full_rank_slots(layer, delta.reshape(o, i))
    if cfg.get("init_weights") == "mini":
        mini = int(cfg.get("mini_r", 1))
        if M.dim() != 2 or M.shape[1] != mini or o % mini:
            raise layer.error(f"miss_block has shape {tuple(M.shape)}: mini needs [r, mini_r={mini}] with "
                              f"mini_r dividing out_features {o}")
        M = M.repeat(1, o // mini)
    else:
        M = layer.tensor("miss_block", (M.shape[0], o))
    r = M.shape[0]
    S = torch.zeros(r, i, dtype=M.dtype)
    S[torch.arange(i) % r, torch.arange(i)] = 1
    return Slots(i, o, A=layer.intern(S), B=M.T.contiguous(), shared=frozenset({"A"}))
