"""Rank-side code for tests/test_paddle_model.py: the Paddle backend on N CPU ranks.

Starting ranks costs seconds on two cores, so ONE launch per TP size runs every check:
each rank drives ``ModelRunner`` through the same steps (prefill, chunked prefill, decode,
mixed and batched batches) in the fused and the classic layout, for every checkpoint,
and writes what it measured to ``rank{r}.json``. The test only reads and asserts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from glm_fused.batch import ForwardBatch  # noqa: E402
from glm_fused.config import Glm4MoeConfig  # noqa: E402

MAX_SEQS, MAX_LEN, MAX_TOKENS = 4, 64, 64


def rel_err(test, ref) -> float:
    """max |test - ref| / max |ref|, in float64."""
    test, ref = np.asarray(test, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(test - ref).max() / max(float(np.abs(ref).max()), 1e-30))


def digest(*arrays: np.ndarray) -> str:
    return hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()[:16]


class Recorder:
    """Runs batches on one runner and keeps each forward's fusion counters."""

    def __init__(self, runner):
        self.runner, self.stats = runner, []

    def __call__(self, batch: ForwardBatch) -> np.ndarray:
        logits = self.runner.forward(batch)
        self.stats.append(self.runner.fusion_stats())
        return logits


def steps(run: Recorder, p0: list[int], p1: list[int]) -> dict[str, np.ndarray]:
    """Logits of every step; each entry lines up with rows of ``expected_rows``.

    ``p0`` has 40 tokens, ``p1`` 10. Slots are reused freely: a step that starts a sequence
    at position 0 overwrites whatever an earlier step cached there.
    """
    out = {}
    # Two whole prompts in one batch (50 tokens); then token counts 1 and 3 (< TP 4).
    out["two_prompts"] = run(ForwardBatch.prefill([p0, p1], all_logits=True))
    for n in (1, 3):
        out[f"tokens_{n}"] = run(ForwardBatch.prefill([p0[:n]], all_logits=True))

    # One sequence through the cache: prefill 24, a chunk of 8 after that context, 4 decodes.
    rows = [run(ForwardBatch.prefill([p0[:24]], slots=[1], all_logits=True))]
    rows.append(run(ForwardBatch(p0[24:32], np.arange(24, 32), [1], [8], [24], np.arange(8))))
    for t in range(32, 36):
        rows.append(run(ForwardBatch.decode([p0[t]], [t], [1])))
    out["cached"] = np.concatenate(rows)

    # Mixed batch: sequence A (slot 0) prefills 12 tokens while B (slot 2) decodes its 7th.
    run(ForwardBatch.prefill([p1[:6]], slots=[2]))
    mixed = ForwardBatch(np.array([*p0[:12], p1[6]]), np.array([*range(12), 6]), [0, 2], [12, 1], [0, 6],
                         np.arange(13))
    out["mixed"] = run(mixed)

    # Batched decode (every query_len 1): two sequences at different context lengths.
    run(ForwardBatch.prefill([p0[:33], p1[:7]], slots=[3, 0]))
    out["batched_decode"] = np.concatenate([
        run(ForwardBatch.decode([p0[33 + i], p1[7 + i]], [33 + i, 7 + i], [3, 0])) for i in range(2)])
    return out


def expected_rows(full0: np.ndarray, full1: np.ndarray) -> dict[str, np.ndarray]:
    """The rows of full-prompt logits each step must reproduce (causal: a prefix's logits
    are the first rows of the whole prompt's)."""
    return {
        "two_prompts": np.concatenate([full0, full1]),
        "tokens_1": full0[:1],
        "tokens_3": full0[:3],
        "cached": full0[:36],
        "mixed": np.concatenate([full0[:12], full1[6:7]]),  # = the two sequences run separately
        "batched_decode": np.stack([full0[33], full1[7], full0[34], full1[8]]),
    }


def hf_logits(ckpt: str, name: str) -> tuple[np.ndarray, np.ndarray]:
    """transformers' logits of both prompts, saved by the test beside the checkpoint."""
    return tuple(np.load(Path(ckpt).parent / f"{name}_hf_{i}.npy") for i in (0, 1))


