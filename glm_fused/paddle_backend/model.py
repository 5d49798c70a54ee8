"""GLM-4.5 / GLM-4.5-Air (``glm4_moe``) for tensor-parallel inference, Paddle.

Two layouts of the same maths, chosen by ``fused``:

* fused (default): every all-reduce of the stack is folded into the norm after it.
  Embedding, o_proj and MLP/MoE return partial sums; each norm is
  ``fused_allreduce_residual_rmsnorm`` (all-reduce + residual add + RMSNorm), 2L+1 calls
  per forward and no plain all-reduce.
* classic: embedding, o_proj and MLP/MoE all-reduce themselves (2L+1 plain all-reduces)
  and each norm takes ``(x, residual)``.

Parameter names are the contract of docs/design.md (``embed_tokens``, ``layers.{i}...``,
``norm``, ``lm_head``; no ``model.`` prefix), so the causal LM *is* the decoder stack plus
an LM head.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import paddle
from paddle import nn

from glm_fused.batch import ForwardBatch
from glm_fused.config import Glm4MoeConfig
from glm_fused.errors import UserError
from glm_fused.paddle_backend import dist
from glm_fused.paddle_backend.layers.attention import Attention, AttentionMetadata
from glm_fused.paddle_backend.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from glm_fused.paddle_backend.layers.layernorm import RMSNorm, fused_allreduce_residual_rmsnorm
from glm_fused.paddle_backend.layers.linear import QKVParallelLinear, RowParallelLinear
from glm_fused.paddle_backend.layers.moe import MLP, MoE
from glm_fused.paddle_backend.layers.rotary_embedding import RotaryEmbedding
from glm_fused.sharding import TPShard

DTYPES = ("float32", "bfloat16")


def paddle_dtype(dtype, flag: str = "--dtype") -> str:
    """The model dtype as Paddle names it; bfloat16 is refused on CPU (Paddle has no CPU kernels for it)."""
    name = str(dtype).removeprefix("paddle.")
    if name not in DTYPES:
        raise UserError(f"{flag} {dtype!r}: choose one of {', '.join(DTYPES)}")
    if name == "bfloat16" and paddle.get_device() == "cpu":
        raise UserError(f"{flag} bfloat16: Paddle on CPU has no bfloat16 kernels (matmul, silu, softmax, "
                        f"topk); use {flag} float32, or the torch backend for bfloat16 on CPU")
    return name


def add_norm(norm: RMSNorm, x: paddle.Tensor, residual: paddle.Tensor | None, fused: bool, comm
             ) -> tuple[paddle.Tensor, paddle.Tensor]:
    """``(norm(x + residual), x + residual)``; in the fused layout ``x`` is a partial sum."""
    if fused:
        return fused_allreduce_residual_rmsnorm(x, residual, norm.weight, norm.eps, comm)
    return norm(x, residual)


class Glm4MoeAttention(nn.Layer):
    def __init__(self, config: Glm4MoeConfig, shard: TPShard, comm, fused: bool, rotary_emb: RotaryEmbedding,
                 dtype: str):
        super().__init__()
        D = config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, D
        self.qkv_proj = QKVParallelLinear(config.hidden_size, D, self.num_heads, self.num_kv_heads,
                                          bias=config.attention_bias, dtype=dtype)
        self.use_qk_norm = config.use_qk_norm
        if self.use_qk_norm:  # per-head RMSNorm over head_dim, before RoPE
            self.q_norm = RMSNorm(D, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(D, config.rms_norm_eps, dtype)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.num_kv_heads, D, scale=D ** -0.5)
        # The fused layout leaves the all-reduce to post_attention_layernorm.
        self.o_proj = RowParallelLinear(self.num_heads * D, config.hidden_size, comm,
                                        reduce_results=not fused, dtype=dtype)

    def forward(self, positions: paddle.Tensor, x: paddle.Tensor, meta: AttentionMetadata, kv_cache) -> paddle.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x)
        q = q.reshape([T, self.num_heads, self.head_dim])
        k = k.reshape([T, self.num_kv_heads, self.head_dim])
        v = v.reshape([T, self.num_kv_heads, self.head_dim])
        if self.use_qk_norm:
            q, _ = self.q_norm(q)
            k, _ = self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v, meta, kv_cache)
        return self.o_proj(o.reshape([T, self.num_heads * self.head_dim]))


class Glm4MoeDecoderLayer(nn.Layer):
    """Pre-norm block: attention, then a dense MLP (first layers) or the MoE."""

    def __init__(self, config: Glm4MoeConfig, layer_idx: int, shard: TPShard, comm, fused: bool,
                 rotary_emb: RotaryEmbedding, dtype: str):
        super().__init__()
        self.comm, self.fused = comm, fused
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps, dtype)
        self.self_attn = Glm4MoeAttention(config, shard, comm, fused, rotary_emb, dtype)
        self.post_attention_layernorm = RMSNorm(H, eps, dtype)
        if config.is_moe_layer(layer_idx):
            self.mlp = MoE(config, shard, comm, reduce_results=not fused, dtype=dtype)
        else:
            self.mlp = MLP(H, shard.intermediate_size, comm, reduce_results=not fused, dtype=dtype)

    def forward(self, positions, hidden, residual, meta, kv_cache):
        """``hidden`` is the previous block's output (a partial sum when fused); returns the same."""
        h, residual = add_norm(self.input_layernorm, hidden, residual, self.fused, self.comm)
        hidden = self.self_attn(positions, h, meta, kv_cache)
        h, residual = add_norm(self.post_attention_layernorm, hidden, residual, self.fused, self.comm)
        return self.mlp(h), residual


