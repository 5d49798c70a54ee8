"""Partial rotary position embedding, NeoX style (NOT interleaved).

GLM-4.5 rotates only the first ``rotary_dim`` dims of each head (head_dim * partial_rotary_factor)
and pairs dim i with dim i + rotary_dim/2 (``rotate_half``); the other dims pass through.
(Dense GLM-4 models interleave pairs instead - the two are not interchangeable.)
"""

from __future__ import annotations

import numpy as np
import paddle
from paddle import nn


class RotaryEmbedding(nn.Layer):
    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float):
        super().__init__()
        self.head_dim, self.rotary_dim, self.max_position = head_dim, rotary_dim, max_position
        # Same fp32 arithmetic as transformers: inv_freq, then position * inv_freq, then cos/sin.
        exponent = np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)
        inv_freq = np.float32(1.0) / (np.float32(base) ** exponent)
        freqs = np.arange(max_position, dtype=np.float32)[:, None] * inv_freq[None, :]
        # [max_position, rotary_dim/2]; buffers, not parameters: the loader never sees them.
        self.register_buffer("cos_cache", paddle.to_tensor(np.cos(freqs)), persistable=False)
        self.register_buffer("sin_cache", paddle.to_tensor(np.sin(freqs)), persistable=False)

    def forward(self, positions: paddle.Tensor, q: paddle.Tensor, k: paddle.Tensor
                ) -> tuple[paddle.Tensor, paddle.Tensor]:
        """``q [T, heads, head_dim]``, ``k [T, kv_heads, head_dim]`` rotated at ``positions [T]``."""
        cos = paddle.gather(self.cos_cache, positions).unsqueeze(1)  # [T, 1, rotary_dim/2]
        sin = paddle.gather(self.sin_cache, positions).unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
        half = self.rotary_dim // 2
        x1 = x[..., :half].astype("float32")
        x2 = x[..., half:self.rotary_dim].astype("float32")
        # (x1, x2) * cos + rotate_half(x1, x2) * sin, with rotate_half(x1, x2) = (-x2, x1)
        rotated = paddle.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
        if self.rotary_dim == self.head_dim:
            return rotated
        return paddle.concat([rotated, x[..., self.rotary_dim:]], axis=-1)
