"""Rank-side code for tests/test_torch_model.py: the torch backend on N CPU ranks.

One multi-rank run does every check for its TP size (starting ranks costs seconds on two
cores): each rank runs the same scenarios through ``ModelRunner`` in fused and classic
layout for every checkpoint, compares, and writes ``rank{r}.json`` (+ logits ``.npz`` on
rank 0); the test asserts on those files.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from glm_fused.batch import ForwardBatch  # noqa: E402
from glm_fused.config import Glm4MoeConfig  # noqa: E402

MAX_SEQS, MAX_LEN, MAX_TOKENS = 4, 64, 64


def rel_err(test: np.ndarray, ref: np.ndarray) -> float:
    """max |test - ref| / max |ref|."""
    return float(np.abs(np.asarray(test, np.float64) - ref).max() / max(float(np.abs(ref).max()), 1e-30))


def compare(test: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """Differences relative to the reference's scale (max |ref|): ``max`` and ``mean`` |diff|,
    ``p90`` the 90th percentile over rows of a row's max |diff|; ``top1`` argmax agreement."""
    test, ref = np.asarray(test, np.float64), np.asarray(ref, np.float64)
    scale = max(float(np.abs(ref).max()), 1e-30)
    rows = np.abs(test - ref).reshape(-1, ref.shape[-1]).max(axis=-1) / scale
    return {"max": float(rows.max()), "mean": float(np.abs(test - ref).mean() / scale),
            "p90": float(np.percentile(rows, 90)), "top1": float(np.mean(test.argmax(-1) == ref.argmax(-1)))}


