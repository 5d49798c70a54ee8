"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous block of vocab rows."""

from __future__ import annotations

from glm_fused.model.module import Module


class VocabParallelEmbedding(Module):
    """Rows ``[vocab_start, vocab_end)`` of the table; other ids contribute zeros on this rank.

    The sum over ranks of these partial lookups is the full lookup. ``reduce_results=False``
    returns the partial sum; the fused layout lets layer 0's input norm all-reduce it.
    """

    def __init__(self, vocab_start: int, vocab_end: int, hidden_size: int, comm, reduce_results: bool,
                 dtype: str = "float32"):
        super().__init__()
        self.vocab_start, self.vocab_end = vocab_start, vocab_end
        self.comm, self.reduce_results = comm, reduce_results
        self.weight = self.param([vocab_end - vocab_start, hidden_size], dtype)

    def forward(self, input_ids):
        F = self.F
        if self.comm.size == 1:
            out = F.embedding(input_ids, self.weight)
        else:
            mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
            local_ids = F.where(mine, input_ids - self.vocab_start, 0)
            out = F.where(mine.unsqueeze(-1), F.embedding(local_ids, self.weight), 0.0)
        return self.comm.all_reduce(out) if self.reduce_results else out


class ParallelLMHead(Module):
    """Logits of this rank's vocab block, then gathered to the full vocabulary: on every rank,
    or (``dst``) on that rank only (the engine samples on rank 0; the others get None)."""

    def __init__(self, vocab_start: int, vocab_end: int, hidden_size: int, comm, dtype: str = "float32"):
        super().__init__()
        self.vocab_start, self.vocab_end = vocab_start, vocab_end
        self.comm = comm
        self.weight = self.param([vocab_end - vocab_start, hidden_size], dtype)

    def forward(self, hidden, dst: int | None = None):
        local = self.F.linear(hidden, self.weight)
        return self.comm.all_gather(local, dim=-1) if dst is None else self.comm.gather(local, dim=-1, dst=dst)
