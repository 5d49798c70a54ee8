"""Fill a model's parameters: from a checkpoint (the framework-free load plan) or at random.

``glm_fused.checkpoint`` maps, slices and checks the checkpoint tensors and makes sure every
parameter gets exactly one; the framework's weight writer (``Ops.weight_writer``) copies each
planned slice, as stored, into its place in the parameter, converting once to the
parameter's dtype (the router stays fp32 because its parameters are fp32).

fp8 (``glm_fused.quantization``): an fp8 parameter (``model.fp8_params``) takes a row-scaled
checkpoint's codes and row scales as stored, by the same writer; a block-scaled weight, or a
float one under ``--quantization fp8``, is read as float32 on the host (one expert at a time),
and quantized per row on the device (``Ops.quantize_fp8``). A float parameter takes an fp8
weight decoded exactly (the writer); a model that keeps no fp8 weights but runs a
``--quantization fp8`` scheme gets its weights rounded through fp8, so it computes with what
an fp8 model holds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from glm_fused.checkpoint import expected_shapes, load_rank_weights, read_float32_into, scale_parameter
from glm_fused.model.ops import Fp8Weight


@dataclass(frozen=True)
class LoadStats:
    """What one rank read: checkpoint bytes as stored, and the seconds from opening the
    checkpoint to the last byte in place."""
    bytes: int
    seconds: float

    @property
    def gib_per_s(self) -> float:
        return self.bytes / 2**30 / max(self.seconds, 1e-9)

    def __str__(self) -> str:
        size = f"{self.bytes / 2**30:.2f} GiB" if self.bytes >= 2**30 / 10 else f"{self.bytes / 2**20:.1f} MiB"
        return f"{self.gib_per_s:.2f} GiB/s ({size} in {self.seconds:.2f} s)"


def load_weights(model, model_dir: str | Path, progress: bool = True) -> LoadStats:
    F = model.F
    params = dict(model.named_parameters())
    round_trip = []  # quantized at load but held as floats: rounded through fp8 once in place
    t0 = time.perf_counter()
    with F.no_grad():
        with F.weight_writer(model.device) as writer:
            def write(name, parts):
                if name in model.fp8_params:
                    _write_fp8(F, writer, params[name], params[scale_parameter(name)], parts)
                    return
                writer.write(params[name], parts)
                if name in model.quantized and not model.quant.stored:
                    round_trip.append(name)

            nbytes = load_rank_weights(model_dir, model.config, model.shard,
                                       {n: tuple(p.shape) for n, p in params.items()}, write, progress,
                                       fp8=model.fp8_params)
        for name in round_trip:  # after the writer closed: every copy to a GPU has landed
            _round_through_fp8(F, params[name])
    return LoadStats(nbytes, time.perf_counter() - t0)


def _write_fp8(F, writer, weight, scale, parts) -> None:
    """One fp8 parameter and its row scales from its checkpoint parts."""
    if all(part.row_scaled for part in parts):  # codes and row scales as stored
        writer.write(weight, parts)
        writer.write(scale, [part.scale for part in parts])
        return
    # Block scales (requantized per row: the fp8 kernels take one scale per row) or float weights
    # (--quantization fp8). A part holds whole rows (parts split rows, never columns), so each
    # is quantized on its own, one expert at a time.
    for part in (one for part in parts for one in part.per_expert()):
        host = np.empty(part.shape, dtype=np.float32)
        read_float32_into(host, part)
        _put_fp8(F, weight, scale, part.dst, F.tensor(host, like=scale))


def _put_fp8(F, weight, scale, dst: tuple, x) -> None:
    """``quantize_fp8(x)`` into ``weight[dst]`` and its row scales ``scale[dst]`` (``()``: all of them)."""
    q = F.quantize_fp8(x)
    F.assign(weight[dst] if dst else weight, q.codes)
    F.assign(scale[dst] if dst else scale, q.scale)


def _round_through_fp8(F, param) -> None:
    F.assign(param, F.dequantize_fp8(F.quantize_fp8(param), F.dtype_name(param)))


def _quantize_into(F, weight, scale, source) -> None:
    """Fill an fp8 weight and its row scales with ``quantize_fp8(source(i))``, one expert ``i`` at
    a time for stacked experts (``i`` None: the whole weight), so the float temporary stays small."""
    for i in range(weight.shape[0]) if len(weight.shape) == 3 else [None]:
        _put_fp8(F, weight, scale, () if i is None else (i,), source(i))


def dummy_weights(model, seed: int = 0) -> None:
    """Random weights at the real sizes (``--load-format dummy``): N(0, 0.02), norms ones; an
    fp8 weight is such a draw quantized per row (one expert at a time; where the model holds
    fp8 weights dequantized, the draw rounded through fp8).

    Deterministic per (seed, parameter, rank). Router parameters are replicated, so they are
    drawn without the rank: every rank must route a token to the same experts.
    """
    F = model.F
    kinds = {name: kind for name, (_, kind) in expected_shapes(model.config, model.shard).items()}
    params = dict(model.named_parameters())
    scales = {scale_parameter(n) for n in model.fp8_params}
    with F.no_grad():
        for name, param in params.items():
            kind = kinds.get(name, "weight")
            if kind == "norm":
                F.fill(param, 1.0)
                continue
            if name in scales:
                continue  # filled with its weight
            owner = "all" if kind == "router" else model.shard.rank
            if name not in model.fp8_params:
                F.fill_normal(param, 0.02, f"{seed}:{name}:{owner}")
                if name in model.quantized:  # fp8 by the scheme, held dequantized: the values fp8 holds
                    _round_through_fp8(F, param)
                continue
            scale = params[scale_parameter(name)]

            def draw(i, name=name, owner=owner, shape=list(param.shape[-2:]), scale=scale):
                x = F.zeros(shape, "float32", like=scale)
                F.fill_normal(x, 0.02, f"{seed}:{name}:{owner}" + ("" if i is None else f":{i}"))
                return x

            _quantize_into(F, param, scale, draw)


def copy_weights(src, dst) -> None:
    """Give ``dst`` the weights of ``src``, a model of the same config and rank in any dtype or
    weight kind, as ``dst`` holds them: cast; an fp8 weight dequantized into a float parameter
    (an fp32 reference of an fp8 model holds its exact weights); a float weight quantized into
    an fp8 one, or rounded through fp8 where ``dst`` is fp8 by its scheme but holds floats."""
    F = dst.F
    source, target = dict(src.named_parameters()), dict(dst.named_parameters())
    scales = {scale_parameter(n) for n in dst.fp8_params}
    with F.no_grad():
        for name, param in target.items():
            if name in scales:
                continue  # filled with its weight
            value = source[name]
            if name in src.fp8_params:
                value = Fp8Weight(value, source[scale_parameter(name)])
            if name in dst.fp8_params and name in src.fp8_params:
                F.assign(param, value.codes)
                F.assign(target[scale_parameter(name)], value.scale)
            elif name in dst.fp8_params:
                _quantize_into(F, param, target[scale_parameter(name)], lambda i: value if i is None else value[i])
            else:
                F.assign(param, F.dequantize_fp8(value, F.dtype_name(param)) if name in src.fp8_params else value)
                if name in dst.quantized and name not in src.quantized:
                    _round_through_fp8(F, param)
