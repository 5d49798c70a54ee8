"""Continuous batching over fixed KV-cache slots, with chunked prefill.

The backends keep one cache slot of ``max_model_len`` positions per sequence
(``[max_num_seqs, max_model_len, kv_heads, head_dim]`` per layer). A sequence takes a slot
when it is admitted and gives it back the moment it finishes or is aborted. Since a slot
always has room for the whole sequence, a running sequence never waits for memory and
nothing is ever preempted: admission is the only decision.

Each step takes at most ``max_num_batched_tokens`` tokens, in this order:
1. one token for every decoding sequence (so decodes never stall behind a long prompt),
2. the next chunk of prompts already being prefilled,
3. new sequences from the waiting queue, first come first served, while slots and token
   budget last; a long prompt is split over several steps (chunked prefill).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from glm_fused.batch import ForwardBatch
from glm_fused.engine_args import EngineArgs
from glm_fused.engine.sequence import Sequence, Status


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
        """``args``: the engine's settings (``max_num_seqs``, ``max_model_len``, ``max_num_batched_tokens``)."""
        self.max_num_seqs = args.max_num_seqs
        self.max_model_len = args.max_model_len
        self.max_num_batched_tokens = args.max_num_batched_tokens
        self.free_slots: deque[int] = deque(range(self.max_num_seqs))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # admission order

    # ---- queue ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.prompt_len > self.max_model_len:
            raise ValueError(f"prompt of {seq.prompt_len} tokens exceeds max_model_len={self.max_model_len}")
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (done, aborted): its slot is free for the very next step."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.free_slots.append(seq.slot)
            seq.slot = None
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.finish(reason)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep | None:
        budget = self.max_num_batched_tokens
        picked: list[tuple[Sequence, int]] = []
        # A decoding sequence feeds its last token (on the host, or in flight from the step
        # before); one that has all the tokens it may make waits for them to arrive instead.
        decoding = [s for s in self.running if not s.in_prefill and s.num_pending and s.wants_more]
        prefilling = [s for s in self.running if s.in_prefill]
        for seq in decoding + prefilling:
            if budget == 0:
                break
            n = min(seq.num_pending, budget)
            picked.append((seq, n))
            budget -= n
        while self.waiting and self.free_slots and budget > 0:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(seq.num_pending, budget)
            picked.append((seq, n))
            budget -= n
        if not picked:
            return None
        return self._build(picked)

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
            # Only mid-prompt chunks this step (nothing is sampled): ask for one row anyway so
            # the backends never see an empty logits selection.
            logits_indices.append(offset - 1)
        batch = ForwardBatch(
            input_ids=np.asarray(ids, dtype=np.int64),
            positions=np.asarray(positions, dtype=np.int64),
            slots=np.asarray([s.slot for s in seqs], dtype=np.int64),
            query_lens=np.asarray(num_new, dtype=np.int64),
            context_lens=np.asarray([s.num_computed for s in seqs], dtype=np.int64),
            logits_indices=np.asarray(logits_indices, dtype=np.int64),
        )
        return ScheduledStep(seqs, num_new, sample, batch)

    def commit(self, step: ScheduledStep) -> None:
        """The forward was launched: the scheduled tokens are in the cache, and each sampled
        sequence has one more token in flight."""
        for seq, n, sampled in zip(step.seqs, step.num_new, step.sample):
            seq.num_computed += n
            seq.num_inflight += sampled
