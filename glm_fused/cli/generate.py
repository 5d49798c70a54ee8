"""``scripts/generate.py``: offline generation, the server's twin.

Same flags for the model and engine, same ``LLMEngine`` and scheduler, same prompt
encoding as ``/v1/completions`` (or ``/v1/chat/completions`` with ``--chat``): greedy output
matches the server's token for token.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from glm_fused.cli.common import Rank, eos_ids, load_tokenizer, run_main, setup_logging
from glm_fused.engine_args import EngineArgs
from glm_fused.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scripts/generate.py",
                                     description="Generate text with GLM-4.5-Air on --tp ranks.")
    EngineArgs.add_cli_args(parser)
    g = parser.add_argument_group("generation")
    g.add_argument("--prompt", action="append", default=None,
                   help="prompt text; repeat for several prompts (run as one batch)")
    g.add_argument("--prompt-ids", action="append", default=None,
                   help="prompt as comma-separated token ids (for checkpoints without a tokenizer)")
    g.add_argument("--chat", action="store_true",
                   help="send each prompt as one user message through the checkpoint's chat template")
    g.add_argument("--no-thinking", action="store_true", help="with --chat: enable_thinking=False")
    g.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = whole vocabulary")
    g.add_argument("--sampling-seed", type=int, default=None, help="seed of the sampler (sampled runs)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt (text, token ids, finish reason) instead of text")
    return parser


def check_generate_flags(args: argparse.Namespace) -> None:
    if not args.prompt and not args.prompt_ids:
        raise UserError("give at least one --prompt (or --prompt-ids)")
    if args.prompt_ids and args.chat:
        raise UserError("--chat renders text messages; it cannot go with --prompt-ids")
    if args.no_thinking and not args.chat:
        raise UserError("--no-thinking applies to --chat prompts only")
    for text in args.prompt_ids or []:
        try:
            ids = [int(t) for t in text.split(",") if t.strip()]
        except ValueError:
            raise UserError(f"--prompt-ids {text!r}: expected comma-separated integers") from None
        if not ids:
            raise UserError("--prompt-ids is empty")
    if args.prompt and (args.model_dir is None or not (Path(args.model_dir) / "tokenizer.json").is_file()):
        raise UserError(f"--prompt: --model {args.model} has no tokenizer.json, so text cannot be encoded "
                        "(use --prompt-ids)")
    from glm_fused.engine import InvalidParam

    try:
        sampling_params(args)
    except InvalidParam as exc:
        flag = {"max_tokens": "--max-new-tokens", "seed": "--sampling-seed"}.get(exc.param, f"--{exc.param.replace('_', '-')}")
        raise UserError(f"{flag}: {exc}") from None


def sampling_params(args):
    from glm_fused.engine import SamplingParams

    return SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sampling_seed, stop=args.stop or [],
                          ignore_eos=args.ignore_eos)


def main(argv=None) -> int:
    return run_main(build_parser(), "glm_fused.cli.generate:worker", argv, extra_checks=check_generate_flags)


def encode_prompts(args, tokenizer) -> list[list[int]]:
    """Token ids exactly as the server makes them for the same request (a text prompt has a
    tokenizer: ``check_generate_flags`` refused it otherwise)."""
    prompts = []
    for text in args.prompt or []:
        if args.chat:
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                     add_generation_prompt=True,
                                                     enable_thinking=not args.no_thinking)
            prompts.append(tokenizer.encode(rendered, add_special_tokens=False))
        else:
            prompts.append(tokenizer.encode(text, add_special_tokens=True))
    for text in args.prompt_ids or []:
        prompts.append([int(t) for t in text.split(",") if t.strip()])
    return prompts


def worker(args) -> int:
    args = argparse.Namespace(**args) if isinstance(args, dict) else args
    from glm_fused.engine import InvalidParam, LLMEngine, run_worker

    rank = Rank(args)
    if rank.rank != 0:
        runner = rank.build_runner()
        run_worker(runner, rank.backend.broadcast_int64)
        runner.close()
        return 0

    setup_logging()
    tokenizer = load_tokenizer(args)
    prompts = encode_prompts(args, tokenizer)
    runner = rank.build_runner()
    broadcast = (lambda a: rank.backend.broadcast_int64(a, src=0)) if rank.world > 1 else None
    engine = LLMEngine(runner, rank.args, vocab_size=rank.config.vocab_size,
                       eos_token_ids=eos_ids(rank.config, tokenizer), tokenizer=tokenizer, broadcast=broadcast)
    print(rank.describe(), file=sys.stderr, flush=True)
    for i, ids in enumerate(prompts):
        try:
            engine.check_prompt(ids, sampling_params(args))
        except InvalidParam as exc:
            engine.stop_workers()  # nothing has run yet: the other ranks can leave cleanly
            flag = "--max-new-tokens" if exc.param == "max_tokens" else "--prompt"
            raise UserError(f"{flag} (prompt {i + 1}): {exc}") from None
    start = time.perf_counter()
    # On an exception mid-step the other ranks may be inside a collective: no stop message
    # then (it would meet the wrong collective); the launcher stops them.
    seqs = engine.generate(prompts, sampling_params(args))
    elapsed = time.perf_counter() - start
    engine.stop_workers()
    runner.close()
    for seq in seqs:
        if args.json:
            print(json.dumps({"text": seq.text, "token_ids": seq.output_token_ids,
                              "finish_reason": seq.finish_reason, "prompt_tokens": seq.prompt_len},
                             ensure_ascii=False))
        else:
            print(seq.text if tokenizer is not None else " ".join(map(str, seq.output_token_ids)))
    generated = sum(len(s.output_token_ids) for s in seqs)
    print(f"{len(seqs)} prompt(s), {generated} tokens in {elapsed:.2f} s ({generated / max(elapsed, 1e-9):.1f} tok/s)",
          file=sys.stderr, flush=True)
    return 0
