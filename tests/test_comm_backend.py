"""The comm_backend protocol FlashInfer uses for its workspace exchange, on real CPU ranks."""

import json

import pytest

from glm_fused.launcher import launch


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["paddle", "torch"])
def test_comm_backend_collectives(tmp_path, backend):
    pytest.importorskip(backend)
    status = launch("comm_workers:comm_backend", {"backend": backend, "out": str(tmp_path)}, nprocs=2,
                    timeout=150)
    assert status == 0
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, out in enumerate(ranks):
        assert (out["rank"], out["size"]) == (r, 2)
        assert out["gathered"] == [{"pid_of": 0, "handle": [0, 0, 0]}, {"pid_of": 1, "handle": [1, 1, 1]}]
        assert out["bcast"] == "from 1"
        assert out["split_is_same"] is True
        assert "different colours" in out["split_two_colours"]
        assert out["group_left"] is True  # the backend's teardown ran before the process exited
