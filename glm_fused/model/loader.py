"""Fill a model's parameters: from a checkpoint (the framework-free load plan) or at random.

``glm_fused.checkpoint`` maps, slices and checks the checkpoint tensors and makes sure every
parameter gets exactly one; this file only hands each value to the framework
(``Ops.copy_into``: to the parameter's device and dtype; the router stays fp32 because its
parameters are fp32). An fp8 parameter (``model.fp8_params``) takes the checkpoint's codes and
row scales as they are, or a float32 array quantized per row here, on the device (``--quantization
fp8``, block-scaled checkpoints); a model that keeps no fp8 weights but runs a ``--quantization
fp8`` scheme gets its weights rounded through fp8, so it computes with what an fp8 model holds.
"""

from __future__ import annotations

from pathlib import Path

from glm_fused.checkpoint import expected_shapes, load_rank_weights, scale_parameter
from glm_fused.model.ops import Fp8Weight
from glm_fused.quantization import Fp8Array


def load_weights(model, model_dir: str | Path, progress: bool = True) -> None:
    F = model.F
    params = dict(model.named_parameters())
    round_trip = model.quant is not None and not model.quant.stored and not model.fp8_params

    def assign(name, value):
        if name in model.fp8_params:
            _assign_fp8(F, params[name], params[scale_parameter(name)], value)
            return
        F.copy_into(params[name], value)
        if round_trip and name in model.quantized:
            _round_through_fp8(F, params[name])

    with F.no_grad():
        load_rank_weights(model_dir, model.config, model.shard, {n: tuple(p.shape) for n, p in params.items()},
                          assign, progress, fp8=model.fp8_params)


def _assign_fp8(F, weight, scale, value) -> None:
    if isinstance(value, Fp8Array):
        F.copy_codes(weight, value.codes)
        F.copy_into(scale, value.scale)
        return
    _quantize_into(F, weight, scale, lambda i: F.tensor(value if i is None else value[i], like=scale))


def _round_through_fp8(F, param) -> None:
    F.assign(param, F.dequantize_fp8(F.quantize_fp8(param), F.dtype_name(param)))


def _quantize_into(F, weight, scale, source) -> None:
    """Fill an fp8 weight and its row scales with ``quantize_fp8(source(i))``, one expert ``i`` at
    a time for stacked experts (``i`` None: the whole weight), so the float temporary stays small."""
    for i in range(weight.shape[0]) if len(weight.shape) == 3 else [None]:
        q = F.quantize_fp8(source(i))
        F.assign(weight if i is None else weight[i], q.codes)
        F.assign(scale if i is None else scale[i], q.scale)


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
