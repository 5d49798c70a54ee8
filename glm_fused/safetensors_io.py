"""Safetensors headers, checked, and tensor slices as numpy views of the file. Framework-free.

Every loader opens each shard here first: the header is parsed and checked (dtype, size,
truncation) so that a broken file is a one-line ``UserError`` before any tensor is read, and
the launcher can check a checkpoint without importing a framework.

Reading tensors: the torch backend reads with safetensors' own ``safe_open(framework="pt")``
(zero-copy views of the file). The Paddle backend and ``glm_fused.checkpoint.read_float32_into``
read through ``view``/``read_into`` below, because safetensors offers them nothing better
(measured with safetensors 0.8.0 and Paddle 3.3.1): ``safe_open(framework="np")`` cannot
represent bfloat16 or fp8 (``TypeError: data type 'bfloat16' not understood``), and
``framework="paddle"`` aborts the whole process (SIGABRT, "The deleter of the pointer is not
found") when two tensors read from the same checkpoint tensor are freed (a load plan reads gate
and up rows of one fused expert tensor), besides casting bf16 -> fp32 about 5x slower than the
numpy widening in ``read_into``. The format is simple: an 8-byte little-endian header length,
a JSON header ``{name: {dtype, shape, data_offsets}}``, then the raw little-endian data.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np

from glm_fused.errors import UserError

# How each stored dtype is viewed in numpy: bf16 and fp8 as their raw bits (numpy has neither;
# an fp8 weight's value also needs the scales beside it: glm_fused.quantization.decode_into).
RAW_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "F8_E4M3": np.uint8, "F8_E5M2": np.uint8,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
_MAX_HEADER = 100 * 1024 * 1024


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def slice_shape(shape: tuple[int, ...], index: tuple) -> tuple[int, ...]:
    """The shape of ``tensor[index]`` for a tensor of ``shape`` (basic indexing), touching no data."""
    return np.broadcast_to(np.uint8(0), shape)[index].shape


class SafetensorsFile:
    """One ``.safetensors`` file: header checked on open; tensors read as numpy slices."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise UserError(f"{self.path}: truncated safetensors file (no header)")
                (n,) = struct.unpack("<Q", head)
                if n > _MAX_HEADER or 8 + n > size:
                    raise UserError(f"{self.path}: corrupt or truncated safetensors header")
                header = json.loads(f.read(n))
        except FileNotFoundError:
            raise UserError(f"{self.path}: shard file not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{self.path}: corrupt safetensors header (not JSON)") from None
        if not isinstance(header, dict):
            raise UserError(f"{self.path}: corrupt safetensors header (not a JSON object)")
        header.pop("__metadata__", None)
        self._data_start = 8 + n
        self._entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        data_size = size - self._data_start
        for name, info in header.items():
            try:
                dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise UserError(f"{self.path}: corrupt header entry for tensor {name!r}") from None
            if not all(_is_count(v) for v in (*shape, begin, end)):
                raise UserError(f"{self.path}: corrupt header entry for tensor {name!r} (shape and data_offsets "
                                f"must be non-negative integers)")
            if not isinstance(dtype, str) or dtype not in RAW_DTYPES:
                raise UserError(f"{self.path}: tensor {name!r} has dtype {dtype}, which is not supported")
            nbytes = math.prod(shape) * np.dtype(RAW_DTYPES[dtype]).itemsize
            if end - begin != nbytes:
                raise UserError(f"{self.path}: corrupt header entry for tensor {name!r} (size mismatch)")
            if end > data_size:
                raise UserError(f"{self.path}: file is truncated (tensor {name!r} ends at byte "
                                f"{self._data_start + end}, file has {size})")
            self._entries[name] = (dtype, shape, begin, end)

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def nbytes(self, name: str) -> int:
        """Bytes of the tensor as stored."""
        _, _, begin, end = self._entries[name]
        return end - begin

    def dtype(self, name: str) -> str:
        """The stored dtype as safetensors names it: ``BF16``, ``F32``, ``F8_E4M3``, ..."""
        return self._entries[name][0]

    def view(self, name: str, index: tuple = ()) -> np.ndarray:
        """``tensor[index]`` as a read-only numpy view of the file, in its stored bits (bf16 and
        fp8 as unsigned integers). The map covers this one tensor and goes with the last view of
        it: drop the view once copied, and the file pages it touched stop counting in this
        process's memory."""
        dtype, shape, begin, end = self._entries[name]
        raw = RAW_DTYPES[dtype]
        if end == begin:
            return np.zeros(shape, dtype=raw)[index]
        mapped = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self._data_start + begin,
                           shape=(end - begin,))
        return mapped.view(raw).reshape(shape)[index]

    def read_into(self, out: np.ndarray, name: str, index: tuple = ()) -> None:
        """Copy ``tensor[index]`` into ``out`` (any strides), converting once on the way.

        bf16 -> fp32 is exact (bf16 is fp32's top half): the 16 bits shifted straight into
        ``out``, no intermediate array. Raw bits go to an ``out`` of the raw dtype (uint16 for
        bf16, uint8 for fp8); other float conversions are numpy's.
        """
        dtype = self.dtype(name)
        src = self.view(name, index)
        if src.shape != out.shape:
            raise ValueError(f"{name}{list(index)}: slice {src.shape} does not fit {out.shape}")
        if out.dtype == src.dtype:
            np.copyto(out, src)
        elif dtype == "BF16" and out.dtype == np.float32:
            np.left_shift(src, 16, out=out.view(np.uint32), dtype=np.uint32)
        elif dtype in ("F64", "F32", "F16") and out.dtype.kind == "f":
            np.copyto(out, src, casting="unsafe")
        else:
            raise ValueError(f"{self.path}: tensor {name!r} is {dtype}; numpy cannot convert it to {out.dtype}")

    def read(self, name: str, index: tuple = ()) -> np.ndarray:
        """A float32 copy of ``tensor[index]`` (floats; other dtypes as stored)."""
        dtype = self.dtype(name)
        widened = np.float32 if dtype in ("F64", "F32", "F16", "BF16") else RAW_DTYPES[dtype]
        out = np.empty(slice_shape(self.shape(name), index), dtype=widened)
        self.read_into(out, name, index)
        return out
