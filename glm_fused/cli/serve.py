"""``scripts/serve.py``: the OpenAI-compatible server on --tp ranks.

Every rank loads its shard of the model; the ranks then meet in a barrier (the readiness
collective), exchange their pids (for the engine watchdog's report), and only after that
does rank 0's ``GET /health`` answer 200. Rank 0 runs the HTTP server, its preprocessing
workers and the engine; the others run each step rank 0 broadcasts.
"""

from __future__ import annotations

import argparse
import logging
import re
import signal
import socket
import sys
import time

from glm_fused.cli.common import Rank, eos_ids, load_tokenizer, run_main, setup_logging
from glm_fused.engine_args import EngineArgs
from glm_fused.errors import UserError
from glm_fused.launcher import usable_cpus

logger = logging.getLogger("glm_fused.serve")

DEFAULT_MAX_REQUEST_BODY = "4M"
DEFAULT_WATCHDOG_TIMEOUT_S = 20.0   # below Paddle's fixed 30 s gloo timeout, so the watchdog reports first
DEFAULT_DIST_TIMEOUT_S = 600.0      # covers ranks that finish loading minutes apart
DEFAULT_PREPROCESS_WORKERS = 2
STOP_DRAIN_S = (0.5, 1.5)           # after a stop: keep answering 503 at least / at most this long
                                    # (well inside the launcher's 3 s grace before SIGKILL)
_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]?)(i?b)?\s*$", re.IGNORECASE)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scripts/serve.py",
        description="OpenAI-compatible server (continuous batching, streaming) for GLM-4.5-Air.")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as `vllm serve MODEL` takes it (the same as --model)")
    EngineArgs.add_cli_args(parser)
    g = parser.add_argument_group("OpenAI API")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file to use instead of the checkpoint's")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model call tools on its own (tool_choice auto; needs --tool-call-parser)")
    g.add_argument("--tool-call-parser", choices=["glm45"], default=None,
                   help="read tool calls in the model's output: glm45 (GLM-4.5's <tool_call> format)")
    g.add_argument("--reasoning-parser", choices=["glm45"], default=None,
                   help="split the <think> block into reasoning_content: glm45")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="no log line per request (default: one line each, with status, time and tokens)")
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    g.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: the --model value)")
    g.add_argument("--max-request-body-bytes", default=DEFAULT_MAX_REQUEST_BODY, metavar="SIZE",
                   help="larger request bodies are refused with 413; bytes, or with a K/M/G suffix "
                        f"(powers of 1024) (default {DEFAULT_MAX_REQUEST_BODY})")
    g.add_argument("--preprocess-workers", type=int, default=DEFAULT_PREPROCESS_WORKERS,
                   help="processes that parse, validate, render and tokenize requests, off the engine's "
                        f"process (default {DEFAULT_PREPROCESS_WORKERS}; 0: a thread of rank 0 instead)")
    g.add_argument("--watchdog-timeout", type=float, default=DEFAULT_WATCHDOG_TIMEOUT_S, metavar="SECONDS",
                   help="when an engine step (or the idle ping of the ranks) has not returned after this "
                        "long, /health turns 503, in-flight requests fail and the server exits naming the "
                        f"rank at fault (default {DEFAULT_WATCHDOG_TIMEOUT_S:g})")
    g.add_argument("--dist-timeout", type=float, default=DEFAULT_DIST_TIMEOUT_S, metavar="SECONDS",
                   help="how long a collective may wait for a peer before the rank fails: torch (gloo, NCCL) "
                        "and Paddle NCCL; Paddle's gloo (CPU) keeps its fixed 30 s "
                        f"(default {DEFAULT_DIST_TIMEOUT_S:g})")
    return parser


def parse_size(text: str, flag: str) -> int:
    """``4M`` -> 4194304 (K, M, G are powers of 1024; plain digits are bytes)."""
    m = _SIZE.match(str(text))
    if not m:
        raise UserError(f"{flag} {text}: expected a size such as 4194304, 512K, 4M or 1G")
    return int(m.group(1)) * 1024 ** " kmg".index((m.group(2) or " ").lower())


def check_model_flags(args: argparse.Namespace) -> None:
    """Before the model is resolved: the positional MODEL is --model."""
    if args.model_tag is not None:
        if "--model" in (args.given or []) and args.model != args.model_tag:
            raise UserError(f"the model is given twice: {args.model_tag!r} and --model {args.model}")
        args.model = args.model_tag


