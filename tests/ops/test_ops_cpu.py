"""The CPU serving path (`scute_linear_cpu`: low-rank parts batched) against the reference op it must equal."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from scute.ops.cpu import MIN_BATCHED, LowRankStack, scute_linear_cpu
from scute.ops.reference import scute_linear_ref
from scute.ops.testing import POPULARITY, random_slots, token_slots, vera_pair

IN, OUT = 256, 192  # wide enough that the batched form pays (see the fallback test)


def mixed(dtype, gen) -> list:
    """Every method, ranks 1..17, a VeRA pair shared by two slots, an empty slot."""
    pair = vera_pair(8, IN, OUT, dtype=dtype, generator=gen)
    kw = dict(dtype=dtype, generator=gen)
    return [random_slots("lora", IN, OUT, rank=16, bias=True, **kw), random_slots("lora", IN, OUT, rank=1, **kw),
            random_slots("dora", IN, OUT, rank=17, bias=True, **kw), None, random_slots("ia3", IN, OUT, **kw),
            random_slots("ia3", IN, OUT, feedforward=True, **kw), random_slots("vera", IN, OUT, vera_pair=pair, **kw),
            random_slots("vera", IN, OUT, vera_pair=pair, **kw), random_slots("oft", IN, OUT, block=8, **kw),
            random_slots("road", IN, OUT, group=8, **kw)]


def run(dtype, popularity, num_tokens, seed, slots=None):
    gen = torch.Generator().manual_seed(seed)
    slots = mixed(dtype, gen) if slots is None else slots
    w = (torch.randn(OUT, IN, generator=gen) / IN ** 0.5).to(dtype)
    b = torch.randn(OUT, generator=gen).to(dtype)
    ts = token_slots(popularity, num_tokens, len(slots), generator=gen)
    x = torch.randn(num_tokens, IN, generator=gen).to(dtype)
    stack = LowRankStack.build(slots, torch.float64 if dtype == torch.float64 else torch.float32, x.device)
    y = scute_linear_cpu(x, w, b, slots, ts, stack)
    if len({a for a in ts.tolist() if a in stack.spans}) >= MIN_BATCHED:  # batched: a zeroed stack shows it
        zeroed = LowRankStack(torch.zeros_like(stack.a), torch.zeros_like(stack.b), stack.spans)
        assert not torch.equal(scute_linear_cpu(x, w, b, slots, ts, zeroed), y)
    return y, scute_linear_ref(x, w, b, slots, ts), F.linear(x, w, b), ts, slots


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("popularity", POPULARITY)
def test_equals_reference(dtype, tol, popularity):
    for num_tokens in (1, 7, 33):
        y, ref, base, ts, slots = run(dtype, popularity, num_tokens, seed=num_tokens)
        plain = torch.tensor([a < 0 or slots[a] is None for a in ts.tolist()])
        assert torch.equal(y[plain], base[plain])
        err = (y.double() - ref.double()).abs().amax(1) / (ref.double() - base.double()).abs().amax(1).clamp_min(1e-3)
        assert bool((err[~plain] <= tol).all()), float(err.max())


def test_wide_ranks_go_through_the_loop():
    """On a 256 -> 192 layer the masked product may hold ~110 rank columns: the three rank-4 adapters are batched,
    the two rank-100 ones run through the reference loop (their rows bit-identical to it, the stack unread)."""
    gen = torch.Generator().manual_seed(3)
    ranks = [100, 4, 4, 100, 4]
    slots = [random_slots("lora", IN, OUT, rank=r, dtype=torch.float64, generator=gen) for r in ranks]
    ts = torch.arange(10) % 5
    x = torch.randn(10, IN, generator=gen).double()
    w, b = torch.randn(OUT, IN, generator=gen).double(), torch.randn(OUT, generator=gen).double()
    stack = LowRankStack.build(slots, torch.float64, x.device)
    zeroed = LowRankStack(torch.zeros_like(stack.a), torch.zeros_like(stack.b), stack.spans)
    y, ref = scute_linear_cpu(x, w, b, slots, ts, zeroed), scute_linear_ref(x, w, b, slots, ts)
    wide = torch.tensor([ranks[a] == 100 for a in ts.tolist()])
    assert torch.equal(y[wide], ref[wide]) and not torch.isclose(y[~wide], ref[~wide]).all(dim=1).any()
    torch.testing.assert_close(scute_linear_cpu(x, w, b, slots, ts, stack), ref, rtol=1e-12, atol=1e-12)
