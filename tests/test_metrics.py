"""Accuracy maths against direct formulas."""

import numpy as np

from glm_fused import metrics


def test_identical_logits_have_zero_distance():
    x = np.random.default_rng(0).normal(size=(5, 50))
    m = metrics.compare_logits(x, x.copy())
    assert m["max_abs_diff"] == 0 and abs(m["kl_mean"]) < 1e-12
    assert m["top1_agreement"] == 1 and m["top5_agreement"] == 1


def test_kl_matches_the_definition():
    rng = np.random.default_rng(1)
    p, q = rng.normal(size=(3, 7)), rng.normal(size=(3, 7))
    pp = np.exp(p) / np.exp(p).sum(-1, keepdims=True)
    qq = np.exp(q) / np.exp(q).sum(-1, keepdims=True)
    np.testing.assert_allclose(metrics.kl_divergence(p, q), (pp * np.log(pp / qq)).sum(-1), rtol=1e-10)


def test_topk_agreement_counts_overlap():
    a = np.array([[5.0, 4, 3, 2, 1, 0]])
    b = np.array([[5.0, 4, 3, 2, 0, 1]])  # top-5 sets share 4 of 5
    assert metrics.topk_agreement(a, b, 1) == 1.0
    assert metrics.topk_agreement(a, b, 5) == 0.8
    c = np.array([[0.0, 4, 3, 2, 1, 5]])
    assert metrics.topk_agreement(a, c, 1) == 0.0


def test_sequence_agreement_stops_at_first_divergence():
    assert metrics.sequence_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    assert metrics.sequence_agreement([], []) == 1.0


def test_aggregate_takes_worst_max_and_weighted_means():
    rows = [{"positions": 1, "max_abs_diff": 1.0, "mean_abs_diff": 1.0},
            {"positions": 3, "max_abs_diff": 2.0, "mean_abs_diff": 0.0}]
    out = metrics.aggregate(rows)
    assert out == {"positions": 4, "max_abs_diff": 2.0, "mean_abs_diff": 0.25}
