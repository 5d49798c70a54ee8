"""FP8 weights: what a checkpoint's ``quantization_config`` says, and the e4m3 format on the host.

Framework-free. Three sources of fp8 weights, one form in the model:

* compressed-tensors ``float-quantized`` (the official zai-org/GLM-4.5-Air-FP8): each Linear's
  weight in fp8 e4m3 with one scale per output row (``<module>.weight_scale`` ``[out, 1]``,
  strategy ``channel``) or per block (strategy ``block``, ``block_structure``); activations
  quantized per token at run time; ``ignore`` names the modules kept unquantized (exact names
  or ``re:`` + a regex matched from the start of the name);
* block fp8 (``quant_method: fp8`` with ``weight_block_size``, as DeepSeek-style exports
  write it): ``<module>.weight_scale_inv`` per block; ``modules_to_not_convert`` (or
  ``ignored_layers``) names the unquantized modules;
* ``--quantization fp8`` on a bf16 checkpoint: every decoder Linear quantized at load.

A weight is ``codes * scale`` (the scale multiplies; ``_inv`` in DeepSeek's name notwithstanding,
it is the dequantization factor in every format). In the model an fp8 Linear holds e4m3 codes
``[out, in]`` and one fp32 scale per output row (``glm_fused.model.ops.Fp8Weight``), which is
what ``torch._scaled_mm``'s row-wise scaling and the fused-MoE kernels take: a block-scaled
checkpoint is requantized per row at load where the model keeps fp8 (one more e4m3 rounding;
docs/fp8.md), and decoded exactly where it does not (CPU, Paddle).

Which tensors are fp8 follows the formats' own rules: decoder Linears (attention, dense MLP,
shared and routed experts) unless ignored; ``lm_head`` only in compressed-tensors and unless
ignored (transformers keeps it out of fp8 for ``quant_method: fp8``); routers, embeddings, norms
and biases never (GLM's router is not a Linear in transformers).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from glm_fused.errors import UserError

FP8_DTYPE = "float8_e4m3fn"  # the model's name for e4m3 (torch's, and Paddle's)
FP8_MAX = 448.0              # largest finite e4m3 value
# Quantization's smallest scale numerator: an all-zero row (or token) gets codes 0, not NaN.
AMAX_EPS = 1e-12
SAFETENSORS_FP8 = "F8_E4M3"
SCALE_DTYPES = ("F32", "BF16", "F16")
_DECODER_LINEAR = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(shared_experts\.|experts\.\d+\.)?(gate|up|down)_proj"
    r"|mlp\.experts\.(gate_up|down)_proj)$")


@dataclass(frozen=True)
class Fp8Scheme:
    """How a checkpoint stores its fp8 weights (``source``), or that it is quantized at load."""

    source: str                          # compressed-tensors | fp8 | online
    block: tuple[int, int] | None = None  # scale per (rows, cols) block; None: one per output row
    ignore: tuple[str, ...] = ()         # modules kept unquantized

    @property
    def stored(self) -> bool:
        """Whether the checkpoint itself holds fp8 tensors (not ``--quantization fp8``)."""
        return self.source != "online"

    @property
    def scale_suffix(self) -> str:
        return "_scale_inv" if self.source == "fp8" else "_scale"

    def scale_name(self, weight: str) -> str:
        """``X.weight`` -> ``X.weight_scale`` (or ``_scale_inv``); fused experts ``X`` -> ``X_scale``."""
        return weight + self.scale_suffix

    def ignored(self, module: str) -> bool:
        return any(self._matches(entry, module) for entry in self.ignore)

    def _matches(self, entry: str, module: str) -> bool:
        if entry.startswith("re:"):  # compressed-tensors' regex entries, matched from the start
            return re.match(entry[3:], module) is not None
        if self.source == "compressed-tensors":
            return module == entry
        # transformers' modules_to_not_convert: the name, a prefix or a suffix at a module boundary
        return module == entry or module.startswith(entry + ".") or module.endswith("." + entry)

    def quantized(self, module: str) -> bool:
        """Whether this module's weight is fp8 under the scheme (stored so, or made so at load)."""
        if module == "lm_head":
            return self.source == "compressed-tensors" and not self.ignored(module)
        return bool(_DECODER_LINEAR.match(module)) and not self.ignored(module)

    def describe(self) -> str:
        scales = "one scale per output row" if self.block is None else f"{self.block[0]}x{self.block[1]} block scales"
        where = {"compressed-tensors": "compressed-tensors checkpoint", "fp8": "block-fp8 checkpoint",
                 "online": "quantized at load"}[self.source]
        return f"fp8 e4m3 ({scales}, {where})"


