"""GLM-4.5 / GLM-4.5-Air (``glm4_moe``) for tensor-parallel inference, written once.

Two layouts of the same maths, chosen by ``fused``:

* fused (default): every all-reduce of the stack is folded into the norm after it.
  Embedding, o_proj and MLP/MoE return partial sums; each norm is
  ``fused_allreduce_residual_rmsnorm`` (all-reduce + residual add + RMSNorm), 2L+1 calls
  per forward and no plain all-reduce.
* classic: embedding, o_proj and MLP/MoE all-reduce themselves (2L+1 plain all-reduces)
  and each norm takes ``(x, residual)``.

Parameter names are the contract of docs/design.md (``embed_tokens``, ``layers.{i}...``,
``norm``, ``lm_head``; no ``model.`` prefix), so the causal LM *is* the decoder stack plus
an LM head. Users get these classes bound to a framework (``glm_fused.model.module.bind``):
``glm_fused.Glm4MoeForCausalLM`` (Paddle) and ``glm_fused.torch_backend.Glm4MoeForCausalLM``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from glm_fused import quantization as q8
from glm_fused.batch import ForwardBatch
from glm_fused.checkpoint import fp8_parameters
from glm_fused.config import Glm4MoeConfig
from glm_fused.engine_args import DTYPE_NAMES
from glm_fused.model.attention import Attention, AttentionMetadata  # noqa: F401  (layer classes)
from glm_fused.model.embedding import ParallelLMHead, VocabParallelEmbedding  # noqa: F401
from glm_fused.model.layernorm import RMSNorm, add_norm  # noqa: F401
from glm_fused.model.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear  # noqa: F401
from glm_fused.model.module import Module
from glm_fused.model.moe import MLP, MoE  # noqa: F401
from glm_fused.model.rotary import RotaryEmbedding  # noqa: F401
from glm_fused.quantization import scheme_for
from glm_fused.sharding import TPShard


class Glm4MoeAttention(Module):
    def __init__(self, config: Glm4MoeConfig, shard: TPShard, comm, fused: bool, rotary_emb, dtype: str,
                 fp8: frozenset[str] = frozenset()):
        super().__init__()
        nn, D = self.nn, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, D
        self.qkv_proj = nn.QKVParallelLinear(config.hidden_size, D, self.num_heads, self.num_kv_heads,
                                             bias=config.attention_bias, dtype=dtype, fp8="qkv_proj" in fp8)
        self.use_qk_norm = config.use_qk_norm
        if self.use_qk_norm:  # per-head RMSNorm over head_dim, before RoPE
            self.q_norm = nn.RMSNorm(D, config.rms_norm_eps, dtype)
            self.k_norm = nn.RMSNorm(D, config.rms_norm_eps, dtype)
        self.attn = nn.Attention(self.num_heads, self.num_kv_heads, D, D ** -0.5, rotary_emb)
        # The fused layout leaves the all-reduce to post_attention_layernorm.
        self.o_proj = nn.RowParallelLinear(self.num_heads * D, config.hidden_size, comm,
                                           reduce_results=not fused, dtype=dtype, fp8="o_proj" in fp8)

    def forward(self, positions, x, meta: AttentionMetadata, kv_cache):
        T = x.shape[0]
        q, k, v = self.qkv_proj(x)
        q = q.reshape([T, self.num_heads, self.head_dim])
        k = k.reshape([T, self.num_kv_heads, self.head_dim])
        v = v.reshape([T, self.num_kv_heads, self.head_dim])
        if self.use_qk_norm:
            q, _ = self.q_norm(q)
            k, _ = self.k_norm(k)
        o = self.attn(positions, q, k, v, meta, kv_cache)
        return self.o_proj(o.reshape([T, self.num_heads * self.head_dim]))


class Glm4MoeDecoderLayer(Module):
    """Pre-norm block: attention, then a dense MLP (first layers) or the MoE."""

    def __init__(self, config: Glm4MoeConfig, layer_idx: int, shard: TPShard, comm, fused: bool, rotary_emb,
                 dtype: str, fp8: frozenset[str] = frozenset()):
        """``fp8``: which of the layer's weights are e4m3, by name within the layer
        (``self_attn.qkv_proj``, ``mlp.experts.gate_up_proj``, ...)."""
        super().__init__()
        nn = self.nn
        self.comm, self.fused = comm, fused
        H, eps = config.hidden_size, config.rms_norm_eps

        def within(prefix: str) -> frozenset[str]:
            return frozenset(n.removeprefix(prefix) for n in fp8 if n.startswith(prefix))

        self.input_layernorm = nn.RMSNorm(H, eps, dtype)
        self.self_attn = nn.Glm4MoeAttention(config, shard, comm, fused, rotary_emb, dtype, within("self_attn."))
        self.post_attention_layernorm = nn.RMSNorm(H, eps, dtype)
        mlp = within("mlp.")
        if config.is_moe_layer(layer_idx):
            self.mlp = nn.MoE(config, shard, comm, reduce_results=not fused, dtype=dtype, fp8=mlp)
        else:
            self.mlp = nn.MLP(H, shard.intermediate_size, comm, reduce_results=not fused, dtype=dtype,
                              fp8=("gate_up_proj" in mlp, "down_proj" in mlp))

    def forward(self, positions, hidden, residual, meta, kv_cache):
        """``hidden`` is the previous block's output (a partial sum when fused); returns the same."""
        h, residual = add_norm(self.input_layernorm, hidden, residual, self.fused, self.comm)
        hidden = self.self_attn(positions, h, meta, kv_cache)
        h, residual = add_norm(self.post_attention_layernorm, hidden, residual, self.fused, self.comm)
        return self.mlp(h), residual


