"""Accuracy maths for comparing two sets of logits. Framework-free (numpy, float64)."""

from __future__ import annotations

import numpy as np


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def kl_divergence(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(P || Q) per row, P the reference distribution."""
    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return (np.exp(lp) * (lp - lq)).sum(axis=-1)


def topk_agreement(a: np.ndarray, b: np.ndarray, k: int) -> float:
    """Mean overlap of the k most likely tokens (k=1: fraction of equal argmax)."""
    if k == 1:
        return float(np.mean(a.argmax(-1) == b.argmax(-1)))
    ta = np.argpartition(-a, k - 1, axis=-1)[..., :k]
    tb = np.argpartition(-b, k - 1, axis=-1)[..., :k]
    overlap = [len(set(x) & set(y)) / k for x, y in zip(ta.reshape(-1, k), tb.reshape(-1, k))]
    return float(np.mean(overlap))


def compare_logits(ref: np.ndarray, test: np.ndarray) -> dict:
    """Metrics of ``test`` against ``ref``, both [positions, vocab]."""
    ref = np.asarray(ref, dtype=np.float64)
    test = np.asarray(test, dtype=np.float64)
    if ref.shape != test.shape:
        raise ValueError(f"logit shapes differ: {ref.shape} vs {test.shape}")
    diff = np.abs(ref - test)
    scale = float(np.abs(ref).max()) or 1.0
    row_scale = np.abs(ref).max(axis=-1)
    kl = kl_divergence(ref, test)
    return {
        "positions": int(ref.shape[0]),
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "max_rel_diff": float(diff.max() / scale),  # relative to the largest logit
        # each row's max |diff| relative to that row's largest logit, averaged over rows
        "mean_row_rel_diff": float(np.mean(diff.max(axis=-1) / np.where(row_scale > 0, row_scale, 1.0))),
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "top1_agreement": topk_agreement(ref, test, 1),
        "top5_agreement": topk_agreement(ref, test, min(5, ref.shape[-1])),
    }


def sequence_agreement(a: list[int], b: list[int]) -> float:
    """Fraction of the continuation that matches before the first divergence."""
    n = max(len(a), len(b))
    if n == 0:
        return 1.0
    same = 0
    for x, y in zip(a, b):
        if x != y:
            break
        same += 1
    return same / n


def aggregate(per_prompt: list[dict]) -> dict:
    """Overall row: worst case for maxima, position-weighted means for the rest."""
    weights = np.array([m["positions"] for m in per_prompt], dtype=np.float64)
    out = {"positions": int(weights.sum())}
    for key in per_prompt[0]:
        if key == "positions":
            continue
        vals = np.array([m[key] for m in per_prompt], dtype=np.float64)
        if key.startswith("max") or key == "kl_max":
            out[key] = float(vals.max())
        else:
            out[key] = float((vals * weights).sum() / weights.sum())
    return out
