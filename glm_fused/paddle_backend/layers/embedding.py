"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous block of vocab rows."""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle import nn

from glm_fused.paddle_backend.layers.linear import linear, make_param


class VocabParallelEmbedding(nn.Layer):
    """Rows ``[vocab_start, vocab_end)`` of the table; other ids contribute zeros on this rank.

    The sum over ranks of these partial lookups is the full lookup. ``reduce_results=False``
    returns the partial sum; the fused layout lets layer 0's input norm all-reduce it.
    """

    def __init__(self, vocab_start: int, vocab_end: int, hidden_size: int, comm, reduce_results: bool,
                 dtype: str = "float32"):
        super().__init__()
        self.vocab_start, self.vocab_end = vocab_start, vocab_end
        self.comm, self.reduce_results = comm, reduce_results
        self.weight = make_param(self, [vocab_end - vocab_start, hidden_size], dtype)

    def forward(self, input_ids: paddle.Tensor) -> paddle.Tensor:
        if self.comm.size == 1:
            out = F.embedding(input_ids, self.weight)
        else:
            mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
            local_ids = paddle.where(mine, input_ids - self.vocab_start, paddle.zeros_like(input_ids))
            out = F.embedding(local_ids, self.weight) * mine.unsqueeze(-1).astype(self.weight.dtype)
        return self.comm.all_reduce(out) if self.reduce_results else out


class ParallelLMHead(nn.Layer):
    """Logits of this rank's vocab block, then gathered to the full vocabulary on every rank."""

    def __init__(self, vocab_start: int, vocab_end: int, hidden_size: int, comm, dtype: str = "float32"):
        super().__init__()
        self.vocab_start, self.vocab_end = vocab_start, vocab_end
        self.comm = comm
        self.weight = make_param(self, [vocab_end - vocab_start, hidden_size], dtype)

    def forward(self, hidden: paddle.Tensor) -> paddle.Tensor:
        return self.comm.all_gather(linear(hidden, self.weight), axis=-1)