def tp_checks(args: dict) -> None:
    """Every check for one TP size; each rank writes ``args['out']/rank{r}.json``."""
    import paddle

    from glm_fused.paddle_backend import (Glm4MoeForCausalLM, ModelRunner, barrier, broadcast_int64,
                                          device_info, init_distributed)

    from glm_fused.fusion import FallbackLog

    rank, world = init_distributed()
    FallbackLog.reset()  # TP 1 runs inside the test process: start from a fresh process's state
    log: list[str] = []  # every log record of this rank, to count the fallback messages
    logging.getLogger().addHandler(_ListHandler(log))
    logging.getLogger().setLevel(logging.INFO)
    p0, p1 = args["prompts"]
    result: dict = {"rank": rank, "world": world, "device": device_info(), "checkpoints": {}}
    for name, ckpt in args["checkpoints"].items():
        config = Glm4MoeConfig.from_pretrained(ckpt)
        hf0, hf1 = hf_logits(ckpt, name)
        refs = expected_rows(hf0, hf1)
        entry: dict = {"layers": config.num_hidden_layers, "vs_hf": {}, "vs_own_full": {}, "stats": {}, "digest": {}}
        logits = {}
        for fused in (True, False):
            mode = "fused" if fused else "unfused"
            runner = ModelRunner(config, ckpt, tp_rank=rank, tp_size=world, dtype="float32", fused=fused,
                                 fusion="auto", max_num_seqs=MAX_SEQS, max_model_len=MAX_LEN,
                                 max_num_batched_tokens=MAX_TOKENS)
            run = Recorder(runner)
            got = steps(run, p0, p1)
            runner.close()
            logits[mode] = got
            entry["stats"][mode] = run.stats
            entry["vs_hf"][mode] = {k: rel_err(v, refs[k]) for k, v in got.items()}
            # The cache paths against this runner's own one-shot forward of the same tokens.
            own = expected_rows(got["two_prompts"][:40], got["two_prompts"][40:])
            entry["vs_own_full"][mode] = {k: rel_err(got[k], own[k])
                                          for k in ("tokens_1", "tokens_3", "cached", "mixed", "batched_decode")}
            entry["digest"][mode] = digest(*(got[k] for k in sorted(got)))
        entry["fused_vs_unfused"] = {k: rel_err(logits["fused"][k], logits["unfused"][k]) for k in logits["fused"]}
        result["checkpoints"][name] = entry

    # ---- once per launch, on the first checkpoint --------------------------------------
    name, ckpt = next(iter(args["checkpoints"].items()))
    config = Glm4MoeConfig.from_pretrained(ckpt)
    hf0, hf1 = hf_logits(ckpt, name)

    # fusion="flashinfer" on CPU: the kernel cannot run, every call falls back; the runner says so.
    start = len(log)
    runner = ModelRunner(config, ckpt, tp_rank=rank, tp_size=world, dtype="float32", fused=True,
                         fusion="flashinfer", max_num_seqs=MAX_SEQS, max_model_len=MAX_LEN,
                         max_num_batched_tokens=MAX_TOKENS)
    run = Recorder(runner)
    forced = run(ForwardBatch.prefill([p0[:5]], all_logits=True))
    run(ForwardBatch.decode([p0[5]], [5], [0]))
    runner.close()
    result["forced_flashinfer"] = {"stats": run.stats, "vs_hf": rel_err(forced, hf0[:5]), "log": log[start:]}

    # The model on its own: from_pretrained + model(ids) on a [batch, seq] array and a [seq] tensor.
    model = Glm4MoeForCausalLM.from_pretrained(ckpt, tp_rank=rank, tp_size=world, fused=True)
    batch_logits = model(np.array([p0[:10], p1[:10]])).numpy()
    seq_logits = model(paddle.to_tensor(p1)).numpy()
    result["standalone"] = {"shape_2d": list(batch_logits.shape), "shape_1d": list(seq_logits.shape),
                            "vs_hf_2d": rel_err(batch_logits, np.stack([hf0[:10], hf1[:10]])),
                            "vs_hf_1d": rel_err(seq_logits, hf1)}

    # Dummy weights: deterministic, and the replicated router is the same on every rank.
    dummy = []
    for _ in range(2):
        r = ModelRunner(config, None, tp_rank=rank, tp_size=world, dtype="float32", fused=True, fusion="auto",
                        max_num_seqs=1, max_model_len=16, max_num_batched_tokens=16, load_format="dummy", seed=7)
        dummy.append(r.forward(ForwardBatch.prefill([p0[:4]])))
        params = dict(r.model.named_parameters())
        router, norm = params["layers.1.mlp.gate.weight"].numpy(), params["norm.weight"].numpy()
        r.close()
    result["dummy"] = {"repeat_equal": bool(np.array_equal(dummy[0], dummy[1])),
                       "finite": bool(np.isfinite(dummy[0]).all()), "router_digest": digest(router),
                       "norm_all_ones": bool((norm == 1).all()), "logits_std": float(dummy[0].std())}

    # The module API's collectives.
    sent = np.arange(6, dtype=np.int64) * 7 if rank == 0 else None
    result["broadcast"] = broadcast_int64(sent, src=0).tolist()
    barrier()
    result["log"] = log
    (Path(args["out"]) / f"rank{rank}.json").write_text(json.dumps(result))


class _ListHandler(logging.Handler):
    def __init__(self, sink: list[str]):
        super().__init__(logging.INFO)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        self.sink.append(record.getMessage())
