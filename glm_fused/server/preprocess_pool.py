"""Request preprocessing in worker processes, and rank 0's async client of them.

Why processes: parsing, validation, the chat template and tokenization hold the
interpreter lock while they run (seconds per MB of text), so a thread pool in rank 0 would
still stall the engine loop and ``/health``. A worker is a fresh interpreter
(``python -m glm_fused.server.preprocess_pool``), not a fork: rank 0 has framework threads
running by then. It loads the tokenizer, says it is ready, then answers one request at a
time over a pair of pipes. A frame is an 8-byte length and that many bytes; a request is a
JSON header frame and the body; an answer is a JSON header frame and the token ids (int64).

A completion whose prompt is token ids, in a body of at most ``INLINE_MAX_BYTES``, is prepared
on rank 0's event loop instead: its work is parsing and checks (0.4 ms for 2,080 ids), less
than a round trip to a worker costs (0.8 ms on an H200 host: two thread hand-offs, two pipe
writes, a process wake-up), and its time to first token carries that round trip. A text
prompt always goes to a worker: tokenizing it is the costly part.

On rank 0 each worker has a thread that takes jobs from a shared queue, writes them to its
pipe and waits for the answer (pipe I/O releases the interpreter lock). A worker that dies
(killed, out of memory) is started again and the job tried once more on the new one; a job
that kills that one too, or runs past ``JOB_TIMEOUT_S``, gets a 500. A worker still busy for
a client that hung up more than ``ABANDONED_KILL_S`` ago is restarted. Workers die with their parent (``PR_SET_PDEATHSIG``) and ignore SIGINT
(a Ctrl-C meant for the server reaches its whole process group).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import io
import json
import logging
import os
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from glm_fused.server.errors import ApiError
from glm_fused.server.preprocess import Prepared, RequestPreprocessor

logger = logging.getLogger("glm_fused.server")

JOB_TIMEOUT_S = 120.0      # one request's preprocessing, at most
ABANDONED_KILL_S = 2.0     # a job whose client left is cut short after this long
START_TIMEOUT_S = 120.0    # a worker's start-up (imports, tokenizer)
INLINE_MAX_BYTES = 64 << 10  # token-id completions up to this size are prepared in place (~2 ms at most)
_POLL_S = 0.25
_HEADER = struct.Struct("<Q")
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def make_preprocessor(config: dict, tokenizer=None) -> RequestPreprocessor:
    """The preprocessor a worker runs; ``config``: model_name, max_model_len, vocab_size,
    tokenizer_dir (None: token-id prompts only), chat_template (a file replacing the
    checkpoint's, or None) and options (``RequestPreprocessor``'s). ``tokenizer``: one already
    loaded from that directory and template (rank 0's), instead of loading it again."""
    if tokenizer is None and config.get("tokenizer_dir"):
        from glm_fused.tokenizer import Tokenizer

        tokenizer = Tokenizer(config["tokenizer_dir"], chat_template=config.get("chat_template"))
    return RequestPreprocessor(model_name=config["model_name"], max_model_len=config["max_model_len"],
                               vocab_size=config.get("vocab_size"), tokenizer=tokenizer,
                               options=config.get("options"))


# ---- frames ------------------------------------------------------------------------------
def _write_frame(f: io.FileIO, data: bytes) -> None:
    for part in (_HEADER.pack(len(data)), data):
        view = memoryview(part)
        while view:
            view = view[f.write(view):]


def _read_exact(f: io.FileIO, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = f.readinto(view[got:])
        if not k:
            raise EOFError("the other end closed the pipe")
        got += k
    return bytes(buf)


def _read_frame(f: io.FileIO) -> bytes:
    (n,) = _HEADER.unpack(_read_exact(f, _HEADER.size))
    return _read_exact(f, n)


# ---- rank 0's side -----------------------------------------------------------------------
class _Job:
    def __init__(self, kind: str, body: bytes):
        self.kind, self.body = kind, body
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.abandoned_at: float | None = None  # set when the waiting request went away


class PreprocessPool:
    """``await pool.prepare(kind, body)`` -> ``Prepared``, or raises ``ApiError``.

    ``workers=0`` runs the preprocessor in a thread of this process instead (tests, and
    anyone who would rather have no extra processes). Token-id completions up to
    ``inline_max_bytes`` are prepared on the calling event loop either way (module docstring).
    """

    def __init__(self, config: dict, workers: int, inline_max_bytes: int = INLINE_MAX_BYTES, tokenizer=None):
        """``tokenizer``: rank 0's, loaded from ``config``'s directory and template, for this
        process's preprocessor (None: it loads its own)."""
        self.config = config  # may be completed until start() (the context limit is settled at load)
        self.tokenizer = tokenizer
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.inline_max_bytes = inline_max_bytes
        self._local = None  # this process's preprocessor: token-id completions; every request if workers=0
        self._workers = [_Worker(self, i) for i in range(workers)]
        self.restarts = 0
        self.started = False

    def start(self) -> None:
        self._local = make_preprocessor(self.config, self.tokenizer)
        for w in self._workers:
            w.thread.start()
        self.started = True

    def close(self) -> None:
        """Stop the workers; also after a start that never came (the model failed to load)."""
        for _ in self._workers:
            self.jobs.put(None)
        for w in self._workers:
            if w.thread.ident is not None:  # started
                w.thread.join(5)
            w.stop()

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers if w.proc is not None and w.proc.poll() is None]

    def prepare_now(self, kind: str, body: bytes) -> Prepared | None:
        """The request prepared here and now if it is a small token-id completion, else None
        (``prepare_in_worker`` then). Raises ``ApiError`` as ``prepare`` does."""
        if not self.started:  # requests are answered 503 until the model is loaded; never here
            raise RuntimeError("the preprocessing pool has not been started")
        if kind == "completion" and len(body) <= self.inline_max_bytes:
            return self._local.prepare_token_ids(body)
        return None

    async def prepare(self, kind: str, body: bytes) -> Prepared:
        prepared = self.prepare_now(kind, body)
        return prepared if prepared is not None else await self.prepare_in_worker(kind, body)

    async def prepare_in_worker(self, kind: str, body: bytes) -> Prepared:
        """``prepare`` for a request ``prepare_now`` declined: in a worker (a thread if workers=0)."""
        if not self._workers:
            return await asyncio.to_thread(self._local.prepare, kind, body)
        job = _Job(kind, body)
        self.jobs.put(job)
        try:
            header, ids = await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            job.abandoned_at = time.monotonic()
            raise
        return Prepared.from_wire(header, ids)


class _Worker:
    """One worker process and the thread that feeds it."""

    def __init__(self, pool: PreprocessPool, index: int):
        self.pool, self.index = pool, index
        self.proc: subprocess.Popen | None = None
        self.to_child: io.FileIO | None = None
        self.from_child: io.FileIO | None = None
        self.thread = threading.Thread(target=self._run, name=f"preprocess-{index}", daemon=True)

    def _run(self) -> None:
        try:
            self._start_process()
        except Exception as exc:  # noqa: BLE001 - reported per job below, retried on the next one
            logger.warning("preprocessing worker %d did not start: %s", self.index, exc)
        while True:
            job = self.pool.jobs.get()
            if job is None:
                return
            if not job.future.set_running_or_notify_cancel():
                continue  # its request was cancelled while queued
            for attempt in (1, 2):
                try:
                    if self.proc is None or self.proc.poll() is not None:
                        self.pool.restarts += self.proc is not None
                        self._start_process()
                    job.future.set_result(self._call(job))
                    break
                except ApiError as exc:
                    job.future.set_exception(exc)
                    break
                except Exception as exc:  # noqa: BLE001 - the worker is gone or wedged: a fresh one
                    self.stop()
                    logger.warning("preprocessing worker %d: %s; starting a new one", self.index, exc)
                    # A worker that died before this job leaves it to the next one; a job that
                    # killed two workers, or took too long, gets a 500.
                    if attempt == 2 or isinstance(exc, TimeoutError):
                        job.future.set_exception(ApiError(500, f"request preprocessing failed: {exc}"))
                        break

    def _start_process(self) -> None:
        self.stop()
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        env.pop("GLM_FUSED_ERROR_FILE", None)  # a rank's report file is not the worker's
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "glm_fused.server.preprocess_pool", "--fds", f"{down_r},{up_w}",
                 "--parent-pid", str(os.getpid()), "--config", json.dumps(self.pool.config)],
                pass_fds=(down_r, up_w), stdin=subprocess.DEVNULL, env=env)
        finally:
            os.close(down_r)
            os.close(up_w)
        self.to_child = io.FileIO(down_w, "wb")
        self.from_child = io.FileIO(up_r, "rb")
        hello = self._await_frame(START_TIMEOUT_S, None)
        if not hello.get("ready"):
            raise RuntimeError(f"worker start-up failed: {hello.get('error')}")

    def _call(self, job: _Job) -> tuple[dict, bytes]:
        _write_frame(self.to_child, json.dumps({"kind": job.kind}).encode())
        _write_frame(self.to_child, job.body)
        answer = self._await_frame(JOB_TIMEOUT_S, job)
        ids = _read_frame(self.from_child)
        if not answer["ok"]:
            raise ApiError.from_dict(answer["error"])
        return answer["prepared"], ids

    def _await_frame(self, timeout: float, job: _Job | None) -> dict:
        """The next JSON frame, waiting at most ``timeout`` (less once the job's client has left)."""
        start = time.monotonic()
        while not select.select([self.from_child], [], [], _POLL_S)[0]:
            now = time.monotonic()
            if now - start > timeout:
                raise TimeoutError(f"the worker took over {timeout:g} s")
            if job is not None and job.abandoned_at is not None and now - job.abandoned_at > ABANDONED_KILL_S:
                raise TimeoutError("the client left while its request was being prepared")
            if self.proc.poll() is not None:
                raise EOFError(f"the worker exited with status {self.proc.returncode}")
        return json.loads(_read_frame(self.from_child))

    def stop(self) -> None:
        for f in (self.to_child, self.from_child):
            if f is not None:
                f.close()
        self.to_child = self.from_child = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# ---- the worker process ------------------------------------------------------------------
