"""The scripts as a user runs them: logit_diff at TP 4, and user mistakes ending in one line.

Tolerances: fused vs unfused in float32 within 1e-5 of the largest logit (the two layouts
differ only in where the same additions happen); both within 1e-4 of transformers.
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT

from glm_fused.tiny import ensure_tiny_checkpoint


def run_script(script, *args, timeout=240, env_extra=None):
    marker = uuid.uuid4().hex
    env = dict(os.environ, GLM_FUSED_TEST_MARKER=marker, **(env_extra or {}))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    proc.elapsed = time.monotonic() - t0
    proc.leftovers = _processes_with(marker)
    return proc


def _processes_with(marker: str) -> list[int]:
    """Pids whose environment carries the marker: ranks left behind by a run."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.fixture(scope="module")
def tiny():
    return ensure_tiny_checkpoint()


@pytest.mark.timeout(300)
def test_logit_diff_tp4_fused_matches_unfused_and_transformers(tiny, tmp_path):
    out, npz = tmp_path / "out.json", tmp_path / "logits.npz"
    proc = run_script("logit_diff.py", "--model", tiny, "--tp", 4, "--json", out, "--save-logits", npz,
                      "--hf-reference", "--max-new-tokens", 4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Paddle's start-up noise stays off the terminal: its flags banner and C++ INFO lines
    assert "Modified FLAGS" not in proc.stderr and not re.search(r"^I\d{4} ", proc.stderr, re.M), proc.stderr
    report = json.loads(out.read_text())
    layers = 4
    fusion = report["fusion"]
    assert fusion["plain_allreduce_calls"] == 0
    assert fusion["fused_allreduce_norm_calls"] == 2 * layers + 1  # >= two per layer, plus the embedding
    assert fusion["per_decode_step"]["fused_allreduce_norm_calls"] == 2 * layers + 1
    assert fusion["unfused_model"] == {"fused_allreduce_norm_calls": 0, "plain_allreduce_calls": 2 * layers + 1}
    assert report["overall"]["max_rel_diff"] <= 1e-5 and report["overall"]["top1_agreement"] == 1.0
    assert all(p["greedy_agreement"] == 1.0 for p in report["prompts"])
    for tag in ("fused", "unfused"):
        assert report["vs_transformers"][tag]["max_rel_diff"] <= 1e-4
    assert report["passed"] and "PASS" in proc.stdout
    with np.load(npz) as data:
        for i, prompt in enumerate(report["prompts"]):
            for tag in ("fused", "unfused"):
                arr = data[f"{tag}_{i}"]
                assert arr.dtype == np.float32 and arr.shape == (prompt["tokens"], 1024)
    assert not proc.leftovers


# GLM-4.5's own settings where they differ from the Air-shaped tiny default: routed experts
# scaled by 2.5 (Air: 1.0, which hides a dropped scaling factor), qk-norm, and more dense layers.
GLM45_OVERRIDES = {"routed_scaling_factor": 2.5, "use_qk_norm": True, "first_k_dense_replace": 2}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["paddle", "torch"])
def test_logit_diff_glm45_settings_match_transformers(tmp_path, backend):
    """The accuracy tool end to end at TP 2 on a tiny checkpoint with GLM-4.5's settings:
    fused and unfused within 1e-4 of transformers (fp32; measured <= 1e-6)."""
    from glm_fused.tiny import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tmp_path / "glm45-tiny", GLM45_OVERRIDES)
    assert json.loads((ckpt / "config.json").read_text())["routed_scaling_factor"] == 2.5
    out = tmp_path / "out.json"
    proc = run_script("logit_diff.py", "--model", ckpt, "--tp", 2, "--backend", backend, "--json", out,
                      "--hf-reference", "--max-new-tokens", 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    for tag in ("fused", "unfused"):
        assert report["vs_transformers"][tag]["max_rel_diff"] <= 1e-4, report["vs_transformers"][tag]
        assert report["vs_transformers"][tag]["top1_agreement"] == 1.0
    assert report["passed"] and report["fusion"]["plain_allreduce_calls"] == 0
    assert not proc.leftovers


def test_logit_diff_fails_past_tolerance():
    from glm_fused.cli.logit_diff import _report

    rng = np.random.default_rng(0)
    unfused = rng.normal(size=(6, 50)).astype(np.float32)
    results = {"fused_0": unfused + 0.5 * rng.normal(size=unfused.shape).astype(np.float32),
               "unfused_0": unfused, "fused_greedy_0": np.array([1, 2]), "unfused_greedy_0": np.array([1, 3])}
    stats = {"fused": {"fused_allreduce_norm_calls": 9, "plain_allreduce_calls": 0},
             "unfused": {"fused_allreduce_norm_calls": 0, "plain_allreduce_calls": 9}}
    args = {"backend": "paddle", "tp": 1, "dtype": "float32"}
    report = _report([[1] * 6], results, stats, None, 1e-4, 0.99, args)
    assert not report["passed"] and report["prompts"][0]["greedy_agreement"] == 0.5
    same = dict(results, fused_0=unfused.copy())
    assert _report([[1] * 6], same, stats, None, 1e-4, 0.99, args)["passed"]


@pytest.mark.timeout(300)
def test_logit_diff_fp32_reference_holds_the_same_weights(tiny, tmp_path):
    """``--fp32-reference`` on a bf16 checkpoint: fused and unfused bf16 are each measured against
    an fp32 run of the same weights on the same ranks. That run must equal a plain fp32 run of
    the checkpoint (its bf16 weights widen exactly): within 1e-5 of the largest logit (TP 2 vs
    TP 1, summation order only)."""
    import torch
    from safetensors.torch import load_file, save_file

    from glm_fused.batch import ForwardBatch
    from glm_fused.engine_args import EngineArgs
    from glm_fused.runner import ModelRunner

    bf16 = tmp_path / "bf16"
    shutil.copytree(tiny, bf16)
    for shard in bf16.glob("*.safetensors"):
        save_file({k: v.to(torch.bfloat16) if "e_score" not in k else v for k, v in load_file(str(shard)).items()},
                  str(shard))
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([[5, 9, 300, 41, 8], [17, 2, 600]]))
    out, npz = tmp_path / "out.json", tmp_path / "logits.npz"
    proc = run_script("logit_diff.py", "--model", bf16, "--tp", 2, "--backend", "torch", "--dtype", "bfloat16",
                      "--prompt-ids", ids, "--fp32-reference", "--max-new-tokens", 2, "--json", out,
                      "--save-logits", npz)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    v = report["vs_fp32"]
    for tag in ("fused", "unfused"):  # bf16 compute is off fp32 by rounding, not more
        assert 0 < v[tag]["mean_row_rel_diff"] < 5e-2 and v[tag]["top1_agreement"] >= 0.75, v[tag]
    assert v["error_ratio"] <= 1.1 and "fused / unfused error to fp32" in proc.stdout
    settings = EngineArgs(model=str(bf16), backend="torch", device="cpu", dtype="float32", max_num_seqs=1,
                          max_model_len=16, max_num_batched_tokens=16).resolve()
    settings.num_gpu_blocks_override = settings.slot_blocks()
    runner = ModelRunner(settings, settings.config(), tp_rank=0, tp_size=1)
    with np.load(npz) as data:
        for i, prompt in enumerate(json.loads(ids.read_text())):
            plain = runner.forward(ForwardBatch.prefill([prompt], runner.slot_tables([0]), all_logits=True))
            assert np.abs(data[f"fp32_{i}"] - plain).max() / np.abs(plain).max() <= 1e-5
    runner.close()
    assert not proc.leftovers


