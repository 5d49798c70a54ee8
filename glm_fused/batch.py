"""The flattened token batch every forward takes. Framework-free (numpy int64)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_FIELDS = ("input_ids", "positions", "slots", "query_lens", "context_lens", "logits_indices")


@dataclass
class ForwardBatch:
    """S sequences flattened into T tokens.

    Sequence s contributes ``query_lens[s]`` new tokens at positions
    ``context_lens[s] .. context_lens[s] + query_lens[s] - 1``; its keys and values live in
    KV-cache slot ``slots[s]``. ``logits_indices`` picks the rows of T whose logits are wanted.
    """

    input_ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    query_lens: np.ndarray
    context_lens: np.ndarray
    logits_indices: np.ndarray

    def __post_init__(self):
        for name in _FIELDS:
            setattr(self, name, np.ascontiguousarray(getattr(self, name), dtype=np.int64).reshape(-1))
        t, s = len(self.input_ids), len(self.slots)
        if len(self.positions) != t or len(self.query_lens) != s or len(self.context_lens) != s:
            raise ValueError("ForwardBatch: inconsistent lengths")
        if int(self.query_lens.sum()) != t:
            raise ValueError("ForwardBatch: query_lens do not sum to the token count")

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.slots)

    @property
    def logits_seq(self) -> np.ndarray:
        """The sequence each logits row belongs to."""
        return np.repeat(np.arange(self.num_seqs), self.query_lens)[self.logits_indices]

    @property
    def seq_starts(self) -> np.ndarray:
        """Offset of each sequence's first token in the flattened batch."""
        return np.concatenate([[0], np.cumsum(self.query_lens)[:-1]]).astype(np.int64)

    @classmethod
    def prefill(cls, prompts: list[list[int]], slots: list[int] | None = None,
                all_logits: bool = False) -> "ForwardBatch":
        """Whole prompts from position 0; logits of every token or of each last token."""
        slots = list(range(len(prompts))) if slots is None else slots
        lens = [len(p) for p in prompts]
        ids = np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts])
        pos = np.concatenate([np.arange(n, dtype=np.int64) for n in lens])
        ends = np.cumsum(lens)
        logits = np.arange(ends[-1]) if all_logits else ends - 1
        return cls(ids, pos, slots, lens, [0] * len(prompts), logits)

    @classmethod
    def decode(cls, tokens: list[int], context_lens: list[int], slots: list[int]) -> "ForwardBatch":
        """One new token per sequence, after ``context_lens`` cached tokens."""
        n = len(tokens)
        return cls(tokens, context_lens, slots, [1] * n, context_lens, np.arange(n))

    # ---- one int64 array, for a broadcast from rank 0 --------------------------------
    def to_array(self) -> np.ndarray:
        parts = [getattr(self, name) for name in _FIELDS]
        header = np.array([len(p) for p in parts], dtype=np.int64)
        return np.concatenate([header, *parts])

    @classmethod
    def from_array(cls, arr: np.ndarray) -> "ForwardBatch":
        arr = np.asarray(arr, dtype=np.int64)
        n = len(_FIELDS)
        sizes, offset, values = arr[:n], n, {}
        for name, size in zip(_FIELDS, sizes):
            values[name] = arr[offset:offset + size]
            offset += int(size)
        return cls(**values)


@dataclass
class AttentionPlan:
    """Host-side attention bookkeeping of one batch (numpy), shared by every layer and backend.

    ``masks[s]`` is ``[query_len, context_len + query_len]``, True where query i (at position
    ``context_len + i``) may see a key; None for a single query, which sees the whole prefix.
    ``decode_visible`` is ``[S, longest context + 1]`` when every sequence decodes one token,
    so all of them can attend in one call over keys padded to the longest.
    """

    token_slots: np.ndarray                   # [T] cache slot of each token
    seqs: list[tuple[int, int, int, int]]     # (slot, context_len, query_len, first token) per sequence
    masks: list[np.ndarray | None]
    decode_visible: np.ndarray | None


def attention_plan(batch: ForwardBatch) -> AttentionPlan:
    seqs = list(zip(batch.slots.tolist(), batch.context_lens.tolist(), batch.query_lens.tolist(),
                    batch.seq_starts.tolist()))
    masks = [None if n == 1 else np.arange(context + n)[None, :] <= np.arange(n)[:, None] + context
             for _, context, n, _ in seqs]
    decode_visible = None
    if batch.num_seqs > 1 and bool(np.all(batch.query_lens == 1)):
        lengths = batch.context_lens + 1
        decode_visible = np.arange(int(lengths.max()))[None, :] < lengths[:, None]
    return AttentionPlan(np.repeat(batch.slots, batch.query_lens), seqs, masks, decode_visible)
