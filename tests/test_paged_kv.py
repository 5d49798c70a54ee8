"""The paged KV cache end to end on the tiny model: greedy tokens equal to those of the
slot-based cache the engine had before paging (recorded in tests/data/greedy_tiny_slots.json
from scripts/generate.py at TP 1 and TP 4, both frameworks: all four gave the same tokens),
with prefix caching on (hits asserted) and off, and under preemption forced by a block budget
that holds one sequence of the context limit but not two of the prompts (preemptions asserted). Exact equality: fp32 on
CPU, and the paged attention reads the same keys in the same order as the slots did."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import paged_workers  # noqa: E402  (tests/ is on sys.path under pytest)
from glm_fused.launcher import launch

DATA = json.loads((Path(__file__).resolve().parent / "data" / "greedy_tiny_slots.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("framework", ["paddle", "torch"])
def test_greedy_unchanged_by_paging_prefix_caching_and_preemption(tmp_path, framework, tp):
    if importlib.util.find_spec(framework) is None:
        pytest.skip(f"{framework} is not installed")
    args = {"out": str(tmp_path), "backend": framework, "prompts": DATA["prompts"],
            "max_new_tokens": DATA["max_new_tokens"]}
    assert launch(paged_workers.run_modes, args, nprocs=tp, device="cpu", timeout=360) == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert set(result) == set(paged_workers.MODES)
    for name, got in result.items():
        assert got["tokens"] == DATA["greedy"], f"{framework} TP{tp} {name}"
        assert got["stats"]["usage"] == 0.0  # every block given back
    shared = 45 // paged_workers.BLOCK * paged_workers.BLOCK  # prompts 1-3 share prompt 0's first 45 tokens
    assert result["prefix_caching"]["stats"]["prefix_cache_hits"] >= 3 * shared
    assert result["no_prefix_caching"]["stats"]["prefix_cache_hits"] == 0
    assert result["tiny_budget"]["stats"]["num_preemptions"] > 0
    assert sum(result["tiny_budget"]["preempted"]) == result["tiny_budget"]["stats"]["num_preemptions"]
