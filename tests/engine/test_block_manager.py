"""BlockManager: reference counts, the prefix cache's hash chain (rooted in the adapter's identity), eviction."""

from __future__ import annotations

from types import SimpleNamespace

from scute.engine.block_manager import BlockManager
from scute.engine.request import Request
from scute.sampling_params import SamplingParams


def request(tokens, identity=None, rid="r", invocation=None) -> Request:
    adapter = None if identity is None else SimpleNamespace(identity=identity, name=identity,
                                                            invocation_tokens=invocation)
    return Request(rid, None, tokens, SamplingParams(), adapter, None, 0)


def run(bm: BlockManager, req: Request) -> list[int]:
    """Admit the request, 'compute' all its tokens, register its full blocks; returns the cache hits."""
    hits = bm.get_computed_blocks(req)
    req.num_computed_tokens = len(hits) * bm.block_size
    assert bm.allocate_slots(req, req.num_tokens - req.num_computed_tokens, hits)
    req.num_computed_tokens = req.num_tokens
    bm.cache_blocks(req)
    return hits


def test_allocate_and_free_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    req = request(list(range(10)))
    assert bm.allocate_slots(req, 10)
    assert len(req.block_table) == 3 and bm.num_free_blocks == 5
    req.num_computed_tokens = 10
    assert bm.allocate_slots(req, 2)  # 12 tokens: still 3 blocks
    assert len(req.block_table) == 3
    assert bm.allocate_slots(req, 3) and len(req.block_table) == 4
    assert not bm.allocate_slots(request(list(range(40)), rid="big"), 40)  # does not fit: nothing changes
    assert bm.num_free_blocks == 4
    bm.free(req)
    assert bm.num_free_blocks == 8 and req.block_table == []


def test_prefix_hits_share_blocks_and_leave_one_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = request(list(range(12)), rid="a")
    assert run(bm, a) == []
    b = request(list(range(12)), rid="b")  # identical: 3 full blocks, but the last token must be computed
    hits = run(bm, b)
    assert hits == a.block_table[:2]
    assert all(bm.blocks[i].ref_count == 2 for i in hits)
    c = request(list(range(8)) + [99, 98, 97, 96, 95], rid="c")
    assert run(bm, c) == a.block_table[:2]


def test_hash_chain_is_rooted_in_adapter_identity():
    bm = BlockManager(num_blocks=16, block_size=4)
    run(bm, request(list(range(9)), identity="sha-A", rid="a"))
    assert run(bm, request(list(range(9)), identity="sha-B", rid="b")) == []  # same tokens, other adapter
    assert run(bm, request(list(range(9)), identity=None, rid="c")) == []  # base model
    assert len(run(bm, request(list(range(9)), identity="sha-A", rid="d"))) == 2


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = request(list(range(9)), rid="a")
    run(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = request(list(range(9)), rid="b")
    assert len(run(bm, b)) == 2  # revived from the free list
    bm.free(b)
    other = request([50 + i for i in range(16)], rid="o")  # needs every block: evicts the cached ones
    run(bm, other)
    bm.free(other)
    assert run(bm, request(list(range(9)), rid="c")) == []


def test_prefix_caching_off():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    run(bm, request(list(range(9)), rid="a"))
    assert run(bm, request(list(range(9)), rid="b")) == []


def test_alora_prefix_chains_from_the_base_root():
    """An aLoRA's blocks before its invocation tokens hash as the base model's (they were computed by it); from
    the block the adapter starts in on, the chain is the adapter's, and differs from base and plain-LoRA chains."""
    bm = BlockManager(num_blocks=32, block_size=4)
    tokens = list(range(20, 30)) + [7, 9] + list(range(40, 50))  # invocation [7, 9] at 10: inside block 2
    base, plain = request(tokens, rid="b"), request(tokens, "L", rid="p")
    alora = request(tokens, "L", rid="a", invocation=(7, 9))
    missing = request(list(range(20, 42)), "L", rid="m", invocation=(7, 9))  # never invoked: the base throughout
    missing_base = request(list(range(20, 42)), rid="mb")
    for r in (base, plain, alora, missing, missing_base):
        bm._update_hashes(r)
    alora.adapter_slot = missing.adapter_slot = 3
    assert alora.token_adapter_slots(8, 4) == [-1, -1, 3, 3] and alora.token_adapter_slots(12, 2) == [3, 3]
    assert alora.token_adapter_slots(0, 3) == [-1] * 3 and missing.token_adapter_slots(10 ** 6, 2) == [-1, -1]
    assert alora.block_hashes[:2] == base.block_hashes[:2] != plain.block_hashes[:2]
    assert all(a not in (b, p) for a, b, p in zip(alora.block_hashes[2:], base.block_hashes[2:],
                                                   plain.block_hashes[2:]))
    assert missing.block_hashes == missing_base.block_hashes
