"""GLM-4.5 / GLM-4.5-Air (``glm4_moe``) for tensor-parallel inference, PyTorch.

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

import torch
from torch import nn

from glm_fused.batch import ForwardBatch
from glm_fused.config import Glm4MoeConfig
from glm_fused.errors import UserError
from glm_fused.sharding import TPShard
from glm_fused.torch_backend import dist, kernels
from glm_fused.torch_backend.layers.attention import Attention, AttentionMetadata
from glm_fused.torch_backend.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from glm_fused.torch_backend.layers.layernorm import RMSNorm, fused_allreduce_residual_rmsnorm
from glm_fused.torch_backend.layers.linear import QKVParallelLinear, RowParallelLinear
from glm_fused.torch_backend.layers.moe import MLP, MoE
from glm_fused.torch_backend.layers.rotary_embedding import RotaryEmbedding

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def torch_dtype(dtype: str | torch.dtype, flag: str = "--dtype") -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise UserError(f"{flag} {dtype!r}: choose one of {', '.join(DTYPES)}")


def add_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None, fused: bool, comm
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual), x + residual)``; in the fused layout ``x`` is a partial sum."""
    if fused:
        return fused_allreduce_residual_rmsnorm(x, residual, norm.weight, norm.eps, comm)
    return norm(x, residual)


class Glm4MoeAttention(nn.Module):
    def __init__(self, config: Glm4MoeConfig, shard: TPShard, comm, fused: bool, rotary_emb: RotaryEmbedding,
                 dtype: torch.dtype):
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

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata, kv_cache) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.use_qk_norm:
            q, _ = self.q_norm(q)
            k, _ = self.k_norm(k)
        if kernels.enabled(x):  # one launch rotates q and k and writes k, v to the cache
            q = self.rotary_emb.rotate_and_store(positions, meta.token_slots, q, k, v, kv_cache)
            o = self.attn(q, None, None, meta, kv_cache)
        else:
            q, k = self.rotary_emb(positions, q, k)
            o = self.attn(q, k, v, meta, kv_cache)
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))


class Glm4MoeDecoderLayer(nn.Module):
    """Pre-norm block: attention, then a dense MLP (first layers) or the MoE."""

    def __init__(self, config: Glm4MoeConfig, layer_idx: int, shard: TPShard, comm, fused: bool,
                 rotary_emb: RotaryEmbedding, dtype: torch.dtype):
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