def test_logit_diff_fp32_reference_judges_the_error_ratio():
    from glm_fused.cli.logit_diff import _report

    rng = np.random.default_rng(1)
    ref = rng.normal(size=(6, 50))
    unfused = (ref + 0.01 * rng.normal(size=ref.shape)).astype(np.float32)
    results = {"fp32_0": ref.astype(np.float32), "unfused_0": unfused, "fused_0": unfused.copy(),
               "fused_greedy_0": np.array([1]), "unfused_greedy_0": np.array([1])}
    stats = {"fused": {"fused_allreduce_norm_calls": 9, "plain_allreduce_calls": 0},
             "unfused": {"fused_allreduce_norm_calls": 0, "plain_allreduce_calls": 9}}
    args = {"backend": "torch", "tp": 2, "dtype": "bfloat16"}
    report = _report([[1] * 6], results, stats, None, 1e-1, 0.5, args, max_error_ratio=1.1)
    assert report["passed"] and report["vs_fp32"]["error_ratio"] == pytest.approx(1.0)
    worse = dict(results, fused_0=(ref + 0.02 * rng.normal(size=ref.shape)).astype(np.float32))
    report = _report([[1] * 6], worse, stats, None, 1e-1, 0.5, args, max_error_ratio=1.1)
    assert not report["passed"] and report["vs_fp32"]["error_ratio"] > 1.5


