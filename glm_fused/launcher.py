"""Run a worker function as N tensor-parallel ranks on this machine.

Every script goes multi-rank the same way::

    sys.exit(launch("glm_fused.cli.generate:worker", args, nprocs=args.tp, device=args.device))

and the worker, ``worker(args)``, runs once per rank. A rank comes to life in one of three ways:

* ``nprocs == 1``: the worker runs in this process, with no distributed environment.
* ``nprocs > 1``: N children ``python -m glm_fused.launcher`` run it, each with the
  environment of docs/design.md ("Launcher environment"). Rank 0 writes to this terminal;
  the other ranks write to log files in a temporary directory, kept when something fails.
* inside a job already started by ``python -m paddle.distributed.launch``, ``torchrun`` or
  this launcher: the worker runs in this process as that job's rank.

``args`` travel to the ranks as JSON, and the worker gets back what was given (a dict, or an
``argparse.Namespace``). The launcher never initialises Paddle or torch (the backend's
``init_distributed()`` does, from this environment) and imports neither, so a rank pays
for one framework only.

When a rank fails, the others are stopped and one short message is printed:
``error: <message>`` for a ``UserError`` (exit status 2), the rank's traceback for any other
exception (status 1). No rank outlives the launch, even when the launcher is SIGKILLed
(then only processes a rank started itself may survive it).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import glob
import importlib
import importlib.util
import json
import math
import os
import shutil
import signal
import site
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glm_fused.errors import UserError

HOST = "127.0.0.1"
GRACE_S = 3.0  # how long ranks get to exit after being asked, before SIGKILL
POLL_S = 0.05
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}

Worker = str | Callable[[Any], Any]

# What must run when this rank's worker has returned, before the process exits: whoever
# joins a process group registers how to leave it (see ``at_rank_end``).
_RANK_END_HOOKS: list[Callable[[], None]] = []
_END_AT_EXIT = False


# ---- where am I ------------------------------------------------------------------------


def current_rank() -> int:
    """This process's rank: 0 outside a multi-rank job."""
    return int(_first_env("GLM_FUSED_RANK", "PADDLE_TRAINER_ID", "RANK") or 0)


def world_size() -> int:
    """Number of ranks in this job: 1 outside a multi-rank job."""
    return int(_first_env("GLM_FUSED_WORLD_SIZE", "PADDLE_TRAINERS_NUM", "WORLD_SIZE") or 1)


def at_rank_end(hook: Callable[[], None]) -> None:
    """Run ``hook()`` once this rank's worker has returned, before the process exits.

    A backend's ``init_distributed`` registers its process-group teardown here, so every
    entry point leaves its collectives the same way: all ranks meet, then the group is
    destroyed while the interpreter is still whole (docs/design.md, "How a rank ends").
    """
    global _END_AT_EXIT
    if not _END_AT_EXIT:
        # Outside the launcher (a library user's own torchrun job) nobody calls _end_rank:
        # interpreter exit does, before finalization. After _end_rank no hooks are left.
        atexit.register(_end_rank)
        _END_AT_EXIT = True
    if hook not in _RANK_END_HOOKS:
        _RANK_END_HOOKS.append(hook)


def _end_rank() -> None:
    """Run the registered hooks, last registered first; each runs once."""
    while _RANK_END_HOOKS:
        _RANK_END_HOOKS.pop()()


def stop_signal_name(received: int) -> str:
    """The name of the signal that asked this job to stop.

    The launcher passes every stop request on to the ranks as SIGINT (see ``_Ranks._stop``)
    and writes the one it caught to ``GLM_FUSED_STOP_SIGNAL_FILE`` first; outside the
    launcher, ``received`` is the signal itself.
    """
    path = os.environ.get("GLM_FUSED_STOP_SIGNAL_FILE")
    if path:
        with contextlib.suppress(OSError):
            if name := Path(path).read_text().strip():
                return name
    return signal.Signals(received).name


def exit_rank_now(message: str, code: int = 1) -> None:
    """End this process at once, from any thread, reporting ``message``: a rank of the
    launcher hands it over as its failure report (the launcher prints ``error: <message>``
    and stops the other ranks), a process on its own prints it. For a rank whose main
    thread cannot unwind (blocked inside a collective that will never complete)."""
    error_file = os.environ.get("GLM_FUSED_ERROR_FILE")
    if error_file:
        _write_error(error_file, {"kind": "internal", "summary": message, "traceback": ""})
    else:
        _print_error(message)
    _flush_output()
    os._exit(code)


