"""RMSNorm, and the fused all-reduce + residual-add + RMSNorm that threads the residual.

``fused_allreduce_residual_rmsnorm(partial, residual, weight, eps, comm)`` returns
``(rmsnorm(allreduce(partial) + residual) * weight, allreduce(partial) + residual)``.
Per call, ``glm_fused.fusion.pick_for_call`` picks FlashInfer's one-kernel version (GPU, made
at start-up, held by ``comm``) or the reference below; both give the same maths.

The norm is written with plain ops: ``F.rms_norm`` has no CPU kernel, and the CPU kernel of
``paddle.incubate``'s ``fused_rms_norm`` dies with SIGILL (illegal instruction) on an
AVX2-only CPU - a crash of the process, which no fallback can catch.
"""

from __future__ import annotations

import contextlib

import paddle
from paddle import nn

from glm_fused.fusion import pick_for_call
from glm_fused.paddle_backend.layers.linear import make_param


def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    """fp32 statistics; cast back to the input dtype BEFORE the weight multiply (as transformers)."""
    xf = x.astype("float32")
    xf = xf * paddle.rsqrt((xf * xf).mean(axis=-1, keepdim=True) + eps)
    return weight * xf.astype(x.dtype)


class RMSNorm(nn.Layer):
    def __init__(self, hidden_size: int, eps: float, dtype: str = "float32"):
        super().__init__()
        self.eps = eps
        self.weight = make_param(self, [hidden_size], dtype, value=1.0)

    def forward(self, x: paddle.Tensor, residual: paddle.Tensor | None = None
                ) -> tuple[paddle.Tensor, paddle.Tensor]:
        """Classic layout: ``(norm(x + residual), x + residual)``; no residual means it starts here."""
        if residual is not None:
            x = x + residual
        return rms_norm(x, self.weight, self.eps), x


def fused_allreduce_residual_rmsnorm(partial: paddle.Tensor, residual: paddle.Tensor | None,
                                     weight: paddle.Tensor, eps: float, comm
                                     ) -> tuple[paddle.Tensor, paddle.Tensor]:
    """All-reduce this rank's partial sum, add the residual (None = zero), RMSNorm.

    ``partial`` is consumed (the reference all-reduces it in place).
    """
    impl = pick_for_call(comm, dtype=_dtype_name(partial.dtype), num_tokens=partial.shape[0])
    if impl == "flashinfer":
        return _flashinfer(partial, residual, weight, eps, comm)
    return _reference(partial, residual, weight, eps, comm)


def _reference(partial, residual, weight, eps, comm):
    # The all-reduce runs in the model dtype like the plain path; the add rounds to the model
    # dtype exactly as the classic ``x + residual`` does, so reference == classic layout.
    summed = comm.all_reduce_uncounted(partial)
    if residual is not None:
        summed = summed + residual
    return rms_norm(summed, weight, eps), summed


def _flashinfer(partial, residual, weight, eps, comm):
    # UNPROVEN on GPU: needs paddlepaddle-gpu 3.x beside a CUDA build of torch, which no
    # machine of this project has had (the DLPack round trip itself is tested on CPU). The
    # kernel is the shared torch adapter; tensors cross by DLPack, zero-copy, both ways. On
    # GPU the kernel is enqueued on Paddle's current stream (torch wraps it as an external
    # stream): ordered after the Paddle ops that made its inputs, before those that read its
    # outputs, with no host synchronisation.
    import torch

    from glm_fused.flashinfer_adapter import as_torch

    if residual is None:
        residual = paddle.zeros_like(partial)
    on_gpu = partial.place.is_gpu_place()
    stream = (torch.cuda.stream(torch.cuda.ExternalStream(paddle.device.current_stream().cuda_stream))
              if on_gpu else contextlib.nullcontext())
    with stream:
        normed, residual_out = comm.kernel(as_torch(partial), as_torch(residual), as_torch(weight), eps)
    return paddle.utils.dlpack.from_dlpack(normed), paddle.utils.dlpack.from_dlpack(residual_out)


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("paddle.")