class Glm4MoeModel(Module):
    """Embedding, decoder layers, final norm: ``forward`` returns normed hidden states.

    fp8 (``glm_fused.quantization``): with an fp8 checkpoint's config, or ``quantization="fp8"``,
    the decoder Linears are fp8. ``quant`` is the scheme, ``quantized`` the parameters it makes
    fp8, ``fp8_params`` those this model holds as e4m3 codes with row scales: all of them where
    the framework has fp8 kernels for the device and dtype (``Ops.keeps_fp8``: torch, bf16,
    CUDA), none elsewhere (CPU, Paddle, fp32), where the loader hands them over dequantized
    (or, quantized at load, rounded through fp8) and the model computes in ``dtype``.
    """

    def __init__(self, config: Glm4MoeConfig, *, tp_rank: int = 0, tp_size: int = 1, fused: bool = True,
                 comm=None, dtype: str = "float32", max_position: int | None = None,
                 quantization: str | None = None):
        super().__init__()
        nn, F = self.nn, self.F
        self.config, self.fused = config, fused
        self.dtype = F.check_dtype(DTYPE_NAMES.get(dtype, dtype) if isinstance(dtype, str) else dtype, flag="dtype")
        if max_position is not None and not (isinstance(max_position, (int, np.integer)) and not isinstance(
                max_position, bool) and max_position > 0):
            raise ValueError(f"max_position must be a positive integer (or None: the config's "
                             f"max_position_embeddings), got {max_position!r}")
        self.quant = scheme_for(config, quantization)
        self.quantized = fp8_parameters(config, self.quant)
        self.fp8_params = self.quantized if self.quantized and F.keeps_fp8(self.dtype) else set()
        self.shard = TPShard(config, tp_rank, tp_size)
        self.comm = comm if comm is not None else F.dist.TPComm.from_env(tp_rank, tp_size)
        if (self.comm.rank, self.comm.size) != (tp_rank, tp_size):
            raise ValueError(f"comm is rank {self.comm.rank} of {self.comm.size}, model wants {tp_rank} of {tp_size}")
        c, s, d = config, self.shard, self.dtype
        self.max_position = max_position if max_position is not None else c.max_position_embeddings
        self.embed_tokens = nn.VocabParallelEmbedding(*s.vocab(), c.hidden_size, self.comm,
                                                      reduce_results=not fused, dtype=d)
        rotary_emb = nn.RotaryEmbedding(c.head_dim, c.rotary_dim, self.max_position, c.rope_theta)  # shared
        self.layers = nn.ModuleList([nn.Glm4MoeDecoderLayer(c, i, s, self.comm, fused, rotary_emb, d, frozenset(
            q8.module_of(n).removeprefix(f"layers.{i}.") for n in self.fp8_params if n.startswith(f"layers.{i}.")))
            for i in range(c.num_hidden_layers)])
        self.norm = nn.RMSNorm(c.hidden_size, c.rms_norm_eps, d)

    def forward(self, input_ids, positions, batch: ForwardBatch, kv_caches: list):
        """Hidden states ``[len(batch.logits_indices), H]`` after the final norm."""
        meta = AttentionMetadata.from_batch(batch, self.F, like=input_ids, block_size=kv_caches[0][0].shape[1])
        # uploaded before the layers, through page-locked memory: a plain copy after them would
        # hold the host until the device had run the whole forward
        rows = self.F.upload(batch.logits_indices, like=input_ids)
        return self.F.index_rows(self.forward_hidden(input_ids, positions, meta, kv_caches), rows)

    def forward_hidden(self, input_ids, positions, meta: AttentionMetadata, kv_caches: list):
        """Normed hidden states of every token; only device work (what a CUDA graph captures)."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(self.layers)} layers")
        hidden, residual = self.embed_tokens(input_ids), None  # residual is zero before layer 0
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, meta, kv_cache)
        hidden, _ = add_norm(self.norm, hidden, residual, self.fused, self.comm)
        return hidden

    def make_kv_caches(self, num_blocks: int, block_size: int) -> list:
        """Zeroed ``(k, v)`` per layer, ``[num_blocks, block_size, kv_heads_local, head_dim]``.

        Zeros, not garbage: batched decode multiplies masked (zero-weight) rows, and 0 * NaN is NaN.
        """
        shape, like = [num_blocks, block_size, self.shard.num_kv_heads, self.config.head_dim], self.embed_tokens.weight
        return [(self.F.zeros(shape, self.dtype, like), self.F.zeros(shape, self.dtype, like)) for _ in self.layers]

    def kv_cache_block_bytes(self, block_size: int) -> int:
        """Bytes of one block of this rank's cache over all layers (keys and values)."""
        itemsize = 2 if self.dtype in ("bfloat16", "float16") else 4
        return 2 * len(self.layers) * block_size * self.shard.num_kv_heads * self.config.head_dim * itemsize

    @property
    def device(self):
        return self.F.device_of(self.embed_tokens.weight)


