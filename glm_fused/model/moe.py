"""GLM-4.5 feed-forward blocks: dense SwiGLU MLP, and the MoE (router, routed + shared experts).

Experts are tensor-parallel: every rank holds every expert (``TPShard.experts()``) with its
slice of the intermediate dimension, so a rank's output is a partial sum. Routed and shared
outputs are added BEFORE the one all-reduce (or before the next fused norm does it).
"""

from __future__ import annotations

from glm_fused.config import Glm4MoeConfig
from glm_fused.model.linear import fp8_param, weight_of
from glm_fused.model.module import Module
from glm_fused.model.ops import Routing
from glm_fused.sharding import TPShard


class MLP(Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up merged into one column-parallel matmul."""

    def __init__(self, hidden_size: int, intermediate_size_local: int, comm, reduce_results: bool,
                 dtype: str = "float32", fp8: tuple[bool, bool] = (False, False)):
        super().__init__()
        self.gate_up_proj = self.nn.MergedColumnParallelLinear(hidden_size, [intermediate_size_local] * 2,
                                                               dtype=dtype, fp8=fp8[0])
        self.down_proj = self.nn.RowParallelLinear(intermediate_size_local, hidden_size, comm, reduce_results,
                                                   dtype=dtype, fp8=fp8[1])

    def forward(self, x):
        gate, up = self.gate_up_proj(x)
        return self.down_proj(self.F.silu_and_mul(gate, up))


class TopKRouter(Module):
    """The router's weights (fp32 whatever the model dtype) and its fp32 logits.

    The MoE hands the weights to ``Ops.moe``, which computes the logits and the selection
    (sigmoid, group-limited top-k on the bias-corrected scores, weights from the un-biased
    scores: ``Ops.route``) together, so a backend can do both in one kernel.
    """

    def __init__(self, config: Glm4MoeConfig):
        super().__init__()
        E = config.n_routed_experts
        self.routing = Routing(E, config.num_experts_per_tok, config.n_group, config.topk_group,
                               config.norm_topk_prob, config.routed_scaling_factor)
        self.weight = self.param([E, config.hidden_size], "float32")
        self.e_score_correction_bias = self.param([E], "float32", fill=0.0)

    def forward(self, x):
        """``x [T, H]`` -> router logits ``[T, E]`` in fp32."""
        return self.F.router_logits(x, self.weight)


class Experts(Module):
    """Stacked weights of this rank's experts (``expert_range``), intermediate dim split over TP;
    fp8: e4m3 codes with ``gate_up_proj_scale [n, 2I]`` and ``down_proj_scale [n, H]`` beside."""

    def __init__(self, expert_range: tuple[int, int], hidden_size: int, intermediate_size_local: int,
                 dtype: str = "float32", fp8: tuple[bool, bool] = (False, False)):
        super().__init__()
        self.expert_range = expert_range
        n = expert_range[1] - expert_range[0]
        fp8_param(self, "gate_up_proj", [n, 2 * intermediate_size_local, hidden_size], dtype, fp8[0])
        fp8_param(self, "down_proj", [n, hidden_size, intermediate_size_local], dtype, fp8[1])


class MoE(Module):
    """Routed experts + shared experts on the same normed input, summed, then one all-reduce."""

    def __init__(self, config: Glm4MoeConfig, shard: TPShard, comm, reduce_results: bool, dtype: str = "float32",
                 fp8: frozenset[str] = frozenset()):
        """``fp8``: which of this block's weights are e4m3 (``experts.gate_up_proj``,
        ``shared_experts.down_proj``, ...)."""
        super().__init__()
        self.comm, self.reduce_results = comm, reduce_results
        self.gate = self.nn.TopKRouter(config)
        self.experts = self.nn.Experts(shard.experts(), config.hidden_size, shard.moe_intermediate_size, dtype,
                                       fp8=("experts.gate_up_proj" in fp8, "experts.down_proj" in fp8))
        self.shared_experts = self.nn.MLP(config.hidden_size, shard.shared_intermediate_size, comm,
                                          reduce_results=False, dtype=dtype,
                                          fp8=("shared_experts.gate_up_proj" in fp8, "shared_experts.down_proj" in fp8))

    def forward(self, x):
        experts, shared = self.experts, self.shared_experts
        out = self.F.moe(x, self.gate.weight, self.gate.e_score_correction_bias, self.gate.routing,
                         weight_of(experts, "gate_up_proj"), weight_of(experts, "down_proj"), experts.expert_range,
                         weight_of(shared.gate_up_proj), weight_of(shared.down_proj))
        return self.comm.all_reduce(out) if self.reduce_results else out
