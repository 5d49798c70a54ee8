"""The paged KV cache's bookkeeping (glm_fused.engine.block_manager) and the scheduler's
preemption, unit by unit: block keys, reference counts, copy-free sharing, LRU eviction."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from glm_fused.engine import SamplingParams, Scheduler, Sequence
from glm_fused.engine.block_manager import BlockManager
from glm_fused.engine.sequence import Status
from glm_fused.engine_args import EngineArgs

BS = 4


def seq(tokens, rid="r") -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=8, temperature=0.0))


def computed(bm: BlockManager, s: Sequence, n: int | None = None) -> Sequence:
    """Allocate and 'compute' the first n tokens (all by default), as a step would."""
    n = s.num_tokens if n is None else n
    assert bm.allocate(s, n)
    s.num_computed = n
    bm.commit(s)
    return s


def test_a_block_is_keyed_by_every_token_up_to_its_end():
    bm = BlockManager(8, BS)
    a = seq(range(12))
    h = bm.hashes(a, 3)
    # Block i's key is sha256 of the int64 bytes of every token of blocks 0..i.
    for i in range(3):
        assert h[i] == hashlib.sha256(np.arange(4 * (i + 1), dtype=np.int64).tobytes()).digest()
    # Same block tokens after a different prefix: another key.
    b = seq([9, 9, 9, 9, 4, 5, 6, 7])
    assert bm.hashes(b, 2)[1] != h[1] and bm.hashes(b, 2)[0] != h[0]
    # Same prefix: same keys, whatever follows.
    assert bm.hashes(seq(list(range(8)) + [100]), 2) == h[:2]
    # Output tokens count as the sequence's tokens too, hashed as they fill blocks.
    c = seq(range(6))
    assert bm.hashes(c, 1) == h[:1]
    c.output_token_ids += [6, 7]
    assert bm.hashes(c, 2) == h[:2]
    c.output_token_ids += [8, 9, 10, 11]
    assert bm.hashes(c, 3) == h
    # The prompt is the sequence's own: a caller's array changed afterwards changes no key.
    ids = np.arange(12, dtype=np.int64)
    d = Sequence("d", ids, SamplingParams(max_tokens=8))
    ids[:] = 0
    assert bm.hashes(d, 3) == h


def test_the_lookup_stops_hashing_at_the_first_miss():
    """A long uncached prompt is not hashed whole when it is admitted: its blocks are hashed
    as they are computed (commit), the keys the same either way."""
    from glm_fused.engine.block_manager import LOOKUP_BATCH

    bm = BlockManager(256, BS)
    computed(bm, seq(range(8), "a"))                 # two full blocks cached
    tokens = list(range(8)) + list(range(100, 500))  # 102 blocks
    b = seq(tokens, "b")
    hits = bm.cached_prefix(b)
    assert len(hits) == 2 and len(b.block_hashes) <= 2 + LOOKUP_BATCH < 102
    assert bm.allocate(b, b.num_tokens, cached=hits)
    b.num_computed = b.num_tokens
    bm.commit(b)
    assert len(b.block_hashes) == 102 and b.block_hashes == bm.hashes(seq(tokens, "c"), 102)
    again = seq(tokens + [5], "d")
    assert bm.cached_prefix(again) == b.block_table  # a lookup of several batches


@pytest.mark.parametrize("shared", [0, 1, 31, 32, 33, 64, 70, 100])
def test_the_lookup_finds_the_longest_cached_run_across_its_batches(shared):
    """Keys are hashed a batch (LOOKUP_BATCH) at a time: the run of hits ends where the first
    miss is, wherever in a batch it falls, and a second lookup (keys already on the sequence)
    agrees."""
    bm = BlockManager(512, BS)
    base = list(range(100 * BS))
    a = computed(bm, seq(base, "a"))  # 100 full blocks cached
    tokens = base[:shared * BS] + [10_000 + i for i in range((100 - shared) * BS)] + [7]
    q = seq(tokens, "q")
    assert bm.cached_prefix(q) == a.block_table[:shared]
    assert bm.cached_prefix(q) == a.block_table[:shared]


def test_full_blocks_are_shared_copy_free_with_reference_counts():
    bm = BlockManager(10, BS)
    a = computed(bm, seq(range(10), "a"))          # blocks: 2 full + 1 partial
    assert len(a.block_table) == 3 and bm.num_free == 7
    b = seq(list(range(8)) + [77, 78, 79], "b")    # same first 8 tokens
    hits = bm.cached_prefix(b)
    assert hits == a.block_table[:2]
    assert bm.allocate(b, b.num_tokens, cached=hits)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] not in a.block_table
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    assert bm.num_free == 6 and bm.usage() == pytest.approx(0.4)  # one new block, no copies
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [1, 1]
    assert bm.num_free == 7                         # only a's own partial block came back
    bm.free(b)
    assert bm.num_free == 10 and bm.usage() == 0.0


def test_a_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(6, BS)
    computed(bm, seq(range(8), "a"))
    again = seq(range(8), "b")
    assert len(bm.cached_prefix(again)) == 1  # block 2 is recomputed: its last position's logits are needed
    longer = seq(range(9), "c")
    assert len(bm.cached_prefix(longer)) == 2


def test_prompt_logprobs_read_only_the_already_scored_prefix_from_the_cache():
    """Echo needs every prompt position's logits: a cached prefix would leave its tokens
    unscored (lm-eval sends one context with several continuations)."""
    bm = BlockManager(8, BS)
    computed(bm, seq(range(12), "a"))
    echo = Sequence("e", list(range(12)), SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    assert bm.cached_prefix(echo) == []
    echo.prompt_logprobs += [(0.0, [], [])] * 5   # tokens 1..5 scored (a preempted, recomputed echo)
    assert len(bm.cached_prefix(echo)) == 1       # 5 positions may be reused: one full block
    echo.prompt_logprobs += [(0.0, [], [])] * 6   # every prompt token scored
    assert len(bm.cached_prefix(echo)) == 2       # as any sequence: the last token is computed


def test_blocks_stay_cached_after_release_and_are_evicted_least_recently_used_first():
    bm = BlockManager(4, BS)
    a = computed(bm, seq(range(8), "a"))            # 2 cached blocks
    b = computed(bm, seq(range(100, 108), "b"))     # 2 more: the cache is full
    assert bm.num_free == 0 and len(bm.cached) == 4
    x = seq([1], "x")
    assert not bm.allocate(x, 1) and x.block_table == []  # nothing free: refused, nothing changed
    (a0, a1), (b0, b1) = a.block_table, b.block_table
    bm.free(a)
    bm.free(b)
    assert bm.num_free == 4 and len(bm.cached) == 4  # released, still findable
    # a was released first: its blocks are the least recently used; within a sequence the
    # later block goes first (a longer prefix is less likely to be asked for again).
    assert list(bm.free_queue) == [a1, a0, b1, b0]
    c = seq(range(200, 204), "c")
    assert bm.allocate(c, 4) and c.block_table == [a1]  # a's block 1 evicted for c
    assert bm.cached_prefix(seq(range(9), "a2")) == [a0] and len(bm.cached) == 3
    # Touching b's prefix makes it the most recently used: a's block 0 goes next.
    b2 = seq(list(range(100, 108)) + [5], "b2")
    hits = bm.cached_prefix(b2)
    assert len(hits) == 2 and bm.allocate(b2, b2.num_tokens, cached=hits)
    bm.free(b2)
    d = seq(range(300, 304), "d")
    assert bm.allocate(d, 4) and d.block_table == [a0]
    assert bm.cached_prefix(seq(range(9), "a3")) == []   # a's block 0 evicted
    assert len(bm.cached_prefix(seq(list(range(100, 108)) + [6], "b3"))) == 2  # b's kept


def test_uncached_blocks_are_reused_before_cached_ones():
    bm = BlockManager(4, BS)
    a = computed(bm, seq(range(6), "a"))            # block 0 full (cached), block 1 partial
    full, partial = a.block_table
    bm.free(a)
    x = seq([9], "x")
    assert bm.allocate(x, 1) and x.block_table == [partial]
    assert bm.blocks[full].hash is not None


def test_without_prefix_caching_nothing_is_hashed_or_found():
    bm = BlockManager(4, BS, enable_prefix_caching=False)
    computed(bm, seq(range(8), "a"))
    assert bm.cached == {} and bm.cached_prefix(seq(range(9), "b")) == []


def test_same_content_computed_twice_in_one_step_is_cached_once():
    bm = BlockManager(8, BS)
    a, b = seq(range(8), "a"), seq(range(8), "b")
    for s in (a, b):
        assert bm.allocate(s, 8)
    for s in (a, b):
        s.num_computed = 8
        bm.commit(s)
    assert len(bm.cached) == 2 and all(bm.cached[h] in a.block_table for h in bm.hashes(a, 2))
    private = b.block_table
    bm.free(b)                                      # b's private copies go to the head: reused first
    assert list(bm.free_queue)[:2] == private
    x = seq([1], "x")
    assert bm.allocate(x, 1) and bm.blocks[x.block_table[0]].hash is None


def deliver(s, token: int) -> None:
    """What the engine does when a sampled token reaches the host."""
    s.num_inflight -= 1
    s.output_token_ids.append(token)


def test_scheduler_preempts_the_latest_admitted_and_requeues_it_first():
    args = EngineArgs(max_num_seqs=4, max_model_len=16, max_num_batched_tokens=64, block_size=BS)
    args.num_kv_blocks = 4  # 16 positions in all
    sched = Scheduler(args)
    old, new = seq(range(7), "old"), seq(range(50, 57), "new")
    sched.add(old)
    sched.add(new)
    step = sched.schedule()                         # both admitted: 2 + 2 blocks, none free
    sched.commit(step)
    assert [s.request_id for s in step.seqs] == ["old", "new"] and sched.blocks.num_free == 0
    for s in (old, new):
        deliver(s, 1)                               # 8 tokens each: fits the blocks they have
    sched.commit(sched.schedule())
    for s in (old, new):
        deliver(s, 2)                               # token 9 needs a third block: none free
    step = sched.schedule()
    assert [s.request_id for s in step.seqs] == ["old"]
    assert new.status is Status.WAITING and new.num_computed == 0 and new.block_table == []
    assert list(sched.waiting) == [new] and new.num_preemptions == 1 == sched.num_preemptions
    assert len(old.block_table) == 3
    sched.commit(step)
    sched.finish(old, "stop")
    # Recomputed later, from its prompt and the outputs it already has; its first full block
    # was cached when computed, so only the rest is fed again.
    step = sched.schedule()
    assert step.seqs == [new] and step.batch.context_lens.tolist() == [4]
    assert step.num_new == [new.num_tokens - 4] and step.sample == [True]
    assert sched.kv_cache_stats()["num_preemptions"] == 1
