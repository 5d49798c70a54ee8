"""Causal GQA attention over a KV cache with one slot per sequence.

Per layer the cache is ``(k_cache, v_cache)``, each ``[num_slots, max_model_len, kv_heads, head_dim]``.
Sequence s of a ForwardBatch writes its new keys/values at its positions in slot ``slots[s]``
and its queries attend to ``cache[slot, :context_len + query_len]``, query i seeing keys up to
its own position ``context_len + i``. One rule covers prefill (context 0), decode (one query)
and chunked prefill (several queries after cached context).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from glm_fused.batch import ForwardBatch, attention_plan
from glm_fused.model.module import Module


@dataclass
class AttentionMetadata:
    """What every layer's attention needs from the ForwardBatch, built once per forward
    (framework tensors on the model's device)."""

    token_slots: Any              # [T] cache slot of each token
    positions: Any                # [T] cache row of each token (= its position)
    seqs: list[tuple[int, int, int, int]]  # (slot, context_len, query_len, first token) per sequence
    masks: list[Any]              # per sequence: [query_len, keys] True where visible, for chunked
                                  # prefill only (None: causal from position 0, or a single query)
    decode_slots: Any = None      # all query_len == 1: each sequence's cache slot [S]
    seq_lens: Any = None          # all query_len == 1: keys each query sees [S]
    decode_mask: Any = None       # S > 1 decodes, unfused path: [S, 1, 1, max_len] visible keys

    @classmethod
    def for_decode(cls, slots, positions, seq_lens) -> "AttentionMetadata":
        """All-device metadata of a decode step (one token per sequence), for a decode kernel
        that reads lengths on the device; what a CUDA graph captures (no host-side lists)."""
        return cls(slots, positions, [], [], decode_slots=slots, seq_lens=seq_lens)

    @classmethod
    def from_batch(cls, batch: ForwardBatch, F, like) -> "AttentionMetadata":
        """``like``: a tensor on the model's device (where the metadata goes)."""
        plan = attention_plan(batch)
        # A fresh prompt (no cached context) is plain causal: no mask needed.
        masks = [None if m is None or context == 0 else F.tensor(m, like)
                 for (_, context, _, _), m in zip(plan.seqs, plan.masks)]
        meta = cls(F.tensor(plan.token_slots, like), F.tensor(batch.positions, like), plan.seqs, masks)
        if bool((batch.query_lens == 1).all()):
            meta.decode_slots = F.tensor(batch.slots, like)
            meta.seq_lens = F.tensor(batch.context_lens + 1, like)
        if plan.decode_visible is not None:
            meta.decode_mask = F.tensor(plan.decode_visible, like)[:, None, None, :]
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
