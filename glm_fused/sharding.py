"""Which part of every weight a tensor-parallel rank owns. Framework-free.

Column-parallel weights ([out, in]) split their rows, row-parallel weights split their
columns, the vocabulary splits by contiguous rows. KV heads split while tp <= num_kv_heads
and are replicated beyond that (each KV head then serves tp // num_kv_heads ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

from glm_fused.config import Glm4MoeConfig


@dataclass(frozen=True)
class TPShard:
    config: Glm4MoeConfig
    rank: int
    size: int

    def __post_init__(self):
        self.config.check_tp(self.size)
        if not (isinstance(self.rank, int) and 0 <= self.rank < self.size):
            raise ValueError(f"tp_rank {self.rank!r} outside 0..{self.size - 1} (tp_size {self.size})")

    # ---- sizes on this rank ------------------------------------------------------------
    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.config.num_key_value_heads // self.size)

    @property
    def intermediate_size(self) -> int:
        return self.config.intermediate_size // self.size

    @property
    def moe_intermediate_size(self) -> int:
        return self.config.moe_intermediate_size // self.size

    @property
    def shared_intermediate_size(self) -> int:
        return self.config.shared_intermediate_size // self.size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size // self.size

    # ---- ranges in the full tensors ----------------------------------------------------
    def _block(self, local: int) -> tuple[int, int]:
        return self.rank * local, (self.rank + 1) * local

    def q_heads(self) -> tuple[int, int]:
        return self._block(self.num_heads)

    def kv_heads(self) -> tuple[int, int]:
        kv = self.config.num_key_value_heads
        if self.size <= kv:
            return self._block(self.num_kv_heads)
        head = self.rank * kv // self.size  # replicated: ranks share a head in order
        return head, head + 1

    def intermediate(self) -> tuple[int, int]:
        return self._block(self.intermediate_size)

    def moe_intermediate(self) -> tuple[int, int]:
        return self._block(self.moe_intermediate_size)

    def shared_intermediate(self) -> tuple[int, int]:
        return self._block(self.shared_intermediate_size)

    def vocab(self) -> tuple[int, int]:
        return self._block(self.vocab_size)

    def experts(self) -> tuple[int, int]:
        """Experts held on this rank: all of them (tensor-parallel experts).

        Expert parallelism would return a sub-range here; the loader and the MoE layer
        already index experts through this range.
        """
        return 0, self.config.n_routed_experts
