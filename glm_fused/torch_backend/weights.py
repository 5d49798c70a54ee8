"""Checkpoint slices into torch parameters: read by safetensors, converted once, on the device.

Each part of the load plan (``glm_fused.checkpoint.Part``) is read with safetensors' own
``safe_open(framework="pt").get_slice(...)[index]``: a zero-copy view of the mapped file, in
the stored dtype (bf16, fp8, fp32 scales...). Then:

* CPU parameter: ``param[dst].copy_(view)`` - the one pass over the data, converting
  (bf16 -> fp32 widening) straight into the parameter, on torch's intra-op threads.
* CUDA parameter: the view is gathered into a pinned staging slot (the host copy, also
  threaded) and the slot goes to the device asynchronously on a copy stream, in the stored
  dtype; a dtype change happens on the device. A ring of slots lets the next slice's host
  copy overlap the last one's transfer, as fast loaders do.

An fp8 weight going into a float parameter (CPU, an fp32 model: no fp8 kernels there) is
decoded exactly on the host (``glm_fused.checkpoint.read_float32_into``), straight into a CPU
fp32 parameter; an fp8 parameter takes the codes as stored, like any other slice.

safetensors' own CUDA path (``device="cuda"``) is not used: it moves a tensor whole (never
a rank's slice), and each transfer waits for the previous one.

Each parameter opens its shards anew and lets them go once copied, so the file pages a rank
touched stop counting in its memory (a handle kept open would add the mapped checkpoint to
the rank's peak RSS).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from safetensors import safe_open

from glm_fused.checkpoint import read_float32_into

SLOT_BYTES = 64 * 2**20  # per staging slot: large transfers, few Python steps
SLOTS = 3


class TorchWeightWriter:
    """``write(param, parts)`` for every parameter, then ``close()`` (or use it in a ``with``);
    parameters may be read only after ``close`` (copies to a GPU finish there)."""

    def __init__(self, device, staged: bool | None = None, slot_bytes: int = SLOT_BYTES, slots: int = SLOTS):
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        # ``staged`` on a CPU runs the same chunking through plain buffers (tests).
        self.staged = cuda if staged is None else staged
        self.slot_bytes = slot_bytes
        self._slots: list[torch.Tensor] = []
        self._done: list = []  # per slot: the event its last transfer records, or None
        self._next = 0
        self._stream = torch.cuda.Stream(self.device) if cuda and self.staged else None
        if self._stream is not None:  # after whatever filled the new parameters (fills run on the default stream)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        if self.staged:
            self._slots = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(slots)]
            self._done = [None] * slots

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def write(self, param: torch.Tensor, parts) -> None:
        with contextlib.ExitStack() as files:
            handles = {}
            for part in parts:
                dst = param[part.dst] if part.dst else param
                if part.scale is not None and param.dtype != torch.float8_e4m3fn:
                    self._decode(dst, part)
                    continue
                path = part.source.path
                if path not in handles:
                    handles[path] = files.enter_context(safe_open(str(path), framework="pt"))
                self._copy(dst, handles[path].get_slice(part.name)[part.index])

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.staged:
            self._staged_copy(dst, src)
        else:
            dst.copy_(src)

    def _decode(self, dst: torch.Tensor, part) -> None:
        """An fp8 weight into a float parameter: decoded exactly on the host, once - straight into
        a CPU fp32 parameter, else into a float32 copy that goes the usual way."""
        if not self.staged and dst.device.type == "cpu" and dst.dtype == torch.float32:
            read_float32_into(dst.detach().numpy(), part)
            return
        host = np.empty(part.shape, dtype=np.float32)
        read_float32_into(host, part)
        self._copy(dst, torch.from_numpy(host))

    def close(self) -> None:
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            self._stream.synchronize()  # every transfer landed before the parameters are used
            self._stream = None
        self._slots, self._done = [], []

    # ---- staged: host slot -> device, asynchronously --------------------------------
    def _staged_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Split ``src`` along its first dimension into pieces that fit a slot."""
        nbytes = src.numel() * src.element_size()
        if nbytes <= self.slot_bytes or src.dim() == 0:
            self._transfer(dst, src)
            return
        if src.shape[0] == 1:
            self._staged_copy(dst[0], src[0])
            return
        rows = max(1, self.slot_bytes // (nbytes // src.shape[0]))
        for a in range(0, src.shape[0], rows):
            self._staged_copy(dst[a:a + rows], src[a:a + rows])

    def _transfer(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        k = self._next
        self._next = (k + 1) % len(self._slots)
        if self._done[k] is not None:
            self._done[k].synchronize()  # the slot's last transfer has left it
        nbytes = src.numel() * src.element_size()
        host = self._slots[k][:nbytes].view(src.dtype).view(src.shape)
        host.copy_(src)  # out of the page cache, gathering a strided slice
        if self._stream is None:
            dst.copy_(host)
            return
        with torch.cuda.stream(self._stream):
            if dst.dtype == src.dtype:
                dst.copy_(host, non_blocking=True)
            else:  # to the device as stored, converted there
                stored = torch.empty(src.shape, dtype=src.dtype, device=dst.device)
                stored.copy_(host, non_blocking=True)
                dst.copy_(stored)
            done = torch.cuda.Event()
            done.record(self._stream)
        self._done[k] = done