def _worker_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m glm_fused.server.preprocess_pool",
                                     description="A request preprocessing worker of the server (internal).")
    parser.add_argument("--fds", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    from glm_fused.launcher import _die_with_parent

    _die_with_parent(args.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    down, up = (int(fd) for fd in args.fds.split(","))
    inbox, outbox = io.FileIO(down, "rb"), io.FileIO(up, "wb")
    try:
        pre = make_preprocessor(json.loads(args.config))
    except Exception as exc:  # noqa: BLE001 - told to the parent, which reports it
        _write_frame(outbox, json.dumps({"ready": False, "error": f"{type(exc).__name__}: {exc}"}).encode())
        return 1
    _write_frame(outbox, json.dumps({"ready": True}).encode())
    while True:
        try:
            header = json.loads(_read_frame(inbox))
            body = _read_frame(inbox)
        except EOFError:
            return 0  # the server closed the pipe: it is stopping
        ids = b""
        try:
            meta, ids = pre.prepare(header["kind"], body).to_wire()
            answer = {"ok": True, "prepared": meta}
        except ApiError as exc:
            answer = {"ok": False, "error": exc.to_dict()}
        except Exception as exc:  # noqa: BLE001 - a bug: a 500 in the usual shape, the traceback in the log
            traceback.print_exc()
            answer = {"ok": False, "error": ApiError(
                500, f"internal error while preparing the request: {type(exc).__name__}: {exc}").to_dict()}
        del body
        _write_frame(outbox, json.dumps(answer).encode())
        _write_frame(outbox, ids)


if __name__ == "__main__":
    sys.exit(_worker_main())
