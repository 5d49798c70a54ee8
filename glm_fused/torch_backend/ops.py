"""``TorchOps``: the model's ops in PyTorch, and the Triton kernels that replace the composites on CUDA.

Each override below is the one place the torch backend chooses a kernel: a CUDA tensor with
Triton present (``kernels.enabled``) runs the Triton version, anything else the composite
written once in ``glm_fused.model.ops`` (plain PyTorch ops: the CPU path, and the reference
the kernels are tested against).
"""

from __future__ import annotations

import contextlib
import logging
import zlib

import numpy as np
import torch
import torch.nn.functional as TF
from torch import nn

from glm_fused.errors import UserError
from glm_fused.model.module import bind
from glm_fused.model.ops import Fp8Weight, Ops, Routing
from glm_fused.torch_backend import dist, kernels

log = logging.getLogger("glm_fused.torch_backend")
_said: set[str] = set()


def _fallback_once(reason: str) -> None:
    if reason not in _said:
        _said.add(reason)
        log.warning("%s", reason)


def _codes(w):
    """The tensor a kernel reads: an fp8 weight's codes, or the weight itself."""
    return w.codes if isinstance(w, Fp8Weight) else w

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int64": torch.int64,
          "int32": torch.int32, "bool": torch.bool, "float8_e4m3fn": torch.float8_e4m3fn}
FP8_MIN_SM = 89  # fp8 tensor cores (Ada, Hopper and later): where _scaled_mm and fp8 tl.dot run


def _int64(c: int) -> int:
    """A 64-bit constant as the signed int64 holding the same bits (tensor arithmetic wraps)."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def counter_uniforms(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """``glm_fused.engine.sampling.uniforms`` for every row at once: float64 ``[rows, vocab]``,
    bit-identical to the host's (the same SplitMix64 on wrapping int64)."""
    from glm_fused.engine.sampling import GOLDEN, MIX1, MIX2

    v = torch.arange(1, vocab + 1, device=keys.device, dtype=torch.int64)
    x = keys[:, None] + v * _int64(GOLDEN)
    x = (x ^ _shr(x, 30)) * _int64(MIX1)
    x = (x ^ _shr(x, 27)) * _int64(MIX2)
    x = x ^ _shr(x, 31)
    return (_shr(x, 11).double() + 0.5) / float(1 << 53)


