"""``EngineArgs``: every model and engine setting, from the command line, validated once.

The scripts build it from their flags (``add_cli_args`` / ``from_cli``) and call ``resolve()``
in the parent process, before any rank starts: everything that can be wrong with the flags
is found there and reported as one line naming the flag (``UserError``). The resolved object
travels whole to every rank (``to_dict`` / ``from_dict``) and is handed as is to the model
runner, the engine and the scheduler; none of them checks a flag again.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
from dataclasses import dataclass, fields

from glm_fused.errors import UserError
from glm_fused.fused_op import FUSION_IMPLS, KERNEL_TP_SIZES

DTYPE_NAMES = {"auto": "auto", "float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
LOAD_FORMATS = ("safetensors", "dummy")
QUANTIZATIONS = ("fp8",)
BACKENDS = ("paddle", "torch")
BACKEND_CHOICES = ("auto", *BACKENDS)
DEFAULT_MAX_LOGPROBS = 20  # vLLM's default
DEFAULT_MAX_NUM_SEQS = 32
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_BLOCK_SIZE = 16
BLOCK_SIZES = tuple(2**i for i in range(9))  # 1 .. 256: powers of two (the kernels shift, not divide)
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


@dataclass
class EngineArgs:
    # the model
    model: str = "glm-4.5-air-tiny"
    revision: str | None = None        # a snapshot of a Hugging Face cache entry (branch, tag, commit)
    tp: int = 1
    backend: str = "auto"              # auto: Paddle where it can use the device, else torch
    device: str | None = None          # cpu | gpu; None: gpu when one is visible
    dtype: str = "auto"                # auto: bfloat16 on GPU, float32 on CPU
    load_format: str = "safetensors"
    seed: int = 0                      # the global seed: dummy weights, and unseeded requests' sampling
    quantization: str | None = None    # fp8: quantize a bf16 checkpoint at load; resolved: fp8 when the weights are
    # the engine
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_model_len: int | None = None   # None: the model's limit where the KV cache holds it (settled by
                                       # the ModelRunner once it has sized the cache)
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    enforce_eager: bool = False
    # the paged KV cache (glm_fused.kv_cache, glm_fused.engine.block_manager)
    block_size: int = DEFAULT_BLOCK_SIZE
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # most top logprobs a request may ask for
    # the fused all-reduce + residual + RMSNorm
    fused: bool = True                 # False: the classic all-reduce layout (--unfused)
    fusion_impl: str = "auto"          # auto | flashinfer | reference (glm_fused.fused_op)
    # filled by resolve()
    model_dir: str | None = None       # checkpoint directory; None for dummy weights from a bare config
    config_path: str | None = None
    model_name: str | None = None      # what to call the model in output
    backend_reason: str = ""           # why --backend auto chose what it did ("" when named)
    resolved: bool = False
    # filled by the ModelRunner: blocks in every rank's KV cache (then max_model_len is set too)
    num_kv_blocks: int | None = None

    # ---- the command line ----------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        d = EngineArgs()
        g = parser.add_argument_group("model")
        g.add_argument("--model", default=d.model,
                       help="checkpoint directory, Hugging Face name found in the local cache "
                            "(zai-org/GLM-4.5-Air), or glm-4.5-air-tiny (default: made on first use)")
        g.add_argument("--revision", default=None,
                       help="which snapshot of a Hugging Face cache entry: a branch, tag or commit (default main)")
        g.add_argument("--tp", "--tensor-parallel-size", "-tp", dest="tp", type=int, default=d.tp,
                       help="tensor-parallel ranks (default 1)")
        g.add_argument("--backend", choices=BACKEND_CHOICES, default=d.backend,
                       help="tensor framework (default auto: Paddle wherever it can use the device, the CPU "
                            "always; torch where only torch can use the GPU)")
        g.add_argument("--device", choices=["cpu", "gpu"], default=None,
                       help="default: gpu when one is visible (refused if no installed framework can use it), "
                            "else cpu")
        g.add_argument("--dtype", default=d.dtype, choices=sorted(DTYPE_NAMES),
                       help="compute dtype (default auto: bfloat16 on GPU, float32 on CPU)")
        g.add_argument("--load-format", choices=LOAD_FORMATS, default=d.load_format,
                       help="dummy: random weights at the model's real config, no checkpoint needed")
        g.add_argument("--seed", type=int, default=d.seed,
                       help="global seed: dummy weights, and the sampling of requests that bring no seed "
                            "(derived from it and the request's arrival number) (default 0)")
        g.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                       help="fp8: e4m3 weights with one scale per output row, quantized at load from a bf16 "
                            "checkpoint (an fp8 checkpoint, e.g. GLM-4.5-Air-FP8, is fp8 without it; with "
                            "--load-format dummy: random fp8 weights)")

        g = parser.add_argument_group("engine")
        g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                       help=f"sequences running at once (default {d.max_num_seqs})")
        g.add_argument("--max-model-len", type=int, default=None,
                       help="context limit per sequence, prompt + output (default: the model's "
                            "max_position_embeddings where the KV cache holds one such sequence, "
                            "else the most it holds)")
        g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                       help="tokens per forward step (prefill chunk bound; also sizes the fused all-reduce "
                            f"workspace) (default {d.max_num_batched_tokens})")
        g.add_argument("--enforce-eager", action="store_true",
                       help="no CUDA graphs: run decode steps op by op (torch backend on GPU; "
                            "elsewhere there are none anyway)")
        g.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                       help=f"most top logprobs a request may ask for (logprobs, top_logprobs) "
                            f"(default {d.max_logprobs})")

        g = parser.add_argument_group("KV cache")
        g.add_argument("--block-size", type=int, default=d.block_size,
                       help=f"tokens per KV-cache block, a power of two up to {BLOCK_SIZES[-1]} "
                            f"(default {d.block_size})")
        g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                       help="fraction of each GPU's memory this server may use; the KV cache gets what the weights "
                            f"and a profiled peak forward leave of it (default {d.gpu_memory_utilization})")
        g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                       help="exactly this many KV-cache blocks per rank, instead of sizing from memory "
                            "(CPU default: room for --max-num-seqs sequences of --max-model-len, at most 4 GiB)")
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=d.enable_prefix_caching,
                       help="reuse the cached blocks of a prompt's leading full blocks across requests "
                            "(default on; --no-enable-prefix-caching turns it off)")

        g = parser.add_argument_group("fused all-reduce + residual + RMSNorm")
        g.add_argument("--unfused", dest="fused", action="store_false",
                       help="classic layout: o_proj, MLP/MoE and embedding all-reduce themselves")
        impl = g.add_mutually_exclusive_group()
        impl.add_argument("--enable-flashinfer-allreduce-fusion", dest="fusion_impl", action="store_const",
                          const="flashinfer", default="auto",
                          help="use FlashInfer's TRT-LLM kernel for the fused op (needs --device gpu, "
                               f"--tp in {'/'.join(map(str, KERNEL_TP_SIZES))}, bfloat16); default: on where it "
                               "can run")
        impl.add_argument("--disable-flashinfer-allreduce-fusion", dest="fusion_impl", action="store_const",
                          const="reference", help="always use the reference fused op (all-reduce, add, RMSNorm)")

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls.from_dict(vars(args))

    @classmethod
    def from_dict(cls, values: dict) -> "EngineArgs":
        """The settings among ``values`` (other keys, a script's own flags, are ignored)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # ---- validation, once ------------------------------------------------------------------
    def resolve(self) -> "EngineArgs":
        """Validate every setting, find the model, settle the defaults; raises ``UserError``."""
        from glm_fused.config import Glm4MoeConfig
        from glm_fused.model_path import resolve_model

        if self.resolved:
            return self
        if self.backend not in BACKEND_CHOICES:
            raise UserError(f"--backend {self.backend!r}: choose one of {', '.join(BACKEND_CHOICES)}")
        if not 0 <= self.seed < 2**63:
            raise UserError(f"--seed {self.seed}: must be in [0, 2**63)")
        if self.max_logprobs < 0:
            raise UserError(f"--max-logprobs {self.max_logprobs}: must be 0 or more")
        if self.tp < 1:
            raise UserError(f"--tp {self.tp}: must be at least 1")
        if self.load_format not in LOAD_FORMATS:
            raise UserError(f"--load-format {self.load_format!r}: choose one of {', '.join(LOAD_FORMATS)}")
        if self.fusion_impl not in FUSION_IMPLS:  # only a caller of the API can get here
            raise UserError(f"fusion_impl {self.fusion_impl!r}: choose one of {', '.join(FUSION_IMPLS)}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise UserError(f"--quantization {self.quantization!r}: choose one of {', '.join(QUANTIZATIONS)}")
        found = resolve_model(self.model, load_format=self.load_format, revision=self.revision)
        config = Glm4MoeConfig.from_json_file(found.config_path)
        config.check_tp(self.tp)
        from glm_fused.checkpoint import fp8_parameters
        from glm_fused.quantization import scheme_for

        scheme = scheme_for(config, self.quantization)
        fp8_parameters(config, scheme)  # a scheme that splits a matmul fails here, by name
        self.quantization = None if scheme is None else "fp8"
        if self.load_format == "safetensors" and found.path is None:
            raise UserError(f"--model {self.model}: no checkpoint found (use --load-format dummy for random weights)")
        self.model_dir = None if found.path is None else str(found.path)
        self.config_path, self.model_name = str(found.config_path), found.name
        if found.path is not None and self.load_format == "safetensors":
            # Headers and names only (milliseconds): a broken checkpoint fails here, before any rank starts.
            from glm_fused.checkpoint import Checkpoint, validate
            from glm_fused.sharding import TPShard

            validate(Checkpoint(found.path), config, TPShard(config, 0, self.tp))

        self.backend, self.device, self.backend_reason = self._resolve_backend_and_device()
        if self.dtype not in DTYPE_NAMES:
            raise UserError(f"--dtype {self.dtype!r}: choose one of {', '.join(sorted(DTYPE_NAMES))}")
        dtype = DTYPE_NAMES[self.dtype]
        if dtype == "auto":
            dtype = "bfloat16" if self.device == "gpu" else "float32"
        if dtype == "bfloat16" and self.device == "cpu" and self.backend == "paddle":
            raise UserError("--dtype bfloat16: Paddle has no bfloat16 kernels on CPU "
                            "(use --dtype float32, or --backend torch)")
        self.dtype = dtype

        if self.max_num_seqs < 1:
            raise UserError(f"--max-num-seqs {self.max_num_seqs}: must be at least 1")
        limit = config.max_position_embeddings
        if self.max_model_len is not None and not 2 <= self.max_model_len <= limit:
            raise UserError(f"--max-model-len {self.max_model_len}: must be in 2..{limit} "
                            f"(the model's max_position_embeddings)")
        if self.block_size not in BLOCK_SIZES:
            raise UserError(f"--block-size {self.block_size}: choose a power of two up to {BLOCK_SIZES[-1]}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise UserError(f"--gpu-memory-utilization {self.gpu_memory_utilization:g}: must be in (0, 1]")
        if self.num_gpu_blocks_override is not None and not 1 <= self.num_gpu_blocks_override < 2**31:
            raise UserError(f"--num-gpu-blocks-override {self.num_gpu_blocks_override}: must be in 1..{2**31 - 1}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise UserError(f"--max-num-batched-tokens {self.max_num_batched_tokens}: must be at least "
                            f"--max-num-seqs {self.max_num_seqs} (every running sequence decodes each step)")

        if self.fusion_impl == "flashinfer":
            flag = "--enable-flashinfer-allreduce-fusion"
            if not self.fused:
                raise UserError(f"{flag} fuses the all-reduce into the norm: it cannot go with --unfused")
            if self.device != "gpu":
                raise UserError(f"{flag}: FlashInfer's kernel needs --device gpu (this run is on CPU)")
            if self.tp not in KERNEL_TP_SIZES:
                raise UserError(f"{flag}: the kernel needs --tp in {', '.join(map(str, KERNEL_TP_SIZES))}, "
                                f"not {self.tp}")
            if dtype != "bfloat16":
                raise UserError(f"{flag}: the kernel runs in bfloat16 (got --dtype {dtype})")
        self.resolved = True
        return self

    def _resolve_backend_and_device(self) -> tuple[str, str, str]:
        """``(backend, device, why)``. A visible GPU is used unless ``--device cpu`` says
        otherwise: never a silent fall back to the CPU."""
        if self.device is not None and self.device not in ("cpu", "gpu"):
            raise UserError(f"--device {self.device!r}: choose cpu or gpu")
        if self.device == "gpu" and not gpu_visible():
            raise UserError("--device gpu: no GPU is visible on this machine")
        want_gpu = self.device == "gpu" or (self.device is None and gpu_visible())
        if not want_gpu:
            return ("paddle", "cpu", "auto: Paddle runs on the CPU") if self.backend == "auto" else \
                (self.backend, "cpu", "")
        how = "--device gpu" if self.device == "gpu" else "a GPU is visible"
        if self.backend == "auto":
            if backend_has_cuda("paddle"):
                return "paddle", "gpu", "auto: Paddle can use the GPU"
            if backend_has_cuda("torch"):
                return "torch", "gpu", "auto: only torch can use the GPU (this Paddle build has no CUDA)"
            raise UserError(f"{how}, but neither Paddle nor torch as installed can use it (install a CUDA "
                            f"build of torch: pip install -e '.[torch]'), or pass --device cpu to run on the CPU")
        if not backend_has_cuda(self.backend):
            other = "torch" if self.backend == "paddle" else "paddle"
            raise UserError(f"--backend {self.backend}: {how}, but this {self.backend} build cannot use it "
                            f"(no CUDA support); use --backend {other} or auto, or pass --device cpu to run on "
                            f"the CPU")
        return self.backend, "gpu", ""

    def slot_blocks(self) -> int:
        """Blocks for ``max_num_seqs`` sequences of ``max_model_len``: what a tool that drives the
        runner with one fixed slot per sequence passes as ``num_gpu_blocks_override``
        (``glm_fused.batch.slot_block_tables``)."""
        return self.max_num_seqs * -(-self.max_model_len // self.block_size)

    def config(self):
        """The model's config (after ``resolve``)."""
        from glm_fused.config import Glm4MoeConfig

        return Glm4MoeConfig.from_json_file(self.config_path)


def gpu_visible() -> bool:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def backend_has_cuda(backend: str) -> bool:
    try:
        if backend == "torch":
            import torch
            return torch.cuda.is_available()
        import paddle
        return paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    except ImportError:
        return False

