"""A reranker's held-out metrics: each group (a positive and its candidates) ranked by score.

The eval rows are scored as :class:`~mmembed.encoding.rerank_inputs.RerankCollator` lays them
out with ``train=False``: each positive followed by every negative of its row, ``group_ids``
naming the group of each pair. Per group, the positive's rank ``r`` among the group's scores
(1 = the best; a tie counts against the positive, as the worst rank among equals), then the
mean over the groups of:

- ``mrr``: ``1 / r`` (ms-swift's reranker ``mrr``);
- ``ndcg``: ``1 / log2(r + 1)`` (one relevant candidate: its DCG over the ideal's, ms-swift's ``ndcg``);
- ``acc``: ``r == 1``, the positive scored above every negative.

A group of one (a row with no negatives) ranks its positive first.
"""

from __future__ import annotations

import numpy as np

__all__ = ["RERANK_METRICS", "rerank_metrics"]

RERANK_METRICS = ("mrr", "ndcg", "acc")


def rerank_metrics(scores: np.ndarray, labels: np.ndarray, group_ids: np.ndarray) -> dict[str, float]:
    """``{"mrr", "ndcg", "acc"}`` of the pairs' ``scores`` ``[N]``, ``labels`` ``[N]`` (1.0 for
    the one positive of each group) and ``group_ids`` ``[N]`` (a group's pairs together, any
    ids). Raises ValueError when a group has no positive or several."""
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    labels = np.asarray(labels).reshape(-1)
    groups = np.asarray(group_ids).reshape(-1)
    if not (scores.shape == labels.shape == groups.shape):
        raise ValueError(f"scores, labels and group_ids differ in length: {scores.shape}, {labels.shape}, {groups.shape}")
    if not scores.size:
        return {name: 0.0 for name in RERANK_METRICS}
    _, group = np.unique(groups, return_inverse=True)
    n_groups = int(group.max()) + 1
    positive = labels == 1
    per_group = np.bincount(group, weights=positive.astype(np.float64), minlength=n_groups)
    if not np.all(per_group == 1):
        bad = int(np.flatnonzero(per_group != 1)[0])
        raise ValueError(f"each group needs exactly one positive; group {bad} has {int(per_group[bad])}")
    positive_score = np.zeros(n_groups)
    positive_score[group[positive]] = scores[positive]
    # the positive's rank: 1 + the group's negatives scored at or above it
    ahead = (~positive) & (scores >= positive_score[group])
    rank = 1 + np.bincount(group, weights=ahead.astype(np.float64), minlength=n_groups)
    return {"mrr": float(np.mean(1.0 / rank)), "ndcg": float(np.mean(1.0 / np.log2(rank + 1))),
            "acc": float(np.mean(rank == 1))}
