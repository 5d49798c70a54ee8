"""Checkpoint slices into Paddle parameters: numpy views of the file, converted once.

Each part of the load plan (``glm_fused.checkpoint.Part``) is read as a numpy view of the
mapped file in its stored bits (``glm_fused.safetensors_io``; why not safetensors'
``safe_open`` for Paddle is written there). Then:

* CPU parameter of a dtype numpy has (fp32, the CPU model's) from bf16 / fp16 / fp32 data:
  the parameter's own memory as a numpy array (DLPack, no copy), and ``read_into`` converts
  the slice straight into it - a bf16 -> fp32 widening is a bit shift written into the
  parameter, the one pass over the data; an fp8 weight (Paddle keeps no fp8 weights: no fp8
  kernels here) is decoded exactly into it (``glm_fused.checkpoint.read_float32_into``).
* otherwise (a GPU, bf16 or fp8 parameters, fp8 data without its scales): the slice is
  gathered into one contiguous host array in its stored bits, sent to the parameter's place
  as it is, given its dtype there (a reinterpretation of the bits), converted there when the
  parameter's dtype differs, and copied into its place in the parameter (an fp8 weight for a
  float parameter goes decoded, as float32). Synchronous: no pinned ring as on torch (no
  Paddle GPU build to measure one with).
"""

from __future__ import annotations

import numpy as np
import paddle

from glm_fused.checkpoint import read_float32_into

STORED = {"F64": paddle.float64, "F32": paddle.float32, "F16": paddle.float16, "BF16": paddle.bfloat16,
          "F8_E4M3": paddle.float8_e4m3fn, "F8_E5M2": paddle.float8_e5m2}
_NUMPY_PARAMS = (paddle.float32, paddle.float16, paddle.float64)
_NUMPY_SOURCES = ("F64", "F32", "F16", "BF16")  # what read_into converts (not fp8)


class PaddleWeightWriter:
    """``write(param, parts)`` for every parameter, then ``close()`` (or use it in a ``with``)."""

    def __init__(self, device=None):
        self.device = device

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def write(self, param, parts) -> None:
        decode = param.dtype != paddle.float8_e4m3fn  # fp8 weights into a float parameter: decoded
        if (param.place.is_cpu_place() and param.dtype in _NUMPY_PARAMS
                and all(part.dtype in _NUMPY_SOURCES if part.scale is None else param.dtype == paddle.float32
                        for part in parts)):
            array = np.from_dlpack(param)  # the parameter's memory: written in place
            for part in parts:
                read_float32_into(array[part.dst], part)
            return
        for part in parts:
            if decode and part.scale is not None:
                host = np.empty(part.shape, dtype=np.float32)
                read_float32_into(host, part)
                value = paddle.to_tensor(host, place=param.place)
            else:
                host = np.ascontiguousarray(part.source.view(part.name, part.index))
                value = paddle.to_tensor(host, place=param.place)
                if value.dtype != STORED[part.dtype]:  # raw bits (bf16, fp8) -> their dtype
                    value = value.view(STORED[part.dtype])
            if value.dtype != param.dtype:
                value = value.astype(param.dtype)
            (param[part.dst] if part.dst else param).copy_(value)

    def close(self) -> None:
        pass
