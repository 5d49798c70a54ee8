"""Partial rotary position embedding, NeoX style (NOT interleaved).

GLM-4.5 rotates only the first ``rotary_dim`` dims of each head (head_dim * partial_rotary_factor)
and pairs dim i with dim i + rotary_dim/2 (``rotate_half``); the other dims pass through.
(Dense GLM-4 models interleave pairs instead - the two are not interchangeable.)
"""

from __future__ import annotations

import numpy as np

from glm_fused.errors import UserError
from glm_fused.model.module import Module


class RotaryEmbedding(Module):
    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float):
        super().__init__()
        self.head_dim, self.rotary_dim, self.max_position = head_dim, rotary_dim, max_position
        # Same fp32 arithmetic as transformers: inv_freq, then position * inv_freq, then cos/sin.
        exponent = np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)
        inv_freq = np.float32(1.0) / (np.float32(base) ** exponent)
        try:
            freqs = np.arange(max_position, dtype=np.float32)[:, None] * inv_freq[None, :]
            cos, sin = np.cos(freqs), np.sin(freqs)
        except (MemoryError, ValueError):  # a config.json limit far beyond any context served
            raise UserError(f"a RoPE table for {max_position} positions (max_position_embeddings, or "
                            f"--max-model-len) does not fit in host memory: pass a smaller --max-model-len") from None
        # [max_position, rotary_dim/2]; buffers, not parameters: the loader never sees them.
        self.F.buffer(self, "cos_cache", cos)
        self.F.buffer(self, "sin_cache", sin)

    def forward(self, positions, q, k):
        """``q [T, heads, head_dim]``, ``k [T, kv_heads, head_dim]`` rotated at ``positions [T]``."""
        return self.F.rope(positions, q, k, self.cos_cache, self.sin_cache, self.rotary_dim)

    def rotate_and_store(self, positions, q, k, v, meta, kv_cache):
        """Rotate q and k and write k, v into the KV cache (one launch on the torch GPU path)."""
        return self.F.rope_and_store(positions, q, k, v, self.cos_cache, self.sin_cache, self.rotary_dim,
                                     meta, kv_cache)
