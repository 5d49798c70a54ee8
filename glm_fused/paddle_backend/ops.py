"""``PaddleOps``: the model's ops in PaddlePaddle (the default backend).

Primitives only: every composite (RMSNorm, RoPE, attention, the router, the MoE) is the one
written in ``glm_fused.model.ops``. Notes on Paddle's CPU build, which shape some choices:
bfloat16 has no CPU kernels (matmul, silu, softmax, topk), so it is refused there; the norm is
plain ops because ``F.rms_norm`` has no CPU kernel and the CPU kernel of ``paddle.incubate``'s
``fused_rms_norm`` dies with SIGILL on an AVX2-only CPU (a crash no fallback can catch).
"""

from __future__ import annotations

import contextlib
import zlib

import numpy as np
import paddle
import paddle.nn.functional as PF
from paddle import nn
from paddle.base.framework import EagerParamBase

from glm_fused.errors import UserError
from glm_fused.model.module import bind
from glm_fused.model.ops import Ops
from glm_fused.paddle_backend import dist


class PaddleOps(Ops):
    name = "paddle"
    Module = nn.Layer
    ModuleList = nn.LayerList
    layers_module = "glm_fused.paddle_backend"
    dist = dist

    # ---- dtypes, devices, creation -------------------------------------------------------
    def check_dtype(self, dtype, flag: str = "--dtype") -> str:
        """The model dtype's name; bfloat16 is refused on CPU (Paddle has no CPU kernels for it)."""
        name = str(dtype).removeprefix("paddle.")
        if name not in self.dtypes:
            raise UserError(f"{flag} {dtype!r}: choose one of {', '.join(self.dtypes)}")
        if name == "bfloat16" and paddle.get_device() == "cpu":
            raise UserError(f"{flag} bfloat16: Paddle on CPU has no bfloat16 kernels (matmul, silu, softmax, "
                            f"topk); use {flag} float32, or the torch backend for bfloat16 on CPU")
        return name

    def dtype(self, name: str) -> str:
        return name

    def dtype_name(self, x) -> str:
        return str(x.dtype).removeprefix("paddle.")

    def cast(self, x, dtype: str):
        return x if self.dtype_name(x) == dtype else x.astype(dtype)

    def param(self, module, shape, dtype, fill):
        if fill is None:  # uninitialised, as torch.empty: the loader writes every byte, once
            param = EagerParamBase.from_tensor(paddle.empty(list(shape), dtype=dtype))
        else:
            param = module.create_parameter(shape=list(shape), dtype=dtype,
                                            default_initializer=nn.initializer.Constant(fill))
        param.stop_gradient = True
        return param

    def buffer(self, module, name, array):
        module.register_buffer(name, paddle.to_tensor(array), persistable=False)

    def tensor(self, array, like=None):
        return paddle.to_tensor(array, place=None if like is None else like.place)

    def to_numpy(self, x) -> np.ndarray:
        return x.numpy()

    def zeros(self, shape, dtype, like=None):
        out = paddle.zeros(shape, dtype=dtype)
        return out if like is None or out.place == like.place else out.to(like.place)

    def zeros_like(self, x):
        return paddle.zeros_like(x)

    def no_grad(self):
        return paddle.no_grad()

    @contextlib.contextmanager
    def device_scope(self, device=None):
        """Paddle's device is process-wide: this sets it (default: this rank's) for what follows."""
        paddle.set_device(device if device is not None else dist.device())
        yield

    def device_of(self, x):
        return x.place

    def gpu_sm(self, device) -> int | None:
        if str(device) == "cpu":
            return None
        major, minor = paddle.device.cuda.get_device_capability()
        return major * 10 + minor

    def weight_writer(self, device):
        from glm_fused.paddle_backend.weights import PaddleWeightWriter

        return PaddleWeightWriter(device)

    def assign(self, dst, src) -> None:
        dst.set_value(src.astype(dst.dtype))

    def keeps_fp8(self, dtype: str) -> bool:
        # No fp8 kernels of this project in Paddle: fp8 checkpoints load dequantized.
        return False

    def fill(self, param, value: float) -> None:
        param.set_value(paddle.full(param.shape, value, dtype=param.dtype))

    def fill_normal(self, param, std: float, key: str) -> None:
        # Paddle has no per-call generator: re-seed the global one, and put its state back.
        saved = paddle.get_rng_state()
        try:
            paddle.seed(zlib.crc32(key.encode()))
            param.set_value(paddle.normal(0.0, std, shape=param.shape).astype(param.dtype))
        finally:
            paddle.set_rng_state(saved)

    # ---- maths and shapes ----------------------------------------------------------------
    def linear(self, x, weight, bias=None):
        # Weights stay [out, in] as in the checkpoint (Paddle's own Linear stores [in, out]);
        # transpose_y costs nothing and keeps the parameter contract identical across frameworks.
        y = paddle.matmul(x, weight, transpose_y=True)
        return y if bias is None else y + bias

    def embedding(self, ids, weight):
        return PF.embedding(ids, weight)

    def silu(self, x):
        return PF.silu(x)

    def sigmoid(self, x):
        return PF.sigmoid(x)

    def rsqrt(self, x):
        return paddle.rsqrt(x)

    def abs(self, x):
        return paddle.abs(x)

    def amax(self, x, dim):
        return x.max(axis=dim)

    def clamp(self, x, min=None, max=None):
        return paddle.clip(x, min, max)

    def mean(self, x, dim, keepdim=False):
        return x.mean(axis=dim, keepdim=keepdim)

    def sum(self, x, dim, keepdim=False):
        return x.sum(axis=dim, keepdim=keepdim)

    def cat(self, xs, dim):
        return paddle.concat(xs, axis=dim)

    def split(self, x, sizes, dim):
        return paddle.split(x, sizes, axis=dim)

    def transpose(self, x, dim0, dim1):
        perm = list(range(x.ndim))
        perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
        return x.transpose(perm)

    def topk(self, x, k, dim=-1):
        return paddle.topk(x, k, axis=dim)

    def where(self, cond, x, y):
        if not isinstance(x, paddle.Tensor):
            x = paddle.full_like(y, x)
        if not isinstance(y, paddle.Tensor):
            y = paddle.full_like(x, y)
        return paddle.where(cond, x, y)

    def index_rows(self, x, index):
        return paddle.gather(x, index)

    def take_along(self, x, index, dim):
        return paddle.take_along_axis(x, index, axis=dim)

    def put_along(self, x, index, value, dim):
        return paddle.put_along_axis(x, index, value, axis=dim)

    def repeat_interleave(self, x, repeats, dim):
        return paddle.repeat_interleave(x, repeats, axis=dim)

    def argsort(self, x):
        return paddle.argsort(x, stable=True)

    def bincount(self, x):
        return paddle.bincount(x).tolist()

    def index_add(self, out, index, source):
        return paddle.index_add(out, index, 0, source)

    def sdpa(self, q, k, v, mask, causal, scale):
        """``softmax(q k^T * scale) v`` on ``[B, heads, L, D]``, softmax in fp32 (GQA: kv heads repeat)."""
        group = q.shape[1] // k.shape[1]
        if group > 1:  # kv head j serves query heads j*group .. (j+1)*group-1
            k = paddle.repeat_interleave(k, group, axis=1)
            v = paddle.repeat_interleave(v, group, axis=1)
        scores = paddle.matmul(q, k, transpose_y=True).astype("float32") * scale
        if causal:  # query i (the last of Lq) sees keys up to Lk - Lq + i
            lq, lk = q.shape[2], k.shape[2]
            mask = paddle.to_tensor(np.arange(lk)[None, :] <= np.arange(lq)[:, None] + (lk - lq))
        if mask is not None:
            scores = paddle.where(mask, scores, paddle.full_like(scores, float("-inf")))
        return paddle.matmul(PF.softmax(scores, axis=-1).astype(q.dtype), v)

    def empty_cache(self, device) -> None:
        if str(device) != "cpu":
            paddle.device.cuda.empty_cache()

    # UNPROVEN on GPU (no paddlepaddle-gpu 3.x on this project's machines): Paddle has no
    # mem_get_info, so "free" is the device's total less what this process's allocator holds;
    # memory held by other processes or outside Paddle's allocator is not seen.
    def memory_info(self, device):
        if str(device) == "cpu":
            return None
        total = paddle.device.cuda.get_device_properties(device).total_memory
        return total - paddle.device.cuda.memory_reserved(device), total

    def reset_peak_memory(self, device) -> None:
        if str(device) != "cpu":
            paddle.device.cuda.reset_max_memory_allocated(device)

    def peak_memory(self, device) -> int:
        return paddle.device.cuda.max_memory_allocated(device)

    def reserved_memory(self, device) -> int:
        return paddle.device.cuda.memory_reserved(device)

    def call_flashinfer(self, kernel, partial, residual, weight, eps):
        # UNPROVEN on GPU: needs paddlepaddle-gpu 3.x beside a CUDA build of torch, which no
        # machine of this project has had (the DLPack round trip itself is tested on CPU). The
        # kernel is the shared torch adapter; tensors cross by DLPack, zero-copy, both ways. On
        # GPU the kernel is enqueued on Paddle's current stream (torch wraps it as an external
        # stream): ordered after the Paddle ops that made its inputs, before those that read its
        # outputs, with no host synchronisation.
        import torch

        from glm_fused.fused_op.flashinfer import as_torch

        on_gpu = partial.place.is_gpu_place()
        stream = (torch.cuda.stream(torch.cuda.ExternalStream(paddle.device.current_stream().cuda_stream))
                  if on_gpu else contextlib.nullcontext())
        with stream:
            normed, residual_out = kernel(as_torch(partial), as_torch(residual), as_torch(weight), eps)
        return paddle.utils.dlpack.from_dlpack(normed), paddle.utils.dlpack.from_dlpack(residual_out)


OPS = PaddleOps()
LAYERS = bind(OPS)  # every layer class of glm_fused.model, as this framework's module class
