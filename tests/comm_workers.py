"""Rank code for tests/test_comm_backend.py (imported by each rank through the launcher)."""

import json
from pathlib import Path


def comm_backend(args: dict) -> None:
    """FlashInfer's comm_backend protocol over each backend's TP group, as the workspace uses it."""
    from glm_fused.backends import get_backend
    from glm_fused.fused_op import CommBackend
    from glm_fused.launcher import at_rank_end

    out: dict = {}
    # Registered before the backend's own teardown, so it runs after it (last in, first out).
    at_rank_end(lambda: _write_after_teardown(args, out))
    backend = get_backend(args["backend"])
    rank, world = backend.init_distributed()
    comm = backend.dist.TPComm(rank, world)
    cb = CommBackend(comm)  # FlashInfer's protocol over this TP group
    out.update({
        "rank": cb.Get_rank(), "size": cb.Get_size(),
        "gathered": cb.allgather({"pid_of": rank, "handle": [rank] * 3}),
        "bcast": cb.bcast(f"from {rank}", root=1),
        "split_is_same": cb.Split(0, rank) is cb,
    })
    cb.barrier()
    try:
        cb.Split(rank % 2, rank)  # two colours: sub-groups are refused, never built wrongly
        out["split_two_colours"] = "accepted"
    except RuntimeError as exc:
        out["split_two_colours"] = str(exc)


def _write_after_teardown(args: dict, out: dict) -> None:
    """The rank's report, written once the worker returned and the backend left its group."""
    import importlib

    framework = importlib.import_module("paddle.distributed" if args["backend"] == "paddle" else "torch.distributed")
    out["group_left"] = not framework.is_initialized()
    Path(args["out"], f"rank{out['rank']}.json").write_text(json.dumps(out))
