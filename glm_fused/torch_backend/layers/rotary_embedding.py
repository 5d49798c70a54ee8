"""Partial rotary position embedding, NeoX style (NOT interleaved).

GLM-4.5 rotates only the first ``rotary_dim`` dims of each head (head_dim * partial_rotary_factor)
and pairs dim i with dim i + rotary_dim/2 (``rotate_half``); the other dims pass through.
(Dense GLM-4 models interleave pairs instead - the two are not interchangeable.)
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float):
        super().__init__()
        self.head_dim, self.rotary_dim, self.max_position = head_dim, rotary_dim, max_position
        # Same fp32 arithmetic as transformers: inv_freq, then position * inv_freq, then cos/sin.
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)  # [max_position, rotary_dim/2]
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [T, heads, head_dim]``, ``k [T, kv_heads, head_dim]`` rotated at ``positions [T]``."""
        cos = self.cos_cache[positions].unsqueeze(1)  # [T, 1, rotary_dim/2], broadcast over heads
        sin = self.sin_cache[positions].unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def rotate_and_store(self, positions: torch.Tensor, token_slots: torch.Tensor, q: torch.Tensor,
                         k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor]
                         ) -> torch.Tensor:
        """The Triton path: rotate ``q`` in place and write rotated ``k`` and ``v`` into the cache."""
        from glm_fused.torch_backend.kernels.rotary import rope_and_store

        return rope_and_store(positions, token_slots, q, k, v, self.cos_cache, self.sin_cache, *kv_cache)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.rotary_dim // 2
        x1 = x[..., :half].float()
        x2 = x[..., half:self.rotary_dim].float()
        # (x1, x2) * cos + rotate_half(x1, x2) * sin, with rotate_half(x1, x2) = (-x2, x1)
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
        return torch.cat([rotated, x[..., self.rotary_dim:]], dim=-1)
