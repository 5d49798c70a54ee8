"""Tensor-parallel linear layers. Weights are ``[out, in]`` as in the checkpoint.

Sizes given to these layers are this rank's (``glm_fused.sharding.TPShard`` computes them);
the loader fills the rank's slice. Column-parallel layers need no communication; a
row-parallel layer produces a partial sum and all-reduces it only when told to
(``reduce_results``) - in the fused layout the next norm does that all-reduce instead.

With ``fp8`` a layer's ``weight`` holds e4m3 codes and ``weight_scale`` one float32 scale per
output row (of this rank's rows: row scales split with the rows, and a row-parallel layer keeps
all of its rows' scales); ``weight_of`` hands the ops the pair.
"""

from __future__ import annotations

from glm_fused.model.module import Module
from glm_fused.model.ops import Fp8Weight
from glm_fused.quantization import FP8_DTYPE


def fp8_param(module, name: str, shape: list[int], dtype: str, fp8: bool):
    """Set parameter ``name`` of ``shape`` (e4m3 when ``fp8``, with ``<name>_scale [shape[:-1]]``)."""
    setattr(module, name, module.param(shape, FP8_DTYPE if fp8 else dtype))
    setattr(module, f"{name}_scale", module.param(shape[:-1], "float32") if fp8 else None)


def weight_of(module, name: str = "weight"):
    """The weight as the ops take it: the tensor, or an ``Fp8Weight`` (codes, row scales)."""
    scale = getattr(module, f"{name}_scale")
    return getattr(module, name) if scale is None else Fp8Weight(getattr(module, name), scale)


class ColumnParallelLinear(Module):
    """``y_local = x @ W_local.T (+ b_local)``: this rank's slice of the output features."""

    def __init__(self, input_size: int, output_size_local: int, bias: bool = False, dtype: str = "float32",
                 fp8: bool = False):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size_local
        fp8_param(self, "weight", [output_size_local, input_size], dtype, fp8)
        self.bias = self.param([output_size_local], dtype) if bias else None

    def forward(self, x):
        return self.F.project(x, weight_of(self), self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate and up)."""

    def __init__(self, input_size: int, output_sizes_local: list[int], bias: bool = False, dtype: str = "float32",
                 fp8: bool = False):
        super().__init__(input_size, sum(output_sizes_local), bias=bias, dtype=dtype, fp8=fp8)
        self.output_sizes = list(output_sizes_local)

    def forward(self, x) -> list:
        return self.F.split(super().forward(x), self.output_sizes, -1)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v of this rank's heads in one matmul; rows are q heads, then k, then v."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads_local: int, num_kv_heads_local: int,
                 bias: bool = False, dtype: str = "float32", fp8: bool = False):
        self.q_size = num_heads_local * head_dim
        self.kv_size = num_kv_heads_local * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias=bias, dtype=dtype, fp8=fp8)

    def forward(self, x) -> list:
        return self.F.split(super().forward(x), [self.q_size, self.kv_size, self.kv_size], -1)


class RowParallelLinear(Module):
    """``y = sum over ranks of x_local @ W_local.T``: input features are split over ranks.

    With ``reduce_results=False`` the partial sum is returned as is and the caller owns the
    all-reduce. No bias (GLM's o_proj and down projections have none; a bias would have to be
    added once, after the reduction).
    """

    def __init__(self, input_size_local: int, output_size: int, comm, reduce_results: bool, dtype: str = "float32",
                 fp8: bool = False):
        super().__init__()
        self.input_size, self.output_size = input_size_local, output_size
        self.comm, self.reduce_results = comm, reduce_results
        fp8_param(self, "weight", [output_size, input_size_local], dtype, fp8)

    def forward(self, x):
        y = self.F.project(x, weight_of(self))
        return self.comm.all_reduce(y) if self.reduce_results else y