def _on(array: np.ndarray, device) -> torch.Tensor:
    """A small host array on ``device`` without waiting for the device's queue: through
    page-locked memory (torch's caching host allocator keeps the block until the copy is done),
    since a copy from pageable memory would wait for the step in flight."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class TorchOps(Ops):
    name = "torch"
    Module = nn.Module
    ModuleList = nn.ModuleList
    layers_module = "glm_fused.torch_backend"
    dist = dist

    # ---- dtypes, devices, creation -------------------------------------------------------
    def check_dtype(self, dtype, flag: str = "--dtype") -> str:
        """The model dtype's name; both dtypes run on CPU and on CUDA."""
        name = str(dtype).removeprefix("torch.")
        if name not in self.dtypes:
            raise UserError(f"{flag} {dtype!r}: choose one of {', '.join(self.dtypes)}")
        return name

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[name]

    def dtype_name(self, x: torch.Tensor) -> str:
        return str(x.dtype).removeprefix("torch.")

    def cast(self, x, dtype: str):
        return x.to(DTYPES[dtype])

    def param(self, module, shape, dtype, fill):
        data = torch.empty(shape, dtype=DTYPES[dtype]) if fill is None else torch.full(shape, fill, dtype=DTYPES[dtype])
        return nn.Parameter(data, requires_grad=False)

    def buffer(self, module, name, array):
        module.register_buffer(name, torch.as_tensor(array, device=torch.get_default_device()), persistent=False)

    def tensor(self, array, like=None):
        return torch.as_tensor(array, device=None if like is None else like.device)

    def to_numpy(self, x) -> np.ndarray:
        return x.detach().cpu().numpy()

    def zeros(self, shape, dtype, like=None):
        return torch.zeros(shape, dtype=DTYPES[dtype], device=None if like is None else like.device)

    def zeros_like(self, x):
        return torch.zeros_like(x)

    def no_grad(self):
        return torch.inference_mode()

    @contextlib.contextmanager
    def device_scope(self, device=None):
        """Tensors made inside (parameters, buffers) land on ``device`` (default: this rank's)."""
        with torch.device(torch.device(device) if device is not None else dist.device()):
            yield

    def device_of(self, x) -> torch.device:
        return x.device

    def gpu_sm(self, device) -> int | None:
        if torch.device(device).type != "cuda":
            return None
        major, minor = torch.cuda.get_device_capability(device)
        return major * 10 + minor

    def weight_writer(self, device):
        from glm_fused.torch_backend.weights import TorchWeightWriter

        return TorchWeightWriter(device)

    def assign(self, dst, src) -> None:
        dst.copy_(src)

    def keeps_fp8(self, dtype: str) -> bool:
        """fp8 weights where the fp8 kernels run: a bf16 model on a CUDA device with fp8 tensor
        cores (row-wise ``_scaled_mm`` gives bf16; an fp32 model is a reference and holds its
        weights dequantized), or any model under Triton's CPU interpreter (tests)."""
        if kernels.interpreting():
            return True
        device = torch.get_default_device()
        return (dtype == "bfloat16" and device.type == "cuda" and kernels.triton_available()
                and self.gpu_sm(device) >= FP8_MIN_SM)

    def fill(self, param, value: float) -> None:
        param.fill_(value)

    def fill_normal(self, param, std: float, key: str) -> None:
        generator = torch.Generator(device=param.device)
        generator.manual_seed(zlib.crc32(key.encode()))
        param.normal_(0.0, std, generator=generator)

    # ---- maths and shapes ----------------------------------------------------------------
    def linear(self, x, weight, bias=None):
        return TF.linear(x, weight, bias)

    def embedding(self, ids, weight):
        return TF.embedding(ids, weight)

    def silu(self, x):
        return TF.silu(x)

    def sigmoid(self, x):
        return torch.sigmoid(x)

    def rsqrt(self, x):
        return torch.rsqrt(x)

    def abs(self, x):
        return x.abs()

    def amax(self, x, dim):
        return x.amax(dim)

    def clamp(self, x, min=None, max=None):
        return x.clamp(min, max)

    def mean(self, x, dim, keepdim=False):
        return x.mean(dim, keepdim=keepdim)

    def sum(self, x, dim, keepdim=False):
        return x.sum(dim, keepdim=keepdim)

    def cat(self, xs, dim):
        return torch.cat(xs, dim=dim)

    def split(self, x, sizes, dim):
        return list(torch.split(x, sizes, dim=dim))

    def transpose(self, x, dim0, dim1):
        return x.transpose(dim0, dim1)

    def topk(self, x, k, dim=-1):
        out = x.topk(k, dim=dim)
        return out.values, out.indices

    def where(self, cond, x, y):
        return torch.where(cond, x, y)

    def index_rows(self, x, index):
        return x[index]

    def take_along(self, x, index, dim):
        return x.gather(dim, index)

    def put_along(self, x, index, value, dim):
        return x.scatter(dim, index, value)

    def repeat_interleave(self, x, repeats, dim):
        return x.repeat_interleave(repeats, dim=dim)

    def argsort(self, x):
        return torch.argsort(x, stable=True)

    def bincount(self, x):
        return torch.bincount(x).tolist()

    def index_add(self, out, index, source):
        return out.index_add_(0, index, source)

    def sdpa(self, q, k, v, mask, causal, scale):
        return TF.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                               enable_gqa=q.shape[1] != k.shape[1])

    def call_flashinfer(self, kernel, partial, residual, weight, eps):
        return kernel(partial, residual, weight, eps)

    # ---- Triton on CUDA ------------------------------------------------------------------
    def add_rms_norm(self, x, residual, weight, eps):
        if kernels.enabled(x):
            from glm_fused.torch_backend.kernels.rmsnorm import add_rmsnorm

            return add_rmsnorm(x, residual, weight, eps)
        return super().add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, gate, up):
        if kernels.enabled(gate):
            from glm_fused.torch_backend.kernels.activation import silu_and_mul

            return silu_and_mul(gate, up)
        return super().silu_and_mul(gate, up)

    def rope_and_store(self, positions, q, k, v, cos_cache, sin_cache, rotary_dim, meta, kv_cache):
        if kernels.enabled(q):  # one launch rotates q and k and writes k, v to the cache
            from glm_fused.torch_backend.kernels.rotary import rope_and_store

            return rope_and_store(positions, meta.slot_mapping, q, k, v, cos_cache, sin_cache, *kv_cache)
        return super().rope_and_store(positions, q, k, v, cos_cache, sin_cache, rotary_dim, meta, kv_cache)

    # Fresh prompts of at least this many tokens go to torch's SDPA (FlashAttention, one call
    # each). Per layer on an H200 (96 / 8 heads x 128, bf16, one fresh prompt) the batched
    # kernel took 43 / 52 / 157 / 509 µs at 128 / 512 / 1,024 / 2,048 tokens, gather + SDPA
    # 87 / 83 / 82 / 219 µs (docs/speed.md).
    SDPA_FRESH_MIN = 1024

    def batched_prefill(self, like) -> int | None:
        return self.SDPA_FRESH_MIN if kernels.enabled(like) else None

    def attention(self, q, meta, kv_cache, scale):
        if not kernels.enabled(q):
            return super().attention(q, meta, kv_cache, scale)
        from glm_fused.torch_backend.kernels.decode_attention import decode_attention
        from glm_fused.torch_backend.kernels.prefill_attention import prefill_attention

        if meta.seq_lens is not None:  # decode: split-K over each sequence's blocks
            return decode_attention(q, *kv_cache, meta.block_tables, meta.seq_lens, scale, lead=meta.row_groups)
        out = torch.empty_like(q)
        if meta.mixed_decode is not None:  # decodes beside prompt chunks: the decodes in one call
            rows, tables, lens = meta.mixed_decode
            out[rows] = decode_attention(q[rows], *kv_cache, tables, lens, scale)
        for i in meta.long_fresh:  # long fresh prompts: SDPA, one call each
            _, n, start = meta.seqs[i]
            out[start:start + n] = self.attend_seq(q, meta, kv_cache, scale, i)
        if meta.chunks is not None:  # every other prompt chunk (and a lone decode) in one call
            prefill_attention(q, *kv_cache, meta.chunks, meta.chunk_blocks, meta.chunks_max_len, scale, out)
        return out

    def linear_fp8(self, x, w: Fp8Weight, bias=None):
        if kernels.enabled(x):  # activations quantized per token (Triton), fp8 GEMM (torch._scaled_mm)
            from glm_fused.torch_backend.kernels.fp8 import linear_fp8, scaled_mm_fits

            if scaled_mm_fits(x, w.codes):
                return linear_fp8(x, w.codes, w.scale, bias)
            _fallback_once(f"fp8 linear {list(w.shape)} with {x.dtype} activations: _scaled_mm needs sizes that are "
                           f"multiples of 16 and bf16; it runs dequantized")
        return super().linear_fp8(x, w, bias)

    def router_logits(self, x, weight):
        if kernels.enabled(x):
            from glm_fused.torch_backend.kernels.fused_moe import ROUTER_GEMV_MAX_TOKENS, router_logits

            if x.shape[0] <= ROUTER_GEMV_MAX_TOKENS:  # decode: one launch where the cast and cuBLAS take three
                return router_logits(x, weight)
        return super().router_logits(x, weight)

    def moe(self, x, router_weight, bias, routing: Routing, gate_up, down, expert_range, shared_gate_up,
            shared_down):
        fp8 = isinstance(gate_up, Fp8Weight)
        if not kernels.enabled(x) or fp8 != isinstance(down, Fp8Weight):
            return super().moe(x, router_weight, bias, routing, gate_up, down, expert_range, shared_gate_up,
                               shared_down)
        from glm_fused.torch_backend.kernels.fused_moe import (ROUTER_GEMV_MAX_TOKENS, fused_experts, route_tokens,
                                                               router_topk)

        # One shared expert as wide as a routed one (and stored alike) rides in the routed GEMMs as expert E.
        fold = (shared_gate_up.shape[0] == gate_up.shape[1]
                and isinstance(shared_gate_up, Fp8Weight) == fp8 == isinstance(shared_down, Fp8Weight))
        choice = (bias, routing.top_k, routing.norm_topk_prob, routing.scale)
        if routing.n_group == 1 and x.shape[0] <= ROUTER_GEMV_MAX_TOKENS:  # logits and top-k in one launch
            weights, ids = route_tokens(x, router_weight, *choice, append_shared=fold)
        elif routing.n_group == 1:
            weights, ids = router_topk(self.router_logits(x, router_weight), *choice, append_shared=fold)
        else:
            weights, ids = self.route(self.router_logits(x, router_weight), bias, routing)
            if fold:
                T = ids.shape[0]
                weights = torch.cat([weights, weights.new_ones(T, 1)], dim=1)
                ids = torch.cat([ids, ids.new_full((T, 1), routing.num_experts)], dim=1)
        partial = None if tuple(expert_range) == (0, routing.num_experts) else tuple(expert_range)
        scales = (gate_up.scale, down.scale) if fp8 else None
        routed = (_codes(gate_up), _codes(down), weights, ids)
        if fold:
            return fused_experts(x, *routed, shared_weights=(_codes(shared_gate_up), _codes(shared_down)),
                                 expert_range=partial, scales=scales,
                                 shared_scales=(shared_gate_up.scale, shared_down.scale) if fp8 else None)
        return fused_experts(x, *routed, self.swiglu(x, shared_gate_up, shared_down), expert_range=partial,
                             scales=scales)

    # ---- sampling on the device -----------------------------------------------------------
    def sample(self, logits, sampling):
        """The rule of ``glm_fused.engine.sampling`` on the logits' device; no host sync.

        Rules 1-4 (grammar mask, min_tokens, logit_bias, penalties) and the draw run in
        float64 with the same operations as the host reference, so a draw matches the host's
        except at float ties (top-p and min_p boundaries). Greedy rows take the argmax; the
        others Gumbel-max over the min_p / top-k / top-p survivors, with the same
        counter-based uniforms as the host.
        """
        x = logits.float()
        if sampling.plain and sampling.all_greedy:
            return x.argmax(-1)
        dev, V = x.device, x.shape[-1]
        x = x.double() if sampling.plain else self._processed(x, sampling)
        greedy = x.argmax(-1)
        if sampling.all_greedy:
            return greedy
        temp = _on(sampling.temperature, dev)
        xs = x / torch.where(temp > 0, temp, 1.0).double()[:, None]
        if (sampling.min_p > 0).any():
            min_p = _on(sampling.min_p, dev).double()[:, None]
            xs = torch.where((min_p > 0) & (torch.exp(xs - xs.max(-1, keepdim=True).values) < min_p),
                             float("-inf"), xs)
        if (sampling.top_k > 0).any():
            K = min(int(sampling.top_k.max()), V)
            kth = xs.topk(K, dim=-1).values.gather(1, _on(np.clip(sampling.top_k, 1, K) - 1, dev)[:, None])
            on = _on((sampling.top_k > 0) & (sampling.top_k < V), dev)[:, None]
            xs = torch.where(on & (xs < kth), float("-inf"), xs)
        if (sampling.top_p < 1).any():
            top_p = _on(sampling.top_p, dev).double()[:, None]
            ordered = xs.sort(dim=-1, descending=True).values
            probs = torch.softmax(ordered, dim=-1)
            # Keep tokens while the mass BEFORE them is below top_p: the first always stays.
            kept = ((probs.cumsum(-1) - probs) < top_p).sum(-1, keepdim=True)
            last = ordered.gather(1, kept - 1)
            xs = torch.where((top_p < 1) & (xs < last), float("-inf"), xs)
        g = -torch.log(-torch.log(counter_uniforms(_on(sampling.keys, dev), V)))
        return torch.where(temp > 0, (xs + g).argmax(-1), greedy)

    @staticmethod
    def _processed(x, sampling):
        """Rules 1-4 of the sampling rule, float64 ``[rows, vocab]`` (see ``SamplingBatch.processed_logits``)."""
        dev, V = x.device, x.shape[-1]
        x = x.double()
        if len(sampling.mask_rows):
            words = _on(sampling.masks, dev)  # int32 [M, W]; token t is bit t % 32 of word t // 32
            bits = (words.unsqueeze(-1) >> torch.arange(32, device=dev, dtype=torch.int32)) & 1
            allowed = bits.reshape(len(words), -1)[:, :V].bool()
            if allowed.shape[1] < V:
                allowed = torch.nn.functional.pad(allowed, (0, V - allowed.shape[1]), value=False)
            rows = _on(sampling.mask_rows, dev)
            x[rows] = torch.where(allowed, x[rows], float("-inf"))
        if len(sampling.ban_rows):
            x[_on(sampling.ban_rows, dev), _on(sampling.ban_tokens, dev)] = float("-inf")
        if len(sampling.bias_rows):
            r, t = _on(sampling.bias_rows, dev), _on(sampling.bias_tokens, dev)
            x[r, t] = x[r, t] + _on(sampling.bias_values, dev)
        if len(sampling.hist_rows):
            r, t, c = _on(sampling.hist_rows, dev), _on(sampling.hist_tokens, dev), _on(sampling.hist_counts, dev)
            v = x[r, t]
            rep = _on(sampling.repetition, dev).double()[r]
            v = torch.where(v > 0, v / rep, v * rep)
            v = v - _on(sampling.frequency, dev).double()[r] * c - _on(sampling.presence, dev).double()[r] * (c > 0)
            x[r, t] = v
        return x

    def logprobs(self, logits, targets, n):
        lp = torch.log_softmax(logits.float(), dim=-1)
        chosen = lp.gather(1, targets.long()[:, None])[:, 0]
        if n <= 0:
            return chosen, lp.new_zeros((len(lp), 0), dtype=torch.int64), lp.new_zeros((len(lp), 0))
        values, ids = lp.topk(min(n, lp.shape[-1]), dim=-1)
        return chosen, ids, values

    def upload(self, array, like):
        if like is None or like.device.type != "cuda":
            return self.tensor(array, like)
        return _on(array, like.device)

    def to_host_async(self, x, staging=None):
        """Copy ``x`` into pinned ``staging`` without waiting; the callable waits for the copy only."""
        if x.device.type != "cuda":
            return super().to_host_async(x)
        if staging is None:  # a buffer of its own (the caching host allocator keeps them)
            staging = torch.empty(x.numel(), dtype=x.dtype, pin_memory=True)
        host = staging[: x.numel()].view(x.shape)
        host.copy_(x, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def result() -> np.ndarray:
            done.synchronize()
            return host.numpy().copy()

        return result

    def mark(self, device):
        if torch.device(device).type != "cuda":
            return super().mark(device)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed(self, start, end) -> float:
        if isinstance(start, torch.cuda.Event):
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return super().elapsed(start, end)

    def pinned(self, n: int, dtype: str):
        """A page-locked host buffer (fast, asynchronous device-to-host copies)."""
        return torch.empty(n, dtype=DTYPES[dtype], pin_memory=torch.cuda.is_available())

    # ---- CUDA graphs and device housekeeping ---------------------------------------------
    def compiles_kernels(self, model) -> bool:
        return model.device.type == "cuda" and kernels.enabled(model.embed_tokens.weight)

    def can_capture(self, model) -> bool:
        # Graphs need the Triton path: the plain ops sync with the host (the expert loop).
        return model.device.type == "cuda" and kernels.enabled(model.embed_tokens.weight)

    def capture_decode_graphs(self, model, kv_caches, max_num_seqs, max_blocks_per_seq, next_tokens):
        from glm_fused.torch_backend.cuda_graph import DecodeGraphs

        with torch.inference_mode():
            return DecodeGraphs(model, kv_caches, max_num_seqs, max_blocks_per_seq, next_tokens)

    def is_out_of_memory(self, exc: BaseException) -> bool:
        # torch's CPU allocator raises a plain RuntimeError when malloc fails
        return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
            isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc))

    def memory_info(self, device):
        if torch.device(device).type != "cuda":
            return None
        return torch.cuda.mem_get_info(device)

    def reset_peak_memory(self, device) -> None:
        if torch.device(device).type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def peak_memory(self, device) -> int:
        return torch.cuda.max_memory_allocated(device)

    def reserved_memory(self, device) -> int:
        return torch.cuda.memory_reserved(device)

    def synchronize(self, device) -> None:
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    def empty_cache(self, device) -> None:
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()


OPS = TorchOps()
LAYERS = bind(OPS)  # every layer class of glm_fused.model, as this framework's module class