def _first_env(*names: str) -> str | None:
    for name in names:
        if value := os.environ.get(name):
            return value
    return None


# ---- the launcher ----------------------------------------------------------------------


def launch(
    worker: Worker,
    args: dict[str, Any] | argparse.Namespace,
    *,
    nprocs: int,
    device: str = "cpu",
    timeout: float | None = None,
    num_gpus: int | None = None,
) -> int:
    """Run ``worker(args)`` on ``nprocs`` ranks; return the exit status for ``sys.exit``.

    ``worker`` is ``"package.module:function"`` or a module-level function (one defined in
    the running script is loaded from its file in each rank, as multiprocessing does).
    ``device="gpu"`` gives rank r GPU ``r % num_gpus``; ``num_gpus`` defaults to the count
    in ``CUDA_VISIBLE_DEVICES``, else to the GPUs of this machine. Ranks that share a GPU
    talk over gloo, ranks with a GPU each over NCCL. ``timeout`` (seconds) stops every rank
    and returns 124 when it runs out. A worker may return an int: that rank's exit status.
    """
    payload = _encode_args(args)
    try:
        if device not in ("cpu", "gpu"):
            raise UserError(f"--device must be cpu or gpu, not {device!r}")
        if nprocs < 1:
            raise UserError(f"--tp must be at least 1, got {nprocs}")
        job = _joined_job()
        if job is not None:
            _adopt(job, nprocs, device, num_gpus)
            return _run_here(worker, payload, timeout, job.rank)
        if nprocs == 1:
            # No job, but the backends still learn the device from the environment.
            with _environ(GLM_FUSED_DEVICE=device, GLM_FUSED_DEVICE_ID="0"):
                return _run_here(worker, payload, timeout, 0)
        gpus = _gpu_count(num_gpus) if device == "gpu" else 0
        spec = worker if isinstance(worker, str) else _worker_spec(worker)
        return _Ranks(spec, payload, nprocs, device, gpus, timeout).run()
    except UserError as e:
        _print_error(str(e))
        return e.exit_code


def _encode_args(args: dict[str, Any] | argparse.Namespace) -> str:
    namespace = isinstance(args, argparse.Namespace)
    fields = vars(args) if namespace else dict(args)
    try:
        return json.dumps({"namespace": namespace, "args": fields}, default=_path_to_str)
    except TypeError as e:
        raise TypeError(f"launch() passes args to the ranks as JSON: {e}") from None


def _path_to_str(value: Any) -> str:
    if isinstance(value, os.PathLike):  # argparse's type=Path is common and harmless
        return os.fspath(value)
    raise TypeError(f"{type(value).__name__} {value!r} is not JSON-serialisable")


def _decode_args(payload: str) -> dict[str, Any] | argparse.Namespace:
    data = json.loads(payload)
    return argparse.Namespace(**data["args"]) if data["namespace"] else data["args"]


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    """Set environment variables for the duration of the block."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _print_error(message: str) -> None:
    _flush_output()
    print(f"error: {message}", file=sys.stderr, flush=True)


def stdout_gone() -> int:
    """The reader of this process's output left (``script | head``): stop quietly, as a shell's
    tools do, and keep the interpreter's last flush from printing the same error again."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def _flush_output() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed or gone: nothing to keep
            stream.flush()


# ---- workers ---------------------------------------------------------------------------


def _worker_spec(fn: Callable[[Any], Any]) -> str:
    name, module = fn.__qualname__, fn.__module__
    if "<" in name:
        raise ValueError(f"worker {name} must be a module-level function")
    if module == "__main__":
        path = getattr(sys.modules["__main__"], "__file__", None)
        if path is None:
            raise ValueError(f"worker {name} is defined in __main__ without a file; "
                             "put it in an importable module")
        module = os.path.abspath(path)
    return f"{module}:{name}"


def _resolve(spec: str) -> Callable[[Any], Any]:
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ValueError(f"worker must look like 'package.module:function', not {spec!r}")
    if module_name.endswith(".py"):
        # A script's own function: load the file under another name, so that its
        # ``if __name__ == "__main__":`` block does not launch again in every rank.
        file_spec = importlib.util.spec_from_file_location("__glm_fused_main__", module_name)
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[file_spec.name] = module
        file_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    obj: Any = module
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _call(worker: Worker, payload: str) -> int:
    fn = _resolve(worker) if isinstance(worker, str) else worker
    result = fn(_decode_args(payload))
    return result if type(result) is int else 0


