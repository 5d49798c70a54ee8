"""Paddle backend (the default): the backend module API of docs/design.md.

``init_distributed() -> (rank, world)``, ``broadcast_int64(array, src)``, ``barrier()``,
``ModelRunner(...)``, ``device_info()``; and the model itself for direct use:
``Glm4MoeForCausalLM.from_pretrained(path, tp_rank=..., tp_size=..., fused=True, dtype=...)``.
Paddle on CPU computes in float32 only (it has no bfloat16 CPU kernels). On GPU the fused
op reaches FlashInfer through the shared torch adapter by DLPack - wired, but unproven:
paddlepaddle-gpu 3.x has not been available to run it.
"""

from __future__ import annotations

import warnings

# Paddle warns on import about a compiler cache it only needs for custom C++ ops.
warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)

import paddle  # noqa: E402

from glm_fused.paddle_backend.dist import barrier, broadcast_int64, device, dist_backend, init_distributed
from glm_fused.paddle_backend.model import Glm4MoeForCausalLM
from glm_fused.paddle_backend.runner import ModelRunner

NAME = "paddle"
DTYPES = ("float32", "bfloat16")  # bfloat16 on GPU only


def device_info() -> dict:
    """What this rank computes on, for logs and reports."""
    dev = device()
    info = {"backend": NAME, "framework_version": paddle.__version__, "device": dev,
            "dist_backend": dist_backend(), "dtypes": list(DTYPES) if dev != "cpu" else ["float32"]}
    if dev != "cpu":
        major, minor = paddle.device.cuda.get_device_capability(int(dev.split(":")[1]))
        info.update(name=paddle.device.cuda.get_device_name(int(dev.split(":")[1])), sm=major * 10 + minor)
    else:
        info.update(name="cpu", sm=None)
    return info


__all__ = ["NAME", "DTYPES", "init_distributed", "broadcast_int64", "barrier", "device_info", "ModelRunner",
           "Glm4MoeForCausalLM"]
