"""Causal GQA attention over a KV cache with one slot per sequence.

Per layer the cache is ``(k_cache, v_cache)``, each ``[num_slots, max_model_len, kv_heads, head_dim]``.
Sequence s of a ForwardBatch writes its new keys/values at its positions in slot ``slots[s]``
and its queries attend to ``cache[slot, :context_len + query_len]``, query i seeing keys up to
its own position ``context_len + i``. One rule covers prefill (context 0), decode (one query)
and chunked prefill (several queries after cached context).
"""

from __future__ import annotations

from dataclasses import dataclass

import paddle
import paddle.nn.functional as F
from paddle import nn

from glm_fused.batch import ForwardBatch, attention_plan


@dataclass
class AttentionMetadata:
    """What every layer's attention needs from the ForwardBatch, built once per forward."""

    token_slots: paddle.Tensor     # [T] cache slot of each token
    positions: paddle.Tensor       # [T] cache row of each token (= its position)
    seqs: list[tuple[int, int, int, int]]  # (slot, context_len, query_len, first token) per sequence
    masks: list[paddle.Tensor | None]      # per sequence: [query_len, keys] True where visible
    decode_slots: paddle.Tensor | None = None  # all query_len == 1: batched decode over padded keys
    decode_mask: paddle.Tensor | None = None   # [S, 1, 1, max_len] True where a key is visible

    @classmethod
    def from_batch(cls, batch: ForwardBatch) -> "AttentionMetadata":
        plan = attention_plan(batch)
        masks = [None if m is None else paddle.to_tensor(m) for m in plan.masks]
        meta = cls(paddle.to_tensor(plan.token_slots), paddle.to_tensor(batch.positions), plan.seqs, masks)
        if plan.decode_visible is not None:
            meta.decode_slots = paddle.to_tensor(batch.slots)
            meta.decode_mask = paddle.to_tensor(plan.decode_visible)[:, None, None, :]
        return meta


class Attention(nn.Layer):
    """The attention kernel only (no weights): cache write, then softmax(q k^T * scale) v."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale

    def forward(self, q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, meta: AttentionMetadata,
                kv_cache: tuple[paddle.Tensor, paddle.Tensor]) -> paddle.Tensor:
        """``q [T, heads, D]``, ``k``/``v`` ``[T, kv_heads, D]`` -> ``[T, heads, D]``."""
        k_cache, v_cache = kv_cache
        k_cache[meta.token_slots, meta.positions] = k
        v_cache[meta.token_slots, meta.positions] = v
        if meta.decode_mask is not None:
            return self._decode(q, k_cache, v_cache, meta)
        outs = []
        for (slot, context, n, start), mask in zip(meta.seqs, meta.masks):
            end = context + n
            keys, values = k_cache[slot, :end], v_cache[slot, :end]
            o = self._attend(q[start:start + n][None], keys[None], values[None],
                             None if mask is None else mask[None, None])
            outs.append(o[0])
        return outs[0] if len(outs) == 1 else paddle.concat(outs, axis=0)

    def _decode(self, q, k_cache, v_cache, meta):
        # One query per sequence: all sequences in one call over keys padded to the longest
        # context; the mask hides the padding (the cache is zero-initialised, never NaN).
        max_len = meta.decode_mask.shape[-1]
        keys = k_cache[meta.decode_slots, :max_len]      # [S, max_len, kv_heads, D]
        values = v_cache[meta.decode_slots, :max_len]
        return self._attend(q[:, None], keys, values, meta.decode_mask)[:, 0]

    def _attend(self, q, keys, values, mask):
        """``q [B, Lq, heads, D]``, keys/values ``[B, Lk, kv_heads, D]``, mask ``[B|1, 1, Lq|1, Lk]``."""
        group = self.num_heads // self.num_kv_heads
        if group > 1:  # GQA: kv head j serves query heads j*group .. (j+1)*group-1
            keys = paddle.repeat_interleave(keys, group, axis=2)
            values = paddle.repeat_interleave(values, group, axis=2)
        q, keys, values = (t.transpose([0, 2, 1, 3]) for t in (q, keys, values))  # [B, heads, L, D]
        scores = paddle.matmul(q, keys, transpose_y=True).astype("float32") * self.scale
        if mask is not None:
            scores = paddle.where(mask, scores, paddle.full_like(scores, float("-inf")))
        probs = F.softmax(scores, axis=-1).astype(q.dtype)
        return paddle.matmul(probs, values).transpose([0, 2, 1, 3])  # [B, Lq, heads, D]
