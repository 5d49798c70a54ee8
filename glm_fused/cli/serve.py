"""``scripts/serve.py``: the OpenAI-compatible server on --tp ranks.

Every rank loads its shard of the model; the ranks then meet in a barrier (the readiness
collective) and only after that does rank 0's ``GET /health`` answer 200. Rank 0 runs the
HTTP server and the engine; the others run each step rank 0 broadcasts.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import time

from glm_fused.cli.common import Rank, add_model_flags, eos_ids, load_tokenizer, run_main, setup_logging
from glm_fused.errors import UserError

logger = logging.getLogger("glm_fused.serve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scripts/serve.py",
        description="OpenAI-compatible server (continuous batching, streaming) for GLM-4.5-Air.")
    add_model_flags(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    g.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: the --model value)")
    return parser


def check_server_flags(args: argparse.Namespace) -> None:
    if not 1 <= args.port <= 65535:
        raise UserError(f"--port {args.port}: must be in 1..65535")
    if args.api_key is not None and not args.api_key.strip():
        raise UserError("--api-key is empty")
    args.served_model_name = args.served_model_name or args.model
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
    return run_main(build_parser(), "glm_fused.cli.serve:worker", argv, extra_checks=check_server_flags)


# ---- every rank --------------------------------------------------------------------------
def worker(args) -> int:
    args = argparse.Namespace(**args) if isinstance(args, dict) else args
    from glm_fused.launcher import current_rank

    if current_rank() == 0:
        return _serve(args)
    from glm_fused.engine import run_worker

    rank = Rank(args)
    runner = rank.build_runner()
    rank.backend.barrier()
    # Serving: the launcher asks every rank to stop at once; this one waits for rank 0's stop
    # message instead, so that no rank leaves a collective half-done (stragglers still get
    # killed after the launcher's grace period).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    run_worker(runner, rank.backend.broadcast_int64)
    runner.close()
    return 0


def _serve(args: argparse.Namespace) -> int:
    from glm_fused.engine import LLMEngine
    from glm_fused.server import EngineBridge, HttpServer, ServerMetrics, create_app, run_engine_loop

    setup_logging()
    t0 = time.monotonic()
    bridge, metrics, info = EngineBridge(), ServerMetrics(args.served_model_name), {}
    tokenizer = load_tokenizer(args)
    app = create_app(bridge, metrics, model_name=args.served_model_name, tokenizer=tokenizer,
                     max_model_len=args.max_model_len, api_key=args.api_key, info=info)
    http = HttpServer(app, args.host, args.port)
    http.start()  # /health says 503 while the ranks load

    rank = Rank(args)  # imports the backend (which may install its own handlers) and joins the group
    _install_stop_handlers(bridge)
    try:
        logger.info("loading %s (%s) on %d rank(s)...", args.model_name, args.model_dir or "dummy weights",
                    rank.world)
        runner = rank.build_runner()
        rank.backend.barrier()  # every rank has loaded
        broadcast = (lambda a: rank.backend.broadcast_int64(a, src=0)) if rank.world > 1 else None
        engine = LLMEngine(runner, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                           max_num_batched_tokens=args.max_num_batched_tokens, vocab_size=rank.config.vocab_size,
                           eos_token_ids=eos_ids(rank.config, tokenizer), tokenizer=tokenizer, broadcast=broadcast)
        logger.info("%s", rank.describe())
        info.update(rank.info())
        if tokenizer is None:
            logger.info("no tokenizer.json: only token-id prompts on /v1/completions; text output is empty, "
                        "choices[0].token_ids holds the result")
        bridge.engine = engine
        logger.info("ready in %.1f s: serving %r at http://%s:%d/v1 (OpenAI API), /health, /metrics",
                    time.monotonic() - t0, args.served_model_name, args.host, args.port)
        run_engine_loop(engine, bridge, metrics)
        logger.info("stopped: in-flight requests cancelled, every rank told to stop")
        runner.close()
    finally:
        http.stop()
    return 0


def _install_stop_handlers(bridge) -> None:
    """SIGINT/SIGTERM: before the model is ready, stop at once; after, let the engine loop
    cancel what is in flight and stop the other ranks (it polls the flag between steps)."""

    def on_signal(signum, frame):
        if bridge.engine is None:
            raise KeyboardInterrupt
        if not bridge.stop_requested:
            bridge.stop_requested = True
            print(f"\n{signal.Signals(signum).name}: stopping...", file=sys.stderr, flush=True)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
