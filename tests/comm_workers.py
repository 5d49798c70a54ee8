"""Rank code for tests/test_comm_backend.py (imported by each rank through the launcher)."""

import json
from pathlib import Path


def comm_backend(args: dict) -> None:
    """FlashInfer's comm_backend protocol over each backend's TP group, as the workspace uses it."""
    from glm_fused.backends import get_backend

    backend = get_backend(args["backend"])
    rank, world = backend.init_distributed()
    comm = backend.dist.TPComm(rank, world)
    cb = comm.flashinfer_comm_backend()
    out = {
        "rank": cb.Get_rank(), "size": cb.Get_size(),
        "gathered": cb.allgather({"pid_of": rank, "handle": [rank] * 3}),
        "bcast": cb.bcast(f"from {rank}", root=1),
        "split_is_same": cb.Split(0, rank) is cb,
    }
    cb.barrier()
    try:
        cb.Split(rank % 2, rank)  # two colours: sub-groups are refused, never built wrongly
        out["split_two_colours"] = "accepted"
    except RuntimeError as exc:
        out["split_two_colours"] = str(exc)
    Path(args["out"], f"rank{rank}.json").write_text(json.dumps(out))
