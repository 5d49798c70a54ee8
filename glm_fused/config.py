"""GLM-4.5 family configuration, read from a Hugging Face ``config.json``.

Framework-free. Accepts both config forms in the wild:
transformers 4.x (top-level ``rope_theta``, ``partial_rotary_factor``, ``torch_dtype``) and
transformers 5.x (``rope_parameters: {rope_theta, partial_rotary_factor, rope_type}``, ``dtype``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from glm_fused.errors import UserError
from glm_fused.model_path import resolve_model

# Models this code computes; anything else is refused by name rather than run wrongly.
SUPPORTED_MODEL_TYPES = ("glm4_moe",)
SUPPORTED_ROPE_TYPES = ("default", None)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON's true is not a size


def _is_real(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


# (fields, test, what the message says they must be): config.json is the user's file, so a
# value of the wrong kind is named here rather than failing later inside the model.
_FIELD_KINDS = (
    (("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
      "num_attention_heads", "num_key_value_heads", "head_dim", "n_routed_experts", "num_experts_per_tok",
      "n_group", "topk_group", "max_position_embeddings"),
     lambda v: _is_int(v) and v > 0, "a positive integer"),
    (("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers"),
     lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
    (("pad_token_id",), lambda v: v is None or (_is_int(v) and v >= 0), "a token id or null"),
    (("rope_theta", "rms_norm_eps", "routed_scaling_factor"), lambda v: _is_real(v) and v > 0,
     "a positive number"),
    (("partial_rotary_factor",), _is_real, "a number"),
    (("norm_topk_prob", "use_qk_norm", "attention_bias", "tie_word_embeddings"),
     lambda v: isinstance(v, bool) or (_is_int(v) and v in (0, 1)), "true or false"),
)


@dataclass
class Glm4MoeConfig:
    vocab_size: int = 151552
    hidden_size: int = 4096
    intermediate_size: int = 10944
    moe_intermediate_size: int = 1408
    num_hidden_layers: int = 46
    num_attention_heads: int = 96
    num_key_value_heads: int = 8
    head_dim: int = 128
    partial_rotary_factor: float = 0.5
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 131072
    n_routed_experts: int = 128
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    use_qk_norm: bool = False
    attention_bias: bool = True
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    pad_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    dtype: str = "bfloat16"  # the checkpoint's stored dtype
    model_type: str = "glm4_moe"
    # As the checkpoint's config.json has it (fp8 checkpoints); glm_fused.quantization reads it.
    quantization_config: dict | None = None

    # ---- derived sizes -------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace

    def num_parameters(self) -> tuple[int, int]:
        """(routed experts' parameters, all the others) of the layers served: the MTP block,
        which is never loaded, left out. For messages about memory."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attention = h * q + 2 * h * kv + q * h + (q + 2 * kv) * self.attention_bias + 2 * d * self.use_qk_norm
        moe_layers = sum(map(self.is_moe_layer, range(self.num_hidden_layers)))
        dense_layers = self.num_hidden_layers - moe_layers
        experts = moe_layers * self.n_routed_experts * 3 * h * self.moe_intermediate_size
        per_moe = 3 * h * self.shared_intermediate_size + self.n_routed_experts * (h + 1)  # shared expert, router
        others = (self.num_hidden_layers * (attention + 2 * h) + dense_layers * 3 * h * self.intermediate_size
                  + moe_layers * per_moe + self.vocab_size * h * (1 + (not self.tie_word_embeddings)) + h)
        return experts, others

    # ---- reading -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> "Glm4MoeConfig":
        model_type = raw.get("model_type", "glm4_moe")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UserError(f"{source}: model_type {model_type!r} is not supported (expected 'glm4_moe')")
        values = dict(raw)
        rope = values.get("rope_parameters") or {}
        if isinstance(rope, dict):
            # transformers 5 nests RoPE settings; the nested value wins over a stale top-level one.
            for key in ("rope_theta", "partial_rotary_factor"):
                if key in rope:
                    values[key] = rope[key]
            rope_type = rope.get("rope_type")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise UserError(f"{source}: rope_parameters.rope_type {rope_type!r} is not supported")
        scaling = values.get("rope_scaling")
        if scaling:
            raise UserError(f"{source}: rope_scaling {scaling!r} is not supported (GLM-4.5 uses none)")
        if "dtype" not in values and "torch_dtype" in values:
            values["dtype"] = values["torch_dtype"]
        if values.get("head_dim") is None:
            values["head_dim"] = values.get("hidden_size", cls.hidden_size) // values.get(
                "num_attention_heads", cls.num_attention_heads)
        eos = values.get("eos_token_id")
        values["eos_token_id"] = [] if eos is None else [eos] if _is_int(eos) else eos  # _check: a list of ids
        if values.get("hidden_act", "silu") != "silu":
            raise UserError(f"{source}: hidden_act {values['hidden_act']!r} is not supported (expected 'silu')")
        known = {f.name for f in fields(cls)}
        config = cls(**{k: v for k, v in values.items() if k in known})
        config._check(source)
        return config

    @classmethod
    def from_json_file(cls, path: str | Path) -> "Glm4MoeConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(f"{path}: config file not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise UserError(f"{path}: expected a JSON object")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_pretrained(cls, model: str | Path, *, revision: str | None = None) -> "Glm4MoeConfig":
        """The config of what ``--model`` names: a checkpoint directory, the tiny default, or a
        Hugging Face name (its local cache entry, else the config shipped for GLM-4.5's models)."""
        where = Path(model).expanduser()
        if isinstance(model, Path) or where.is_dir():
            return cls.from_json_file(where / "config.json")
        return cls.from_json_file(resolve_model(str(model), load_format="dummy", revision=revision).config_path)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_hf_dict(self, form: int = 5) -> dict:
        """The config as transformers writes it (form 4 or 5), for tests and tools."""
        out = {k: v for k, v in asdict(self).items() if k not in ("dtype", "rope_theta", "partial_rotary_factor")}
        if out["quantization_config"] is None:  # transformers takes any quantization_config key for one
            del out["quantization_config"]
        out["architectures"] = ["Glm4MoeForCausalLM"]
        if form == 4:
            out.update(rope_theta=self.rope_theta, partial_rotary_factor=self.partial_rotary_factor,
                       torch_dtype=self.dtype, rope_scaling=None)
        else:
            out.update(rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta,
                                        "partial_rotary_factor": self.partial_rotary_factor},
                       dtype=self.dtype)
        return out

    # ---- checks --------------------------------------------------------------------
    def _check(self, source: str) -> None:
        def bad(name: str, why: str) -> UserError:
            return UserError(f"{source}: {name}={getattr(self, name)!r} {why}")

        # Types first: every check after these, and the model, compute with the values.
        for names, ok, what in _FIELD_KINDS:
            for name in names:
                if not ok(getattr(self, name)):
                    raise bad(name, f"must be {what}")
        if not isinstance(self.eos_token_id, list) or not all(_is_int(t) and t >= 0 for t in self.eos_token_id):
            raise UserError(f"{source}: eos_token_id={self.eos_token_id!r} must be a token id or a list of them")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad("num_attention_heads", f"is not a multiple of num_key_value_heads={self.num_key_value_heads}")
        if self.n_routed_experts % self.n_group:
            raise bad("n_routed_experts", f"is not a multiple of n_group={self.n_group}")
        if self.topk_group > self.n_group:
            raise bad("topk_group", f"exceeds n_group={self.n_group}")
        if self.n_routed_experts // self.n_group < 2 and self.n_group > 1:
            raise bad("n_group", "leaves fewer than 2 experts per group (group score sums the top 2)")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise bad("num_experts_per_tok", "exceeds the experts left after group selection")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise bad("partial_rotary_factor", f"gives an odd or empty rotary_dim={self.rotary_dim}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise bad("first_k_dense_replace", f"is outside 0..num_hidden_layers={self.num_hidden_layers}")
        if self.tie_word_embeddings:
            raise bad("tie_word_embeddings", "is not supported (GLM-4.5 keeps a separate lm_head)")
        from glm_fused.quantization import parse

        parse(self.quantization_config, source)  # a format this code cannot read fails here, by name

    def check_tp(self, tp: int, flag: str = "--tp") -> None:
        """Refuse a tensor-parallel size that does not divide what it must, naming the value."""
        if not isinstance(tp, int) or tp < 1:
            raise UserError(f"{flag} {tp!r}: must be a positive integer")
        if tp == 1:
            return
        needs = {
            "num_attention_heads": self.num_attention_heads,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "vocab_size": self.vocab_size,
        }
        for name, value in needs.items():
            if value % tp:
                raise UserError(f"{flag} {tp}: {name}={value} is not divisible by {tp}")
        kv = self.num_key_value_heads
        # KV heads split when tp <= kv, else each is replicated on tp // kv ranks.
        if (tp <= kv and kv % tp) or (tp > kv and tp % kv):
            raise UserError(f"{flag} {tp}: num_key_value_heads={kv} can be neither split nor replicated "
                            f"evenly over {tp} ranks")