def module_of(tensor: str) -> str:
    """The module a weight tensor belongs to (``X.weight`` -> ``X``; fused experts keep their name)."""
    return tensor.removesuffix(".weight")


def parse(raw, source: str = "config") -> Fp8Scheme | None:
    """``quantization_config`` of a config.json -> the scheme, or None; a UserError names what is off."""
    if raw is None:
        return None
    where = f"{source}: quantization_config"
    if not isinstance(raw, dict):
        raise UserError(f"{where} must be a JSON object")
    method = raw.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(raw, where)
    if method == "fp8":
        return _block_fp8(raw, where)
    raise UserError(f"{where}.quant_method {method!r} is not supported (fp8 checkpoints: 'compressed-tensors' "
                    f"float-quantized, or 'fp8' with weight_block_size)")


def _compressed_tensors(raw: dict, where: str) -> Fp8Scheme:
    fmt = raw.get("format")
    if fmt != "float-quantized":
        raise UserError(f"{where}.format {fmt!r} is not supported (only 'float-quantized': fp8 e4m3 weights)")
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise UserError(f"{where}.config_groups is missing or empty")
    blocks = set()
    for name, group in groups.items():
        at = f"{where}.config_groups.{name}"
        if not isinstance(group, dict):
            raise UserError(f"{at} must be a JSON object")
        targets = group.get("targets")
        if not isinstance(targets, list) or "Linear" not in targets:
            raise UserError(f"{at}.targets {targets!r}: only groups targeting 'Linear' are supported")
        w = group.get("weights")
        if not isinstance(w, dict):
            raise UserError(f"{at}.weights is missing")
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise UserError(f"{at}.weights: type {w.get('type')!r} with {w.get('num_bits')!r} bits is not supported "
                            f"(fp8: type 'float', num_bits 8)")
        if w.get("dynamic", False) is not False or w.get("symmetric", True) is not True:
            raise UserError(f"{at}.weights: only static symmetric weight scales are supported")
        strategy = w.get("strategy")
        if strategy == "channel":
            blocks.add(None)
        elif strategy == "block":
            blocks.add(_block_size(w.get("block_structure"), f"{at}.weights.block_structure"))
        else:
            raise UserError(f"{at}.weights.strategy {strategy!r} is not supported (channel or block)")
        acts = group.get("input_activations")
        if (not isinstance(acts, dict) or acts.get("dynamic") is not True
                or acts.get("strategy") not in ("token", "group") or acts.get("type", "float") != "float"
                or acts.get("num_bits", 8) != 8 or acts.get("symmetric", True) is not True):
            raise UserError(f"{at}.input_activations must be dynamic symmetric per-token (or per-group) fp8: "
                            f"activations are quantized per token at run time; static or other activation schemes are "
                            f"not supported")
    if len(blocks) > 1:
        raise UserError(f"{where}.config_groups: the groups use different weight strategies; one is supported")
    return Fp8Scheme("compressed-tensors", blocks.pop(), _names(raw.get("ignore"), f"{where}.ignore"))


