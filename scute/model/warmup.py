"""Kernel warm-up: the Triton kernel variants a placement will need, compiled before it is made, off the step loop.

A Triton kernel compiles once per variant: per set of constants, which follow from a pool's `SlotPool.signature`
and a step's token count (rank tiles, chunk widths, which passes run). The first adapter of a method in a model's
pools (an IA3 adapter among LoRA ones, a first OFT block size) makes new signatures; compiled on the step loop,
its variants stall every running request for a second or two each, at the recapture of the CUDA graphs and at
the first eager steps of new sizes. `warm_kernels` runs, on the adapter loader's thread as it stages an adapter,
each new kind of layer call once per token count the engine steps at, over a scratch pool (the layer's slots as
they are, the adapter in a free slot) and zeros: the variants compile there, and the step loop finds them built.
Nothing it does is seen by a step: the scratch pool, its inputs and its outputs are its own, its launches go to the
calling thread's stream with a `LaunchResources` of their own (the shrink's arrival counters are not shared with
the step loop's), and the layers' slots are only read.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch

from scute.adapters import Adapter
from scute.adapters.adapter import Pause, no_pause, paused
from scute.model.linear import ScuteLinear
from scute.ops import SlotPool, build_lora_meta, scute_linears_deferred, scute_linears_triton, triton_enabled
from scute.ops.groups import pool_facts, slot_facts
from scute.ops.launch import LaunchResources, config, tile_tokens
from scute.ops.plan import step_facts


def warm_kernels(units: Sequence[tuple], adapter: Adapter, token_counts: Sequence[int], warmed: set,
                 pause: Pause = no_pause) -> int:
    """Run every kind of layer call `adapter`'s placement makes new, at each of `token_counts` tokens, all of them
    on its slot, with the passes of its slot alone and of the whole pool (an eager step of its tokens, a CUDA
    graph); returns the calls run. `warmed` (the caller's, kept between calls) holds the kinds done: a pool's kind
    is its shape and dtype with its signature before the adapter and the adapter's part in it (`slot_facts`), then
    what the plans of its calls read of the scratch pool (`pool_facts`, `step_facts`), so that a second adapter of
    a method, or a mix whose plans are the same, makes no call. Layers of the CPU path, sharded layers (tensor
    parallelism) and an empty `token_counts` make none. `units`: the model's `layer_pools`, walked once by the
    caller. `pause` before each pool and each call."""
    calls = 0
    # the whole adapter at once: an adapter of a config (and layers) warmed before, over pools of the same
    # signatures, makes no call; this costs a load a hash of each pool's signature, not the walk below
    recipe = json.dumps({k: v for k, v in adapter.config.items() if k not in _PER_FOLDER}, sort_keys=True, default=str)
    pools = (linear.pool if group is None else group.pool for linear, group, _ in units)
    whole = (adapter.peft_type, recipe, frozenset(adapter.layers), tuple(p and p.signature for p in pools))
    if not token_counts or whole in warmed:
        return calls
    for linear, group, names in paused(units, pause):
        members = [linear] if group is None else group.members
        column = [adapter.layers.get(n) for n in names]
        x = linear.weight
        if all(sl is None for sl in column) or not triton_enabled(x[:0]) or any(m.shard is not None for m in members):
            continue
        real, part = linear.pool if group is None else group.pool, slot_facts(column)
        kind = (x.shape[1], tuple(m.out_features for m in members), x.dtype, x.device,
                None if real is None else real.signature, part._replace(share_key=part.share_key is not None))
        if kind in warmed:
            continue
        warmed.add(kind)
        column = [sl if sl is None or sl.scale == 1.0 else sl.folded() for sl in column]  # as `assign` keeps them
        slots = [list(m.slots) for m in members]
        s = next((s for s in range(len(slots[0])) if all(row[s] is None for row in slots)), 0)  # a free slot
        for row, sl in zip(slots, column):
            row[s] = sl
        facts = pool_facts(slots, kind[1])
        plans = (kind[:4], tuple(m != 0 for m in facts.kind_masks), facts.max_rank, facts.block_b, facts.min_block,
                 facts.exact_delta, facts.shared_a_of, facts.shared_outs, step_facts(facts, {s}))
        if plans in warmed:  # what the plans read of this pool is as warmed before (another mix, the same plans)
            continue
        warmed.add(plans)
        pool = SlotPool(x.shape[1], kind[1], len(slots[0]), x.device, x.dtype)
        pool.update(slots)
        pool.update_slot(slots, s)  # a placement's write of the slot's rows (`TableWrites`), as the step loop's
        merged = None if group is None else group.merged()
        calls += _calls(pool, members, merged, s, token_counts, pause)
    warmed.add(whole)
    return calls


_PER_FOLDER = ("base_model_name_or_path", "revision")  # config keys that differ between adapters of one recipe


@torch.inference_mode()
def _calls(pool: SlotPool, members: Sequence[ScuteLinear], merged, s: int, token_counts: Sequence[int],
           pause: Pause) -> int:
    """The layer call over `pool` at each token count, every token on slot `s`: with the step's passes of slot `s`
    and with every pass of the pool, and deferred where a consumer would take the delta (`defer_max_tokens`)."""
    weights, biases = [m.weight for m in members], [m.bias for m in members]
    resources = LaunchResources()  # its own arrival counters: the step loop's shrinks run meanwhile
    x = torch.zeros(max(token_counts), pool.in_features, dtype=pool.dtype, device=pool.device)
    calls = 0
    for n in sorted(set(token_counts)):
        meta = build_lora_meta(torch.full((n,), s, dtype=torch.int64, device=pool.device), pool.slot_group,
                               block_m=tile_tokens(n))
        for active in ({s}, None):
            pause()
            scute_linears_triton(x[:n], weights, biases, pool, meta, resources, active_slots=active, merged=merged)
            calls += 1
            if n <= config().defer_max_tokens:
                scute_linears_deferred(x[:n], weights, biases, pool, meta, resources, active_slots=active,
                                       merged=merged)
                calls += 1
    return calls
