"""Benchmark scripts that have a CPU mode, run small on the CPU, so that they cannot rot
between GPU runs unnoticed (bench_attention and bench_layers run under Triton's interpreter in
test_triton_kernels.py, bench_fusion in test_bench_fusion.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_load_on_the_tiny_checkpoint(tmp_path):
    """scripts/bench_load.py on the tiny checkpoint, both frameworks, TP 1 and 2: each TP 2 rank
    reads less than the TP 1 rank (its slices), the two together at least as much (the
    replicated tensors), and plain reads the whole checkpoint."""
    pytest.importorskip("torch")
    from glm_fused.tiny import ensure_tiny_checkpoint

    out = tmp_path / "load.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_load.py"), "--dir", str(ensure_tiny_checkpoint()),
                           "--tp", "1,2", "--json", str(out)], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert sorted(report["backends"]) == ["paddle", "torch"]
    for backend, result in report["backends"].items():
        assert result["plain"]["bytes"] == report["checkpoint_bytes"] and result["plain"]["seconds"] > 0, backend
        (one,), two = result["tp"]["1"], result["tp"]["2"]
        assert [r["rank"] for r in two] == [0, 1], backend
        assert all(0 < r["bytes"] < one["bytes"] and r["seconds"] > 0 for r in two), (backend, one, two)
        assert sum(r["bytes"] for r in two) >= one["bytes"], (backend, one, two)


@pytest.mark.timeout(120)
def test_fp8_accuracy_on_the_tiny_config(tmp_path):
    """scripts/fp8_accuracy.py on CPU (2 tiny layers): both variants measured against fp32 and
    the fp8 rule judged (the GPU test runs it at real width)."""
    pytest.importorskip("torch")
    from bench import fp8_accuracy

    out = fp8_accuracy.run(fp8_accuracy.build_parser().parse_args(
        ["--device", "cpu", "--config", str(REPO / "configs" / "glm-4.5-air-tiny.json"), "--layers", "2",
         "--prompts", "2", "--prompt-len", "16", "--json", str(tmp_path / "fp8_accuracy.json")]))
    errors = {name: out["vs_fp32"][name]["mean_row_rel_diff"] for name in ("bfloat16", "fp8")}
    assert 0 < errors["bfloat16"] < errors["fp8"], errors  # fp8 rounds more than bf16, and neither is exact
    assert out["passed"], out  # fp8 / bf16 mean row error to fp32 <= 8
