"""Random adapters in normal form and adapter-popularity batches, for the op tests and benchmarks.

Every tensor is random and non-trivial (PEFT's default inits are zero / identity and would hide errors).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from scute.ops.slots import Slots

METHODS = ("lora", "dora", "ia3", "vera", "oft", "road")
POPULARITY = ("distinct", "uniform", "zipf", "identical", "skewed")


def random_slots(method: str, in_features: int, out_features: int, *, rank: int = 16, dtype=torch.float32,
                 device="cpu", vera_pair: tuple[Tensor, Tensor] | None = None, feedforward: bool = False,
                 block: int = 8, block_share: bool = False, group: int = 8, bias: bool = False,
                 generator: torch.Generator | None = None) -> Slots:
    """One random adapter of `method` on an ``in -> out`` layer, folded (what the kernels see).

    lora/dora: rank `rank` (dora: o = magnitude ratio, c when `bias`); ia3: o, or t if `feedforward`;
    vera: A/B views of `vera_pair` (shared; [r, max_in], [max_out, r]) with m, v; oft: `block`-sized blocks
    (one shared block if `block_share`); road: o, o2 with rot group `group`.
    """
    def rnd(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*shape, generator=generator, device=_gen_device(generator, device)) * scale).to(
            device=device, dtype=dtype)

    i, o = in_features, out_features
    if method == "lora":
        s = Slots(i, o, A=rnd(rank, i, scale=i ** -0.5), B=rnd(o, rank, scale=rank ** -0.5), scale=0.5,
                  c=rnd(o, scale=0.1) if bias else None)
    elif method == "dora":
        g = 1 + rnd(o, scale=0.1)
        s = Slots(i, o, A=rnd(rank, i, scale=i ** -0.5), B=rnd(o, rank, scale=rank ** -0.5), v=g, o=g,
                  c=rnd(o, scale=0.1) if bias else None)
    elif method == "ia3":
        s = Slots(i, o, t=1 + rnd(i, scale=0.2)) if feedforward else Slots(i, o, o=1 + rnd(o, scale=0.2))
    elif method == "vera":
        A_s, B_s = vera_pair
        r = A_s.shape[0]
        s = Slots(i, o, A=A_s[:, :i], B=B_s[:o], m=rnd(r, scale=0.5), v=rnd(o, scale=0.5),
                  shared=frozenset({"A", "B"}))
    elif method == "oft":
        nb = 1 if block_share else i // block
        q = rnd(nb, block, block, scale=0.3 / math.sqrt(block))
        eye = torch.eye(block, device=device, dtype=dtype)
        s = Slots(i, o, t_blocks=eye + q - q.transpose(-2, -1))
    elif method == "road":
        theta, alpha = rnd(o, scale=0.5), 1 + rnd(o, scale=0.1)
        s = Slots(i, o, o=alpha * torch.cos(theta), o2=alpha * torch.sin(theta), rot_group=group)
    else:
        raise ValueError(f"unknown method {method!r}; known: {METHODS}")
    return s.folded()


def vera_pair(rank: int, max_in: int, max_out: int, *, dtype=torch.float32, device="cpu",
              generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """The shared (A_s [r, max_in], B_s [max_out, r]) of VeRA adapters, kaiming-uniform like PEFT's."""
    def uni(rows: int, cols: int) -> Tensor:
        bound = math.sqrt(6 / cols)
        x = torch.rand(rows, cols, generator=generator, device=_gen_device(generator, device))
        return ((x * 2 - 1) * bound).to(device=device, dtype=dtype)

    return uni(rank, max_in), uni(max_out, rank)


def _gen_device(generator: torch.Generator | None, device) -> torch.device:
    """Draw where the generator lives (a CUDA generator draws large adapters fast), else on `device`."""
    return generator.device if generator is not None else torch.device(device)


def token_slots(popularity: str, num_tokens: int, num_slots: int, *, base_fraction: float = 0.15,
                generator: torch.Generator | None = None) -> Tensor:
    """Adapter slot of each token (−1 = base) under a popularity law (punica's grid).

    distinct: every token its own slot (cycling when tokens outnumber slots); uniform; zipf (p ∝ 1/rank);
    identical: one slot for all; skewed: one hot slot for ~70 % of tokens plus a long uniform tail.
    A `base_fraction` of tokens (except under 'identical') is set to −1.
    """
    g = generator
    if popularity == "distinct":
        ts = torch.randperm(num_slots, generator=g).repeat(num_tokens // num_slots + 1)[:num_tokens]
    elif popularity == "uniform":
        ts = torch.randint(num_slots, (num_tokens,), generator=g)
    elif popularity == "zipf":
        ts = torch.multinomial(1 / torch.arange(1.0, num_slots + 1), num_tokens, replacement=True, generator=g)
    elif popularity == "identical":
        return torch.full((num_tokens,), int(torch.randint(num_slots, (1,), generator=g)))
    elif popularity == "skewed":
        hot = torch.rand(num_tokens, generator=g) < 0.7
        ts = torch.where(hot, 0, torch.randint(1, max(num_slots, 2), (num_tokens,), generator=g) % num_slots)
    else:
        raise ValueError(f"unknown popularity {popularity!r}; known: {POPULARITY}")
    base = torch.rand(num_tokens, generator=g) < base_fraction
    return torch.where(base, -1, ts)
