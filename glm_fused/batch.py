"""The flattened token batch every forward takes. Framework-free (numpy int64)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_FIELDS = ("input_ids", "positions", "query_lens", "context_lens", "logits_indices", "rows")


@dataclass
class ForwardBatch:
    """S sequences flattened into T tokens, over a paged KV cache.

    Sequence s contributes ``query_lens[s]`` new tokens at positions
    ``context_lens[s] .. context_lens[s] + query_lens[s] - 1``. Its keys and values live in
    the cache blocks ``block_tables[s]`` (``[S, W]``, in order: position p is row
    ``p % block_size`` of block ``block_tables[s, p // block_size]``; entries past the
    sequence's last block are padding, 0). ``logits_indices`` picks the rows of T whose
    logits are wanted.
    """

    input_ids: np.ndarray
    positions: np.ndarray
    query_lens: np.ndarray
    context_lens: np.ndarray
    logits_indices: np.ndarray
    block_tables: np.ndarray
    rows: np.ndarray | None = None  # each sequence's row of per-sequence device state (default 0..S-1)

    def __post_init__(self):
        if self.rows is None:
            self.rows = np.arange(len(np.asarray(self.query_lens).reshape(-1)))
        for name in _FIELDS:
            setattr(self, name, np.ascontiguousarray(getattr(self, name), dtype=np.int64).reshape(-1))
        s = len(self.query_lens)
        self.block_tables = np.ascontiguousarray(self.block_tables, dtype=np.int64).reshape(s, -1)
        t = len(self.input_ids)
        if len(self.positions) != t or len(self.context_lens) != s:
            raise ValueError("ForwardBatch: inconsistent lengths")
        if int(self.query_lens.sum()) != t:
            raise ValueError("ForwardBatch: query_lens do not sum to the token count")

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def logits_seq(self) -> np.ndarray:
        """The sequence each logits row belongs to."""
        return np.repeat(np.arange(self.num_seqs), self.query_lens)[self.logits_indices]

    @property
    def seq_starts(self) -> np.ndarray:
        """Offset of each sequence's first token in the flattened batch."""
        return np.concatenate([[0], np.cumsum(self.query_lens)[:-1]]).astype(np.int64)

    def slot_mapping(self, block_size: int) -> np.ndarray:
        """``[T]`` the cache row of each new token: ``block * block_size + offset``."""
        seq_of_token = np.repeat(np.arange(self.num_seqs), self.query_lens)
        blocks = self.block_tables[seq_of_token, self.positions // block_size]
        return blocks * block_size + self.positions % block_size

    @classmethod
    def prefill(cls, prompts: list[list[int]], block_tables, all_logits: bool = False) -> "ForwardBatch":
        """Whole prompts from position 0; logits of every token or of each last token."""
        lens = [len(p) for p in prompts]
        ids = np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts])
        pos = np.concatenate([np.arange(n, dtype=np.int64) for n in lens])
        ends = np.cumsum(lens)
        logits = np.arange(ends[-1]) if all_logits else ends - 1
        return cls(ids, pos, lens, [0] * len(prompts), logits, block_tables)

    @classmethod
    def decode(cls, tokens: list[int], context_lens: list[int], block_tables) -> "ForwardBatch":
        """One new token per sequence, after ``context_lens`` cached tokens."""
        n = len(tokens)
        return cls(tokens, context_lens, [1] * n, context_lens, np.arange(n), block_tables)

    def as_token_rows(self) -> "ForwardBatch":
        """The same tokens as a batch of one-token rows: each token at its position, over its
        sequence's block table, its context everything before it. Every row's key is written
        before any row attends, so row i sees exactly the keys a causal prefill gives token i:
        the same forward, in the shape the CUDA decode graphs take
        (``glm_fused.torch_backend.cuda_graph``)."""
        seq = np.repeat(np.arange(self.num_seqs), self.query_lens)
        return ForwardBatch(self.input_ids, self.positions, np.ones(self.num_tokens), self.positions,
                            self.logits_indices, self.block_tables[seq], rows=self.rows[seq])

    # ---- one int64 array, for a broadcast from rank 0 --------------------------------
    def to_array(self) -> np.ndarray:
        parts = [getattr(self, name) for name in _FIELDS]
        header = np.array([len(p) for p in parts] + [self.block_tables.shape[1]], dtype=np.int64)
        return np.concatenate([header, *parts, self.block_tables.reshape(-1)])

    @classmethod
    def from_array(cls, arr: np.ndarray) -> "ForwardBatch":
        arr = np.asarray(arr, dtype=np.int64)
        n = len(_FIELDS)
        sizes, width, offset, values = arr[:n], int(arr[n]), n + 1, {}
        for name, size in zip(_FIELDS, sizes):
            values[name] = arr[offset:offset + size]
            offset += int(size)
        tables = arr[offset:offset + len(values["query_lens"]) * width]
        return cls(**values, block_tables=tables.reshape(-1, width))


def slot_block_tables(slots, blocks_per_slot: int) -> np.ndarray:
    """Block tables of fixed per-sequence slots: slot s owns blocks ``s * W .. s * W + W - 1``
    (``W = blocks_per_slot``). For tools and tests that drive a runner directly, one
    sequence per slot, as the KV cache was laid out before paging."""
    slots = np.asarray(slots, dtype=np.int64).reshape(-1, 1)
    return slots * blocks_per_slot + np.arange(blocks_per_slot, dtype=np.int64)[None, :]


@dataclass
class AttentionPlan:
    """Host-side attention bookkeeping of one batch (numpy), shared by every layer and backend.

    ``all_decode``: more than one sequence, each decoding one token, so all of them can attend
    in one call (``decode_visible`` the mask where that call pads keys to the longest).
    """

    slot_mapping: np.ndarray                  # [T] cache row of each new token (block * block_size + offset)
    seqs: list[tuple[int, int, int]]          # (context_len, query_len, first token) per sequence
    seq_blocks: list[np.ndarray]              # per sequence: the blocks holding its keys, in order
    all_decode: bool


def attention_plan(batch: ForwardBatch, block_size: int) -> AttentionPlan:
    seqs = list(zip(batch.context_lens.tolist(), batch.query_lens.tolist(), batch.seq_starts.tolist()))
    seq_blocks = [batch.block_tables[s, :-(-(context + n) // block_size)] for s, (context, n, _) in enumerate(seqs)]
    all_decode = batch.num_seqs > 1 and bool(np.all(batch.query_lens == 1))
    return AttentionPlan(batch.slot_mapping(block_size), seqs, seq_blocks, all_decode)


def decode_visible(lengths: np.ndarray) -> np.ndarray:
    """``[S, longest]``: True where sequence s (``lengths[s]`` keys) sees key j, for one call over
    keys padded to the longest. Made only where a path reads it (the plain ops; the kernels read
    the lengths): 256 KiB at batch 64 and 4,096 keys."""
    return np.arange(int(lengths.max()))[None, :] < lengths[:, None]


def causal_mask(context: int, n: int) -> np.ndarray:
    """``[n, context + n]``: True where query i (at position ``context + i``) may see a key.
    Made only where a path needs it (it is n x (context + n) bytes: 4 MiB, 2.4 ms of host
    time on two CPU cores, for a 2,048-token prompt)."""
    return np.arange(context + n)[None, :] <= np.arange(n)[:, None] + context
