"""A small safetensors reader on numpy memory maps. Framework-free, never unpickles.

Why not ``safetensors.safe_open``: its numpy path cannot represent bfloat16, and we want
every rank to read only its own slice of each tensor (a strided view of the mapped file,
copied once) without materialising the full tensor. The format is simple: an 8-byte
little-endian header length, a JSON header ``{name: {dtype, shape, data_offsets}}``, then
the raw little-endian data.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from glm_fused.errors import UserError

# bf16 is read as its raw 16 bits and widened to fp32 exactly (it is fp32's top half); fp8 e4m3
# stays its raw 8 bits (numpy has no fp8): its value needs the scale beside it
# (glm_fused.quantization decodes both together).
_NUMPY_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_, "F8_E4M3": np.uint8,
}
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFile:
    """One ``.safetensors`` file: header checked on open, tensors read as (sliced) numpy."""

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
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + n
        self._entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        data_size = size - self._data_start
        for name, info in header.items():
            try:
                dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise UserError(f"{self.path}: corrupt header entry for tensor {name!r}") from None
            if dtype not in _NUMPY_DTYPES:
                raise UserError(f"{self.path}: tensor {name!r} has dtype {dtype}, which is not supported")
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(_NUMPY_DTYPES[dtype]).itemsize
            if end - begin != nbytes or begin < 0:
                raise UserError(f"{self.path}: corrupt header entry for tensor {name!r} (size mismatch)")
            if end > data_size:
                raise UserError(f"{self.path}: file is truncated (tensor {name!r} ends at byte "
                                f"{self._data_start + end}, file has {size})")
            self._entries[name] = (dtype, shape, begin, end)

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def dtype(self, name: str) -> str:
        return self._entries[name][0]

    def read(self, name: str, index: tuple | None = None, float32: bool = True) -> np.ndarray:
        """Copy out ``tensor[index]`` only; floats widened to float32 when ``float32`` (fp8 e4m3
        comes back as its uint8 codes).

        The map covers this one tensor and is dropped right after the copy, so the file
        pages a rank touched do not stay counted in its memory for the rest of the load.
        """
        dtype, shape, begin, end = self._entries[name]
        if end == begin:
            return np.zeros(shape, dtype=np.float32 if dtype in _FLOAT_DTYPES else _NUMPY_DTYPES[dtype])
        mapped = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self._data_start + begin,
                           shape=(end - begin,))
        try:
            view = mapped.view(_NUMPY_DTYPES[dtype]).reshape(shape)
            part = view[index] if index is not None else view
            if dtype == "BF16":
                return (part.astype(np.uint32) << 16).view(np.float32)
            if float32 and dtype in _FLOAT_DTYPES:
                return np.array(part, dtype=np.float32)  # a copy: never hand out views of the map
            return np.array(part)
        finally:
            del mapped
