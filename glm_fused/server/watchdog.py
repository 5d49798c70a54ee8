"""The engine-progress watchdog: a rank that stops answering ends the server, loudly.

Every engine step is a round of collectives that needs every rank, and so is the idle
heartbeat (a ping the other ranks answer with a barrier, every 2 s). A rank that is stopped
(SIGSTOP, a debugger), stuck in the kernel or hung in a device call never returns from it,
and neither does rank 0's engine loop: without a watchdog, ``/health`` would stay 200 while
nothing is generated, until a collective timeout ended the job (30 s on Paddle's gloo,
``--dist-timeout`` elsewhere) or never.

A thread watches how long the engine loop has been inside one such call (``track``). Past
the bound it calls ``on_stall(reason)`` once; the reason names the rank at fault as far as
``/proc`` tells (the launcher runs every rank on this host, and the ranks exchange their
pids at start-up: ``exchange_pids``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np


def exchange_pids(broadcast_int64, rank: int, world: int) -> list[int]:
    """Every rank's pid, on every rank (a collective: all ranks call it, in the same order)."""
    if world == 1:
        return [os.getpid()]
    mine = np.array([os.getpid()], dtype=np.int64)
    return [int(broadcast_int64(mine if src == rank else None, src=src)[0]) for src in range(world)]


def process_state(pid: int) -> str | None:
    """The state letter of /proc/PID/stat (R, S, D, T, t, Z...), or None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def rank_faults(pids: list[int]) -> list[str]:
    """What is wrong with the other ranks' processes, one phrase per rank at fault."""
    faults = []
    for rank, pid in enumerate(pids):
        if pid == os.getpid():
            continue
        state = process_state(pid)
        who = f"rank {rank} (pid {pid}) stopped answering"
        if state is None or state in "ZX":
            faults.append(f"{who}: its process has exited")
        elif state in "Tt":
            faults.append(f"{who}: its process is stopped (SIGSTOP or a debugger)")
        elif state == "D":
            faults.append(f"{who}: it is stuck in an uninterruptible system call")
    return faults


class EngineWatchdog:
    def __init__(self, bound_s: float, on_stall: Callable[[str], None], pids: list[int] | None = None):
        self.bound_s = bound_s
        self.on_stall = on_stall
        self.pids = pids or [os.getpid()]
        self._since: float | None = None
        self._what = ""
        self.thread = threading.Thread(target=self._run, name="engine-watchdog", daemon=True)

    @contextlib.contextmanager
    def track(self, what: str) -> Iterator[None]:
        """Wrap one call that needs every rank (a step, a heartbeat, the stop message)."""
        self._what, self._since = what, time.monotonic()
        try:
            yield
        finally:
            self._since = None

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(min(0.5, self.bound_s / 4))
            since, what = self._since, self._what
            if since is not None and time.monotonic() - since > self.bound_s:
                self.on_stall(self.reason(what))
                return

    def reason(self, what: str) -> str:
        waited = f"no engine {what} finished in {self.bound_s:g} s (--watchdog-timeout)"
        faults = rank_faults(self.pids)
        if faults:
            return f"{'; '.join(faults)}; {waited}"
        if len(self.pids) > 1:
            return (f"{waited}, yet every rank's process is running: a collective or a device kernel is stuck "
                    f"(rank 0 is waiting in it)")
        return f"{waited}: the model's forward is stuck"
