"""GLM-4.5 feed-forward blocks: dense SwiGLU MLP, and the MoE (router, routed + shared experts).

Experts are tensor-parallel: every rank holds every expert (``TPShard.experts()``) with its
slice of the intermediate dimension, so a rank's output is a partial sum. Routed and shared
outputs are added BEFORE the one all-reduce (or before the next fused norm does it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glm_fused.config import Glm4MoeConfig
from glm_fused.sharding import TPShard
from glm_fused.torch_backend import kernels
from glm_fused.torch_backend.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up merged into one column-parallel matmul."""

    def __init__(self, hidden_size: int, intermediate_size_local: int, comm, reduce_results: bool,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size_local] * 2, dtype=dtype)
        self.down_proj = RowParallelLinear(intermediate_size_local, hidden_size, comm, reduce_results, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        if kernels.enabled(x):
            from glm_fused.torch_backend.kernels.activation import silu_and_mul

            return self.down_proj(silu_and_mul(gate, up))
        return self.down_proj(F.silu(gate) * up)


class TopKRouter(nn.Module):
    """Sigmoid router with group-limited top-k, all in fp32 whatever the model dtype.

    The correction bias steers only WHICH experts are chosen; the weights come from the
    un-biased scores.
    """

    def __init__(self, config: Glm4MoeConfig):
        super().__init__()
        E = config.n_routed_experts
        self.top_k, self.n_group, self.topk_group = config.num_experts_per_tok, config.n_group, config.topk_group
        self.norm_topk_prob, self.scale = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(E, config.hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor, append_shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> ``(weights [T, top_k] fp32, expert ids [T, top_k])``.

        ``append_shared``: one more column, id E (the shared expert) with weight 1."""
        logits = F.linear(x.float(), self.weight)
        if self.n_group == 1 and kernels.enabled(x):
            from glm_fused.torch_backend.kernels.fused_moe import router_topk

            return router_topk(logits, self.e_score_correction_bias, self.top_k, self.norm_topk_prob, self.scale,
                               append_shared=append_shared)
        weights, ids = self._route(logits)
        if append_shared:
            T, E = logits.shape
            weights = torch.cat([weights, weights.new_ones(T, 1)], dim=1)
            ids = torch.cat([ids, ids.new_full((T, 1), E)], dim=1)
        return weights, ids

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            T, E = choice.shape
            # A group's score is the sum of its best two experts; keep the best topk_group groups.
            group_scores = choice.view(T, self.n_group, -1).topk(2, dim=-1).values.sum(dim=-1)
            kept = group_scores.topk(self.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            expert_mask = group_mask.repeat_interleave(E // self.n_group, dim=1)
            choice = choice.masked_fill(~expert_mask, float("-inf"))
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids


class Experts(nn.Module):
    """Stacked expert weights; runs only the experts that received tokens.

    On CUDA the Triton fused MoE (``kernels/fused_moe.py``); else a loop over the experts hit.
    """

    def __init__(self, expert_range: tuple[int, int], hidden_size: int, intermediate_size_local: int,
                 dtype: torch.dtype = torch.float32, partial: bool = False):
        super().__init__()
        self.first, self.last = expert_range
        self.partial = partial  # this rank holds only some of the experts (expert_range is not all)
        n = self.last - self.first
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * intermediate_size_local, hidden_size, dtype=dtype),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(n, hidden_size, intermediate_size_local, dtype=dtype),
                                      requires_grad=False)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                shared: torch.Tensor | None = None, shared_weights=None) -> torch.Tensor:
        """Weighted sum of each token's experts, plus the shared expert: its output ``shared``,
        or (Triton path) its weights ``(gate_up, down)`` folded in as one more expert."""
        if kernels.enabled(x):
            from glm_fused.torch_backend.kernels.fused_moe import fused_experts

            return fused_experts(x, self.gate_up_proj, self.down_proj, weights, ids, shared,
                                 shared_weights=shared_weights,
                                 expert_range=(self.first, self.last) if self.partial else None)
        out = self._loop(x, weights, ids)
        return out if shared is None else out + shared

    def _loop(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        top_k = ids.shape[1]
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)  # (token, k) pairs grouped by expert
        counts = torch.bincount(flat).tolist()  # the one host sync per layer
        tokens, token_weights = order // top_k, weights.flatten()[order]
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        begin = 0
        for expert, count in enumerate(counts):
            end = begin + count
            if count and self.first <= expert < self.last:
                e = expert - self.first
                rows = tokens[begin:end]
                gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
                y = F.linear(F.silu(gate) * up, self.down_proj[e])
                out.index_add_(0, rows, y.float() * token_weights[begin:end, None])
            begin = end
        return out.to(x.dtype)


class MoE(nn.Module):
    """Routed experts + shared experts on the same normed input, summed, then one all-reduce."""

    def __init__(self, config: Glm4MoeConfig, shard: TPShard, comm, reduce_results: bool,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.comm, self.reduce_results = comm, reduce_results
        self.gate = TopKRouter(config)
        self.experts = Experts(shard.experts(), config.hidden_size, shard.moe_intermediate_size, dtype=dtype,
                               partial=shard.experts() != (0, config.n_routed_experts))
        # One shared expert as wide as a routed one can ride in the routed GEMMs (Triton path).
        self.fold_shared = shard.shared_intermediate_size == shard.moe_intermediate_size
        self.shared_experts = MLP(config.hidden_size, shard.shared_intermediate_size, comm,
                                  reduce_results=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fold_shared and kernels.enabled(x):
            weights, ids = self.gate(x, append_shared=True)
            shared = self.shared_experts
            out = self.experts(x, weights, ids,
                               shared_weights=(shared.gate_up_proj.weight, shared.down_proj.weight))
        else:
            weights, ids = self.gate(x)
            out = self.experts(x, weights, ids, shared=self.shared_experts(x))
        return self.comm.all_reduce(out) if self.reduce_results else out