def compare_all(tests: dict[str, np.ndarray], refs: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
    """Per scenario, plus ``all``: every row of every scenario pooled (for bf16, where a few
    rows flip an expert choice under rounding and a 1-row scenario says little on its own)."""
    table = {k: compare(v, refs[k]) for k, v in tests.items()}
    table["all"] = compare(np.concatenate([tests[k] for k in tests]), np.concatenate([refs[k] for k in tests]))
    return table


def _step(batch: ForwardBatch, runner, stats: list) -> np.ndarray:
    logits = runner.forward(batch)
    stats.append(runner.fusion_stats())
    return logits


def run_scenarios(runner, prompts: list[list[int]]) -> tuple[dict[str, np.ndarray], list[dict]]:
    """Logits of each scenario, each laid out to compare with the full-prompt references.

    ``prompts[0]`` has 40 tokens, ``prompts[1]`` has 7. Slots are reused: every scenario
    starts its sequences at position 0, overwriting what an earlier one cached.
    """
    p0, p1 = prompts[0], prompts[1]
    stats: list[dict] = []
    out: dict[str, np.ndarray] = {}

    def prefill(ps, slots=None):
        return _step(ForwardBatch.prefill(ps, slots=slots, all_logits=True), runner, stats)

    # Whole prompts in one batch (two sequences, 47 tokens); and token counts 1, 3, 40.
    out["prefill_2seq"] = prefill([p0, p1])
    out["tokens_1"] = prefill([p0[:1]])
    out["tokens_3"] = prefill([p0[:3]])
    out["tokens_40"] = prefill([p0])

    # KV cache: prefill 20, chunked prefill of 10 more after cached context, then 10 decode steps.
    rows = [prefill([p0[:20]], slots=[1])]
    rows.append(_step(ForwardBatch(p0[20:30], np.arange(20, 30), [1], [10], [20], np.arange(10)), runner, stats))
    for t in range(30, 40):
        rows.append(_step(ForwardBatch.decode([p0[t]], [t], [1]), runner, stats))
    out["cached_decode"] = np.concatenate(rows)  # rows of positions 0..39 of p0

    # Mixed batch: sequence A decodes its last token while sequence B prefills its whole prompt.
    _step(ForwardBatch.prefill([p0[:39]], slots=[0]), runner, stats)
    mixed = ForwardBatch(np.array([p0[39], *p1]), np.array([39, *range(len(p1))]), [0, 2],
                         [1, len(p1)], [39, 0], np.arange(1 + len(p1)))
    out["mixed"] = _step(mixed, runner, stats)  # row 0: p0 position 39; rows 1..: p1

    # Batched decode of two sequences with different context lengths.
    _step(ForwardBatch.prefill([p0[:35], p1[:5]], slots=[3, 0]), runner, stats)
    steps = [_step(ForwardBatch.decode([p0[35 + i], p1[5 + i]], [35 + i, 5 + i], [3, 0]), runner, stats)
             for i in range(2)]
    out["batched_decode"] = np.concatenate(steps)  # p0@35, p1@5, p0@36, p1@6
    return out, stats


def references(ref0: np.ndarray, ref1: np.ndarray) -> dict[str, np.ndarray]:
    """The rows of the full-prompt references each scenario should reproduce."""
    return {
        "prefill_2seq": np.concatenate([ref0, ref1]),
        "tokens_1": ref0[:1],  # causal: a prefix's logits are the full prompt's first rows
        "tokens_3": ref0[:3],
        "tokens_40": ref0,
        "cached_decode": ref0,
        "mixed": np.concatenate([ref0[39:40], ref1]),
        "batched_decode": np.stack([ref0[35], ref1[5], ref0[36], ref1[6]]),
    }


def self_consistency(out: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
    """Cached and batched paths against this runner's own one-shot forward of the same tokens."""
    full0, full1 = out["tokens_40"], out["prefill_2seq"][40:]
    keys = ("cached_decode", "mixed", "batched_decode", "prefill_2seq")
    return compare_all({k: out[k] if k != "prefill_2seq" else out[k][:40] for k in keys}, {
        "cached_decode": full0,
        "mixed": np.concatenate([full0[39:40], full1]),
        "batched_decode": np.stack([full0[35], full1[5], full0[36], full1[6]]),
        "prefill_2seq": full0,
    })


def tp_checks(args: dict) -> None:
    """Every multi-rank check for one TP size; results to ``args['out']/rank{r}.json``.

    ``args``: ``out``, ``prompts``, ``checkpoints`` (name -> directory holding
    ``hf_logits_{0,1}.npy``), and optionally ``backend`` (torch | paddle: the scenarios use
    only the backend API of docs/design.md, so the same checks run the Paddle backend for
    comparison), ``dtype`` (float32) and ``fusion`` (auto).
    """
    from glm_fused.backends import get_backend

    backend = get_backend(args.get("backend", "torch"))
    rank, world = backend.init_distributed()
    out_dir = Path(args["out"])
    prompts = args["prompts"]
    result: dict = {"rank": rank, "world": world, "device": backend.device_info(), "checkpoints": {}}
    saved: dict[str, np.ndarray] = {}
    for name, ckpt in args["checkpoints"].items():
        config = Glm4MoeConfig.from_pretrained(ckpt)
        refs = references(np.load(Path(ckpt) / "hf_logits_0.npy"), np.load(Path(ckpt) / "hf_logits_1.npy"))
        logits, entry = {}, {"vs_hf": {}, "self": {}, "stats": {}, "digest": {}}
        for fused in (True, False):
            mode = "fused" if fused else "unfused"
            runner = backend.ModelRunner(config, ckpt, tp_rank=rank, tp_size=world,
                                         dtype=args.get("dtype", "float32"), fused=fused,
                                         fusion=args.get("fusion", "auto"), max_num_seqs=MAX_SEQS,
                                         max_model_len=MAX_LEN, max_num_batched_tokens=MAX_TOKENS)
            logits[mode], stats = run_scenarios(runner, prompts)
            runner.close()
            entry["vs_hf"][mode] = compare_all(logits[mode], refs)
            entry["self"][mode] = self_consistency(logits[mode])
            entry["stats"][mode] = stats
            # Every rank must hold the same full-vocab logits: compare digests across ranks.
            entry["digest"][mode] = hashlib.sha256(
                b"".join(v.astype(np.float32).tobytes() for _, v in sorted(logits[mode].items()))).hexdigest()
            saved[f"{name}.{mode}"] = logits[mode]["prefill_2seq"]
        entry["fused_vs_unfused"] = compare_all(logits["fused"], logits["unfused"])
        entry["num_layers"] = config.num_hidden_layers
        result["checkpoints"][name] = entry
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    if rank == 0:
        np.savez(out_dir / "logits.npz", **saved)
