"""Paged KV blocks with reference counts, and the prefix cache over full blocks.

A block holds the K/V of `block_size` consecutive tokens of one request. With prefix caching, a full block
is registered under a hash chain: ``h_i = H(h_{i-1}, tokens of block i)``, rooted in the *content hash* of
the request's adapter (KV computed under adapter A is wrong for adapter B, and reloading a changed adapter
under the same name changes the root). A later request whose chain matches reuses the block (its tokens are
compared too, so a hash collision cannot serve wrong KV). Freed blocks keep their hash and stay reusable until
they are handed out again, least recently freed first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from scute.engine.request import Request


class Block:
    __slots__ = ("block_id", "hash", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] = ()


def root_hash(adapter_identity: str | None) -> bytes:
    """The root of a request's hash chain: the base model, or its adapter's content hash."""
    return hashlib.sha256(b"scute-kv:" + (adapter_identity or "base").encode()).digest()


def chain_hash(parent: bytes, token_ids: list[int]) -> bytes:
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in the order they were freed: allocation takes the oldest, so recently freed blocks
        # (a finished request's prefix) survive longest in the prefix cache. OrderedDict: O(1) removal.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[bytes, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ prefix cache
    def _update_hashes(self, req: Request) -> None:
        """Extend the request's hash chain over its full blocks (prompt and output tokens). A block whose
        tokens all precede the adapter's start (an aLoRA's prefix) was computed by the base model: it chains
        from the base root, so base requests and other aLoRAs share it; the first block the adapter touches
        mixes the adapter's root into the chain."""
        bs = self.block_size
        for i in range(len(req.block_hashes), len(req.all_token_ids) // bs):  # tokens the host has
            adapted = req.adapter_start < (i + 1) * bs
            if not req.block_hashes:
                parent = root_hash(req.adapter_identity if adapted else None)
            elif adapted and req.adapter_start >= i * bs:  # the adapter starts inside this block
                parent = hashlib.sha256(req.block_hashes[-1] + root_hash(req.adapter_identity)).digest()
            else:
                parent = req.block_hashes[-1]
            req.block_hashes.append(chain_hash(parent, req.all_token_ids[i * bs:(i + 1) * bs]))

    def get_computed_blocks(self, req: Request) -> list[int]:
        """The leading full blocks whose KV the request can reuse: the longest run of cached blocks matching its
        tokens, or, for a parallel sample (`Request.prompt_source`), the full prompt blocks its first sample has
        computed and still holds, whichever is longer. At least one token is always left to compute (its logits
        give the next token). A request still owed prompt logprobs reads no cached block (their tokens would
        have no logits)."""
        cached = [] if req.needs_prompt_logprobs else self._cached_blocks(req)
        source = req.prompt_source
        if source is None or not source.block_table or source.is_finished:
            return cached
        num = min(source.num_computed_tokens, req.num_prompt_tokens, req.num_tokens - 1) // self.block_size
        return max(cached, source.block_table[:num], key=len)

    def _cached_blocks(self, req: Request) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        self._update_hashes(req)
        bs, hits = self.block_size, []
        for i in range((req.num_tokens - 1) // bs):
            block_id = self.hash_to_block_id.get(req.block_hashes[i])
            if block_id is None or self.blocks[block_id].token_ids != tuple(req.all_token_ids[i * bs:(i + 1) * bs]):
                break
            hits.append(block_id)
        return hits

    def cache_blocks(self, req: Request) -> None:
        """Register the request's blocks that are now full and computed in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = req.num_computed_tokens // self.block_size
        if num_full <= req.num_hashed_blocks:
            return
        self._update_hashes(req)
        bs = self.block_size
        for i in range(req.num_hashed_blocks, num_full):
            block = self.blocks[req.block_table[i]]
            if block.hash is None:
                block.hash, block.token_ids = req.block_hashes[i], tuple(req.all_token_ids[i * bs:(i + 1) * bs])
                self.hash_to_block_id.setdefault(block.hash, block.block_id)
        req.num_hashed_blocks = num_full

    # ------------------------------------------------------------------ allocation
    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed_blocks: list[int] = (), reserve: int = 0
    ) -> bool:
        """Grow the request's block table to cover num_computed_tokens + num_new_tokens (a new request
        first takes `computed_blocks` from the prefix cache). Returns False, changing nothing, if fewer than
        `reserve` free blocks would remain."""
        if not computed_blocks and not reserve and \
                req.num_computed_tokens + num_new_tokens <= len(req.block_table) * self.block_size:
            return True  # its blocks hold them already (a decode step's usual case)
        total = len(computed_blocks) * self.block_size if computed_blocks else req.num_computed_tokens
        have = len(computed_blocks) if computed_blocks else len(req.block_table)
        new = max(0, self.blocks_needed(total + num_new_tokens) - have)
        revived = sum(self.blocks[b].ref_count == 0 for b in computed_blocks)  # cached but free: leave the pool
        if new + revived + reserve > self.num_free_blocks:
            return False
        if computed_blocks:
            for block_id in computed_blocks:
                self._take(block_id)
            req.block_table = list(computed_blocks)
            req.num_hashed_blocks = len(computed_blocks)
        for _ in range(new):
            block_id = next(iter(self.free_block_ids))
            self._evict(block_id)
            self._take(block_id)
            req.block_table.append(block_id)
        return True

    def free(self, req: Request) -> None:
        """Release the request's blocks (last block first, so a shared prefix outlives its tail)."""
        for block_id in reversed(req.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        req.block_table = []
        req.num_hashed_blocks = 0

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_ids[block_id]
        block.ref_count += 1

    def _evict(self, block_id: int) -> None:
        """Forget a free block's cached content before it is reused for other tokens."""
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.hash, block.token_ids = None, ()
