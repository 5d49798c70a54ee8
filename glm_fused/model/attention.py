"""Causal GQA attention over a paged KV cache.

Per layer the cache is ``(k_cache, v_cache)``, each ``[num_blocks, block_size, kv_heads, head_dim]``.
Sequence s of a ForwardBatch owns the blocks of its row of ``block_tables``: position p lives in
row ``p % block_size`` of block ``block_tables[s, p // block_size]``. The new keys/values of a
step are written at their positions, then the queries attend to positions
``0 .. context_len + query_len - 1``, query i seeing keys up to its own position
``context_len + i``. One rule covers prefill (context 0), decode (one query), chunked prefill
(several queries after cached context) and prefix-cache hits (context found in shared blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from glm_fused.batch import ForwardBatch, attention_plan, causal_mask, decode_visible
from glm_fused.model.module import Module


@dataclass
class AttentionMetadata:
    """What every layer's attention needs from the ForwardBatch, built once per forward
    (framework tensors on the model's device)."""

    slot_mapping: Any             # [T] cache row (block * block_size + offset) of each new token; -1: not
                                  # stored (CUDA-graph padding)
    block_size: int
    token_blocks: Any = None      # [T] block and row of each new token (the plain-ops cache write)
    token_offsets: Any = None
    seqs: list[tuple[int, int, int]] = None  # (context_len, query_len, first token) per sequence
    seq_blocks: list[Any] = None  # per sequence: its blocks, in order [ceil((context + query) / block_size)]
    masks: list[Any] = None       # per sequence: [query_len, keys] True where visible, for chunked
                                  # prefill only (None: causal from position 0, or a single query)
    block_tables: Any = None      # all query_len == 1: [S, W] each sequence's blocks (padding 0)
    seq_lens: Any = None          # all query_len == 1: keys each query sees [S]
    decode_mask: Any = None       # S > 1 decodes, plain-ops path: [S, 1, 1, max_len] visible keys
    row_groups: Any = None        # decode-kernel rows that are a prompt chunk's tokens: [S] groups of
                                  # one sequence's consecutive rows (kernels/decode_attention.py)
    # A step that mixes decodes with prompt chunks, on a backend with a batched prompt kernel:
    # its decoding sequences as a batch (their tokens' rows in T, block tables, key counts), so
    # a decode kernel takes them in one call.
    mixed_decode: Any = None
    # Backends with a batched prompt kernel (``Ops.batched_prefill``): the sequences it takes
    # (every one but the decodes of ``mixed_decode`` and the long fresh prompts) as ``[4, C]``
    # (first token, query_len, context_len, index of its first block in ``chunk_blocks``),
    # their blocks concatenated, and the longest query_len (host int: the launch shape);
    # ``long_fresh``: the indices (in ``seqs``) of the fresh prompts left to ``attend_seq``.
    chunks: Any = None
    chunk_blocks: Any = None
    chunks_max_len: int = 0
    long_fresh: list[int] = ()

    @classmethod
    def for_decode(cls, slot_mapping, block_tables, seq_lens, block_size: int,
                   row_groups=None) -> "AttentionMetadata":
        """All-device metadata of a decode step (one token per row), for kernels that read
        lengths and block tables on the device; what a CUDA graph captures. ``row_groups``:
        the rows are tokens of prompt chunks too, consecutive per sequence."""
        return cls(slot_mapping, block_size, block_tables=block_tables, seq_lens=seq_lens, row_groups=row_groups)

    @classmethod
    def from_batch(cls, batch: ForwardBatch, F, like, block_size: int) -> "AttentionMetadata":
        """``like``: a tensor on the model's device (where the metadata goes)."""
        plan = attention_plan(batch, block_size)
        up = F.upload  # small host arrays: never wait for the step still running on the device
        fresh_limit = F.batched_prefill(like)
        batched = fresh_limit is not None
        # A fresh prompt (no cached context) is plain causal: no mask needed; nor for the batched
        # kernel, nor for a single query (it sees the whole prefix).
        masks = [None if n == 1 or context == 0 or batched else up(causal_mask(context, n), like)
                 for context, n, _ in plan.seqs]
        seq_blocks = flat = None
        if not plan.all_decode:  # batched decode reads through the block tables instead
            # One upload, then each sequence's blocks as a slice of it.
            counts = np.array([len(b) for b in plan.seq_blocks])
            ends = np.cumsum(counts)
            flat = up(np.concatenate(plan.seq_blocks), like)
            seq_blocks = [flat[end - len(b):end] for end, b in zip(ends.tolist(), plan.seq_blocks)]
        meta = cls(up(plan.slot_mapping, like), block_size,
                   token_blocks=up(plan.slot_mapping // block_size, like),
                   token_offsets=up(plan.slot_mapping % block_size, like),
                   seqs=plan.seqs, seq_blocks=seq_blocks, masks=masks)
        decoding = batch.query_lens == 1
        if bool(decoding.all()):
            lens = batch.context_lens + 1
            width = -(-int(lens.max()) // block_size)
            meta.block_tables = up(batch.block_tables[:, :width], like)
            meta.seq_lens = up(lens, like)
        elif batched and decoding.sum() > 1:
            lens = batch.context_lens[decoding] + 1
            width = -(-int(lens.max()) // block_size)
            meta.mixed_decode = (up(batch.seq_starts[decoding], like), up(batch.block_tables[decoding, :width], like),
                                 up(lens, like))
        if batched and not bool(decoding.all()):
            context, query, first = np.asarray(plan.seqs, dtype=np.int64).T
            long_fresh = (context == 0) & (query >= fresh_limit)
            meta.long_fresh = np.flatnonzero(long_fresh).tolist()
            elsewhere = long_fresh | decoding if meta.mixed_decode is not None else long_fresh
            take = np.flatnonzero(~elsewhere)
            if len(take):
                block0 = ends - counts
                meta.chunks = up(np.stack([first[take], query[take], context[take], block0[take]]), like)
                meta.chunk_blocks, meta.chunks_max_len = flat, int(query[take].max())
        if plan.all_decode and not batched:  # (the kernels read the lengths)
            meta.decode_mask = up(decode_visible(batch.context_lens + 1), like)[:, None, None, :]
        return meta


class Attention(Module):
    """RoPE, the KV-cache write, then ``softmax(q k^T * scale) v`` (no weights of its own)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, rotary_emb):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.rotary_emb = rotary_emb

    def forward(self, positions, q, k, v, meta: AttentionMetadata, kv_cache):
        """``q [T, heads, D]``, ``k``/``v`` ``[T, kv_heads, D]`` -> ``[T, heads, D]``."""
        q = self.rotary_emb.rotate_and_store(positions, q, k, v, meta, kv_cache)
        return self.F.attention(q, meta, kv_cache, self.scale)
