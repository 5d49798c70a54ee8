"""Tensor-parallel linear layers. Weights are ``[out, in]`` as in the checkpoint.

Sizes given to these layers are this rank's (``glm_fused.sharding.TPShard`` computes them);
the loader fills the rank's slice. Column-parallel layers need no communication; a
row-parallel layer produces a partial sum and all-reduces it only when told to
(``reduce_results``) - in the fused layout the next norm does that all-reduce instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """``y_local = x @ W_local.T (+ b_local)``: this rank's slice of the output features."""

    def __init__(self, input_size: int, output_size_local: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size_local
        self.weight = _param(output_size_local, input_size, dtype=dtype)
        self.bias = _param(output_size_local, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate and up)."""

    def __init__(self, input_size: int, output_sizes_local: list[int], bias: bool = False,
                 dtype: torch.dtype = torch.float32):
        super().__init__(input_size, sum(output_sizes_local), bias=bias, dtype=dtype)
        self.output_sizes = list(output_sizes_local)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(super().forward(x), self.output_sizes, dim=-1)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v of this rank's heads in one matmul; rows are q heads, then k, then v."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads_local: int, num_kv_heads_local: int,
                 bias: bool = False, dtype: torch.dtype = torch.float32):
        self.q_size = num_heads_local * head_dim
        self.kv_size = num_kv_heads_local * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.split(super().forward(x), [self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(nn.Module):
    """``y = sum over ranks of x_local @ W_local.T``: input features are split over ranks.

    With ``reduce_results=False`` the partial sum is returned as is and the caller owns the
    all-reduce. No bias (GLM's o_proj and down projections have none; a bias would have to be
    added once, after the reduction).
    """

    def __init__(self, input_size_local: int, output_size: int, comm, reduce_results: bool,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.input_size, self.output_size = input_size_local, output_size
        self.comm, self.reduce_results = comm, reduce_results
        self.weight = _param(output_size, input_size_local, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return self.comm.all_reduce(y) if self.reduce_results else y