# ---- user mistakes: one line naming the culprit, exit 2, nothing left running ---------------

def _digest(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _broken(tiny, tmp_path, how):
    d = tmp_path / "ckpt"
    shutil.copytree(tiny, d)
    shards = sorted(d.glob("*.safetensors"))
    if how == "truncated":
        data = shards[1].read_bytes()
        shards[1].write_bytes(data[:-4096])
        return d, shards[1].name
    if how == "missing_shard":
        shards[2].unlink()
        return d, shards[2].name
    if how == "bad_config":
        (d / "config.json").write_text('{"model_type": "glm4_moe", "hidden_size": ')
        return d, "config.json"
    from safetensors.numpy import load_file, save_file
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = "model.layers.2.mlp.experts.7.up_proj.weight"
    shard = d / index["weight_map"][name]
    tensors = load_file(str(shard))
    if how == "missing_tensor":
        del tensors[name]
        del index["weight_map"][name]
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
    else:  # wrong shape
        tensors[name] = tensors[name][:, :-1].copy()
    save_file(tensors, str(shard))
    return d, name


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["truncated", "missing_shard", "bad_config", "missing_tensor", "wrong_shape"])
def test_broken_checkpoint_is_one_line(tiny, tmp_path, how):
    ckpt, culprit = _broken(tiny, tmp_path, how)
    before = _digest(ckpt)
    proc = run_script("generate.py", "--model", ckpt, "--tp", 2, "--prompt", "hello", "--max-new-tokens", 2)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and culprit in lines[-1], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.elapsed < 60 and not proc.leftovers
    assert _digest(ckpt) == before  # nothing the user gave is changed


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv,flag", [
    (["--model", "no/such/model-anywhere"], "--model"),
    (["--tp", "3"], "--tp 3"),
    (["--dtype", "bfloat16"], "--dtype bfloat16"),
    (["--unfused", "--enable-flashinfer-allreduce-fusion"], "--enable-flashinfer-allreduce-fusion"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5: must be in (0, 1]"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization 0: must be in (0, 1]"),
    (["--block-size", "24"], "--block-size 24"),
    (["--num-gpu-blocks-override", "0"], "--num-gpu-blocks-override 0"),
    (["--num-gpu-blocks-override", str(2**64)], f"--num-gpu-blocks-override {2**64}: must be in 1..{2**31 - 1}"),
    (["--top-k", str(2**63), "--temperature", "0.8"], "--top-k: top_k must be a positive 64-bit integer"),
])
def test_impossible_flags_are_named(argv, flag):
    proc = run_script("generate.py", "--prompt", "hi", *argv, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ") and flag in proc.stderr


@pytest.mark.timeout(180)
def test_logit_diff_keeps_its_files_when_its_reader_leaves(tmp_path):
    """`logit_diff.py ... | head`: the report's reader is gone before it is printed; the JSON is
    written anyway, and the run ends with the shell's status for that (141), no traceback."""
    out = tmp_path / "out.json"
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "logit_diff.py"), "--json", str(out),
                             "--max-new-tokens", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(150) == 141, err
    assert "Traceback" not in err and "error" not in err, err
    assert json.loads(out.read_text())["passed"]