def check_server_flags(args: argparse.Namespace) -> None:
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise UserError("--enable-auto-tool-choice needs --tool-call-parser (glm45)")
    if args.chat_template is not None:
        from pathlib import Path

        from glm_fused.tokenizer import Tokenizer

        where = Path(args.chat_template).expanduser()
        if not where.is_file():
            raise UserError(f"--chat-template {args.chat_template}: "
                            f"{'a directory, not a file' if where.is_dir() else 'no such file'}")
        if args.model_dir is None or not (Path(args.model_dir) / "tokenizer.json").is_file():
            raise UserError("--chat-template: this model has no tokenizer.json to go with it")
        tok = Tokenizer(args.model_dir, chat_template=args.chat_template)
        try:
            tok.apply_chat_template([{"role": "user", "content": "hi"}])
        except UserError as exc:
            raise UserError(f"--chat-template {args.chat_template}: {exc}") from None
    if not 1 <= args.port <= 65535:
        raise UserError(f"--port {args.port}: must be in 1..65535")
    if args.api_key is not None and not args.api_key.strip():
        raise UserError("--api-key is empty")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise UserError("--served-model-name is empty")
    args.served_model_name = args.served_model_name or args.model
    args.max_request_body_bytes = parse_size(args.max_request_body_bytes, "--max-request-body-bytes")
    if args.max_request_body_bytes < 1024:
        raise UserError(f"--max-request-body-bytes {args.max_request_body_bytes}: at least 1K, "
                        "or no request would fit")
    cpus = max(DEFAULT_PREPROCESS_WORKERS, usable_cpus())
    if not 0 <= args.preprocess_workers <= cpus:  # each is a process; more than the CPUs only take turns
        raise UserError(f"--preprocess-workers {args.preprocess_workers}: must be in 0..{cpus} "
                        f"(the CPUs this process may use)")
    if not args.watchdog_timeout > 0:
        raise UserError(f"--watchdog-timeout {args.watchdog_timeout:g}: must be positive")
    if not args.dist_timeout > args.watchdog_timeout:
        raise UserError(f"--dist-timeout {args.dist_timeout:g}: must exceed --watchdog-timeout "
                        f"({args.watchdog_timeout:g}), or a collective times out before the watchdog can report")
    # Found now, before any rank loads anything: a busy port or a foreign address.
    try:
        infos = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UserError(f"--host {args.host}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            raise UserError(f"--host {args.host} --port {args.port}: cannot listen there ({exc.strerror})") from None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    given = [a.split("=", 1)[0] for a in argv if a.startswith("--")]

    def first(args):
        args.given = given
        check_model_flags(args)

    return run_main(build_parser(), "glm_fused.cli.serve:worker", argv, extra_checks=check_server_flags,
                    first_checks=first)


# ---- every rank --------------------------------------------------------------------------
def worker(args) -> int:
    args = argparse.Namespace(**args) if isinstance(args, dict) else args
    from glm_fused.launcher import current_rank

    if current_rank() == 0:
        return _serve(args)
    from glm_fused.engine import run_worker
    from glm_fused.server.watchdog import exchange_pids

    rank = _join(args)
    runner = rank.build_runner()
    rank.backend.barrier()
    exchange_pids(rank.backend.broadcast_int64, rank.rank, rank.world)
    # Serving: the launcher asks every rank to stop at once; this one waits for rank 0's stop
    # message instead, so that no rank leaves a collective half-done (stragglers still get
    # killed after the launcher's grace period).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    run_worker(runner, rank.backend.broadcast_int64, barrier=rank.backend.barrier)
    runner.close()
    return 0


def _join(args: argparse.Namespace) -> Rank:
    """Join the process group with the explicit collective timeout, then build the Rank."""
    from glm_fused.backends import get_backend

    get_backend(args.backend).init_distributed(timeout_s=args.dist_timeout)
    return Rank(args)  # its own init_distributed() finds the group joined


def _serve(args: argparse.Namespace) -> int:
    from glm_fused.config import Glm4MoeConfig
    from glm_fused.engine import LLMEngine
    from glm_fused.server.app import EngineBridge, Grammars, HttpServer, create_app, run_engine_loop
    from glm_fused.server.metrics import ServerMetrics
    from glm_fused.server.preprocess_pool import PreprocessPool
    from glm_fused.server.watchdog import EngineWatchdog, exchange_pids

    setup_logging()
    t0 = time.monotonic()
    bridge, metrics, info = EngineBridge(), ServerMetrics(args.served_model_name), {}
    tokenizer = load_tokenizer(args)
    config = Glm4MoeConfig.from_json_file(args.config_path)
    options = {"max_logprobs": args.max_logprobs, "enable_auto_tool_choice": args.enable_auto_tool_choice,
               "tool_call_parser": args.tool_call_parser, "reasoning_parser": args.reasoning_parser}
    # Started once the model is loaded: the context limit may be settled by the KV-cache sizing.
    pool = PreprocessPool({"model_name": args.served_model_name, "vocab_size": config.vocab_size,
                           "options": options, "chat_template": args.chat_template,
                           "tokenizer_dir": args.model_dir if tokenizer is not None else None},
                          workers=args.preprocess_workers, tokenizer=tokenizer)
    grammars = None
    if tokenizer is not None:
        from glm_fused.engine.structured import StructuredOutputs

        grammars = Grammars(lambda: StructuredOutputs(tokenizer, config.vocab_size, eos_ids(config, tokenizer)))
    app = create_app(bridge, metrics, model_name=args.served_model_name, pool=pool,
                     max_model_len=args.max_model_len, api_key=args.api_key, info=info,
                     max_body_bytes=args.max_request_body_bytes, tokenizer=tokenizer, grammars=grammars)
    http = HttpServer(app, args.host, args.port, log_requests=not args.disable_log_requests)
    info["http"] = f"uvicorn ({http.http}, {http.loop})"  # a benchmark's report says what served it
    http.start()  # /health says 503 while the ranks load

    rank = _join(args)  # imports the backend (which may install its own handlers) and joins the group
    _install_stop_handlers(bridge)
    try:
        logger.info("loading %s (%s) on %d rank(s)...", args.model_name, args.model_dir or "dummy weights",
                    rank.world)
        runner = rank.build_runner()
        pool.config["max_model_len"] = rank.args.max_model_len
        pool.start()  # the workers start while the ranks meet
        rank.backend.barrier()  # every rank has loaded
        pids = exchange_pids(rank.backend.broadcast_int64, rank.rank, rank.world)
        multi = rank.world > 1
        engine = LLMEngine(runner, rank.args, vocab_size=rank.config.vocab_size,
                           eos_token_ids=eos_ids(rank.config, tokenizer), tokenizer=tokenizer,
                           broadcast=(lambda a: rank.backend.broadcast_int64(a, src=0)) if multi else None,
                           barrier=rank.backend.barrier if multi else None)
        logger.info("%s", rank.describe())
        info.update(rank.info())
        if tokenizer is None:
            logger.info("no tokenizer.json: only token-id prompts on /v1/completions; text output is empty, "
                        "choices[0].token_ids holds the result")
        watchdog = EngineWatchdog(args.watchdog_timeout, lambda reason: _stalled(reason, bridge, http), pids)
        watchdog.start()
        bridge.engine = engine
        weights = "" if runner.load_stats is None else f", weights loaded at {runner.load_stats} on rank 0"
        host = f"[{args.host}]" if ":" in args.host else args.host  # an IPv6 address, as a URL writes it
        logger.info("ready in %.1f s%s: serving %r at http://%s:%d/v1 (OpenAI API), /health, /metrics; %s",
                    time.monotonic() - t0, weights, args.served_model_name, host, args.port, info["http"])
        run_engine_loop(engine, bridge, metrics, watchdog)
        http.drain(*STOP_DRAIN_S)  # /health keeps saying 503 while the last answers go out
        logger.info("stopped: in-flight requests cancelled, every rank told to stop")
        runner.close()
    finally:
        http.stop()
        pool.close()
    return 0


def _stalled(reason: str, bridge, http) -> None:
    """The watchdog fired: the main thread is stuck in a collective and cannot unwind.
    Fail what is in flight (503 on /health from now on), let those answers out, leave."""
    from glm_fused.launcher import exit_rank_now

    bridge.fail_all(reason)
    http.drain(*STOP_DRAIN_S)
    exit_rank_now(reason)


def _install_stop_handlers(bridge) -> None:
    """SIGINT/SIGTERM: before the model is ready, stop at once; after, let the engine loop
    cancel what is in flight and stop the other ranks (it polls the flag between steps)."""
    from glm_fused.launcher import stop_signal_name

    def on_signal(signum, frame):
        if bridge.engine is None:
            raise KeyboardInterrupt
        if not bridge.stop_requested:
            bridge.stop_requested = True
            print(f"\n{stop_signal_name(signum)}: stopping...", file=sys.stderr, flush=True)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
