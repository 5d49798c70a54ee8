"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous block of vocab rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabParallelEmbedding(nn.Module):
    """Rows ``[vocab_start, vocab_end)`` of the table; other ids contribute zeros on this rank.

    The sum over ranks of these partial lookups is the full lookup. ``reduce_results=False``
    returns the partial sum; the fused layout lets layer 0's input norm all-reduce it.
    """

    def __init__(self, vocab_start: int, vocab_end: int, hidden_size: int, comm, reduce_results: bool,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.vocab_start, self.vocab_end = vocab_start, vocab_end
        self.comm, self.reduce_results = comm, reduce_results
        self.weight = nn.Parameter(torch.empty(vocab_end - vocab_start, hidden_size, dtype=dtype),
                                   requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            out = F.embedding(input_ids, self.weight)
        else:
            mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
            local_ids = torch.where(mine, input_ids - self.vocab_start, 0)
            out = F.embedding(local_ids, self.weight).masked_fill(~mine.unsqueeze(-1), 0)
        return self.comm.all_reduce(out) if self.reduce_results else out


class ParallelLMHead(nn.Module):
    """Logits of this rank's vocab block, then gathered to the full vocabulary on every rank."""

    def __init__(self, vocab_start: int, vocab_end: int, hidden_size: int, comm,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.vocab_start, self.vocab_end = vocab_start, vocab_end
        self.comm = comm
        self.weight = nn.Parameter(torch.empty(vocab_end - vocab_start, hidden_size, dtype=dtype),
                                   requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather(F.linear(hidden, self.weight), dim=-1)