class Glm4MoeModel(nn.Layer):
    """Embedding, decoder layers, final norm: ``forward`` returns normed hidden states."""

    def __init__(self, config: Glm4MoeConfig, *, tp_rank: int = 0, tp_size: int = 1, fused: bool = True,
                 comm=None, dtype: str = "float32", max_position: int | None = None):
        super().__init__()
        self.config, self.fused = config, fused
        self.model_dtype = paddle_dtype(dtype)
        self.shard = TPShard(config, tp_rank, tp_size)
        self.comm = comm if comm is not None else _default_comm(tp_rank, tp_size)
        if (self.comm.rank, self.comm.size) != (tp_rank, tp_size):
            raise ValueError(f"comm is rank {self.comm.rank} of {self.comm.size}, model wants {tp_rank} of {tp_size}")
        c, s, d = config, self.shard, self.model_dtype
        self.max_position = max_position or c.max_position_embeddings
        self.embed_tokens = VocabParallelEmbedding(*s.vocab(), c.hidden_size, self.comm,
                                                   reduce_results=not fused, dtype=d)
        rotary_emb = RotaryEmbedding(c.head_dim, c.rotary_dim, self.max_position, c.rope_theta)  # shared
        self.layers = nn.LayerList([Glm4MoeDecoderLayer(c, i, s, self.comm, fused, rotary_emb, d)
                                    for i in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, d)

    def forward(self, input_ids: paddle.Tensor, positions: paddle.Tensor, batch: ForwardBatch,
                kv_caches: list) -> paddle.Tensor:
        """Hidden states ``[len(batch.logits_indices), H]`` after the final norm."""
        meta = AttentionMetadata.from_batch(batch)
        hidden, residual = self.embed_tokens(input_ids), None  # residual is zero before layer 0
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(self.layers)} layers")
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, meta, kv_cache)
        hidden, _ = add_norm(self.norm, hidden, residual, self.fused, self.comm)
        return paddle.gather(hidden, paddle.to_tensor(batch.logits_indices))

    def make_kv_caches(self, num_slots: int, max_len: int) -> list[tuple[paddle.Tensor, paddle.Tensor]]:
        """Zeroed ``(k, v)`` per layer, ``[num_slots, max_len, kv_heads_local, head_dim]``.

        Zeros, not garbage: batched decode multiplies masked (zero-weight) rows, and 0 * NaN is NaN.
        """
        shape = [num_slots, max_len, self.shard.num_kv_heads, self.config.head_dim]
        return [(paddle.zeros(shape, dtype=self.model_dtype), paddle.zeros(shape, dtype=self.model_dtype))
                for _ in self.layers]


