"""Continuous batching over the paged KV cache, with chunked prefill, prefix caching and preemption.

The KV cache is a pool of fixed-size blocks (``glm_fused.engine.block_manager``): a sequence
holds only the blocks its tokens fill, so many short sequences share the memory that would
otherwise be reserved for a few of the longest possible. Each step takes at most
``max_num_batched_tokens`` tokens, in this order:
1. one token for every decoding sequence (so decodes never stall behind a long prompt),
2. the next chunk of prompts already being prefilled,
3. new sequences from the waiting queue, first come first served, while ``max_num_seqs``,
   free blocks and token budget last; a new sequence starts after the leading blocks it
   finds in the prefix cache, and a long prompt is split over several steps (chunked prefill).

When a running sequence needs a block and none is free, the most recently admitted running
sequence is preempted, as vLLM does by default: its blocks are given back (its full blocks
stay in the prefix cache until evicted) and it goes back to the front of the waiting queue
with the tokens it has, to be recomputed (prompt and output so far) when blocks free up.
Greedy output is unchanged by this, and nothing is lost. No new sequence is admitted in a
step that preempted one. One sequence always fits: the cache holds at least
``max_model_len`` positions (``glm_fused.kv_cache``).

The engine overlaps steps (``glm_fused.engine.llm_engine``): a sequence may have one sampled
token in flight (``num_inflight``), which the next step feeds as a placeholder (-1) that the
runner fills on the device from the sequence's row of per-sequence state. A row is taken at a
sequence's first admission and given back only when it ends (a preempted sequence keeps it,
so a token still in flight stays findable); preempted sequences wait at the head of the queue,
so new ones never need a row while they wait.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from glm_fused.batch import ForwardBatch
from glm_fused.engine.block_manager import BlockManager
from glm_fused.engine.sequence import Sequence, Status
from glm_fused.engine_args import EngineArgs


@dataclass
class ScheduledStep:
    """One forward's work: which sequences, how many tokens each, who gets sampled."""

    seqs: list[Sequence]
    num_new: list[int]          # tokens each sequence feeds this step
    sample: list[bool]          # whether the step ends the sequence's known tokens
    batch: ForwardBatch

    @property
    def num_tokens(self) -> int:
        return self.batch.num_tokens


class Scheduler:
    def __init__(self, args: EngineArgs):
        """``args``: the engine's settings (``max_num_seqs``, ``max_model_len``, ``max_num_batched_tokens``,
        the KV cache's ``block_size``, ``num_kv_blocks`` and ``enable_prefix_caching``). Without
        ``num_kv_blocks`` (no runner sized a cache), room for ``max_num_seqs`` full-length sequences."""
        self.max_num_seqs = args.max_num_seqs
        self.max_num_batched_tokens = args.max_num_batched_tokens
        num_blocks = args.num_kv_blocks or args.slot_blocks()
        self.blocks = BlockManager(num_blocks, args.block_size, args.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # admission order
        self.free_rows: deque[int] = deque(range(self.max_num_seqs))
        self.num_preemptions = 0

    # ---- queue ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (done, aborted): its blocks are free for the very next step."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.blocks.commit(seq)  # a block whose last token was in flight at the last commit
            self.blocks.free(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        if seq.row is not None:
            self.free_rows.append(seq.row)
            seq.row = None
        seq.finish(reason)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def kv_cache_stats(self) -> dict:
        """Plain numbers for metrics: block usage, prefix-cache lookups (tokens), preemptions."""
        b = self.blocks
        return {"num_blocks": b.num_blocks, "block_size": b.block_size, "usage": b.usage(),
                "prefix_caching": b.enable_prefix_caching, "prefix_cache_queries": b.prefix_queries,
                "prefix_cache_hits": b.prefix_hits, "num_preemptions": self.num_preemptions}

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep | None:
        budget = self.max_num_batched_tokens
        picked: dict[Sequence, int] = {}  # in batch order
        preempted = False
        # A decoding sequence feeds its last token (on the host, or in flight from the step
        # before); one that has all the tokens it may make waits for them to arrive instead.
        decoding = [s for s in self.running if not s.in_prefill and s.num_pending and s.wants_more]
        prefilling = [s for s in self.running if s.in_prefill]
        for seq in decoding + prefilling:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this step
                continue
            n = min(seq.num_pending, budget)
            while not self.blocks.allocate(seq, seq.num_computed + n):
                victim = self.running[-1]  # the most recently admitted
                self._preempt(victim)
                preempted = True
                budget += picked.pop(victim, 0)
                if victim is seq:
                    break
            else:
                picked[seq] = n
                budget -= n
        while self.waiting and not preempted and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if seq.row is None and not self.free_rows:
                break
            hits = self.blocks.cached_prefix(seq)
            computed = len(hits) * self.blocks.block_size
            n = min(seq.num_tokens + seq.num_inflight - computed, budget)
            if not self.blocks.allocate(seq, computed + n, cached=hits):
                break  # first come first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            if seq.row is None:
                seq.row = self.free_rows.popleft()
            self.blocks.count_lookup(seq.num_tokens, computed)
            seq.num_computed = computed
            seq.status = Status.RUNNING
            if seq.scheduled_time is None:
                seq.scheduled_time = time.monotonic()
            self.running.append(seq)
            picked[seq] = n
            budget -= n
        if not picked:
            return None
        return self._build(list(picked.items()))

    def _preempt(self, seq: Sequence) -> None:
        """Give back the sequence's blocks and queue it first, to be recomputed."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _build(self, picked: list[tuple[Sequence, int]]) -> ScheduledStep:
        ids, positions, logits_indices = [], [], []
        seqs, num_new, sample = [], [], []
        offset = 0
        for seq, n in picked:
            start = seq.num_computed
            ids.extend(seq.token_ids(start, start + n))
            positions.extend(range(start, start + n))
            ends = start + n == seq.num_tokens + seq.num_inflight
            if ends:
                logits_indices.append(offset + n - 1)
            offset += n
            seqs.append(seq)
            num_new.append(n)
            sample.append(ends)
        if not logits_indices:
            # Only mid-prompt chunks this step: ask for one row anyway (ignored) so the
            # backends never see an empty logits selection.
            logits_indices.append(offset - 1)
        width = max(len(s.block_table) for s in seqs)
        tables = np.zeros((len(seqs), width), dtype=np.int64)  # padding: block 0, never read
        for row, seq in zip(tables, seqs):
            row[:len(seq.block_table)] = seq.block_table
        batch = ForwardBatch(
            input_ids=np.asarray(ids, dtype=np.int64),
            positions=np.asarray(positions, dtype=np.int64),
            query_lens=np.asarray(num_new, dtype=np.int64),
            context_lens=np.asarray([s.num_computed for s in seqs], dtype=np.int64),
            logits_indices=np.asarray(logits_indices, dtype=np.int64),
            block_tables=tables,
            rows=np.asarray([s.row for s in seqs], dtype=np.int64),
        )
        return ScheduledStep(seqs, num_new, sample, batch)

    def commit(self, step: ScheduledStep) -> None:
        """The forward was launched: the scheduled tokens are in the cache (full blocks join the
        prefix cache), and each sampled sequence has one more token in flight."""
        for seq, n, sampled in zip(step.seqs, step.num_new, step.sample):
            seq.num_computed += n
            seq.num_inflight += sampled
            self.blocks.commit(seq)
