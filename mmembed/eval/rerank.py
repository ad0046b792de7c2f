"""A reranker's held-out metrics: each group (a positive and its candidates) ranked by score.

The eval rows are scored as :class:`~mmembed.tasks.reranker.inputs.RerankCollator` lays them
out with ``train=False``: each positive followed by every negative of its row, ``group_ids``
naming the group of each pair. Per group, the positive's rank ``r`` among the group's scores
(1 = the best; a tie counts against the positive, as the worst rank among equals), then the
mean over the groups of:

- ``mrr_at_10``: ``1 / r`` when ``r <= 10``, else 0;
- ``ndcg_at_10``: ``1 / log2(r + 1)`` when ``r <= 10``, else 0 (one relevant candidate: its DCG
  over the ideal's);
- ``accuracy``: ``r == 1``, the positive scored above every negative.

(ms-swift's reranker metrics ``mrr`` and ``ndcg`` are the same without the cut at 10.)

A group of one (a row with no negatives) ranks its positive first.
"""

from __future__ import annotations

import numpy as np

__all__ = ["RERANK_METRICS", "rerank_metrics"]

RERANK_METRICS = ("mrr_at_10", "ndcg_at_10", "accuracy")
CUTOFF = 10


def rerank_metrics(scores: np.ndarray, labels: np.ndarray, group_ids: np.ndarray) -> dict[str, float]:
    """``{"mrr_at_10", "ndcg_at_10", "accuracy"}`` of the pairs' ``scores`` ``[N]``, ``labels`` ``[N]`` (1.0 for
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
    kept = rank <= CUTOFF
    return {"mrr_at_10": float(np.mean(np.where(kept, 1.0 / rank, 0.0))),
            "ndcg_at_10": float(np.mean(np.where(kept, 1.0 / np.log2(rank + 1), 0.0))),
            "accuracy": float(np.mean(rank == 1))}