class Glm4MoeForCausalLM(Glm4MoeModel):
    """The decoder stack plus a vocab-parallel LM head (not tied to the embedding)."""

    def __init__(self, config: Glm4MoeConfig, *, tp_rank: int = 0, tp_size: int = 1, fused: bool = True,
                 comm=None, dtype: str = "float32", max_position: int | None = None):
        super().__init__(config, tp_rank=tp_rank, tp_size=tp_size, fused=fused, comm=comm, dtype=dtype,
                         max_position=max_position)
        self.lm_head = ParallelLMHead(*self.shard.vocab(), config.hidden_size, self.comm, dtype=self.model_dtype)

    def forward(self, input_ids: paddle.Tensor, positions: paddle.Tensor | None = None,
                batch: ForwardBatch | None = None, kv_caches: list | None = None) -> paddle.Tensor:
        """With ``positions, batch, kv_caches``: hidden states for ``batch.logits_indices``.

        With ``input_ids`` alone (``[batch, seq]`` or ``[seq]``): full-vocab logits of every
        token, each row a fresh sequence from position 0, through a temporary KV cache.
        """
        if positions is None:
            return self._logits_without_cache(input_ids)
        return super().forward(input_ids, positions, batch, kv_caches)

    def compute_logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """Full-vocab logits on every rank (local block, then all-gather)."""
        return self.lm_head(hidden)

    @paddle.no_grad()
    def _logits_without_cache(self, input_ids) -> paddle.Tensor:
        ids = np.asarray(input_ids.numpy() if isinstance(input_ids, paddle.Tensor) else input_ids, dtype=np.int64)
        if ids.ndim not in (1, 2) or ids.shape[-1] == 0:
            raise ValueError(f"input_ids must be [seq] or [batch, seq] with seq > 0, got shape {list(ids.shape)}")
        rows = ids.reshape(-1, ids.shape[-1])
        batch = ForwardBatch.prefill(rows.tolist(), all_logits=True)
        kv_caches = self.make_kv_caches(rows.shape[0], rows.shape[1])
        hidden = super().forward(paddle.to_tensor(batch.input_ids), paddle.to_tensor(batch.positions),
                                 batch, kv_caches)
        return self.compute_logits(hidden).reshape([*ids.shape, -1])

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, tp_rank: int = 0, tp_size: int = 1, fused: bool = True,
                        dtype: str = "float32", comm=None, device: str | None = None,
                        max_position: int | None = None, progress: bool = False) -> "Glm4MoeForCausalLM":
        """Build this rank's model and load its weights from a safetensors checkpoint directory.

        For ``tp_size > 1`` every rank calls this with its own ``tp_rank`` after the launcher
        (or ``paddle.distributed.launch``) set up the environment; the process group is joined
        if needed.
        """
        from glm_fused.paddle_backend.loader import load_weights

        config = Glm4MoeConfig.from_pretrained(model_dir)
        config.check_tp(tp_size, flag="tp_size")
        paddle.set_device(device if device is not None else dist.device())
        model = cls(config, tp_rank=tp_rank, tp_size=tp_size, fused=fused, comm=comm, dtype=dtype,
                    max_position=max_position)
        load_weights(model, model_dir, config, model.shard, progress=progress)
        model.eval()
        return model


def _default_comm(tp_rank: int, tp_size: int):
    if tp_size > 1 and not paddle.distributed.is_initialized():
        dist.init_distributed()
    return dist.TPComm(tp_rank, tp_size)


__all__ = ["Glm4MoeForCausalLM", "Glm4MoeModel", "Glm4MoeDecoderLayer", "Glm4MoeAttention", "paddle_dtype",
           "DTYPES", "add_norm"]
