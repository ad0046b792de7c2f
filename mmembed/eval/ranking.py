"""The ranking core of every retrieval evaluation: top-k search and ranking metrics.

Used by ``metrics.retrieval_metrics`` (training evaluation, STS retrieval in ``sts``),
``beir`` (graded BEIR evaluation) and hard-negative mining (``tools.mining``).

Ranking
-------
Documents are ranked by decreasing score; equal scores are ordered by increasing document
index, so rankings are deterministic. A ``-inf`` or ``nan`` score means "not a candidate":
such a document is never ranked (this is how callers exclude documents).

Metrics (per query, then averaged over queries)
-----------------------------------------------
``rel(d)`` is the graded relevance of document ``d`` (0 when unjudged; a grade <= 0 is not
relevant), ``R_q`` the documents with ``rel > 0``, ``d_r`` the document at rank ``r``
(from 1):

- ``recall@k = |R_q ∩ top_k| / |R_q|``;
- ``mrr@c = 1 / r`` of the first relevant document if ``r <= c``, else 0;
- ``ndcg@c = DCG / IDCG``, ``DCG = sum_{r=1}^{c} rel(d_r) / log2(r + 1)`` (linear gain, as
  trec_eval and BEIR), ``IDCG`` the same sum over the grades of ``R_q`` sorted in
  decreasing order.

Binary relevance is the case where every grade is 1. Relevant documents that are not in
the ranking at all (missing from the corpus, or ranked below the depth searched) still
count in ``|R_q|`` and ``IDCG``.

Memory
------
``search`` scores the queries in blocks of rows so that at most ``_BLOCK_ELEMENTS``
scores are held at once, whatever the number of queries and documents.

Functions
---------
- ``rows_per_block``: how many score rows of ``n_cols`` columns fit in one block.
- ``top_k``: the best ``k`` columns of each row of a score matrix.
- ``search``: the best ``k`` documents of each query by dot product, blockwise.
- ``ranking_metrics``: ``ndcg@c``, ``mrr@c``, ``recall@k`` of ranked documents.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence

import numpy as np

__all__ = ["rows_per_block", "top_k", "search", "ranking_metrics"]

# Upper bound on the number of scores held at once (2**22: 32 MiB in float64, 16 MiB in float32).
_BLOCK_ELEMENTS = 1 << 22


def rows_per_block(n_cols: int) -> int:
    """The number of rows of ``n_cols`` scores that fit in ``_BLOCK_ELEMENTS`` (at least 1)."""
    return max(1, _BLOCK_ELEMENTS // max(1, n_cols))


def top_k(scores: np.ndarray, k: int) -> list[np.ndarray]:
    """Per row of ``scores`` ``[B, C]``: the column indices of the ``k`` highest scores, best
    first, equal scores by increasing index. ``-inf`` (and ``nan``) entries are never
    returned, so a row may give fewer than ``k``; ``k >= C`` gives every other column."""
    s = np.asarray(scores)
    if s.ndim != 2:
        raise ValueError(f"scores must be [B, C], got shape {tuple(s.shape)}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    s = np.where(np.isnan(s), -np.inf, s)
    n = s.shape[1]
    if k < n:
        kth = np.partition(s, n - k, axis=1)[:, n - k]  # the k-th highest value of each row
    out = []
    for i, row in enumerate(s):
        # every column at or above the k-th value (ties at the boundary all kept, then cut by index)
        cand = np.flatnonzero(row >= kth[i]) if k < n else np.arange(n)
        cand = cand[row[cand] > -np.inf]
        out.append(cand[np.argsort(-row[cand], kind="stable")][:k])
    return out


def search(
    queries: np.ndarray,
    docs: np.ndarray,
    k: int,
    *,
    exclude: Sequence[Collection[int]] | None = None,
    score: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
) -> list[np.ndarray]:
    """The ``k`` best documents of each query by dot product, best first (``top_k``'s order).

    ``queries`` ``[Q, D]`` and ``docs`` ``[C, D]`` are numpy arrays; the scores are computed
    in their dtype, ``rows_per_block(C)`` queries at a time. ``exclude``, if given, holds
    one collection of document indices per query that are never ranked for it. ``score``:
    another similarity, ``score(queries_block, docs) -> [b, C]`` (e.g. MaxSim of multi-vector
    rows ``[Q, Lq, D]`` and ``[C, Ld, D]``); the dot product when None. Returns ``Q``
    integer arrays of at most ``k`` document indices.
    """
    q = np.asarray(queries)
    d = np.asarray(docs)
    if score is None and (q.ndim != 2 or d.ndim != 2 or q.shape[1] != d.shape[1]):
        raise ValueError(f"queries [Q, D] and docs [C, D] must share D, got shapes {q.shape} and {d.shape}")
    if exclude is not None and len(exclude) != q.shape[0]:
        raise ValueError(f"exclude must have one entry per query ({q.shape[0]}), got {len(exclude)}")
    out: list[np.ndarray] = []
    step = rows_per_block(d.shape[0])
    for start in range(0, q.shape[0], step):
        scores = q[start : start + step] @ d.T if score is None else np.array(score(q[start : start + step], d))
        if exclude is not None:
            for row, skip in enumerate(exclude[start : start + scores.shape[0]]):
                if len(skip):
                    scores[row, np.fromiter(skip, dtype=np.intp, count=len(skip))] = -np.inf
        out += top_k(scores, k)
    return out


def ranking_metrics(
    rankings: Sequence[Sequence[Hashable]],
    relevance: Sequence[Mapping[Hashable, float]],
    ks: Sequence[int] = (1, 10, 100),
    cutoff: int = 10,
) -> dict[str, float]:
    """Graded metrics of ranked documents (see the module docstring for the formulas).

    ``rankings[i]`` is query ``i``'s ranked documents (any hashable keys: indices, ids), at
    least ``max(ks, cutoff)`` deep unless fewer documents are candidates; ``relevance[i]``
    its judgements ``{document: grade}``. Every query must have a document with grade > 0.
    Returns ``ndcg@{cutoff}``, ``mrr@{cutoff}`` and ``recall@k`` for ``ks``, as Python floats.
    """
    if len(rankings) != len(relevance) or not rankings:
        raise ValueError("ranking_metrics needs one relevance dict per ranking, and at least one query")
    if cutoff < 1 or any(k < 1 for k in ks):
        raise ValueError(f"cut-offs must be >= 1, got ks={tuple(ks)}, cutoff={cutoff}")
    ndcg, mrr = [], []
    recall: dict[int, list[float]] = {k: [] for k in ks}
    discounts = [1.0 / math.log2(r + 1) for r in range(1, cutoff + 1)]
    for ranked, rel in zip(rankings, relevance):
        grades = sorted((g for g in rel.values() if g > 0), reverse=True)
        if not grades:
            raise ValueError("every evaluated query needs a document with score > 0")
        gains = [max(0.0, rel.get(d, 0.0)) for d in ranked]
        dcg = sum(g * w for g, w in zip(gains[:cutoff], discounts))
        idcg = sum(g * w for g, w in zip(grades[:cutoff], discounts))
        ndcg.append(dcg / idcg)
        first = next((r for r, g in enumerate(gains[:cutoff], 1) if g > 0), None)
        mrr.append(1.0 / first if first else 0.0)
        for k in ks:
            recall[k].append(sum(g > 0 for g in gains[:k]) / len(grades))
    out = {f"ndcg@{cutoff}": float(np.mean(ndcg)), f"mrr@{cutoff}": float(np.mean(mrr))}
    out.update({f"recall@{k}": float(np.mean(v)) for k, v in recall.items()})
    return out


def probabilities(scores: Sequence[float] | np.ndarray) -> np.ndarray:
    """``sigmoid(scores)`` as float32 (computed in float64 by ``torch.sigmoid``, which neither
    overflows nor fails at either end: a raw score of -1000 gives 0.0, one of 1000 gives 1.0).
    For a generative reranker's ``logit(yes) - logit(no)`` this is the probability of the
    positive token against the negative one, ``softmax([logit(no), logit(yes)])[1]``."""
    import torch

    raw = torch.as_tensor(np.asarray(scores, dtype=np.float64))
    return torch.sigmoid(raw).numpy().astype(np.float32)


def rank_order(scores: Sequence[float] | np.ndarray, top_n: int | None = None) -> np.ndarray:
    """The indices of ``scores`` (raw scores), highest first, ties in index order (a stable
    sort), at most ``top_n`` (None: all)."""
    return np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")[:top_n]
