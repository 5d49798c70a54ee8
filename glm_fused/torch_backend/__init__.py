"""PyTorch backend: the backend module API of docs/design.md.

``init_distributed() -> (rank, world)``, ``broadcast_int64(array, src)``, ``barrier()``,
``ModelRunner(...)``, ``device_info()``; and the model itself for direct use:
``Glm4MoeForCausalLM.from_pretrained(path, tp_rank=..., tp_size=..., fused=True, dtype=...)``.
Runs on CPU (fp32 or bf16) and CUDA (bf16; FlashInfer's fused kernel where it can serve).
"""

from __future__ import annotations

import torch

from glm_fused.torch_backend.dist import barrier, broadcast_int64, device, dist_backend, init_distributed
from glm_fused.torch_backend.model import Glm4MoeForCausalLM
from glm_fused.torch_backend.runner import ModelRunner

NAME = "torch"
DTYPES = ("float32", "bfloat16")  # both run on CPU and on CUDA


def device_info() -> dict:
    """What this rank computes on, for logs and reports."""
    dev = device()
    info = {"backend": NAME, "framework_version": torch.__version__, "device": str(dev),
            "dist_backend": dist_backend(), "dtypes": list(DTYPES)}
    if dev.type == "cuda":
        major, minor = torch.cuda.get_device_capability(dev)
        info.update(name=torch.cuda.get_device_name(dev), sm=major * 10 + minor)
    else:
        info.update(name="cpu", sm=None)
    return info


__all__ = ["NAME", "DTYPES", "init_distributed", "broadcast_int64", "barrier", "device_info", "ModelRunner",
           "Glm4MoeForCausalLM"]
