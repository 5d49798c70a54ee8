"""``Ops``: what the model computes with (``self.F`` in a layer), written once.

A framework subclass (``glm_fused.torch_backend.ops.TorchOps``, ``glm_fused.paddle_backend.ops
.PaddleOps``) supplies the *primitives* - its tensor library under one set of names, with
torch's argument conventions (``dim``, ``[out, in]`` weights, ``[batch, heads, len, dim]``
attention). The *composites* below (RMSNorm, RoPE and the KV-cache write, attention, SwiGLU,
the router, the MoE) are the model's maths, written here once from those primitives; a
framework may replace a composite with a kernel that computes the same function (the torch
backend's Triton kernels on CUDA), and nothing else.

A weight is a framework tensor, or an ``Fp8Weight`` (e4m3 codes and one scale per output row)
where the model keeps fp8 weights (``keeps_fp8``). The composites take either kind; written
here, an fp8 weight is used as its dequantized value (``linear_fp8``), and a framework's fp8
kernels add what makes them fast: activations quantized per token, fp8 products.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from glm_fused.quantization import AMAX_EPS, FP8_DTYPE, FP8_MAX


@dataclass(frozen=True)
class Routing:
    """How the MoE router picks and weights experts (GLM-4.5: sigmoid, grouped top-k)."""

    num_experts: int
    top_k: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    scale: float  # routed_scaling_factor


@dataclass(frozen=True)
class Fp8Weight:
    """An fp8 weight: e4m3 ``codes [..., out, in]`` and a float32 ``scale [..., out]`` per output
    row; its value is ``codes * scale[..., None]``. Indexing picks experts of a stacked weight."""

    codes: Any
    scale: Any

    @property
    def shape(self):
        return self.codes.shape

    def __getitem__(self, index) -> "Fp8Weight":
        return Fp8Weight(self.codes[index], self.scale[index])


class Ops:
    # ---- set by a framework --------------------------------------------------------------
    name: str = ""            # "torch" | "paddle"
    Module: type = object     # torch.nn.Module | paddle.nn.Layer
    ModuleList: type = list
    layers_module: str = ""   # where the framework's layer twins say they live
    dtypes: tuple[str, ...] = ("float32", "bfloat16")

    # ---- primitives (a framework implements these) ---------------------------------------
    # dtypes, devices, creation
    def dtype(self, name: str): raise NotImplementedError
    def dtype_name(self, x) -> str: raise NotImplementedError
    def cast(self, x, dtype: str): raise NotImplementedError
    def param(self, module, shape: list[int], dtype: str, fill: float | None): raise NotImplementedError
    def buffer(self, module, name: str, array) -> None: raise NotImplementedError
    def tensor(self, array, like=None): raise NotImplementedError     # on like's device (None: host)
    def to_numpy(self, x): raise NotImplementedError
    def zeros(self, shape: list[int], dtype: str, like=None): raise NotImplementedError
    def zeros_like(self, x): raise NotImplementedError
    def no_grad(self): raise NotImplementedError
    def device_scope(self, device=None): raise NotImplementedError  # where new parameters land
    def device_of(self, x): raise NotImplementedError
    def check_dtype(self, dtype, flag: str = "--dtype") -> str: raise NotImplementedError
    def weight_writer(self, device): raise NotImplementedError  # copies checkpoint.Part slices into parameters
    def assign(self, dst, src) -> None: raise NotImplementedError  # a tensor's values into a parameter (or its slice)
    def keeps_fp8(self, dtype: str) -> bool: raise NotImplementedError  # fp8 weights for a model in dtype, where parameters land?
    def fill(self, param, value: float) -> None: raise NotImplementedError
    def fill_normal(self, param, std: float, key: str) -> None: raise NotImplementedError  # seeded by key
    # maths and shapes (torch's semantics)
    def linear(self, x, weight, bias=None): raise NotImplementedError
    def embedding(self, ids, weight): raise NotImplementedError
    def silu(self, x): raise NotImplementedError
    def sigmoid(self, x): raise NotImplementedError
    def rsqrt(self, x): raise NotImplementedError
    def abs(self, x): raise NotImplementedError
    def amax(self, x, dim: int): raise NotImplementedError
    def clamp(self, x, min: float | None = None, max: float | None = None): raise NotImplementedError
    def mean(self, x, dim: int, keepdim: bool = False): raise NotImplementedError
    def sum(self, x, dim: int, keepdim: bool = False): raise NotImplementedError
    def cat(self, xs: list, dim: int): raise NotImplementedError
    def split(self, x, sizes: list[int], dim: int) -> list: raise NotImplementedError
    def transpose(self, x, dim0: int, dim1: int): raise NotImplementedError
    def topk(self, x, k: int, dim: int = -1) -> tuple: raise NotImplementedError
    def where(self, cond, x, y): raise NotImplementedError
    def index_rows(self, x, index): raise NotImplementedError           # x[index] along dim 0
    def take_along(self, x, index, dim: int): raise NotImplementedError  # torch.gather
    def put_along(self, x, index, value: float, dim: int): raise NotImplementedError  # scatter a value
    def repeat_interleave(self, x, repeats: int, dim: int): raise NotImplementedError
    def argsort(self, x): raise NotImplementedError                    # stable, ascending, 1-D
    def bincount(self, x) -> list[int]: raise NotImplementedError      # to the host
    def index_add(self, out, index, source): raise NotImplementedError  # out[index[i]] += source[i]
    def sdpa(self, q, k, v, mask, causal: bool, scale: float): raise NotImplementedError
    # the fused all-reduce kernel, reached from this framework's tensors
    def call_flashinfer(self, kernel, partial, residual, weight, eps: float): raise NotImplementedError

    # ---- composites: the model's maths ---------------------------------------------------
    def float32(self, x):
        return self.cast(x, "float32")

    # fp8 weights (glm_fused.quantization has the formats)
    def quantize_fp8(self, w) -> Fp8Weight:
        """Per output row: ``scale = max|row| / 448``, codes ``w / scale`` rounded to e4m3 (the
        one quantization of weights: ``--quantization fp8``, block scales made row scales, dummy
        weights; the kernels quantize activations per token by the same rule)."""
        wf = self.float32(w)
        scale = self.clamp(self.amax(self.abs(wf), -1), min=AMAX_EPS) / FP8_MAX
        return Fp8Weight(self.cast(self.clamp(wf / scale.unsqueeze(-1), -FP8_MAX, FP8_MAX), FP8_DTYPE), scale)

    def dequantize_fp8(self, w: Fp8Weight, dtype: str = "float32"):
        return self.cast(self.float32(w.codes) * w.scale.unsqueeze(-1), dtype)

    def linear_fp8(self, x, w: Fp8Weight, bias=None):
        """``x @ (codes * scale)^T (+ bias)``: an fp8 Linear as the model's maths (activations as
        they come; the CUDA path quantizes them per token and multiplies in fp8)."""
        return self.linear(x, self.dequantize_fp8(w, self.dtype_name(x)), bias)

    def project(self, x, weight, bias=None):
        """A Linear with either kind of weight."""
        if isinstance(weight, Fp8Weight):
            return self.linear_fp8(x, weight, bias)
        return self.linear(x, weight, bias)

    def rms_norm(self, x, weight, eps: float):
        """fp32 statistics; cast back to the input dtype BEFORE the weight multiply (as transformers)."""
        xf = self.float32(x)
        xf = xf * self.rsqrt(self.mean(xf * xf, -1, keepdim=True) + eps)
        return weight * self.cast(xf, self.dtype_name(x))

    def add_rms_norm(self, x, residual, weight, eps: float):
        """``(rms_norm(x + residual), x + residual)``; no residual means the stream starts at ``x``."""
        if residual is not None:
            x = x + residual
        return self.rms_norm(x, weight, eps), x

    def silu_and_mul(self, gate, up):
        return self.silu(gate) * up

    def rope(self, positions, q, k, cos_cache, sin_cache, rotary_dim: int):
        """Partial NeoX RoPE: the first ``rotary_dim`` dims of each head, dim i paired with
        i + rotary_dim/2 (``rotate_half``), in fp32; the rest pass through."""
        cos = self.index_rows(cos_cache, positions).unsqueeze(1)  # [T, 1, rotary_dim/2]
        sin = self.index_rows(sin_cache, positions).unsqueeze(1)
        half = rotary_dim // 2

        def rotate(x):
            x1, x2 = self.float32(x[..., :half]), self.float32(x[..., half:rotary_dim])
            # (x1, x2) * cos + rotate_half(x1, x2) * sin, with rotate_half(x1, x2) = (-x2, x1)
            rotated = self.cast(self.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1), self.dtype_name(x))
            return rotated if rotary_dim == x.shape[-1] else self.cat([rotated, x[..., rotary_dim:]], -1)

        return rotate(q), rotate(k)

    def rope_and_store(self, positions, q, k, v, cos_cache, sin_cache, rotary_dim: int, meta, kv_cache):
        """Rotate q and k, write k and v into the paged cache at each token's (block, row); the rotated q."""
        q, k = self.rope(positions, q, k, cos_cache, sin_cache, rotary_dim)
        k_cache, v_cache = kv_cache
        k_cache[meta.token_blocks, meta.token_offsets] = k
        v_cache[meta.token_blocks, meta.token_offsets] = v
        return q

    def gather_keys(self, cache, blocks, length: int):
        """The first ``length`` positions of a sequence from its ``blocks`` -> ``[length, kv_heads, D]``."""
        pages = self.index_rows(cache, blocks)  # [n, block_size, kv_heads, D], a copy
        n, size, heads, dim = pages.shape
        return pages.reshape([n * size, heads, dim])[:length]

    def attention(self, q, meta, kv_cache, scale: float):
        """``softmax(q k^T * scale) v`` of every token over its sequence's cached keys (this
        step's included): ``q [T, heads, D]`` -> ``[T, heads, D]``. See ``AttentionMetadata``."""
        k_cache, v_cache = kv_cache
        if meta.decode_mask is not None:
            # One query per sequence: all sequences in one call over keys padded to the longest
            # context; the mask hides the padding. Padding rows hold finite values (zeros, or
            # an earlier owner's keys), never NaN, so their zero weights stay zero.
            max_len = meta.decode_mask.shape[-1]
            S, width = meta.block_tables.shape
            flat = meta.block_tables.reshape([-1])
            keys = self.index_rows(k_cache, flat)  # [S * W, block_size, kv_heads, D]
            values = self.index_rows(v_cache, flat)
            shape = [S, width * meta.block_size, keys.shape[-2], keys.shape[-1]]
            keys = self.transpose(keys.reshape(shape)[:, :max_len], 1, 2)  # [S, kv_heads, max_len, D]
            values = self.transpose(values.reshape(shape)[:, :max_len], 1, 2)
            return self.sdpa(q.unsqueeze(2), keys, values, meta.decode_mask, False, scale)[:, :, 0, :]
        outs = [self.attend_seq(q, meta, kv_cache, scale, i) for i in range(len(meta.seqs))]
        return outs[0] if len(outs) == 1 else self.cat(outs, 0)

    def attend_seq(self, q, meta, kv_cache, scale: float, i: int):
        """Attention of sequence ``i`` of the step alone: ``[query_len, heads, D]``."""
        (context, n, start), blocks, mask = meta.seqs[i], meta.seq_blocks[i], meta.masks[i]
        end = context + n
        k_cache, v_cache = kv_cache
        o = self.sdpa(self.transpose(q[start:start + n], 0, 1).unsqueeze(0),
                      self.transpose(self.gather_keys(k_cache, blocks, end), 0, 1).unsqueeze(0),
                      self.transpose(self.gather_keys(v_cache, blocks, end), 0, 1).unsqueeze(0),
                      mask, mask is None and n > 1, scale)
        return self.transpose(o[0], 0, 1)

    def router_logits(self, x, weight):
        """``x [T, H]`` times the fp32 router ``weight [E, H]``: logits ``[T, E]`` in fp32."""
        return self.linear(self.float32(x), weight)

    def route(self, logits, bias, routing: Routing):
        """Router logits ``[T, E]`` (fp32) -> ``(weights [T, top_k] fp32, expert ids [T, top_k])``.

        Sigmoid scores; the correction bias steers only WHICH experts are chosen (group-limited
        top-k); the weights are the un-biased scores, renormalised and scaled.
        """
        scores = self.sigmoid(logits)
        choice = scores + bias
        if routing.n_group > 1:
            T, E = choice.shape
            # A group's score is the sum of its best two experts; keep the best topk_group groups.
            group_scores = self.sum(self.topk(choice.reshape([T, routing.n_group, -1]), 2)[0], -1)
            kept = self.topk(group_scores, routing.topk_group)[1]
            group_mask = self.put_along(self.zeros_like(group_scores), kept, 1.0, dim=1)
            expert_mask = self.repeat_interleave(group_mask, E // routing.n_group, dim=1) > 0
            choice = self.where(expert_mask, choice, float("-inf"))
        ids = self.topk(choice, routing.top_k)[1]
        weights = self.take_along(scores, ids, dim=1)
        if routing.norm_topk_prob:
            weights = weights / (self.sum(weights, -1, keepdim=True) + 1e-20)
        return weights * routing.scale, ids

    def swiglu(self, x, gate_up, down):
        """``down(silu(gate(x)) * up(x))`` with ``gate_up = [gate rows; up rows]``."""
        gate, up = self.split(self.project(x, gate_up), [gate_up.shape[0] // 2] * 2, -1)
        return self.project(self.silu_and_mul(gate, up), down)

    def moe(self, x, router_weight, bias, routing: Routing, gate_up, down, expert_range: tuple[int, int],
            shared_gate_up, shared_down):
        """Routed experts (stacked ``gate_up [E_local, 2I, H]``, ``down [E_local, H, I]`` holding
        experts ``expert_range``; tensors or ``Fp8Weight``s) plus the shared expert, summed: this
        rank's partial output. Each token's experts are chosen from its router logits (the fp32
        ``router_weight [E, H]``) and the correction ``bias`` (``route``)."""
        weights, ids = self.route(self.router_logits(x, router_weight), bias, routing)
        return (self.routed_experts(x, gate_up, down, weights, ids, expert_range)
                + self.swiglu(x, shared_gate_up, shared_down))

    def routed_experts(self, x, gate_up, down, weights, ids, expert_range: tuple[int, int]):
        """``sum_k weights[t, k] * expert_{ids[t, k]}(x[t])`` over the experts this rank holds:
        only the experts that received tokens run, one matmul pair each."""
        first, last = expert_range
        top_k = ids.shape[1]
        flat = ids.reshape([-1])
        order = self.argsort(flat)  # (token, k) pairs grouped by expert
        counts = self.bincount(flat)  # the one host sync per layer
        tokens, token_weights = order // top_k, self.index_rows(weights.reshape([-1]), order)
        out = self.zeros(list(x.shape), "float32", like=x)
        begin = 0
        for expert, count in enumerate(counts):
            end = begin + count
            if count and first <= expert < last:
                rows = tokens[begin:end]
                y = self.swiglu(self.index_rows(x, rows), gate_up[expert - first], down[expert - first])
                out = self.index_add(out, rows, self.float32(y) * token_weights[begin:end].unsqueeze(-1))
            begin = end
        return self.cast(out, self.dtype_name(x))

    # ---- sampling (glm_fused.engine.sampling states the rule) --------------------------------
    def sample(self, logits, sampling):
        """Token ids ``[rows]`` (int64, on the logits' device) drawn from ``logits [rows, vocab]``
        by the rule of ``glm_fused.engine.sampling``. This default draws on the host."""
        return self.tensor(sampling.sample_on_host(self.to_numpy(self.float32(logits))), like=logits)

    def upload(self, array, like):
        """``tensor(array, like)`` for a step's small host arrays, without waiting for the device
        (a plain host-to-device copy of pageable memory waits for the work queued before it)."""
        return self.tensor(array, like)

    def logprobs(self, logits, targets, n: int) -> tuple:
        """``(logprob of each row's target [rows], top-n ids [rows, n], their logprobs [rows, n])``
        of the raw distribution ``log_softmax(logits)`` (float32, on the logits' device).
        This default computes on the host (``glm_fused.engine.sampling.logprobs_on_host``)."""
        from glm_fused.engine.sampling import logprobs_on_host

        out = logprobs_on_host(self.to_numpy(self.float32(logits)), self.to_numpy(targets), n)
        return tuple(self.tensor(a, like=logits) for a in out)

    def to_host_async(self, x, staging=None):
        """A callable giving ``x`` as a numpy array once it is on the host (default: at once)."""
        value = self.to_numpy(x)
        return lambda: value

    def mark(self, device):
        """A point in the device's timeline (``elapsed`` measures between two, once both passed)."""
        import time

        return time.perf_counter()

    def elapsed(self, start, end) -> float:
        return end - start

    def pinned(self, n: int, dtype: str):
        """A host staging buffer for ``to_host_async`` (None: this framework copies at once)."""
        return None

    # ---- what a framework offers beyond the maths (defaults: nothing) --------------------
    def batched_prefill(self, like) -> int | None:
        """None; or, where ``attention`` takes a step's prompt chunks in one call from
        ``AttentionMetadata.chunks`` for tensors like ``like`` (no per-sequence masks needed),
        the length from which a fresh prompt (no context) is left to ``attend_seq`` instead."""
        return None

    def compiles_kernels(self, model) -> bool:
        """Whether the model's kernels compile on first use of each shape class (Triton): the
        runner then warms them up before serving."""
        return False

    def can_capture(self, model) -> bool:
        """Whether ``capture_decode_graphs`` can make replayable decode steps for this model."""
        return False

    def capture_decode_graphs(self, model, kv_caches: list, max_num_seqs: int, max_blocks_per_seq: int,
                              next_tokens):
        """Replayable decode steps (CUDA graphs; ``glm_fused.torch_backend.cuda_graph``)."""
        raise NotImplementedError

    def is_out_of_memory(self, exc: BaseException) -> bool:
        """Whether ``exc`` is this framework's allocator running out of device memory."""
        return isinstance(exc, MemoryError)

    def memory_info(self, device) -> tuple[int, int] | None:
        """``(free, total)`` bytes of a GPU device; None for a CPU (no fixed memory to size from)."""
        return None

    def reset_peak_memory(self, device) -> None:
        """Start counting this process's peak allocation on ``device`` afresh."""

    def peak_memory(self, device) -> int:
        """The most bytes this framework's allocator held in tensors since ``reset_peak_memory``."""
        raise NotImplementedError

    def reserved_memory(self, device) -> int:
        """Bytes this framework's caching allocator holds on ``device`` now (used or cached)."""
        raise NotImplementedError

    def synchronize(self, device) -> None:
        """Wait for the device's queued work (after a failed capture)."""

    def empty_cache(self, device) -> None:
        """Hand cached device memory back (a runner closing)."""

    def gpu_sm(self, device) -> int | None:
        """Compute capability of ``device`` as an int (90 for H100/H200); None for a CPU."""
        raise NotImplementedError
