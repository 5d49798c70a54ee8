"""Causal GQA attention over a KV cache with one slot per sequence.

Per layer the cache is ``(k_cache, v_cache)``, each ``[num_slots, max_model_len, kv_heads, head_dim]``.
Sequence s of a ForwardBatch writes its new keys/values at its positions in slot ``slots[s]``
and its queries attend to ``cache[slot, :context_len + query_len]``, query i seeing keys up to
its own position ``context_len + i``. One rule covers prefill (context 0), decode (one query)
and chunked prefill (several queries after cached context).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from glm_fused.batch import ForwardBatch, attention_plan
from glm_fused.torch_backend import kernels


@dataclass
class AttentionMetadata:
    """What every layer's attention needs from the ForwardBatch, built once per forward."""

    token_slots: torch.Tensor     # [T] cache slot of each token
    positions: torch.Tensor       # [T] cache row of each token (= its position)
    seqs: list[tuple[int, int, int, int]]  # (slot, context_len, query_len, first token) per sequence
    masks: list[torch.Tensor | None]       # per sequence: [query_len, keys] True where visible, for
                                           # chunked prefill only (else causal or a single query)
    decode_slots: torch.Tensor | None = None  # all query_len == 1: each sequence's cache slot [S]
    seq_lens: torch.Tensor | None = None      # all query_len == 1: keys each query sees [S]
    decode_mask: torch.Tensor | None = None   # S > 1 decodes, eager path: [S, 1, 1, max_len] visible keys

    @classmethod
    def for_decode(cls, slots: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor
                   ) -> "AttentionMetadata":
        """All-device metadata of a decode step (one token per sequence), for the Triton
        decode kernel; what a CUDA graph captures (no host-side lists)."""
        return cls(slots, positions, [], [], decode_slots=slots, seq_lens=seq_lens)

    @classmethod
    def from_batch(cls, batch: ForwardBatch, device: torch.device) -> "AttentionMetadata":
        plan = attention_plan(batch)
        # A fresh prompt (no cached context) is plain causal: SDPA's is_causal needs no mask.
        masks = [None if m is None or context == 0 else torch.as_tensor(m, device=device)
                 for (_, context, _, _), m in zip(plan.seqs, plan.masks)]
        meta = cls(torch.as_tensor(plan.token_slots, device=device), torch.as_tensor(batch.positions, device=device),
                   plan.seqs, masks)
        if bool((batch.query_lens == 1).all()):
            meta.decode_slots = torch.as_tensor(batch.slots, device=device)
            meta.seq_lens = torch.as_tensor(batch.context_lens + 1, device=device)
        if plan.decode_visible is not None:
            meta.decode_mask = torch.as_tensor(plan.decode_visible, device=device)[:, None, None, :]
        return meta


class Attention(nn.Module):
    """The attention kernel only (no weights): cache write, then softmax(q k^T * scale) v."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``q [T, heads, D]``, ``k``/``v`` ``[T, kv_heads, D]`` -> ``[T, heads, D]``.

        ``k = v = None``: the new keys and values are already in the cache (the RoPE kernel
        wrote them)."""
        k_cache, v_cache = kv_cache
        if k is not None:
            k_cache[meta.token_slots, meta.positions] = k
            v_cache[meta.token_slots, meta.positions] = v
        if meta.seq_lens is not None and kernels.enabled(q):
            from glm_fused.torch_backend.kernels.decode_attention import decode_attention

            return decode_attention(q, k_cache, v_cache, meta.decode_slots, meta.seq_lens, self.scale)
        if meta.decode_mask is not None:
            return self._decode(q, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        for (slot, context, n, start), mask in zip(meta.seqs, meta.masks):
            end = context + n
            causal = mask is None and n > 1
            out[start:start + n] = self._sdpa(q[start:start + n], k_cache[slot, :end], v_cache[slot, :end],
                                              mask, causal)
        return out

    def _sdpa(self, q, keys, values, mask, causal):
        # [len, heads, D] -> [1, heads, len, D]; GQA expands kv heads inside SDPA.
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                           values.transpose(0, 1)[None], attn_mask=mask, is_causal=causal,
                                           scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
        return o[0].transpose(0, 1)

    def _decode(self, q, k_cache, v_cache, meta):
        # One query per sequence: all sequences in one call over keys padded to the longest
        # context; the mask hides the padding (the cache is zero-initialised, never NaN).
        max_len = meta.decode_mask.shape[-1]
        keys = k_cache[meta.decode_slots, :max_len].transpose(1, 2)    # [S, kv_heads, max_len, D]
        values = v_cache[meta.decode_slots, :max_len].transpose(1, 2)
        o = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=meta.decode_mask,
                                           scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
        return o[:, :, 0, :]
