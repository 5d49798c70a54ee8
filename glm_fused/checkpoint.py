"""Hugging Face GLM-4.5 checkpoints -> the weights one tensor-parallel rank holds.

Framework-free. The load plan maps checkpoint names onto the model's parameter names
(docs/design.md): which slice of which checkpoint tensor this rank reads, and where it lands
in which parameter (q/k/v and gate/up stacked, experts stacked). Of the tensors it reads only
fp8 scales, to check them: a framework's weight writer copies each slice, as stored, straight
into its parameter (``glm_fused.model.loader``). It is strict: a missing, unexpected,
misshaped or non-float tensor, a missing or truncated shard, or a NaN, infinite or negative
fp8 scale is a UserError naming the tensor and file.

Both expert layouts seen in the wild are accepted: the original per-expert names
(``mlp.experts.{e}.{gate,up,down}_proj.weight``) and transformers-5 fused experts
(``mlp.experts.gate_up_proj [E, 2I, H]`` with gate rows first, ``mlp.experts.down_proj [E, H, I]``).
The MTP block at layer index ``num_hidden_layers`` is skipped (used only for speculative decoding).

FP8 checkpoints (``glm_fused.quantization``): a part of a weight stored in e4m3 carries the part
of its scale tensor that covers it (``Part.scale``: its rows' scales for one scale per row, the
covering blocks for block scales, which need not split evenly over ranks), and dtypes are
checked against the ``quantization_config``. What becomes of a part is the loader's choice, by
the parameter: codes and row scales copied as stored into an fp8 parameter; decoded exactly
(``read_float32_into``) into a float one; decoded, then requantized per row, for a block-scaled
weight the model keeps in fp8.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from glm_fused import quantization as q8
from glm_fused.config import Glm4MoeConfig
from glm_fused.errors import UserError
from glm_fused.quantization import Fp8Scheme
from glm_fused.safetensors_io import FLOAT_DTYPES, RAW_DTYPES, SafetensorsFile, slice_shape
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
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise UserError(f"{index_path}: not a valid safetensors index (weight_map must map "
                                f"tensor names to shard file names)")
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

    def file(self, name: str) -> SafetensorsFile:
        return self.files[self.location[name]]

    def dtype(self, name: str) -> str:
        """The stored dtype as safetensors names it (``BF16``, ``F8_E4M3``, ...)."""
        return self.file(name).dtype(name)


# ---- the load plan -------------------------------------------------------------------

@dataclass(frozen=True)
class Part:
    """One read of the load plan: checkpoint tensor ``name[index]`` lands in ``parameter[dst]``.

    A framework's weight writer copies it (``glm_fused.model.loader``): the slice is read as
    stored (``dtype``: bf16, fp8, fp32, ...) and converted once, into the parameter.

    A weight stored in fp8 carries its scales: ``scale`` is the read of its scale tensor this
    slice needs. Row scales (``block`` None): this slice's rows, and ``scale.dst`` is where they
    land in the parameter's row scales (the weight's ``dst``: parts split rows, never columns).
    Block scales: the blocks covering the slice, whose first element sits at ``offset`` in its
    first block.
    """
    name: str                             # checkpoint tensor
    index: tuple                          # this rank's slice of it (basic slices)
    shape: tuple[int, ...]                # of that slice
    dst: tuple = ()                       # where it goes in the parameter; () = all of it
    source: SafetensorsFile | None = None  # the shard holding it (set by ``validate``)
    scale: Part | None = None             # fp8 weights: the read of their scales
    block: tuple[int, int] | None = None  # block scales: (rows, columns) per scale
    offset: tuple[int, int] = (0, 0)      # block scales: the slice's first element within its first block

    @property
    def dtype(self) -> str:
        """As stored: ``BF16``, ``F32``, ``F8_E4M3``, ..."""
        return self.source.dtype(self.name)

    @property
    def nbytes(self) -> int:
        """Bytes read as stored (an fp8 weight's scales included)."""
        own = math.prod(self.shape) * np.dtype(RAW_DTYPES[self.dtype]).itemsize
        return own + (self.scale.nbytes if self.scale is not None else 0)

    @property
    def row_scaled(self) -> bool:
        """fp8 with one scale per output row: codes and scales go into an fp8 parameter as stored."""
        return self.scale is not None and self.block is None

    def placed(self, dst: tuple) -> Part:
        """This read landing at ``dst`` (its row scales at the same rows of the row scales)."""
        return replace(self, dst=dst, scale=self.scale.placed(dst) if self.row_scaled else self.scale)

    def per_expert(self) -> list[Part]:
        """A read of several stacked experts (``[E, rows, cols]``) as one read per expert, so a
        float copy of it stays one expert large; any other read as it is."""
        if len(self.shape) < 3 or self.shape[0] == 1:
            return [self]
        return [self._expert(i) for i in range(self.shape[0])]

    def _expert(self, i: int) -> Part:
        def one(sl: slice) -> slice:
            start = sl.start or 0
            return slice(start + i, start + i + 1)

        dst = self.dst or (slice(None),)
        scale = self.scale._expert(i) if self.scale is not None else None
        return replace(self, index=(one(self.index[0]), *self.index[1:]), shape=(1, *self.shape[1:]),
                       dst=(one(dst[0]), *dst[1:]), scale=scale)


@dataclass
class _Param:
    shape: tuple[int, ...]                 # on this rank
    kind: str                              # weight | bias | norm | router
    parts: list[Part] = field(default_factory=list)
    axis: int = 0                          # parts are concatenated along this axis
    stack: bool = False                    # parts are stacked on a new axis 0 (experts)

    def __post_init__(self):
        """Place every part: its ``dst`` in this parameter, checked to tile it exactly."""
        groups = [(self.parts, (), self.axis, self.shape)]
        if self.stack:  # expert e's parts are concatenated along axis 0 of param[e]
            per = len(self.parts) // self.shape[0]
            groups = [(self.parts[e * per:(e + 1) * per], (e,), 0, self.shape[1:]) for e in range(self.shape[0])]
        placed = []
        for parts, lead, axis, shape in groups:
            if len(parts) == 1 and parts[0].shape == tuple(shape) and not lead:
                placed.append(parts[0].placed(()))
                continue
            at = 0
            for p in parts:
                n = p.shape[axis]
                if p.shape[:axis] + p.shape[axis + 1:] != tuple(shape[:axis]) + tuple(shape[axis + 1:]):
                    raise AssertionError(f"{p.name}{p.shape} does not fit a parameter slice of {shape}")
                placed.append(p.placed(lead + (slice(None),) * axis + (slice(at, at + n),)))
                at += n
            if at != shape[axis]:  # a planning bug, not a user error
                raise AssertionError(f"parts of {[p.name for p in parts]} fill {at} of {shape[axis]} rows")
        self.parts = placed


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

    def read(name: str, shape: tuple, index: tuple) -> Part:
        full[name] = shape
        part = Part(name, index, slice_shape(shape, index))
        if scheme is None or not scheme.stored or not scheme.quantized(q8.module_of(name)):
            return part
        scale = scheme.scale_name(name)
        full[scale] = q8.scale_shape(scheme, shape)
        return _with_scale(part, scale, full[scale], scheme.block, shape)

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


def _with_scale(part: Part, name: str, scale_shape: tuple, block: tuple[int, int] | None, shape: tuple) -> Part:
    """``part`` of an fp8 weight of ``shape`` with the read of its scale tensor ``name``
    (``scale_shape``) it needs."""
    bounds = _bounds(shape, part.index)
    lead = tuple(slice(a, b) for a, b in bounds[:-2])
    (r0, r1), (c0, c1) = bounds[-2:]
    if block is None:  # one scale per output row: this read's rows, whatever its columns
        index = lead + (slice(r0, r1),)
        return replace(part, scale=Part(name, index, slice_shape(scale_shape, index)))
    bn, bk = block
    index = lead + (slice(r0 // bn, -(-r1 // bn)), slice(c0 // bk, -(-c1 // bk)))
    return replace(part, scale=Part(name, index, slice_shape(scale_shape, index)), block=block,
                   offset=(r0 % bn, c0 % bk))


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


def _and_more(names: list[str]) -> str:
    """What an error naming ``names[0]`` adds for the rest."""
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def _is_mtp(name: str, config: Glm4MoeConfig) -> bool:
    m = _LAYER_RE.match(name)
    return bool(m) and int(m.group(1)) >= config.num_hidden_layers


def validate(ckpt: Checkpoint, config: Glm4MoeConfig, shard: TPShard) -> dict[str, _Param]:
    """Check names, shapes and dtypes (fp8 exactly where the quantization_config says) against
    the config before any tensor is read; return the rank's plan with every part's shard attached."""
    params, full = load_plan(config, shard, ckpt.names)
    scheme = q8.parse(config.quantization_config)
    fp8_parameters(config, scheme)  # one matmul is all fp8 or all float
    reads = {r.name: r for p in params.values() for r in p.parts}
    scales = {r.scale.name: r.name for r in reads.values() if r.scale is not None}

    def missing(names: list[str], why=lambda name: "") -> None:
        if names:
            raise UserError(f"{ckpt.dir}: tensor {names[0]!r} is missing from the checkpoint{why(names[0])}"
                            f"{_and_more(names)}")

    missing([n for n in full if n not in ckpt.location and n not in scales])
    for name in full:  # fp8 exactly where the quantization_config says, before any scale is looked for
        if name not in scales:
            if ckpt.dtype(name) not in FLOAT_DTYPES:
                raise UserError(f"{ckpt.file_of(name)}: tensor {name!r} has dtype {ckpt.dtype(name)}, "
                                f"expected a floating-point dtype ({', '.join(FLOAT_DTYPES)})")
            _check_fp8(ckpt, name, reads.get(name), scheme)
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
    for name in scales:
        if ckpt.dtype(name) not in q8.SCALE_DTYPES:
            raise UserError(f"{ckpt.file_of(name)}: fp8 scale {name!r} is {ckpt.dtype(name)}, expected one of "
                            f"{', '.join(q8.SCALE_DTYPES)}")
    unexpected = sorted(n for n in ckpt.names if n not in full and not _is_mtp(n, config))
    if unexpected:
        raise UserError(f"{ckpt.file_of(unexpected[0])}: unexpected tensor {unexpected[0]!r}{_and_more(unexpected)} "
                        f"(not part of a {config.num_hidden_layers}-layer glm4_moe model)")
    for p in params.values():
        p.parts = [_attached(ckpt, part) for part in p.parts]
    return params


def _attached(ckpt: Checkpoint, part: Part) -> Part:
    """``part`` (and its scale read) with the shard holding it; row scales stored ``[..., out, 1]``
    (compressed-tensors) are read through their one column."""
    scale = part.scale
    if scale is not None:
        if part.block is None and len(ckpt.shape(scale.name)) > len(scale.index):
            scale = replace(scale, index=(*scale.index, 0))
        scale = replace(scale, source=ckpt.file(scale.name))
    return replace(part, source=ckpt.file(part.name), scale=scale)


def _check_fp8(ckpt: Checkpoint, name: str, read: Part | None, scheme: Fp8Scheme | None) -> None:
    """A tensor is stored in fp8 exactly when the quantization_config says its module is quantized,
    and then in e4m3."""
    dtype = ckpt.dtype(name)
    expected_fp8 = read is not None and read.scale is not None
    if (dtype == q8.SAFETENSORS_FP8) if expected_fp8 else not dtype.startswith("F8_"):
        return
    where, module = ckpt.file_of(name), q8.module_of(name)
    if expected_fp8:
        raise UserError(f"{where}: tensor {name!r} is {dtype}, but quantization_config quantizes "
                        f"{module!r} (expected {q8.SAFETENSORS_FP8} with {read.scale.name!r}; list the module in "
                        f"its ignore list if it stays unquantized)")
    if scheme is None:
        why = "config.json has no quantization_config"
    elif scheme.ignored(module):
        why = f"quantization_config's ignore list names {module!r}"
    else:
        why = "only the Linear weights a quantization_config quantizes may be fp8"
    raise UserError(f"{where}: tensor {name!r} is stored in fp8 ({dtype}), but {why}")


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


def scale_parameter(name: str) -> str:
    """The model's row-scale parameter beside an fp8 weight parameter (``...weight_scale``,
    ``...experts.gate_up_proj_scale``)."""
    return name + "_scale"


def read_float32_into(out: np.ndarray, part: Part) -> None:
    """``part``'s values into float32 ``out`` (any strides): floats widened as ``read_into`` does,
    an fp8 weight decoded exactly (``glm_fused.quantization.decode_into``)."""
    if part.scale is None:
        part.source.read_into(out, part.name, part.index)
        return
    scale = part.scale.source.read(part.scale.name, part.scale.index)
    q8.decode_into(out, part.source.view(part.name, part.index), scale, part.block, part.offset)


def iter_rank_plan(ckpt: Checkpoint, config: Glm4MoeConfig, shard: TPShard,
                   progress: bool = False) -> Iterator[tuple[str, _Param]]:
    """Yield ``(parameter name, its plan)`` for every parameter of this rank, after ``validate``.

    A plan's ``parts`` say which slice of which checkpoint tensor lands where in the parameter
    (``Part``); nothing is read here. ``progress``: a bar over the bytes of the parts, advanced
    as each parameter is handed back done.
    """
    params = validate(ckpt, config, shard)
    mtp = [n for n in ckpt.names if _is_mtp(n, config)]
    if mtp and progress:
        logger.info("skipping %d tensors of the MTP block (layer %d): used only for speculative decoding",
                    len(mtp), config.num_hidden_layers)
    bar = _progress(sum(part.nbytes for p in params.values() for part in p.parts)) if progress else None
    for name, p in params.items():
        yield name, p
        if bar is not None:
            bar.update(sum(part.nbytes for part in p.parts))
    if bar is not None:
        bar.close()


def _progress(total_bytes: int):
    try:
        from tqdm import tqdm
    except ImportError:  # progress is a nicety, never a requirement
        return None
    return tqdm(total=total_bytes, desc="loading weights", unit="B", unit_scale=True, unit_divisor=1024,
                dynamic_ncols=True)


def _check_scale(read: Part) -> None:
    """fp8 scales must be finite and not negative: a NaN or infinite one would serve NaN or
    garbage without a word. One per row or per block, so reading them twice costs little."""
    values = read.source.read(read.name, read.index)
    bad = values[~(np.isfinite(values) & (values >= 0))]
    if bad.size:
        more = f" (and {bad.size - 1} more bad values)" if bad.size > 1 else ""
        raise UserError(f"{read.source.path}: fp8 scale {read.name!r} holds {float(bad[0]):g}{more}; scales "
                        f"must be finite and not negative")


def load_rank_weights(model_dir: str | Path, config: Glm4MoeConfig, shard: TPShard,
                      shapes: dict[str, tuple[int, ...]], write, progress: bool = False,
                      fp8: set[str] = frozenset()) -> int:
    """Hand this rank's plan, parameter by parameter, to ``write(name, parts)``, strictly; return
    the bytes of checkpoint data the parts read (as stored).

    ``shapes`` are the model's own parameters (name -> shape on this rank): every one must be
    written exactly once, with its shape, and the plan may name no other. ``write`` copies each
    ``Part`` into the parameter (see ``Part``). ``fp8``: the parameters the model keeps in fp8;
    ``write`` fills each one's row scales (``scale_parameter``) with it.
    """
    loaded: set[str] = set()
    nbytes = 0
    for name, p in iter_rank_plan(Checkpoint(model_dir), config, shard, progress=progress):
        if name not in shapes:
            raise UserError(f"{model_dir}: the load plan names {name!r}, which the model has no parameter for")
        if name in loaded:
            raise UserError(f"{model_dir}: parameter {name!r} would be loaded twice")
        if tuple(p.shape) != tuple(shapes[name]):
            raise UserError(f"{model_dir}: tensor for {name!r} has shape {list(p.shape)}, "
                            f"the parameter on rank {shard.rank} is {list(shapes[name])}")
        for part in p.parts:
            if part.scale is not None:
                _check_scale(part.scale)
        write(name, p.parts)
        nbytes += sum(part.nbytes for part in p.parts)
        loaded.add(name)
        if name in fp8:
            loaded.add(scale_parameter(name))
    missing = sorted(set(shapes) - loaded)
    if missing:
        raise UserError(f"{model_dir}: no weights loaded for parameter {missing[0]!r}{_and_more(missing)}")
    return nbytes
