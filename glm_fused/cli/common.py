"""What the scripts share: settings from the command line (``EngineArgs``), checked in the
parent process before any rank starts, and the start-up steps every rank takes (``Rank``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from glm_fused.config import Glm4MoeConfig
from glm_fused.engine_args import EngineArgs
from glm_fused.errors import UserError

def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


class Rank:
    """What every rank builds from the resolved settings: backend, process group, config, runner."""

    def __init__(self, args):
        from glm_fused.backends import get_backend

        self.args = args if isinstance(args, EngineArgs) else EngineArgs.from_dict(vars(args) if isinstance(
            args, argparse.Namespace) else args)
        self.backend = get_backend(self.args.backend)
        self.rank, self.world = self.backend.init_distributed()
        self.config = self.args.config()
        self.runner = None

    def build_runner(self):
        from glm_fused.runner import ModelRunner

        self.runner = ModelRunner(self.args, self.config, tp_rank=self.rank, tp_size=self.world)
        return self.runner

    def info(self) -> dict:
        a, runner = self.args, self.runner
        kv = runner.kv
        return {"backend": a.backend, "device": a.device, "tp": self.world, "dtype": a.dtype,
                "weights": runner.weights(),
                "layout": "fused" if a.fused else "unfused", "fusion": runner.fusion_impl(),
                "decode": runner.decode_mode(),
                "max_num_seqs": a.max_num_seqs, "max_model_len": a.max_model_len,
                "max_num_batched_tokens": a.max_num_batched_tokens,
                "kv_cache": {"block_size": kv.block_size, "num_blocks": kv.num_blocks, "num_tokens": kv.num_tokens,
                             "bytes_per_rank": kv.bytes, "sized_by": kv.source,
                             "prefix_caching": a.enable_prefix_caching}}

    def describe(self) -> str:
        """One line of what was chosen, for the start-up log."""
        a, runner = self.args, self.runner
        if not a.fused:
            fusion = "off (--unfused: classic all-reduce layout)"
        else:
            env = runner.comm.kernel_env
            if runner.fusion_impl() == "flashinfer":
                from glm_fused.fused_op.policy import DTYPE_BYTES, size_cap_tokens

                cap = size_cap_tokens(env.sm, self.world, self.config.hidden_size, DTYPE_BYTES.get(a.dtype, 2))
                cap = min(cap, env.workspace_max_tokens)
                fusion = (f"flashinfer (TRT-LLM kernel on sm{env.sm}) for calls up to {cap} tokens "
                          f"(workspace and per-GPU size cap), reference above")
            else:
                why = "--disable-flashinfer-allreduce-fusion" if a.fusion_impl == "reference" else None
                if why is None and env is not None:
                    from glm_fused.fused_op import choose_impl

                    why = env.flashinfer_error or choose_impl(env, dtype=a.dtype, num_tokens=1)[1]
                fusion = "reference (all-reduce + add + RMSNorm" + (f"; {why})" if why else ")")
        backend = a.backend + (f" ({a.backend_reason})" if a.backend_reason else "")
        return (f"backend={backend} device={a.device} tp={self.world} dtype={a.dtype} "
                f"weights={runner.weights()} layout={'fused' if a.fused else 'unfused'} fusion={fusion}; "
                f"{runner.kv.describe()}; prefix caching {'on' if a.enable_prefix_caching else 'off'}; "
                f"max {a.max_num_seqs} sequences, {a.max_num_batched_tokens} tokens per step; "
                f"decode {runner.decode_mode()}")


def load_tokenizer(args):
    """The checkpoint's tokenizer, or None when there is no tokenizer.json (dummy weights
    from a bare config): then only token-id prompts can be served. ``args.chat_template``
    (serve's ``--chat-template``), when set, replaces the checkpoint's template."""
    from glm_fused.tokenizer import Tokenizer

    if args.model_dir is None or not (Path(args.model_dir) / "tokenizer.json").is_file():
        return None
    return Tokenizer(args.model_dir, chat_template=getattr(args, "chat_template", None))


def eos_ids(config: Glm4MoeConfig, tokenizer) -> set[int]:
    ids = set(config.eos_token_id)
    if tokenizer is not None:
        ids |= set(tokenizer.eos_token_ids)
    return ids


def run_main(parser: argparse.ArgumentParser, worker: str, argv=None, extra_checks=None, first_checks=None) -> int:
    """Parse, validate in this process, then run ``worker`` on --tp ranks via the launcher.

    ``first_checks(args)`` runs before the settings are resolved, ``extra_checks(args)`` after.
    The ranks get the namespace with the resolved ``EngineArgs`` fields in it (the script's
    own flags beside them); ``Rank(args)`` takes the settings back out.
    """
    from glm_fused.launcher import launch

    args = parser.parse_args(argv)
    try:
        if first_checks is not None:
            first_checks(args)
        vars(args).update(EngineArgs.from_cli(args).resolve().to_dict())
        if extra_checks is not None:
            extra_checks(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    return launch(worker, vars(args), nprocs=args.tp, device=args.device)
