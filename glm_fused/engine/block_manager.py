"""The paged KV cache's bookkeeping: which blocks each sequence holds, and the prefix cache.

The cache is ``num_blocks`` blocks of ``block_size`` positions (``glm_fused.kv_cache``); a
sequence holds a list of blocks (its block table), position p in block ``p // block_size``.
Blocks are handed out as the scheduler feeds a sequence tokens, and given back when it
finishes, is aborted or is preempted.

Prefix caching (on by default). A block whose positions are all computed is keyed by a hash
of its tokens and of everything before it: ``h_i = sha256(tokens of blocks 0..i)`` (int64
bytes; one running sha256 per sequence, digested at each block's end, so each token is
hashed once). Two sequences whose first i blocks hold the same tokens therefore have the same
``h_i``, and the keys and values in those blocks are the same (causal attention: a position depends
only on the tokens up to it), so a new sequence starts from the blocks it finds under its
own hashes and computes only the rest. The lookup hashes a new sequence's blocks a few at a
time and stops at the first miss: a long uncached prompt is hashed as its chunks are computed,
not all at once when it is admitted (131,072 tokens: 8,192 blocks, tens of ms). Shared
blocks are shared copy-free: each holder adds one to the block's reference count. A full
block stays cached after its last holder lets go; it is evicted (its hash forgotten) only
when the block is needed for something else.

Free blocks wait in one queue, least recently used first: new blocks come from its head.
A sequence's blocks are queued in reverse order when it lets go of them, so a later block
(of a longer, less shared prefix) is evicted before an earlier one; blocks that hold no
cached content (a partial last block, or prefix caching off) go to the head, to be reused
before anything cached. Why sha256 and not Python's ``hash``: a collision would silently give
a request another prompt's keys and values; a 256-bit digest makes that practically
impossible, at about a microsecond per block.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


LOOKUP_BATCH = 32  # blocks a lookup hashes at a time (it stops at the first miss)


class Block:
    __slots__ = ("block_id", "ref_count", "hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None  # set while the block is in the prefix cache


class BlockManager:
    """Blocks, reference counts, the LRU free queue and the prefix cache of one KV cache.

    The scheduler calls, per sequence (``glm_fused.engine.sequence.Sequence``, whose
    ``block_table``, ``block_hashes`` and ``num_cached_blocks`` live here in spirit):
    ``cached_prefix`` before admitting it, ``allocate`` before each step it joins, ``commit``
    after the forward, ``free`` when it leaves (finished, aborted, preempted).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        """Sizes as ``EngineArgs.resolve`` and ``kv_cache.settle`` checked them (at least one block)."""
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # hash -> block id
        # Running totals (tokens), for metrics.
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- state -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (cached ones included: they can be evicted at once)."""
        return len(self.free_queue)

    def usage(self) -> float:
        """Fraction of the blocks held by sequences."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- the prefix cache --------------------------------------------------------------
    def hashes(self, seq, num_blocks: int) -> list[bytes]:
        """The keys of the sequence's first ``num_blocks`` full blocks (kept on the sequence:
        its tokens never change, so they are computed once)."""
        hashes, size = seq.block_hashes, self.block_size
        first = len(hashes)
        if first < num_blocks:  # the new blocks' tokens as bytes at once, not a list and an array per block
            if first == 0:
                seq.block_hasher = hashlib.sha256()  # has seen the tokens of the blocks hashed so far
            update, digest, width = seq.block_hasher.update, seq.block_hasher.digest, 8 * size
            data = memoryview(seq.token_bytes(first * size, num_blocks * size))
            for at in range(0, len(data), width):
                update(data[at:at + width])
                hashes.append(digest())  # digest() leaves the running hash as it was: no copy
        return hashes if len(hashes) == num_blocks else hashes[:num_blocks]

    def cached_prefix(self, seq) -> list[int]:
        """The cached blocks that hold the sequence's leading full blocks (longest run of hits).

        Only ``seq.reusable_tokens`` are looked up: at least one token is always left to
        compute, so the step that admits the sequence has a last position to sample from.
        """
        if not self.enable_prefix_caching:
            return []
        hits, last, hashes = [], seq.reusable_tokens // self.block_size, seq.block_hashes
        while len(hits) < last:
            if len(hits) == len(hashes):
                self.hashes(seq, min(last, len(hits) + LOOKUP_BATCH))
            block_id = self.cached.get(hashes[len(hits)])
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    # ---- handing blocks out and taking them back ---------------------------------------
    def allocate(self, seq, num_tokens: int, cached: list[int] = ()) -> bool:
        """Give ``seq`` blocks for its first ``num_tokens`` positions, the cached blocks
        ``cached`` (from ``cached_prefix``, when admitting) first. False, and nothing changes,
        when there are not enough free blocks."""
        table = seq.block_table
        new = self.blocks_needed(num_tokens) - len(table) - len(cached)
        # A cached block no one holds sits in the free queue: taking it leaves one fewer to hand out.
        reused = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        if max(new, 0) + reused > len(self.free_queue):
            return False
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
            table.append(block_id)
        if cached:
            seq.num_cached_blocks = len(table)  # already registered in the prefix cache
        for _ in range(max(new, 0)):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:  # evict: the least recently used cached content goes
                del self.cached[block.hash]
                block.hash = None
            block.ref_count = 1
            table.append(block_id)
        return True

    def count_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """An admitted sequence looked up ``num_tokens`` tokens and found ``num_hit_tokens`` cached."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    def commit(self, seq) -> None:
        """After a forward: cache the sequence's blocks that are now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        # Only blocks whose tokens the host knows (a token still in flight hashes next time).
        full = min(seq.num_computed, seq.num_tokens) // self.block_size
        if full <= seq.num_cached_blocks:
            return
        hashes = self.hashes(seq, full)
        for i in range(seq.num_cached_blocks, full):
            block = self.blocks[seq.block_table[i]]
            # Another sequence may have computed the same content in the same step: the first
            # one cached stays, this copy stays private (freed to the head of the queue).
            if block.hash is None and hashes[i] not in self.cached:
                block.hash = hashes[i]
                self.cached[hashes[i]] = block.block_id
        seq.num_cached_blocks = full

    def free(self, seq) -> None:
        """Take back every block of ``seq``; cached ones stay findable until evicted."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if block.hash is None:
                    self.free_queue.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_cached_blocks = 0
