"""GLM-4.5 feed-forward blocks: dense SwiGLU MLP, and the MoE (router, routed + shared experts).

Experts are tensor-parallel: every rank holds every expert (``TPShard.experts()``) with its
slice of the intermediate dimension, so a rank's output is a partial sum. Routed and shared
outputs are added BEFORE the one all-reduce (or before the next fused norm does it).
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle import nn

from glm_fused.config import Glm4MoeConfig
from glm_fused.paddle_backend.layers.linear import MergedColumnParallelLinear, RowParallelLinear, linear, make_param
from glm_fused.sharding import TPShard


class MLP(nn.Layer):
    """``down(silu(gate(x)) * up(x))`` with gate and up merged into one column-parallel matmul."""

    def __init__(self, hidden_size: int, intermediate_size_local: int, comm, reduce_results: bool,
                 dtype: str = "float32"):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size_local] * 2, dtype=dtype)
        self.down_proj = RowParallelLinear(intermediate_size_local, hidden_size, comm, reduce_results, dtype=dtype)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class TopKRouter(nn.Layer):
    """Sigmoid router with group-limited top-k, all in fp32 whatever the model dtype.

    The correction bias steers only WHICH experts are chosen; the weights come from the
    un-biased scores.
    """

    def __init__(self, config: Glm4MoeConfig):
        super().__init__()
        E = config.n_routed_experts
        self.top_k, self.n_group, self.topk_group = config.num_experts_per_tok, config.n_group, config.topk_group
        self.norm_topk_prob, self.scale = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = make_param(self, [E, config.hidden_size], "float32")
        self.e_score_correction_bias = make_param(self, [E], "float32")

    def forward(self, x: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        """``x [T, H]`` -> ``(weights [T, top_k] fp32, expert ids [T, top_k])``."""
        scores = F.sigmoid(linear(x.astype("float32"), self.weight))
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            T, E = choice.shape
            # A group's score is the sum of its best two experts; keep the best topk_group groups.
            group_scores = paddle.topk(choice.reshape([T, self.n_group, -1]), 2, axis=-1)[0].sum(axis=-1)
            kept = paddle.topk(group_scores, self.topk_group, axis=-1)[1]
            group_mask = paddle.put_along_axis(paddle.zeros_like(group_scores), kept, 1.0, axis=1)
            expert_mask = paddle.repeat_interleave(group_mask, E // self.n_group, axis=1) > 0
            choice = paddle.where(expert_mask, choice, paddle.full_like(choice, float("-inf")))
        ids = paddle.topk(choice, self.top_k, axis=-1)[1]
        weights = paddle.take_along_axis(scores, ids, axis=1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids


class Experts(nn.Layer):
    """Stacked expert weights; runs only the experts that received tokens."""

    def __init__(self, expert_range: tuple[int, int], hidden_size: int, intermediate_size_local: int,
                 dtype: str = "float32"):
        super().__init__()
        self.first, self.last = expert_range
        n = self.last - self.first
        self.gate_up_proj = make_param(self, [n, 2 * intermediate_size_local, hidden_size], dtype)
        self.down_proj = make_param(self, [n, hidden_size, intermediate_size_local], dtype)

    def forward(self, x: paddle.Tensor, weights: paddle.Tensor, ids: paddle.Tensor) -> paddle.Tensor:
        top_k = ids.shape[1]
        flat = ids.flatten()
        order = paddle.argsort(flat, stable=True)  # (token, k) pairs grouped by expert
        counts = paddle.bincount(flat).tolist()  # the one host sync per layer
        tokens, token_weights = order // top_k, paddle.gather(weights.flatten(), order)
        out = paddle.zeros([x.shape[0], x.shape[1]], dtype="float32")
        begin = 0
        for expert, count in enumerate(counts):
            end = begin + count
            if count and self.first <= expert < self.last:
                e = expert - self.first
                rows = tokens[begin:end]
                gate, up = paddle.chunk(linear(paddle.gather(x, rows), self.gate_up_proj[e]), 2, axis=-1)
                y = linear(F.silu(gate) * up, self.down_proj[e])
                out = paddle.index_add(out, rows, 0, y.astype("float32") * token_weights[begin:end].unsqueeze(-1))
            begin = end
        return out.astype(x.dtype)


class MoE(nn.Layer):
    """Routed experts + shared experts on the same normed input, summed, then one all-reduce."""

    def __init__(self, config: Glm4MoeConfig, shard: TPShard, comm, reduce_results: bool,
                 dtype: str = "float32"):
        super().__init__()
        self.comm, self.reduce_results = comm, reduce_results
        self.gate = TopKRouter(config)
        self.experts = Experts(shard.experts(), config.hidden_size, shard.moe_intermediate_size, dtype=dtype)
        self.shared_experts = MLP(config.hidden_size, shard.shared_intermediate_size, comm,
                                  reduce_results=False, dtype=dtype)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids) + self.shared_experts(x)
        return self.comm.all_reduce(out) if self.reduce_results else out
