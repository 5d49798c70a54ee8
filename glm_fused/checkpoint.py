"""Hugging Face GLM-4.5 checkpoints -> the weights one tensor-parallel rank holds.

Framework-free. Maps checkpoint names onto the model's parameter names (docs/design.md),
stacks q/k/v and gate/up, slices each tensor to this rank while reading (so a rank's peak
memory stays near its shard), and is strict: a missing, unexpected or misshaped tensor, or
a missing or truncated shard, is a UserError naming the tensor and file.

Both expert layouts seen in the wild are accepted: the original per-expert names
(``mlp.experts.{e}.{gate,up,down}_proj.weight``) and transformers-5 fused experts
(``mlp.experts.gate_up_proj [E, 2I, H]`` with gate rows first, ``mlp.experts.down_proj [E, H, I]``).
The MTP block at layer index ``num_hidden_layers`` is skipped (used only for speculative decoding).

FP8 checkpoints (``glm_fused.quantization``): a weight stored in e4m3 is read with the part of
its scale tensor that covers this rank's slice (the rows' scales for one scale per row, the
covering blocks for block scales, which need not split evenly over ranks). Each parameter is
then handed over in the form the model holds it: the codes and one scale per row where the
model keeps fp8 and the checkpoint has row scales; float32 everywhere else (decoded exactly;
a block-scaled weight the model keeps in fp8 is requantized per row by the model's loader).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from glm_fused import quantization as q8
from glm_fused.config import Glm4MoeConfig
from glm_fused.errors import UserError
from glm_fused.quantization import Fp8Array, Fp8Scheme
from glm_fused.safetensors_io import SafetensorsFile
from glm_fused.sharding import TPShard

logger = logging.getLogger("glm_fused.checkpoint")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


class Checkpoint:
    """The tensors of a checkpoint directory: single file or sharded index, headers checked."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        index_path = self.dir / INDEX_FILE
        if index_path.exists():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
                raise UserError(f"{index_path}: not a valid safetensors index (no weight_map)") from None
            shard_names = sorted(set(weight_map.values()))
        elif (self.dir / SINGLE_FILE).exists():
            weight_map, shard_names = None, [SINGLE_FILE]
        else:
            if list(self.dir.glob("*.bin")) or list(self.dir.glob("*.pt")):
                raise UserError(f"{self.dir}: only pickle weights (*.bin/*.pt) found; convert the "
                                f"checkpoint to safetensors (pickles are never loaded)")
            raise UserError(f"{self.dir}: no {SINGLE_FILE} or {INDEX_FILE}")
        self.files: dict[str, SafetensorsFile] = {}
        for shard in shard_names:
            path = self.dir / shard
            if not path.exists():
                first = next(n for n, f in weight_map.items() if f == shard)
                raise UserError(f"{path}: shard listed in {INDEX_FILE} is missing (holds {first!r})")
            self.files[shard] = SafetensorsFile(path)
        self.location: dict[str, str] = {}
        for shard, f in self.files.items():
            for name in f.keys():
                self.location[name] = shard
        if weight_map is not None:
            for name, shard in weight_map.items():
                if self.location.get(name) != shard:
                    raise UserError(f"{self.dir / shard}: tensor {name!r} is listed in {INDEX_FILE} "
                                    f"but not stored in that shard")

    @property
    def names(self) -> set[str]:
        return set(self.location)

    def file_of(self, name: str) -> Path:
        return self.dir / self.location[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.files[self.location[name]].shape(name)

    def dtype(self, name: str) -> str:
        """The stored dtype as safetensors names it (``BF16``, ``F8_E4M3``, ...)."""
        return self.files[self.location[name]].dtype(name)

    def read(self, name: str, index: tuple | None = None) -> np.ndarray:
        return self.files[self.location[name]].read(name, index)


# ---- the load plan -------------------------------------------------------------------

@dataclass
class _Scale:
    """The part of a stored fp8 weight's scale tensor that one read needs."""

    name: str
    index: tuple                       # row scales: this read's rows; block scales: its covering blocks
    block: tuple[int, int] | None      # None: one scale per output row
    offset: tuple[int, int] = (0, 0)   # block scales: the read's first element within its first block
    size: tuple[int, int] = (0, 0)     # block scales: the read's rows and columns


@dataclass
class _Read:
    name: str       # checkpoint tensor
    index: tuple    # numpy index of this rank's part
    scale: _Scale | None = None  # the weight is stored in fp8: how its scales are read


@dataclass
class _Param:
    shape: tuple[int, ...]                 # on this rank
    kind: str                              # weight | bias | norm | router
    parts: list[_Read] = field(default_factory=list)
    axis: int = 0                          # parts are concatenated along this axis
    stack: bool = False                    # parts are stacked on a new axis 0 (experts)


def _rows(a: int, b: int) -> tuple:
    return (slice(a, b),)


def _cols(a: int, b: int) -> tuple:
    return (slice(None), slice(a, b))


def load_plan(config: Glm4MoeConfig, shard: TPShard, names: set[str]) -> tuple[dict[str, _Param], dict[str, tuple]]:
    """Parameter plan for this rank, and the full shape every checkpoint tensor must have
    (the fp8 scales of an fp8 checkpoint's quantized weights included).

    ``names``: the checkpoint's tensor names (they tell the expert layout). The one map between
    checkpoint and model names: bench/bench_layers.py runs it backwards to give transformers'
    layer our weights.
    """
    c, s = config, shard
    H, D, V = c.hidden_size, c.head_dim, c.vocab_size
    scheme = q8.parse(c.quantization_config)
    params: dict[str, _Param] = {}
    full: dict[str, tuple] = {}

    def read(name: str, shape: tuple, index: tuple) -> _Read:
        full[name] = shape
        if scheme is None or not scheme.stored or not scheme.quantized(q8.module_of(name)):
            return _Read(name, index)
        scale = scheme.scale_name(name)
        full[scale] = q8.scale_shape(scheme, shape)
        return _Read(name, index, _scale_read(scale, scheme.block, shape, index))

    q0, q1 = s.q_heads()
    k0, k1 = s.kv_heads()
    v0, v1 = s.vocab()
    params["embed_tokens.weight"] = _Param((s.vocab_size, H), "weight",
                                           [read("model.embed_tokens.weight", (V, H), _rows(v0, v1))])
    for i in range(c.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            params[f"{dst}{norm}.weight"] = _Param((H,), "norm", [read(f"{src}{norm}.weight", (H,), ())])
        nq, nkv = s.num_heads, s.num_kv_heads
        qkv_rows = (nq + 2 * nkv) * D
        attn = f"{src}self_attn."
        params[f"{dst}self_attn.qkv_proj.weight"] = _Param((qkv_rows, H), "weight", [
            read(f"{attn}q_proj.weight", (c.num_attention_heads * D, H), _rows(q0 * D, q1 * D)),
            read(f"{attn}k_proj.weight", (c.num_key_value_heads * D, H), _rows(k0 * D, k1 * D)),
            read(f"{attn}v_proj.weight", (c.num_key_value_heads * D, H), _rows(k0 * D, k1 * D)),
        ])
        if c.attention_bias:
            params[f"{dst}self_attn.qkv_proj.bias"] = _Param((qkv_rows,), "bias", [
                read(f"{attn}q_proj.bias", (c.num_attention_heads * D,), _rows(q0 * D, q1 * D)),
                read(f"{attn}k_proj.bias", (c.num_key_value_heads * D,), _rows(k0 * D, k1 * D)),
                read(f"{attn}v_proj.bias", (c.num_key_value_heads * D,), _rows(k0 * D, k1 * D)),
            ])
        params[f"{dst}self_attn.o_proj.weight"] = _Param((H, nq * D), "weight", [
            read(f"{attn}o_proj.weight", (H, c.num_attention_heads * D), _cols(q0 * D, q1 * D))])
        if c.use_qk_norm:
            for qk in ("q_norm", "k_norm"):
                params[f"{dst}self_attn.{qk}.weight"] = _Param((D,), "norm", [read(f"{attn}{qk}.weight", (D,), ())])

        mlp = f"{src}mlp."
        if not c.is_moe_layer(i):
            _swiglu(params, read, f"{dst}mlp.", mlp, H, c.intermediate_size, s.intermediate(), s.intermediate_size)
            continue
        E = c.n_routed_experts
        I = c.moe_intermediate_size
        a, b = s.moe_intermediate()
        e0, e1 = s.experts()
        params[f"{dst}mlp.gate.weight"] = _Param((E, H), "router", [read(f"{mlp}gate.weight", (E, H), ())])
        params[f"{dst}mlp.gate.e_score_correction_bias"] = _Param(
            (E,), "router", [read(f"{mlp}gate.e_score_correction_bias", (E,), ())])
        local_i = s.moe_intermediate_size
        if f"{mlp}experts.gate_up_proj" in names:  # transformers-5 fused experts
            name = f"{mlp}experts.gate_up_proj"
            params[f"{dst}mlp.experts.gate_up_proj"] = _Param((e1 - e0, 2 * local_i, H), "weight", [
                read(name, (E, 2 * I, H), (slice(e0, e1), slice(a, b))),
                read(name, (E, 2 * I, H), (slice(e0, e1), slice(I + a, I + b)))], axis=1)
            params[f"{dst}mlp.experts.down_proj"] = _Param((e1 - e0, H, local_i), "weight", [
                read(f"{mlp}experts.down_proj", (E, H, I), (slice(e0, e1), slice(None), slice(a, b)))])
        else:
            gate_up, down = [], []
            for e in range(e0, e1):
                ex = f"{mlp}experts.{e}."
                gate_up.append([read(f"{ex}gate_proj.weight", (I, H), _rows(a, b)),
                                read(f"{ex}up_proj.weight", (I, H), _rows(a, b))])
                down.append(read(f"{ex}down_proj.weight", (H, I), _cols(a, b)))
            params[f"{dst}mlp.experts.gate_up_proj"] = _Param((e1 - e0, 2 * local_i, H), "weight",
                                                              [r for pair in gate_up for r in pair], stack=True)
            params[f"{dst}mlp.experts.down_proj"] = _Param((e1 - e0, H, local_i), "weight", down, stack=True)
        _swiglu(params, read, f"{dst}mlp.shared_experts.", f"{mlp}shared_experts.", H,
                c.shared_intermediate_size, s.shared_intermediate(), s.shared_intermediate_size)

    params["norm.weight"] = _Param((H,), "norm", [read("model.norm.weight", (H,), ())])
    params["lm_head.weight"] = _Param((s.vocab_size, H), "weight", [read("lm_head.weight", (V, H), _rows(v0, v1))])
    return params, full


def _bounds(shape: tuple, index: tuple) -> list[tuple[int, int]]:
    """(start, stop) along every dimension of ``tensor[index]`` (index: slices, possibly fewer than dims)."""
    out = []
    for dim, size in enumerate(shape):
        start, stop, step = (index[dim] if dim < len(index) else slice(None)).indices(size)
        assert step == 1
        out.append((start, stop))
    return out


def _scale_read(name: str, block: tuple[int, int] | None, shape: tuple, index: tuple) -> _Scale:
    """Which scales a read of ``tensor[index]`` (``shape``: the whole tensor) needs."""
    bounds = _bounds(shape, index)
    lead = tuple(slice(a, b) for a, b in bounds[:-2])
    (r0, r1), (c0, c1) = bounds[-2:]
    if block is None:  # one scale per output row: this read's rows, whatever its columns
        return _Scale(name, lead + (slice(r0, r1),), None)
    bn, bk = block
    covering = lead + (slice(r0 // bn, -(-r1 // bn)), slice(c0 // bk, -(-c1 // bk)))
    return _Scale(name, covering, block, (r0 % bn, c0 % bk), (r1 - r0, c1 - c0))


def _swiglu(params, read, dst: str, src: str, H: int, inter: int, rng: tuple[int, int], local: int) -> None:
    a, b = rng
    params[f"{dst}gate_up_proj.weight"] = _Param((2 * local, H), "weight", [
        read(f"{src}gate_proj.weight", (inter, H), _rows(a, b)),
        read(f"{src}up_proj.weight", (inter, H), _rows(a, b))])
    params[f"{dst}down_proj.weight"] = _Param((H, local), "weight", [
        read(f"{src}down_proj.weight", (H, inter), _cols(a, b))])


def expected_shapes(config: Glm4MoeConfig, shard: TPShard) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every parameter of this rank: ``name -> (shape, kind)``; kind is weight|bias|norm|router.

    Uses the per-expert layout; both layouts give the same parameters.
    """
    params, _ = load_plan(config, shard, names=set())
    return {name: (p.shape, p.kind) for name, p in params.items()}


def _is_mtp(name: str, config: Glm4MoeConfig) -> bool:
    m = _LAYER_RE.match(name)
    return bool(m) and int(m.group(1)) >= config.num_hidden_layers


def validate(ckpt: Checkpoint, config: Glm4MoeConfig, shard: TPShard) -> dict[str, _Param]:
    """Check names, shapes and (fp8) dtypes against the config before any tensor is read."""
    params, full = load_plan(config, shard, ckpt.names)
    scheme = q8.parse(config.quantization_config)
    fp8_parameters(config, scheme)  # one matmul is all fp8 or all float
    reads = {r.name: r for p in params.values() for r in p.parts}
    scales = {r.scale.name: r.name for r in reads.values() if r.scale is not None}

    def missing(names: list[str], why=lambda name: "") -> None:
        if names:
            more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
            raise UserError(f"{ckpt.dir}: tensor {names[0]!r} is missing from the checkpoint{why(names[0])}{more}")

    missing([n for n in full if n not in ckpt.location and n not in scales])
    for name in full:  # fp8 exactly where the quantization_config says, before any scale is looked for
        if name not in scales:
            _check_dtype(ckpt, name, reads.get(name), scheme)
    missing([n for n in scales if n not in ckpt.location], lambda n: f" (the fp8 scale of {scales[n]!r})")
    for name, shape in full.items():
        stored = tuple(ckpt.shape(name))
        if name in scales and scheme.block is None and stored == (*shape, 1):
            continue  # row scales as compressed-tensors writes them: [out, 1]
        if stored != tuple(shape):
            why = " for this config"
            if name in scales:
                per = "output row" if scheme.block is None else "{}x{} block".format(*scheme.block)
                why = f" (one scale per {per} of {scales[name]!r})"
            raise UserError(f"{ckpt.file_of(name)}: tensor {name!r} has shape {list(stored)}, "
                            f"expected {list(shape)}{why}")
        if name in scales and ckpt.dtype(name) not in q8.SCALE_DTYPES:
            raise UserError(f"{ckpt.file_of(name)}: fp8 scale {name!r} is {ckpt.dtype(name)}, expected one of "
                            f"{', '.join(q8.SCALE_DTYPES)}")
    unexpected = sorted(n for n in ckpt.names if n not in full and not _is_mtp(n, config))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise UserError(f"{ckpt.file_of(unexpected[0])}: unexpected tensor {unexpected[0]!r}{more} "
                        f"(not part of a {config.num_hidden_layers}-layer glm4_moe model)")
    return params


def _check_dtype(ckpt: Checkpoint, name: str, read: _Read | None, scheme: Fp8Scheme | None) -> None:
    """A tensor is stored in fp8 exactly when the quantization_config says its module is quantized."""
    stored_fp8 = ckpt.dtype(name) == q8.SAFETENSORS_FP8
    expected_fp8 = read is not None and read.scale is not None
    if stored_fp8 == expected_fp8:
        return
    where, module = ckpt.file_of(name), q8.module_of(name)
    if expected_fp8:
        raise UserError(f"{where}: tensor {name!r} is {ckpt.dtype(name)}, but quantization_config quantizes "
                        f"{module!r} (expected {q8.SAFETENSORS_FP8} with {read.scale.name!r}; list the module in "
                        f"its ignore list if it stays unquantized)")
    if scheme is None:
        why = "config.json has no quantization_config"
    elif scheme.ignored(module):
        why = f"quantization_config's ignore list names {module!r}"
    else:
        why = "only the Linear weights a quantization_config quantizes may be fp8"
    raise UserError(f"{where}: tensor {name!r} is stored in fp8 ({q8.SAFETENSORS_FP8}), but {why}")


def fp8_parameters(config: Glm4MoeConfig, scheme: Fp8Scheme | None) -> set[str]:
    """The model's parameters whose weight is fp8 under ``scheme`` (decoder Linears only: the
    embedding, LM head and routers stay in the model dtype); a matmul whose parts the scheme
    quantizes differently is refused."""
    if scheme is None:
        return set()
    params, _ = load_plan(dataclasses.replace(config, quantization_config=None), TPShard(config, 0, 1), set())
    out = set()
    for name, p in params.items():
        if p.kind != "weight" or not name.startswith("layers."):
            continue
        quantized = {r.name: scheme.quantized(q8.module_of(r.name)) for r in p.parts}
        if len(set(quantized.values())) > 1:
            a = next(n for n, v in quantized.items() if v)
            b = next(n for n, v in quantized.items() if not v)
            raise UserError(f"quantization_config: {q8.module_of(a)!r} is quantized but {q8.module_of(b)!r} is "
                            f"not; they form one matmul ({name}) and must be quantized alike")
        if all(quantized.values()):
            out.add(name)
    return out


def _read_part(ckpt: Checkpoint, r: _Read, codes: bool):
    """One read: float32, or (``codes``, row scales only) the e4m3 codes and their row scales."""
    data = ckpt.read(r.name, r.index)
    if r.scale is None:
        return data
    scale = ckpt.read(r.scale.name, r.scale.index)
    if r.scale.block is None:
        scale = scale.reshape(data.shape[:-1])  # [..., rows] (stored [..., rows] or [..., rows, 1])
        return Fp8Array(data, scale) if codes else q8.decode(data, scale[..., None])
    return q8.decode(data, q8.expand_blocks(scale, r.scale.block, r.scale.offset, r.scale.size))


def _join(parts: list, axis: int):
    if isinstance(parts[0], Fp8Array):  # rows of codes and their scales, side by side
        assert axis < parts[0].codes.ndim - 1, "fp8 parts join along rows only"
        if len(parts) == 1:
            return parts[0]
        return Fp8Array(np.concatenate([p.codes for p in parts], axis=axis),
                        np.concatenate([p.scale for p in parts], axis=axis))
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)


def iter_rank_weights(ckpt: Checkpoint, config: Glm4MoeConfig, shard: TPShard, progress: bool = False,
                      fp8: set[str] = frozenset()) -> Iterator[tuple[str, np.ndarray | Fp8Array]]:
    """Yield ``(parameter name, value in this rank's shape)`` for every parameter: a float32
    array, or an ``Fp8Array`` (codes and row scales) for a parameter the model keeps in fp8
    (``fp8``) whose checkpoint weights are fp8 with row scales."""
    params = validate(ckpt, config, shard)
    mtp = [n for n in ckpt.names if _is_mtp(n, config)]
    if mtp and progress:
        logger.info("skipping %d tensors of the MTP block (layer %d): used only for speculative decoding",
                    len(mtp), config.num_hidden_layers)
    bar = _progress(len(params)) if progress else None
    for name, p in params.items():
        codes = name in fp8 and all(r.scale is not None and r.scale.block is None for r in p.parts)
        if p.stack:  # experts: fill one array expert by expert (no second full-size copy)
            per_expert = len(p.parts) // p.shape[0]
            value = None
            for e in range(p.shape[0]):
                one = _join([_read_part(ckpt, r, codes) for r in p.parts[e * per_expert:(e + 1) * per_expert]], 0)
                if value is None:
                    value = (Fp8Array(np.empty(p.shape, np.uint8), np.empty(p.shape[:-1], np.float32)) if codes
                             else np.empty(p.shape, dtype=np.float32))
                if codes:
                    value.codes[e], value.scale[e] = one.codes, one.scale
                else:
                    value[e] = one
        else:
            value = _join([_read_part(ckpt, r, codes) for r in p.parts], p.axis)
        if tuple(value.shape) != p.shape:  # a planning bug, not a user error
            raise AssertionError(f"{name}: built {value.shape}, planned {p.shape}")
        yield name, value
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:  # progress is a nicety, never a requirement
        return None
    return tqdm(total=total, desc="loading weights", unit="tensor", dynamic_ncols=True)


def load_rank_weights(model_dir: str | Path, config: Glm4MoeConfig, shard: TPShard,
                      shapes: dict[str, tuple[int, ...]], assign, progress: bool = False,
                      fp8: set[str] = frozenset()) -> None:
    """Read this rank's weights and hand each to ``assign(name, value)``, strictly.

    ``shapes`` are the model's own parameters (name -> shape on this rank): every one must be
    assigned exactly once, with its shape, and the plan may name no other. ``fp8``: the
    parameters the model keeps in fp8 (each with a ``<name>_scale`` of one scale per row, which
    ``assign`` fills with the weight). The backend's ``assign`` copies a float32 array or an
    ``Fp8Array`` into its tensors (quantizing a float32 array for an fp8 parameter).
    """
    loaded: set[str] = set()
    for name, value in iter_rank_weights(Checkpoint(model_dir), config, shard, progress=progress, fp8=fp8):
        if name not in shapes:
            raise UserError(f"{model_dir}: the load plan names {name!r}, which the model has no parameter for")
        if name in loaded:
            raise UserError(f"{model_dir}: parameter {name!r} would be loaded twice")
        if tuple(value.shape) != tuple(shapes[name]):
            raise UserError(f"{model_dir}: tensor for {name!r} has shape {list(value.shape)}, "
                            f"the parameter on rank {shard.rank} is {list(shapes[name])}")
        assign(name, value)
        loaded.add(name)
        if name in fp8:
            loaded.add(scale_parameter(name))
    missing = sorted(set(shapes) - loaded)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UserError(f"{model_dir}: no weights loaded for parameter {missing[0]!r}{more}")


def scale_parameter(name: str) -> str:
    """The model's row-scale parameter beside an fp8 weight parameter (``...weight_scale``,
    ``...experts.gate_up_proj_scale``)."""
    return name + "_scale"
