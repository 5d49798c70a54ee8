"""Tensor-parallel linear layers. Weights are ``[out, in]`` as in the checkpoint.

Sizes given to these layers are this rank's (``glm_fused.sharding.TPShard`` computes them);
the loader fills the rank's slice. Column-parallel layers need no communication; a
row-parallel layer produces a partial sum and all-reduces it only when told to
(``reduce_results``) - in the fused layout the next norm does that all-reduce instead.
"""

from __future__ import annotations

from glm_fused.model.module import Module


class ColumnParallelLinear(Module):
    """``y_local = x @ W_local.T (+ b_local)``: this rank's slice of the output features."""

    def __init__(self, input_size: int, output_size_local: int, bias: bool = False, dtype: str = "float32"):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size_local
        self.weight = self.param([output_size_local, input_size], dtype)
        self.bias = self.param([output_size_local], dtype) if bias else None

    def forward(self, x):
        return self.F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate and up)."""

    def __init__(self, input_size: int, output_sizes_local: list[int], bias: bool = False, dtype: str = "float32"):
        super().__init__(input_size, sum(output_sizes_local), bias=bias, dtype=dtype)
        self.output_sizes = list(output_sizes_local)

    def forward(self, x) -> list:
        return self.F.split(super().forward(x), self.output_sizes, -1)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v of this rank's heads in one matmul; rows are q heads, then k, then v."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads_local: int, num_kv_heads_local: int,
                 bias: bool = False, dtype: str = "float32"):
        self.q_size = num_heads_local * head_dim
        self.kv_size = num_kv_heads_local * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias=bias, dtype=dtype)

    def forward(self, x) -> list:
        return self.F.split(super().forward(x), [self.q_size, self.kv_size, self.kv_size], -1)


class RowParallelLinear(Module):
    """``y = sum over ranks of x_local @ W_local.T``: input features are split over ranks.

    With ``reduce_results=False`` the partial sum is returned as is and the caller owns the
    all-reduce. No bias (GLM's o_proj and down projections have none; a bias would have to be
    added once, after the reduction).
    """

    def __init__(self, input_size_local: int, output_size: int, comm, reduce_results: bool, dtype: str = "float32"):
        super().__init__()
        self.input_size, self.output_size = input_size_local, output_size
        self.comm, self.reduce_results = comm, reduce_results
        self.weight = self.param([output_size, input_size_local], dtype)

    def forward(self, x):
        y = self.F.linear(x, self.weight)
        return self.comm.all_reduce(y) if self.reduce_results else y