class Glm4MoeForCausalLM(Glm4MoeModel):
    """The decoder stack plus a vocab-parallel LM head (not tied to the embedding)."""

    def __init__(self, config: Glm4MoeConfig, *, tp_rank: int = 0, tp_size: int = 1, fused: bool = True,
                 comm=None, dtype: str = "float32", max_position: int | None = None,
                 quantization: str | None = None):
        super().__init__(config, tp_rank=tp_rank, tp_size=tp_size, fused=fused, comm=comm, dtype=dtype,
                         max_position=max_position, quantization=quantization)
        self.lm_head = self.nn.ParallelLMHead(*self.shard.vocab(), config.hidden_size, self.comm,
                                              dtype=self.dtype)

    def forward(self, input_ids, positions=None, batch: ForwardBatch | None = None, kv_caches: list | None = None):
        """With ``positions, batch, kv_caches``: hidden states for ``batch.logits_indices``.

        With ``input_ids`` alone (``[batch, seq]`` or ``[seq]``, a tensor, array or list):
        full-vocab logits of every token, each row a fresh sequence from position 0, through a
        temporary KV cache.
        """
        if positions is None:
            return self._logits_without_cache(input_ids)
        return super().forward(input_ids, positions, batch, kv_caches)

    def compute_logits(self, hidden, dst: int | None = None):
        """Full-vocab logits on every rank (local block, then all-gather), or on rank ``dst``
        only (None elsewhere)."""
        return self.lm_head(hidden, dst)

    def _input_ids(self, input_ids) -> np.ndarray:
        """``input_ids`` as int64, checked here: inside the layers a wrong id is a framework's
        index error at best, and at TP > 1 a silent row of zeros (each rank masks the ids
        outside its slice of the vocabulary)."""
        if isinstance(input_ids, (list, tuple, np.ndarray)):
            try:
                ids = np.asarray(input_ids)
            except ValueError:
                raise ValueError("input_ids: its rows differ in length; pass one row at a time") from None
        elif hasattr(input_ids, "shape"):  # a framework tensor
            ids = self.F.to_numpy(input_ids)
        else:
            raise TypeError(f"input_ids must be token ids (a list, array or tensor), got {type(input_ids).__name__}")
        if ids.ndim not in (1, 2) or ids.shape[-1] == 0:
            raise ValueError(f"input_ids must be [seq] or [batch, seq] with seq > 0, got shape {list(ids.shape)}")
        if ids.dtype.kind not in "iu":
            raise ValueError(f"input_ids must be integer token ids, got {ids.dtype}")
        vocab, lowest, highest = self.config.vocab_size, ids.min(), ids.max()
        if lowest < 0 or highest >= vocab:
            raise ValueError(f"input_ids: token id {lowest if lowest < 0 else highest} is outside the vocabulary "
                             f"(0..{vocab - 1})")
        if ids.shape[-1] > self.max_position:
            raise ValueError(f"input_ids: {ids.shape[-1]} positions, more than the {self.max_position} this model "
                             "was built for (from_pretrained's max_position; default the config's "
                             "max_position_embeddings)")
        return ids.astype(np.int64)

    def _logits_without_cache(self, input_ids):
        F = self.F
        ids = self._input_ids(input_ids)
        rows = ids.reshape(-1, ids.shape[-1])
        # A temporary cache of one block per row, as long as the row.
        batch = ForwardBatch.prefill(rows.tolist(), np.arange(rows.shape[0])[:, None], all_logits=True)
        like = self.embed_tokens.weight
        with F.no_grad():
            kv_caches = self.make_kv_caches(rows.shape[0], rows.shape[1])
            hidden = super().forward(F.tensor(batch.input_ids, like), F.tensor(batch.positions, like), batch,
                                     kv_caches)
            return self.compute_logits(hidden).reshape([*ids.shape, -1])

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, tp_rank: int = 0, tp_size: int = 1, fused: bool = True,
                        dtype: str = "float32", comm=None, device=None, max_position: int | None = None,
                        progress: bool = False, quantization: str | None = None,
                        revision: str | None = None) -> "Glm4MoeForCausalLM":
        """Build this rank's model and load its weights from what ``--model`` names: a
        safetensors checkpoint directory, ``glm-4.5-air-tiny`` (the built-in tiny checkpoint), or
        a Hugging Face name in the local cache (``revision``: a branch, tag or commit of it). An
        fp8 checkpoint loads as fp8 (on CPU and in Paddle: dequantized); ``quantization="fp8"``
        quantizes a bf16 one at load.

        For ``tp_size > 1`` every rank calls this with its own ``tp_rank`` after the launcher
        (or torchrun / ``paddle.distributed.launch``) set up the environment; the process group
        is joined if needed. ``device``: the framework's device (default: this rank's).
        """
        from glm_fused.model.loader import load_weights
        from glm_fused.model_path import resolve_model

        F = cls.F
        resolved = resolve_model(str(model_dir), revision=revision)
        if resolved.path is None:
            raise FileNotFoundError(f"{model_dir}: no checkpoint directory")
        config = Glm4MoeConfig.from_pretrained(resolved.path)
        config.check_tp(tp_size, flag="tp_size")
        with F.device_scope(device):
            model = cls(config, tp_rank=tp_rank, tp_size=tp_size, fused=fused, comm=comm, dtype=dtype,
                        max_position=max_position, quantization=quantization)
        load_weights(model, resolved.path, progress=progress)
        model.eval()
        return model