@pytest.mark.timeout(60)
def test_logit_diff_refuses_to_overwrite_its_input(tmp_path):
    ids = tmp_path / "ids.json"
    ids.write_text("[[1, 2, 3]]")
    proc = run_script("logit_diff.py", "--prompt-ids", ids, "--json", ids, timeout=60)
    assert proc.returncode == 2 and "--json" in proc.stderr and "overwrite" in proc.stderr
    assert ids.read_text() == "[[1, 2, 3]]"
    ids.write_text("[[1, 2, 99999]]")
    proc = run_script("logit_diff.py", "--prompt-ids", ids, timeout=60)
    assert proc.returncode == 2 and "99999" in proc.stderr and str(ids) in proc.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv,message", [
    (["--tolerance", "-1"], "--tolerance -1.0: must be 0 or more"),
    (["--tolerance", "nan"], "--tolerance nan: must be 0 or more"),
    (["--min-top1", "3"], "--min-top1 3.0: must be in [0, 1]"),
    (["--prompt-ids", "DIR"], "cannot read it (Is a directory)"),
    (["--prompts", "DIR"], "cannot read it (Is a directory)"),
    (["--prompts", "LATIN1"], "not UTF-8 text"),
])
def test_logit_diff_usage_errors_before_any_rank(tmp_path, argv, message):
    """A threshold no run could meet, or an input that is not a readable text file, is a usage
    error (exit 2, one line) found before the ranks start, not a FAIL after the whole run."""
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    argv = [{"DIR": tmp_path, "LATIN1": tmp_path / "latin1.txt"}.get(a, a) for a in argv]
    proc = run_script("logit_diff.py", "--backend", "torch", *argv, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last and proc.elapsed < 30


@pytest.mark.timeout(120)
def test_kv_cache_too_small_for_one_full_length_sequence_is_one_line():
    """Found once the ranks have sized their caches: every rank refuses alike, said once."""
    proc = run_script("generate.py", "--tp", 2, "--prompt", "hi", "--max-model-len", 512,
                      "--num-gpu-blocks-override", 8, timeout=100)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith("error: --max-model-len 512: the KV cache holds 128 tokens")
    assert "--num-gpu-blocks-override" in lines[0] and not proc.leftovers


def test_weights_that_run_the_gpu_out_of_memory_are_one_line(monkeypatch):
    """The allocator running out while the weights are made or loaded is said in one line
    with what they need per rank and what to change, not the allocator's trace; and the
    server's clean-up after such a start raises nothing of its own."""
    from glm_fused import runner as R
    from glm_fused.engine_args import EngineArgs
    from glm_fused.errors import UserError
    from glm_fused.server.preprocess_pool import PreprocessPool

    def no_memory(model, seed):
        raise MemoryError("out of memory")  # what Paddle raises (torch's own type: ops.is_out_of_memory)

    monkeypatch.setattr(R, "dummy_weights", no_memory)
    settings = EngineArgs(model="glm-4.5-air-tiny", load_format="dummy", backend="torch", device="cpu",
                          dtype="float32", max_num_seqs=2, max_model_len=64, max_num_batched_tokens=64,
                          num_gpu_blocks_override=32).resolve()
    with pytest.raises(UserError) as info:
        R.ModelRunner(settings, settings.config(), tp_rank=0, tp_size=1)
    message = str(info.value)
    assert "\n" not in message and message.startswith("out of memory loading the weights")  # no GPU here
    assert "--tp 1" in message and "--quantization fp8" in message
    experts, others = settings.config().num_parameters()
    assert f"{(experts + others) * 4 / 2**30:.1f} GiB per rank" in message  # float32
    on_gpu = str(R.weights_do_not_fit(settings.config(), settings, 1, (10 * 2**30, 80 * 2**30)))
    assert on_gpu.startswith("out of GPU memory loading the weights") and "10.0 of 80.0 GiB free" in on_gpu
    monkeypatch.setattr(R, "dummy_weights", lambda model, seed: 1 / 0)  # any other failure stays itself
    with pytest.raises(ZeroDivisionError):
        R.ModelRunner(settings, settings.config(), tp_rank=0, tp_size=1)
    PreprocessPool({"model_name": "m", "vocab_size": 8}, workers=2).close()  # never started


@pytest.mark.parametrize("backend", ["torch", "paddle"])
def test_a_kv_cache_that_runs_out_of_memory_is_one_line(monkeypatch, backend):
    """As for the weights: the allocator running out while the KV cache is made is said in one
    line with the block count, its bytes per rank and what decided them. (Planted: allocating
    the real thing could wake the OOM killer on a machine that overcommits.)"""
    from glm_fused import runner as R
    from glm_fused.backends import get_backend
    from glm_fused.engine_args import EngineArgs
    from glm_fused.errors import UserError

    def no_memory(self, num_blocks, block_size):
        if backend == "torch":  # torch's CPU allocator: a RuntimeError, recognised by its text
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                               "allocate memory: you tried to allocate 819200000000 bytes.")
        raise MemoryError("(ResourceExhausted) Fail to alloc memory of 819200000000 size")

    monkeypatch.setattr(get_backend(backend).LAYERS.Glm4MoeForCausalLM, "make_kv_caches", no_memory)
    settings = EngineArgs(model="glm-4.5-air-tiny", load_format="dummy", backend=backend, device="cpu",
                          dtype="float32", max_num_seqs=2, max_model_len=64, max_num_batched_tokens=64,
                          num_gpu_blocks_override=32).resolve()
    with pytest.raises(UserError, match=r"^out of memory allocating the KV cache: 32 blocks x 16 tokens take "
                                        r"\d+\.\d GiB per rank \(--num-gpu-blocks-override\)$"):
        R.ModelRunner(settings, settings.config(), tp_rank=0, tp_size=1)
