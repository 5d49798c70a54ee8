"""Workers for tests/test_launcher.py, each run as one rank by ``launch()``.

Every worker takes a dict with ``out``, a directory where it leaves ``rank{r}.json``:
its pid, the pids of any processes it started, and the environment it saw.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from glm_fused.errors import UserError
from glm_fused.launcher import current_rank, world_size

ENV_NAMES = (
    "GLM_FUSED_RANK", "GLM_FUSED_WORLD_SIZE", "GLM_FUSED_DEVICE", "GLM_FUSED_DEVICE_ID",
    "GLM_FUSED_DIST_BACKEND", "GLM_FUSED_ERROR_FILE",
    "PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM", "PADDLE_TRAINER_ENDPOINTS",
    "PADDLE_CURRENT_ENDPOINT", "PADDLE_MASTER", "PADDLE_DISTRI_BACKEND", "FLAGS_selected_gpus",
    "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "OMP_NUM_THREADS",
)


def fields(args: dict | argparse.Namespace) -> dict:
    return vars(args) if isinstance(args, argparse.Namespace) else args


def note(args: dict, **extra) -> None:
    rank = current_rank()
    record = {
        "rank": rank,
        "world": world_size(),
        "pid": os.getpid(),
        "env": {name: os.environ.get(name) for name in ENV_NAMES},
        **extra,
    }
    path = Path(fields(args)["out"]) / f"rank{rank}.json"
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(record))
    partial.replace(path)  # readers see a whole note or none


def wait_for_notes(args: dict, count: int) -> None:
    while len(list(Path(args["out"]).glob("rank*.json"))) < count:
        time.sleep(0.01)


def start_grandchild() -> int:
    return subprocess.Popen(["sleep", "60"]).pid


def record_env(args: dict) -> int:
    print(f"hello from rank {current_rank()}", flush=True)
    note(args, args_type=type(args).__name__)
    return 0


def exit_with(args: dict) -> int:
    """Return the status args["codes"][rank] after args["delays"][rank] seconds."""
    rank = current_rank()
    note(args)
    time.sleep(fields(args)["delays"][rank])
    return fields(args)["codes"][rank]


def fail(args: dict) -> None:
    """Ranks in args["bad"] raise (a UserError or a RuntimeError) once every rank has
    started; the others sleep. With args["stubborn"], ranks ignore requests to stop."""
    rank = current_rank()
    if args.get("stubborn"):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    note(args, children=[start_grandchild()] if args.get("grandchildren") else [])
    if rank in args["bad"]:
        wait_for_notes(args, world_size())
        if args["kind"] == "user":
            raise UserError(args["message"])
        raise RuntimeError(args["message"])
    time.sleep(60)


def print_lines(args: dict) -> int:
    """Rank 0 prints args["lines"] lines (the others wait for it at a barrier of notes)."""
    note(args)
    if current_rank() == 0:
        for i in range(args["lines"]):
            print(f"line {i} " + "x" * 60)
    wait_for_notes(args, world_size())
    return 0


def sleep_forever(args: dict) -> None:
    note(args, children=[start_grandchild()])
    while True:
        time.sleep(60)


def paddle_all_reduce(args: dict) -> None:
    import paddle
    import paddle.distributed as dist

    dist.init_parallel_env()
    x = paddle.to_tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x)
    note(args, value=float(x.numpy()[0]))


def torch_all_reduce(args: dict) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    try:
        x = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(x)
        note(args, value=float(x[0]))
    finally:
        dist.destroy_process_group()