def _import_roots(spec: str) -> list[str]:
    """Directories a child needs on its path to import this package and the worker."""
    roots = [str(Path(__file__).resolve().parent.parent)]
    module = spec.partition(":")[0]
    if module.endswith(".py"):
        roots.append(os.path.dirname(module))  # the script imports as it does when run
    else:
        found = importlib.util.find_spec(module.split(".")[0])
        if found is None:
            raise ModuleNotFoundError(f"worker module {module!r} is not importable")
        if found.submodule_search_locations:
            roots.append(str(Path(list(found.submodule_search_locations)[0]).parent))
        elif found.has_location:
            roots.append(str(Path(found.origin).parent))
    # Site directories are on every path already; repeated in PYTHONPATH they would come
    # before the standard library.
    site_dirs = {*site.getsitepackages(), site.getusersitepackages()}
    return [root for root in dict.fromkeys(roots) if root not in site_dirs]


# ---- one process: nprocs == 1 or a joined job ------------------------------------------


@dataclass
class _Job:
    started_by: str
    rank: int
    world: int
    local_rank: int
    local_world: int


def _joined_job() -> _Job | None:
    env = os.environ
    if "GLM_FUSED_RANK" in env:
        rank, world = int(env["GLM_FUSED_RANK"]), int(env.get("GLM_FUSED_WORLD_SIZE", "1"))
        return _Job("glm_fused.launcher", rank, world, rank, world)
    if "PADDLE_TRAINER_ID" in env:
        rank, world = int(env["PADDLE_TRAINER_ID"]), int(env.get("PADDLE_TRAINERS_NUM", "1"))
        local_rank = int(env.get("PADDLE_LOCAL_RANK", rank))
        local_world = int(env.get("PADDLE_LOCAL_SIZE", world))
        return _Job("python -m paddle.distributed.launch", rank, world, local_rank, local_world)
    if all(name in env for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")):
        return _Job("torchrun", int(env["RANK"]), int(env["WORLD_SIZE"]),
                    int(env.get("LOCAL_RANK", env["RANK"])), int(env["LOCAL_WORLD_SIZE"]))
    return None


def _adopt(job: _Job, nprocs: int, device: str, num_gpus: int | None) -> None:
    """Check a job started by someone else and describe it in GLM_FUSED_* terms."""
    if job.world != nprocs:
        raise UserError(f"--tp {nprocs} does not match the {job.world} ranks started by "
                        f"{job.started_by}; pass --tp {job.world}")
    if job.started_by == "glm_fused.launcher":
        return
    env = os.environ
    device_id, backend = 0, "gloo"
    if device == "gpu":
        gpus = _gpu_count(num_gpus)
        selected = env.get("FLAGS_selected_gpus", "").split(",")[0]
        device_id = int(selected) if selected else job.local_rank % gpus
        backend = "nccl" if gpus >= job.local_world else "gloo"
    env.update({
        "GLM_FUSED_RANK": str(job.rank),
        "GLM_FUSED_WORLD_SIZE": str(job.world),
        "GLM_FUSED_DEVICE": device,
        "GLM_FUSED_DEVICE_ID": str(device_id),
        "GLM_FUSED_DIST_BACKEND": backend,
    })
    # The other framework's names for the same facts (its endpoints are not known here).
    for name, value in (("PADDLE_TRAINER_ID", job.rank), ("PADDLE_TRAINERS_NUM", job.world),
                        ("RANK", job.rank), ("WORLD_SIZE", job.world),
                        ("LOCAL_RANK", job.local_rank)):
        env.setdefault(name, str(value))


def _run_here(worker: Worker, payload: str, timeout: float | None, rank: int) -> int:
    prefix = f"rank {rank}: " if rank else ""
    try:
        with _alarm(timeout):
            code = _call(worker, payload)
            _end_rank()
            return code
    except UserError as e:
        _print_error(prefix + str(e))
        return e.exit_code
    except _TimedOut:
        _print_error(f"{prefix}timed out after {timeout:g}s")
        return 124
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return stdout_gone()
    except Exception:
        traceback.print_exc()
        return 1


class _TimedOut(BaseException):
    """Raised by the alarm; a BaseException so that ``except Exception`` lets it pass."""


@contextlib.contextmanager
def _alarm(timeout: float | None) -> Iterator[None]:
    if timeout is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise _TimedOut

    previous = signal.signal(signal.SIGALRM, expire)
    earlier_delay, earlier_interval = signal.setitimer(signal.ITIMER_REAL, timeout)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if earlier_delay:  # someone else's alarm (pytest-timeout, say): re-arm what is left
            left = max(earlier_delay - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, earlier_interval)


# ---- N processes -----------------------------------------------------------------------


class _Ranks:
    """Starts the ranks, watches them, stops them all, and reports the first failure."""

    def __init__(self, spec: str, payload: str, nprocs: int, device: str, gpus: int,
                 timeout: float | None) -> None:
        if device == "gpu" and gpus < 1:
            raise UserError("--device gpu, but no GPU is visible "
                            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        self.spec, self.payload, self.nprocs = spec, payload, nprocs
        self.device, self.gpus, self.timeout = device, gpus, timeout
        self.procs: list[subprocess.Popen[bytes]] = []
        self.dir = Path(tempfile.mkdtemp(prefix="glm_fused-ranks-"))

    def run(self) -> int:
        keep_logs = True
        try:
            with _caught_signals() as caught:
                try:
                    self._start()
                    outcome = self._watch(caught)
                finally:
                    self._stop(caught)
            code, keep_logs = self._report(*outcome)
            return code
        finally:
            if not keep_logs:
                shutil.rmtree(self.dir, ignore_errors=True)

    def _start(self) -> None:
        args_file = self.dir / "args.json"
        args_file.write_text(self.payload)
        ports = _free_ports(self.nprocs + 1)
        endpoints = [f"{HOST}:{port}" for port in ports[:-1]]
        base_env = dict(os.environ)
        base_env["PYTHONPATH"] = os.pathsep.join(
            [*_import_roots(self.spec), *filter(None, [os.environ.get("PYTHONPATH")])])
        command = [sys.executable, "-m", "glm_fused.launcher", "--worker", self.spec,
                   "--args-file", str(args_file), "--parent-pid", str(os.getpid())]
        _flush_output()  # rank 0 writes to the same descriptors
        # Ranks start with SIGINT and SIGTERM blocked (the mask survives exec) and unblock
        # them only around the worker, so a stop request never meets Python's start-up or
        # shutdown, where it would print a KeyboardInterrupt traceback. Here, blocking only
        # delays a signal meant for the launcher.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            for rank in range(self.nprocs):
                env = self._rank_env(base_env, rank, endpoints, ports[-1])
                log = None if rank == 0 else open(self._log(rank), "wb")
                try:
                    self.procs.append(subprocess.Popen(
                        command, env=env,
                        stdin=None if rank == 0 else subprocess.DEVNULL,
                        stdout=log, stderr=None if log is None else subprocess.STDOUT,
                        start_new_session=True,  # a group per rank: signals reach its children
                    ))
                finally:
                    if log is not None:
                        log.close()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    def _rank_env(self, base: dict[str, str], rank: int, endpoints: list[str],
                  master_port: int) -> dict[str, str]:
        n = self.nprocs
        gpu = self.device == "gpu"
        device_id = rank % self.gpus if gpu else 0
        backend = "nccl" if gpu and self.gpus >= n else "gloo"  # NCCL needs a GPU per rank
        env = dict(base)
        env.update({
            "GLM_FUSED_RANK": str(rank),
            "GLM_FUSED_WORLD_SIZE": str(n),
            "GLM_FUSED_DEVICE": self.device,
            "GLM_FUSED_DEVICE_ID": str(device_id),
            "GLM_FUSED_DIST_BACKEND": backend,
            "GLM_FUSED_ERROR_FILE": str(self._error_file(rank)),
            "GLM_FUSED_STOP_SIGNAL_FILE": str(self.dir / "stop-signal"),
            "PADDLE_TRAINER_ID": str(rank),
            "PADDLE_TRAINERS_NUM": str(n),
            "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
            "PADDLE_CURRENT_ENDPOINT": endpoints[rank],
            "PADDLE_MASTER": f"{HOST}:{master_port}",
            "PADDLE_DISTRI_BACKEND": backend,
            "PADDLE_LOCAL_RANK": str(rank),
            "PADDLE_LOCAL_SIZE": str(n),
            "PADDLE_RANK_IN_NODE": str(rank),
            # Paddle reads MASTER_* before PADDLE_MASTER, so both name the same store.
            "MASTER_ADDR": HOST,
            "MASTER_PORT": str(master_port),
            "RANK": str(rank),
            "WORLD_SIZE": str(n),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(n),
        })
        if gpu:
            env["FLAGS_selected_gpus"] = str(device_id)
        else:
            env.pop("FLAGS_selected_gpus", None)
        # N ranks each using every core would oversubscribe the machine many times over.
        env.setdefault("OMP_NUM_THREADS", str(max(1, usable_cpus() // n)))
        # Paddle's C++ INFO lines (its TCP store connecting) on the user's terminal say nothing
        # to a user; its warnings and errors still show.
        env.setdefault("GLOG_minloglevel", "1")
        if rank:
            env["PYTHONUNBUFFERED"] = "1"  # a killed rank's log still holds its last lines
        return env

    def _log(self, rank: int) -> Path:
        return self.dir / f"rank{rank}.log"

    def _error_file(self, rank: int) -> Path:
        return self.dir / f"rank{rank}.error"

    def _watch(self, caught: list[int]) -> tuple[str, int]:
        """Wait for all ranks to succeed, one to fail, the deadline, or a signal."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            if caught:
                return "signal", caught[0]
            codes = [_peek(p) for p in self.procs]
            if failed := [rank for rank, code in enumerate(codes) if code]:
                # Several seen in one poll: the one that wrote its error first is the cause.
                return "failed", min(failed, key=lambda r: (self._error_time(r), r))
            if all(code == 0 for code in codes):
                return "done", 0
            if deadline is not None and time.monotonic() >= deadline:
                return "timeout", 0
            time.sleep(POLL_S)

    def _error_time(self, rank: int) -> float:
        try:
            return self._error_file(rank).stat().st_mtime_ns
        except FileNotFoundError:
            return math.inf

    def _stop(self, caught: list[int]) -> None:
        """Ask every live rank to stop, SIGKILL what is left after the grace period."""
        signals_seen = len(caught)
        if caught:  # for the ranks' stop messages: they only see the SIGINT sent below
            with contextlib.suppress(OSError):
                (self.dir / "stop-signal").write_text(signal.Signals(caught[0]).name)
        running = [p for p in self.procs if _peek(p) is None]
        for proc in running:
            # SIGINT, not SIGTERM: Paddle replaces SIGTERM's handler with one that prints
            # a C++ "FatalError" report; SIGINT is a quiet KeyboardInterrupt in the rank.
            _signal_group(proc, signal.SIGINT)
        end = time.monotonic() + GRACE_S
        while (any(_peek(p) is None for p in running) and time.monotonic() < end
               and len(caught) == signals_seen):  # a second Ctrl-C: no more waiting
            time.sleep(POLL_S)
        for proc in self.procs:
            _signal_group(proc, signal.SIGKILL)  # stragglers, and whatever a rank left behind
        for proc in self.procs:
            proc.wait()

    def _report(self, outcome: str, value: int) -> tuple[int, bool]:
        """Print what happened; return (exit status, whether to keep the logs)."""
        if outcome == "done":
            return 0, False
        if outcome == "signal":
            return 128 + value, False
        if outcome == "timeout":
            _print_error(f"timed out after {self.timeout:g}s ({self._logs_hint(0)})")
            return 124, True
        rank = value
        code = self.procs[rank].returncode
        error = self._read_error(rank)
        if error and error.get("kind") == "user":
            message = error["message"]
            # Every rank often fails alike (a bad path, say): then say it once, as rank 0.
            same = [r for r in range(self.nprocs) if self._read_error(r) == error]
            _print_error(message if 0 in same else f"rank {rank}: {message}")
            return code, False
        if error:
            sys.stderr.write(error.get("traceback", ""))
            _print_error(f"{error['summary']} ({self._logs_hint(rank)})")
            return code or 1, True
        if rank == 0 and code == 128 + signal.SIGPIPE:
            return code, False  # rank 0's reader left (`script | head`): nothing to report
        if code < 0:
            _print_error(f"rank {rank} was killed by {signal.Signals(-code).name} "
                         f"({self._logs_hint(rank)})")
            return 128 - code, True
        _print_error(f"rank {rank} exited with status {code} ({self._logs_hint(rank)})")
        return code, True

    def _logs_hint(self, rank: int) -> str:
        if rank:
            return f"its output: {self._log(rank)}"
        others = "rank 1" if self.nprocs == 2 else f"ranks 1-{self.nprocs - 1}"
        return f"output of {others} in {self.dir}"

    def _read_error(self, rank: int) -> dict[str, str] | None:
        try:
            text = self._error_file(rank).read_text()
        except FileNotFoundError:
            return None
        try:
            return json.loads(text)
        except ValueError:  # not ours: show it as it is
            lines = text.strip().splitlines() or [""]
            return {"kind": "internal", "summary": f"rank {rank}: {lines[-1]}", "traceback": text}


def _peek(proc: subprocess.Popen[bytes]) -> int | None:
    """The exit status of a child, without reaping it.

    An unreaped child keeps its pid, and so its process group id, from being reused:
    signalling the group later can only reach what the rank left behind.
    """
    if proc.returncode is not None:
        return proc.returncode
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped elsewhere after all
        return proc.poll()
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _signal_group(proc: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signum)


@contextlib.contextmanager
def _caught_signals() -> Iterator[list[int]]:
    """Turn SIGINT/SIGTERM into entries of a list, so the launcher can stop its ranks."""
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield caught  # only the main thread may set handlers; the caller owns signals
        return
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield caught
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


def _free_ports(count: int) -> list[int]:
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):  # all held open at once, so the ports are distinct
            s = socket.socket()
            s.bind((HOST, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity), else all of the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _gpu_count(num_gpus: int | None) -> int:
    if num_gpus is not None:
        return num_gpus
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return len(glob.glob("/dev/nvidia[0-9]*"))
    count = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break  # CUDA ignores everything from the first invalid entry on
        count += 1
    return count


# ---- inside a child rank ---------------------------------------------------------------


class _Terminated(BaseException):
    """SIGTERM as an exception, so the rank unwinds and exits quietly."""


def _terminate(signum: int, frame: Any) -> None:
    raise _Terminated


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this rank when the launcher dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:  # it died before the request was made
        os._exit(1)


def _run_rank(spec: str, payload: str) -> int:
    rank = current_rank()
    error_file = os.environ.get("GLM_FUSED_ERROR_FILE")
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # see _Ranks._start
        code = _call(spec, payload)
        _end_rank()
        _ignore_stop_requests()
        return code
    except UserError as e:
        _ignore_stop_requests()
        _write_error(error_file, {"kind": "user", "message": str(e)})
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except _Terminated:
        return 143
    except BrokenPipeError:
        _ignore_stop_requests()
        return stdout_gone()
    except Exception as e:
        _ignore_stop_requests()
        tb = traceback.format_exc()
        message = str(e).strip().splitlines()
        summary = f"rank {rank}: {type(e).__name__}" + (f": {message[0]}" if message else "")
        _write_error(error_file, {"kind": "internal", "summary": summary, "traceback": tb})
        if rank:
            sys.stderr.write(tb)  # its log; rank 0's traceback is printed by the launcher
        return 1


def _ignore_stop_requests() -> None:
    # The rank is leaving anyway: a stop request must not cut its report or exit short.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def _write_error(path: str | None, error: dict[str, str]) -> None:
    if not path:
        return
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        json.dump(error, f)
    os.replace(partial, path)  # the launcher never reads half a report


def _rank_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m glm_fused.launcher",
                                     description="One rank of a job started by launch().")
    parser.add_argument("--worker", required=True, help="package.module:function")
    parser.add_argument("--args-file", required=True, type=Path)
    parser.add_argument("--parent-pid", required=True, type=int)
    opts = parser.parse_args(argv)
    _die_with_parent(opts.parent_pid)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        code = _run_rank(opts.worker, opts.args_file.read_text())
    except (KeyboardInterrupt, _Terminated):  # a request that landed as the rank was leaving
        code = 130
    if code:
        # Leave at once: a failed rank that hung in interpreter shutdown (a non-daemon
        # thread, an atexit hook) would keep the launcher from seeing the failure.
        _flush_output()
        os._exit(code)
    sys.exit(0)


if __name__ == "__main__":
    # Run from the imported module rather than this __main__ copy, so the worker and
    # the rank's wrapper share one set of classes.
    from glm_fused.launcher import _rank_main as main

    main()
