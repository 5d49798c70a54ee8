"""Flags shared by generate and serve, their validation, and the start-up steps every rank takes.

Everything that can be wrong with the flags is found in the parent process, before any
rank starts, and reported as one line naming the flag (``UserError``).
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import sys
from pathlib import Path

from glm_fused.backends import BACKENDS, DEFAULT_BACKEND
from glm_fused.config import FUSED_KERNEL_TP_SIZES, Glm4MoeConfig
from glm_fused.errors import UserError

DTYPE_NAMES = {"auto": "auto", "float32": "float32", "fp32": "float32",
               "bfloat16": "bfloat16", "bf16": "bfloat16"}
DEFAULT_MAX_NUM_SEQS = 32
DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048

logger = logging.getLogger("glm_fused")


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--model", default="glm-4.5-air-tiny",
                   help="checkpoint directory, Hugging Face name found in the local cache "
                        "(zai-org/GLM-4.5-Air), or glm-4.5-air-tiny (default: made on first use)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    g.add_argument("--backend", choices=sorted(BACKENDS), default=DEFAULT_BACKEND,
                   help=f"tensor framework (default {DEFAULT_BACKEND})")
    g.add_argument("--device", choices=["cpu", "gpu"], default=None,
                   help="default: gpu when one is visible and the backend can use it, else cpu")
    g.add_argument("--dtype", default="auto", choices=sorted(DTYPE_NAMES),
                   help="compute dtype (default auto: bfloat16 on GPU, float32 on CPU)")
    g.add_argument("--load-format", choices=["safetensors", "dummy"], default="safetensors",
                   help="dummy: random weights at the model's real config, no checkpoint needed")
    g.add_argument("--seed", type=int, default=0, help="seed of dummy weights (default 0)")

    g = parser.add_argument_group("engine")
    g.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS,
                   help=f"sequences running at once = KV-cache slots (default {DEFAULT_MAX_NUM_SEQS})")
    g.add_argument("--max-model-len", type=int, default=None,
                   help=f"context limit per sequence, prompt + output = positions of one KV-cache slot "
                        f"(default min({DEFAULT_MAX_MODEL_LEN}, the model's max_position_embeddings))")
    g.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                   help="tokens per forward step (prefill chunk bound; also sizes the fused all-reduce "
                        f"workspace) (default {DEFAULT_MAX_NUM_BATCHED_TOKENS})")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: run decode steps op by op (torch backend on GPU; "
                        "elsewhere there are none anyway)")

    g = parser.add_argument_group("fused all-reduce + residual + RMSNorm")
    g.add_argument("--unfused", action="store_true",
                   help="classic layout: o_proj, MLP/MoE and embedding all-reduce themselves")
    fusion = g.add_mutually_exclusive_group()
    fusion.add_argument("--enable-flashinfer-allreduce-fusion", dest="flashinfer", action="store_const",
                        const=True, default=None,
                        help="use FlashInfer's TRT-LLM kernel for the fused op (needs --device gpu, "
                             "--tp in 2/4/8/16, bfloat16); default: on where it can run")
    fusion.add_argument("--disable-flashinfer-allreduce-fusion", dest="flashinfer", action="store_const",
                        const=False, help="always use the reference fused op (all-reduce, add, RMSNorm)")


def _gpu_visible() -> bool:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def _backend_has_cuda(backend: str) -> bool:
    try:
        if backend == "torch":
            import torch
            return torch.cuda.is_available()
        import paddle
        return paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    except ImportError:
        return False


def resolve_device(args: argparse.Namespace) -> str:
    if args.device is not None:
        if args.device == "gpu" and not _gpu_visible():
            raise UserError("--device gpu: no GPU is visible on this machine")
        if args.device == "gpu" and not _backend_has_cuda(args.backend):
            raise UserError(f"--device gpu: this {args.backend} build has no CUDA support "
                            f"(install a GPU build, or pass --device cpu)")
        return args.device
    return "gpu" if _gpu_visible() and _backend_has_cuda(args.backend) else "cpu"


def prepare(args: argparse.Namespace) -> argparse.Namespace:
    """Validate flags, resolve the model and config, settle defaults; in the parent process.

    Adds ``model_dir`` (checkpoint directory or None), ``config_path``, ``model_name``,
    ``fusion`` ("auto" | "reference" | "flashinfer") and fills ``device``, ``dtype``,
    ``max_model_len``. The result travels to every rank.
    """
    from glm_fused.model_path import resolve_model

    if args.tp < 1:
        raise UserError(f"--tp {args.tp}: must be at least 1")
    resolved = resolve_model(args.model, load_format=args.load_format)
    config = Glm4MoeConfig.from_json_file(resolved.config_path)
    config.check_tp(args.tp)
    if args.load_format == "safetensors" and resolved.path is None:
        raise UserError(f"--model {args.model}: no checkpoint found (use --load-format dummy for random weights)")
    args.model_dir = None if resolved.path is None else str(resolved.path)
    args.config_path = str(resolved.config_path)
    args.model_name = resolved.name
    if resolved.path is not None and args.load_format == "safetensors":
        # Headers and names only (milliseconds): a broken checkpoint fails here, before any rank starts.
        from glm_fused.checkpoint import Checkpoint, validate
        from glm_fused.sharding import TPShard

        validate(Checkpoint(resolved.path), config, TPShard(config, 0, args.tp))

    args.device = resolve_device(args)
    dtype = DTYPE_NAMES[args.dtype]
    if dtype == "auto":
        dtype = "bfloat16" if args.device == "gpu" else "float32"
    if dtype == "bfloat16" and args.device == "cpu" and args.backend == "paddle":
        raise UserError("--dtype bfloat16: Paddle has no bfloat16 kernels on CPU "
                        "(use --dtype float32, or --backend torch)")
    args.dtype = dtype

    if args.max_num_seqs < 1:
        raise UserError(f"--max-num-seqs {args.max_num_seqs}: must be at least 1")
    limit = config.max_position_embeddings
    if args.max_model_len is None:
        args.max_model_len = min(DEFAULT_MAX_MODEL_LEN, limit)
    if not 2 <= args.max_model_len <= limit:
        raise UserError(f"--max-model-len {args.max_model_len}: must be in 2..{limit} "
                        f"(the model's max_position_embeddings)")
    if args.max_num_batched_tokens < args.max_num_seqs:
        raise UserError(f"--max-num-batched-tokens {args.max_num_batched_tokens}: must be at least "
                        f"--max-num-seqs {args.max_num_seqs} (every running sequence decodes each step)")

    if args.flashinfer:
        flag = "--enable-flashinfer-allreduce-fusion"
        if args.unfused:
            raise UserError(f"{flag} fuses the all-reduce into the norm: it cannot go with --unfused")
        if args.device != "gpu":
            raise UserError(f"{flag}: FlashInfer's kernel needs --device gpu (this run is on CPU)")
        if args.tp not in FUSED_KERNEL_TP_SIZES:
            raise UserError(f"{flag}: the kernel needs --tp in {', '.join(map(str, FUSED_KERNEL_TP_SIZES))}, "
                            f"not {args.tp}")
        if dtype != "bfloat16":
            raise UserError(f"{flag}: the kernel runs in bfloat16 (got --dtype {dtype})")
    args.fusion = {None: "auto", True: "flashinfer", False: "reference"}[args.flashinfer]
    return args


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


class Rank:
    """What every rank builds from the prepared args: backend, config, runner."""

    def __init__(self, args):
        from glm_fused.backends import get_backend

        self.args = args
        self.backend = get_backend(args.backend)
        self.rank, self.world = self.backend.init_distributed()
        self.config = Glm4MoeConfig.from_json_file(args.config_path)
        self.runner = None

    def build_runner(self):
        a = self.args
        self.runner = self.backend.ModelRunner(
            self.config, a.model_dir, tp_rank=self.rank, tp_size=self.world, dtype=a.dtype,
            fused=not a.unfused, fusion=a.fusion, max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len,
            max_num_batched_tokens=a.max_num_batched_tokens, load_format=a.load_format, seed=a.seed,
            cuda_graph=not a.enforce_eager)
        return self.runner

    def kv_cache_bytes(self) -> int:
        """This rank's KV cache: keys and values, every layer, every slot, every position."""
        c, a = self.config, self.args
        kv_heads = max(1, c.num_key_value_heads // self.world)
        itemsize = 2 if a.dtype == "bfloat16" else 4
        return 2 * c.num_hidden_layers * a.max_num_seqs * a.max_model_len * kv_heads * c.head_dim * itemsize

    def fusion_impl(self) -> str:
        """The fused op's implementation after start-up: flashinfer, reference, or off."""
        if self.args.unfused:
            return "off"
        return "flashinfer" if getattr(getattr(self.runner, "comm", None), "kernel", None) is not None else "reference"

    def decode_mode(self) -> str:
        """How decode steps run: replayed CUDA graphs (with their batch sizes) or eager."""
        graphs = getattr(self.runner, "graphs", None)
        return f"cuda-graphs {graphs.sizes}" if graphs is not None else "eager"

    def info(self) -> dict:
        a = self.args
        return {"backend": a.backend, "device": a.device, "tp": self.world, "dtype": a.dtype,
                "layout": "unfused" if a.unfused else "fused", "fusion": self.fusion_impl(),
                "decode": self.decode_mode(),
                "max_num_seqs": a.max_num_seqs, "max_model_len": a.max_model_len,
                "max_num_batched_tokens": a.max_num_batched_tokens, "kv_cache_bytes_per_rank": self.kv_cache_bytes()}

    def describe(self) -> str:
        """One line of what was chosen, for the start-up log."""
        a, runner = self.args, self.runner
        if a.unfused:
            fusion = "off (--unfused: classic all-reduce layout)"
        else:
            comm = getattr(runner, "comm", None)
            env = getattr(comm, "kernel_env", None)
            if self.fusion_impl() == "flashinfer":
                from glm_fused.fusion import DTYPE_BYTES, size_cap_tokens

                cap = size_cap_tokens(env.sm, self.world, self.config.hidden_size, DTYPE_BYTES.get(a.dtype, 2))
                cap = min(cap, env.workspace_max_tokens)
                fusion = (f"flashinfer (TRT-LLM kernel on sm{env.sm}) for calls up to {cap} tokens "
                          f"(workspace and per-GPU size cap), reference above")
            else:
                why = "--disable-flashinfer-allreduce-fusion" if a.fusion == "reference" else None
                if why is None and env is not None:
                    from glm_fused.fusion import choose_impl

                    why = env.flashinfer_error or choose_impl(env, dtype=a.dtype, num_tokens=1)[1]
                fusion = "reference (all-reduce + add + RMSNorm" + (f"; {why})" if why else ")")
        kv = self.kv_cache_bytes()
        return (f"backend={a.backend} device={a.device} tp={self.world} dtype={a.dtype} "
                f"layout={'unfused' if a.unfused else 'fused'} fusion={fusion}; "
                f"KV cache {a.max_num_seqs} slots x {a.max_model_len} tokens = {kv / 2**20:.1f} MiB per rank; "
                f"max {a.max_num_batched_tokens} tokens per step; decode {self.decode_mode()}")


def load_tokenizer(args):
    """The checkpoint's tokenizer, or None when there is no tokenizer.json (dummy weights
    from a bare config): then only token-id prompts can be served."""
    from glm_fused.tokenizer import Tokenizer

    if args.model_dir is None or not (Path(args.model_dir) / "tokenizer.json").is_file():
        return None
    return Tokenizer(args.model_dir)


def eos_ids(config: Glm4MoeConfig, tokenizer) -> set[int]:
    ids = set(config.eos_token_id)
    if tokenizer is not None:
        ids |= set(tokenizer.eos_token_ids)
    return ids


def run_main(parser: argparse.ArgumentParser, worker: str, argv=None, extra_checks=None) -> int:
    """Parse, validate in this process, then run ``worker`` on --tp ranks via the launcher."""
    from glm_fused.launcher import launch

    args = parser.parse_args(argv)
    try:
        prepare(args)
        if extra_checks is not None:
            extra_checks(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    return launch(worker, vars(args), nprocs=args.tp, device=args.device)