def _block_fp8(raw: dict, where: str) -> Fp8Scheme:
    if raw.get("activation_scheme", "dynamic") != "dynamic":
        raise UserError(f"{where}.activation_scheme {raw.get('activation_scheme')!r}: only 'dynamic' is supported")
    if raw.get("fmt", "e4m3") != "e4m3":
        raise UserError(f"{where}.fmt {raw.get('fmt')!r}: only 'e4m3' is supported")
    if raw.get("weight_block_size") is None:
        raise UserError(f"{where}: quant_method 'fp8' without weight_block_size (per-tensor scales) is not supported")
    block = _block_size(raw["weight_block_size"], f"{where}.weight_block_size")
    ignore = raw.get("modules_to_not_convert")
    ignore = raw.get("ignored_layers") if ignore is None else ignore
    return Fp8Scheme("fp8", block, _names(ignore, f"{where}.modules_to_not_convert"))


def _block_size(value, where: str) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise UserError(f"{where} {value!r}: expected two positive integers [rows, cols]")
    return int(value[0]), int(value[1])


def _names(value, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UserError(f"{where} must be a list of module names")
    for v in value:
        if v.startswith("re:"):
            try:
                re.compile(v[3:])
            except re.error as exc:
                raise UserError(f"{where}: {v!r} is not a valid regex ({exc})") from None
    return tuple(value)


def scheme_for(config, quantization: str | None) -> Fp8Scheme | None:
    """The scheme a model of ``config`` runs with: the checkpoint's, or ``--quantization fp8``'s."""
    stored = parse(getattr(config, "quantization_config", None))
    if stored is not None or quantization is None:
        return stored
    if quantization != "fp8":
        raise UserError(f"--quantization {quantization!r}: choose fp8")
    return Fp8Scheme("online")


# ---- expected tensors --------------------------------------------------------------------

def scale_shape(scheme: Fp8Scheme, weight_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The scale tensor a stored fp8 weight of ``weight_shape`` comes with (channel scales may
    also be stored with a trailing 1: ``[out, 1]``, as compressed-tensors writes them)."""
    *lead, rows, cols = weight_shape
    if scheme.block is None:
        return (*lead, rows)
    bn, bk = scheme.block
    return (*lead, math.ceil(rows / bn), math.ceil(cols / bk))


# ---- e4m3 on the host ----------------------------------------------------------------------

def _e4m3_table() -> np.ndarray:
    """float32 value of each of the 256 e4m3fn codes: sign, 4 exponent bits (bias 7), 3 mantissa
    bits, subnormals at exponent 0; 0x7f and 0xff are NaN (no infinities)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp, man = (codes >> 3) & 0xF, codes & 0x7
    mag = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    values = (sign * mag).astype(np.float32)
    values[(exp == 15) & (man == 7)] = np.nan
    return values


E4M3_VALUES = _e4m3_table()


def decode_into(out: np.ndarray, codes: np.ndarray, scale: np.ndarray, block: tuple[int, int] | None = None,
                offset: tuple[int, int] = (0, 0)) -> None:
    """Weights ``codes * scale`` into float32 ``out`` (any strides), exactly: every code is a
    float32, and so is its product with a float32 scale, once rounded.

    ``codes``: uint8 e4m3 bits ``[..., rows, cols]``. ``scale``: one per row ``[..., rows]``
    (``block`` None), or the ``block``-sized blocks covering the codes ``[..., nb_rows, nb_cols]``,
    the codes' first element at ``offset`` in its first block (a rank's slice need not start
    on a block boundary).
    """
    np.take(E4M3_VALUES, codes, out=out, mode="wrap")  # codes are < 256: nothing to bound-check
    scale = np.asarray(scale, dtype=np.float32)
    if block is None:
        out *= scale[..., None]
        return
    (bn, bk), (r_off, c_off), (rows, cols) = block, offset, codes.shape[-2:]
    by_column = np.repeat(scale, bk, axis=-1)[..., c_off:c_off + cols]  # [..., nb_rows, cols]
    for j in range(scale.shape[-2]):  # a band of rows per block row: no scale array as large as the codes
        a, b = max(0, j * bn - r_off), min(rows, (j + 1) * bn - r_off)
        out[..., a:b, :] *= by_column[..., j:j + 1, :]