class Glm4MoeModel(nn.Module):
    """Embedding, decoder layers, final norm: ``forward`` returns normed hidden states."""

    def __init__(self, config: Glm4MoeConfig, *, tp_rank: int = 0, tp_size: int = 1, fused: bool = True,
                 comm=None, dtype: str | torch.dtype = "float32", max_position: int | None = None):
        super().__init__()
        self.config, self.fused = config, fused
        self.dtype = torch_dtype(dtype)
        self.shard = TPShard(config, tp_rank, tp_size)
        self.comm = comm if comm is not None else _default_comm(tp_rank, tp_size)
        if (self.comm.rank, self.comm.size) != (tp_rank, tp_size):
            raise ValueError(f"comm is rank {self.comm.rank} of {self.comm.size}, model wants {tp_rank} of {tp_size}")
        c, s, d = config, self.shard, self.dtype
        self.max_position = max_position or c.max_position_embeddings
        self.embed_tokens = VocabParallelEmbedding(*s.vocab(), c.hidden_size, self.comm,
                                                   reduce_results=not fused, dtype=d)
        rotary_emb = RotaryEmbedding(c.head_dim, c.rotary_dim, self.max_position, c.rope_theta)  # shared
        self.layers = nn.ModuleList(Glm4MoeDecoderLayer(c, i, s, self.comm, fused, rotary_emb, d)
                                    for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, d)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                kv_caches: list) -> torch.Tensor:
        """Hidden states ``[len(batch.logits_indices), H]`` after the final norm."""
        meta = AttentionMetadata.from_batch(batch, input_ids.device)
        hidden = self.forward_hidden(input_ids, positions, meta, kv_caches)
        return hidden[torch.as_tensor(batch.logits_indices, device=hidden.device)]

    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       kv_caches: list) -> torch.Tensor:
        """Normed hidden states of every token; only device work (what a CUDA graph captures)."""
        hidden, residual = self.embed_tokens(input_ids), None  # residual is zero before layer 0
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, meta, kv_cache)
        hidden, _ = add_norm(self.norm, hidden, residual, self.fused, self.comm)
        return hidden

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def make_kv_caches(self, num_slots: int, max_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed ``(k, v)`` per layer, ``[num_slots, max_len, kv_heads_local, head_dim]``.

        Zeros, not garbage: batched decode multiplies masked (zero-weight) rows, and 0 * NaN is NaN.
        """
        shape = (num_slots, max_len, self.shard.num_kv_heads, self.config.head_dim)
        return [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                 torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in self.layers]


class Glm4MoeForCausalLM(Glm4MoeModel):
    """The decoder stack plus a vocab-parallel LM head (not tied to the embedding)."""

    def __init__(self, config: Glm4MoeConfig, *, tp_rank: int = 0, tp_size: int = 1, fused: bool = True,
                 comm=None, dtype: str | torch.dtype = "float32", max_position: int | None = None):
        super().__init__(config, tp_rank=tp_rank, tp_size=tp_size, fused=fused, comm=comm, dtype=dtype,
                         max_position=max_position)
        self.lm_head = ParallelLMHead(*self.shard.vocab(), config.hidden_size, self.comm, dtype=self.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                batch: ForwardBatch | None = None, kv_caches: list | None = None) -> torch.Tensor:
        """With ``positions, batch, kv_caches``: hidden states for ``batch.logits_indices``.

        With ``input_ids`` alone (``[batch, seq]`` or ``[seq]``): full-vocab logits of every
        token, each row a fresh sequence from position 0, through a temporary KV cache.
        """
        if positions is None:
            return self._logits_without_cache(input_ids)
        return super().forward(input_ids, positions, batch, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocab logits on every rank (local block, then all-gather)."""
        return self.lm_head(hidden)

    @torch.inference_mode()
    def _logits_without_cache(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(input_ids)
        if ids.dim() not in (1, 2) or ids.shape[-1] == 0:
            raise ValueError(f"input_ids must be [seq] or [batch, seq] with seq > 0, got shape {list(ids.shape)}")
        rows = ids.reshape(-1, ids.shape[-1])
        batch = ForwardBatch.prefill(rows.cpu().numpy().tolist(), all_logits=True)
        kv_caches = self.make_kv_caches(rows.shape[0], rows.shape[1])
        dev = self.device
        hidden = super().forward(torch.as_tensor(batch.input_ids, device=dev),
                                 torch.as_tensor(batch.positions, device=dev), batch, kv_caches)
        return self.compute_logits(hidden).reshape(*ids.shape, -1)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, tp_rank: int = 0, tp_size: int = 1, fused: bool = True,
                        dtype: str | torch.dtype = "float32", comm=None, device: str | torch.device | None = None,
                        max_position: int | None = None, progress: bool = False) -> "Glm4MoeForCausalLM":
        """Build this rank's model and load its weights from a safetensors checkpoint directory.

        For ``tp_size > 1`` every rank calls this with its own ``tp_rank`` after the launcher
        (or torchrun) set up the environment; torch.distributed is initialised if needed.
        """
        from glm_fused.torch_backend.loader import load_weights

        config = Glm4MoeConfig.from_pretrained(model_dir)
        config.check_tp(tp_size, flag="tp_size")
        target = torch.device(device) if device is not None else dist.device()
        with torch.device(target):
            model = cls(config, tp_rank=tp_rank, tp_size=tp_size, fused=fused, comm=comm, dtype=dtype,
                        max_position=max_position)
        load_weights(model, model_dir, config, model.shard, progress=progress)
        return model.eval()


def _default_comm(tp_rank: int, tp_size: int):
    if tp_size > 1 and not torch.distributed.is_initialized():
        dist.init_distributed()
    return dist.TPComm(tp_rank, tp_size)


__all__ = ["Glm4MoeForCausalLM", "Glm4MoeModel", "Glm4MoeDecoderLayer", "Glm4MoeAttention", "torch_dtype",
           "DTYPES", "add_norm"]
