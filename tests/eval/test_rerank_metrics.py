"""A reranker's eval metrics against a plain per-group loop: each group sorted by score, the
positive's rank (ties against it), then mrr@10, ndcg@10 and accuracy; and the metric names
the run's --metric_for_best_model check knows."""

import math

import numpy as np
import pytest

from mmembed.encoding.layout import Layout
from mmembed.eval.rerank import RERANK_METRICS, rerank_metrics
from mmembed.training.evaluation import eval_metric_names


def _reference(scores, labels, groups):
    by_group = {}
    for s, y, g in zip(scores, labels, groups):
        by_group.setdefault(g, []).append((s, y))
    mrr = ndcg = acc = 0.0
    for pairs in by_group.values():
        pos = next(s for s, y in pairs if y == 1)
        rank = 1 + sum(1 for s, y in pairs if y == 0 and s >= pos)
        mrr += 1 / rank if rank <= 10 else 0
        ndcg += 1 / math.log2(rank + 1) if rank <= 10 else 0
        acc += rank == 1
    n = len(by_group)
    return {"mrr_at_10": mrr / n, "ndcg_at_10": ndcg / n, "accuracy": acc / n}


def test_metrics_equal_a_plain_loop_over_groups():
    rng = np.random.default_rng(0)
    scores, labels, groups = [], [], []
    for g in range(40):
        size = int(rng.integers(1, 16))  # groups past 10 candidates too
        values = rng.integers(-3, 4, size=size).astype(float)  # ties on purpose
        scores += values.tolist()
        labels += [1.0] + [0.0] * (size - 1)
        groups += [g * 7] * size  # any ids
    got = rerank_metrics(np.array(scores), np.array(labels), np.array(groups))
    want = _reference(scores, labels, groups)
    assert got.keys() == want.keys() == set(RERANK_METRICS)
    for k in want:
        assert got[k] == pytest.approx(want[k], abs=1e-12), k


def test_a_group_without_one_positive_is_an_error_and_the_names_are_known():
    with pytest.raises(ValueError, match="exactly one positive"):
        rerank_metrics(np.array([1.0, 2.0]), np.array([0.0, 0.0]), np.array([0, 0]))
    assert eval_metric_names(Layout.RERANK, True, [], False) == {"eval_loss", "eval_mrr_at_10", "eval_ndcg_at_10", "eval_accuracy"}
