"""Evaluation metrics for embeddings: ms-swift's (InfoNCE and pair metrics) plus retrieval.

Every function here is pure: it takes embeddings (numpy arrays or torch tensors of any
dtype and device), converts them to float64 numpy, and returns a ``dict[str, float]``.
No model code, no environment reads; the trainer decides what to pass.

Similarity is the dot product throughout (except ``pair_metrics``, which reports cosine,
dot and distances side by side): mmembed's models L2-normalize their output, so the dot
product is the cosine similarity.

Large evaluation sets are scored in blocks of rows, so memory stays bounded by
``ranking._BLOCK_ELEMENTS`` scores at a time whatever the number of queries and documents.
Retrieval ranks and scores with the shared core of ``ranking`` (``search``,
``ranking_metrics``), as the BEIR evaluation does.

Functions
---------
- ``infonce_metrics``: ``mean_pos``, ``mean_neg``, ``margin`` as ms-swift reports them.
- ``candidate_metrics``: the same three from the candidates a loss weighs (its settings).
- ``retrieval_metrics``: ``recall@k``, ``mrr@10``, ``ndcg@10`` with deterministic ties.
- ``pair_metrics``: pearson / spearman of the label against cosine, dot, -manhattan,
  -euclidean.
- ``embedding_eval_metrics``: the two first ones, straight from ms-swift's InfoNCE layout
  (``[N, D]`` embeddings in group order and ``[N - B]`` labels).
- ``layout_metrics``: the metrics of a batch layout (``encoding.layout.Layout``): pair
  metrics for pairs, ``embedding_eval_metrics`` for groups. The one place that choice is made.

The layouts are read with ``encoding.layout``'s splitters, the ones the losses use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from ..encoding.layout import Layout, split_groups_numpy, split_pair_rows
from .ranking import ranking_metrics, rows_per_block, search

__all__ = [
    "infonce_metrics",
    "retrieval_metrics",
    "pair_metrics",
    "embedding_eval_metrics",
    "candidate_metrics",
    "layout_metrics",
]


def _to_numpy(x: Any, name: str, ndim: int | None = None) -> np.ndarray:
    """Return ``x`` as a float64 numpy array (torch tensors of any dtype/device included)."""
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch here
        import torch

        x = x.detach().to(device="cpu", dtype=torch.float64).numpy()
    arr = np.asarray(x, dtype=np.float64)
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(arr.shape)}")
    return arr


def _to_int_array(x: Any, name: str) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-dimensional, got shape {tuple(arr.shape)}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.all(np.equal(np.mod(arr, 1), 0)):
            raise ValueError(f"{name} must hold integers, got {arr[:8]!r}...")
    return arr.astype(np.int64)


# ---------------------------------------------------------------------------------------
# InfoNCE (ms-swift's InfonceMetrics)
# ---------------------------------------------------------------------------------------


def infonce_metrics(
    anchors: Any,
    positives: Any,
    negatives: Any,
    neg_group: Any,
    *,
    use_batch: bool = True,
) -> dict[str, float]:
    """ms-swift's InfoNCE evaluation metrics over a whole evaluation set.

    Inputs
    ------
    anchors:   ``[B, D]``, anchor ``a_i`` of group ``i``.
    positives: ``[B, D]``, positive ``p_i`` of group ``i``.
    negatives: ``[M, D]``, hard negatives of all groups (``M`` may be 0; ``None`` means 0).
    neg_group: ``[M]`` int, the group (anchor index in ``[0, B)``) each negative belongs to
               (``None`` when ``M = 0``).

    Definitions (``s(x, y) = x . y``, the cosine for L2-normalized embeddings)
    --------------------------------------------------------------------------
    The candidates of anchor ``i`` other than its own positive, ``O_i``, are:

    - ``use_batch=True`` (ms-swift's default, ``INFONCE_USE_BATCH=True``): every other
      document of the whole set, i.e. ``p_j`` for ``j != i`` and every negative of every
      group; ``|O_i| = B - 1 + M`` for all ``i``.
    - ``use_batch=False``: only group ``i``'s own negatives.

    Then

    - ``mean_pos = (1/B) sum_i s(a_i, p_i)``
    - ``mean_neg`` = mean of ``s(a_i, c)`` over all pairs ``(i, c)`` with ``c in O_i``
      (pooled over pairs, as ms-swift does; with ``use_batch=True`` every ``O_i`` has the
      same size, so this is also the mean over anchors of their mean).
    - ``margin = mean_i [ s(a_i, p_i) - max_{c in O_i} s(a_i, c) ]``, over the anchors
      whose ``O_i`` is not empty.

    A metric with nothing to average (no other candidate at all, e.g. ``B = 1`` and
    ``M = 0``, or ``use_batch=False`` and ``M = 0``) is ``nan``; ms-swift would fail there.
    Every negative is used: ms-swift's ``INFONCE_HARD_NEGATIVES`` truncation/resampling is
    a training device and is not applied to the metrics here.

    Returns ``{"margin", "mean_neg", "mean_pos"}`` as Python floats.
    """
    a = _to_numpy(anchors, "anchors", 2)
    p = _to_numpy(positives, "positives", 2)
    n = _to_numpy([] if negatives is None else negatives, "negatives")
    if n.size == 0:  # M = 0 may come as [], shape (0,) or (0, D)
        n = n.reshape(0, a.shape[1])
    if n.ndim != 2:
        raise ValueError(f"negatives must be [M, D], got shape {tuple(n.shape)}")
    g = _to_int_array([] if neg_group is None else neg_group, "neg_group")
    b, d = a.shape
    if b == 0:
        raise ValueError("anchors is empty: need at least one group")
    if p.shape != (b, d):
        raise ValueError(f"positives must have the anchors' shape {(b, d)}, got {p.shape}")
    if n.shape[1] != d:
        raise ValueError(f"negatives must be [M, {d}], got shape {tuple(n.shape)}")
    if g.shape[0] != n.shape[0]:
        raise ValueError(f"neg_group must have one entry per negative ({n.shape[0]}), got {g.shape[0]}")
    if g.size and (g.min() < 0 or g.max() >= b):
        raise ValueError(f"neg_group entries must lie in [0, {b}), got range [{g.min()}, {g.max()}]")

    pos = np.einsum("bd,bd->b", a, p)
    mean_pos = float(pos.mean())

    if use_batch:
        docs = np.concatenate([p, n], axis=0)  # column i < B is p_i
        neg_sum = 0.0
        best = np.full(b, -np.inf)
        step = rows_per_block(docs.shape[0])
        for start in range(0, b, step):
            stop = min(b, start + step)
            s = a[start:stop] @ docs.T
            neg_sum += float(s.sum() - pos[start:stop].sum())
            rows = np.arange(stop - start)
            s[rows, start + rows] = -np.inf  # the own positive is not a competitor
            best[start:stop] = s.max(axis=1)
        n_pairs = b * (docs.shape[0] - 1)
        has_other = np.full(b, docs.shape[0] > 1)
    else:
        neg_scores = np.einsum("md,md->m", a[g], n)
        neg_sum = float(neg_scores.sum())
        n_pairs = neg_scores.shape[0]
        best = np.full(b, -np.inf)
        np.maximum.at(best, g, neg_scores)
        has_other = np.bincount(g, minlength=b) > 0

    mean_neg = neg_sum / n_pairs if n_pairs else float("nan")
    margin = float((pos - best)[has_other].mean()) if has_other.any() else float("nan")
    return {"margin": margin, "mean_neg": float(mean_neg), "mean_pos": mean_pos}


def candidate_metrics(blocks: Iterable[tuple[Any, Any]]) -> dict[str, float]:
    """``mean_pos``, ``mean_neg`` and ``margin`` from the candidates a loss actually weighs.

    Inputs
    ------
    blocks: ``(scores [b, C], target [b])`` per block of anchors, as a group loss's
            ``candidate_scores`` yields them: each anchor's similarities to its candidates,
            ``-inf`` for a candidate the loss leaves out, and the column of its positive.

    With ``O_i`` the finite entries of anchor ``i``'s row other than its target:
    ``mean_pos = mean_i s_i[target_i]``, ``mean_neg`` = the mean over every ``(i, c in
    O_i)`` pair (pooled, as ms-swift pools), ``margin = mean_i (s_i[target_i] - max O_i)``
    over the anchors whose ``O_i`` is not empty. A metric with nothing to average is ``nan``.
    So ``INFONCE_USE_BATCH``, ``INFONCE_HARD_NEGATIVES``, the fake-negative mask and the QQ /
    DD blocks shape the metrics exactly as they shape the loss.
    """
    pos_sum, n_anchors, neg_sum, n_pairs, margin_sum, n_margin = 0.0, 0, 0.0, 0, 0.0, 0
    for scores, target in blocks:
        s = _to_numpy(scores, "scores", 2)
        t = _to_int_array(target, "target")
        rows = np.arange(s.shape[0])
        pos = s[rows, t]
        others = s.copy()
        others[rows, t] = -np.inf
        finite = np.isfinite(others)
        pos_sum += float(pos.sum())
        n_anchors += s.shape[0]
        neg_sum += float(np.where(finite, others, 0.0).sum())
        n_pairs += int(finite.sum())
        has_other = finite.any(axis=1)
        margin_sum += float((pos - others.max(axis=1, initial=-np.inf))[has_other].sum())
        n_margin += int(has_other.sum())
    if n_anchors == 0:
        raise ValueError("no anchors to score")
    nan = float("nan")
    return {"margin": margin_sum / n_margin if n_margin else nan, "mean_neg": neg_sum / n_pairs if n_pairs else nan,
            "mean_pos": pos_sum / n_anchors}


# ---------------------------------------------------------------------------------------
# Retrieval
# ---------------------------------------------------------------------------------------


def _as_sets(x: Any, q: int, name: str) -> list[set[int]]:
    if hasattr(x, "detach") or isinstance(x, np.ndarray):
        arr = _to_int_array(x, name)
        sets = [{int(v)} for v in arr]
    else:
        sets = []
        for entry in x:
            if isinstance(entry, Iterable) and not isinstance(entry, (str, bytes)):
                sets.append({int(v) for v in entry})
            else:
                sets.append({int(entry)})
    if len(sets) != q:
        raise ValueError(f"{name} must have one entry per query ({q}), got {len(sets)}")
    return sets


def retrieval_metrics(
    queries: Any,
    docs: Any,
    relevant: Sequence[set[int]] | Any,
    ks: Sequence[int] = (1, 5, 10),
    *,
    exclude: Sequence[set[int]] | None = None,
    cutoff: int = 10,
    score: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
) -> dict[str, float]:
    """Rank ``docs`` for every query by dot product (or by ``score(queries, docs) -> [Q, C]``,
    e.g. MaxSim of multi-vector rows ``[Q, Lq, D]``, ``[C, Ld, D]``) and score the ranking.

    Inputs
    ------
    queries:  ``[Q, D]``.
    docs:     ``[C, D]``.
    relevant: the relevant documents (indices into ``docs``) of each query: a list of ``Q``
              sets, or a ``[Q]`` int array holding each query's single relevant document.
    ks:       cut-offs for ``recall@k``.
    exclude:  optional list of ``Q`` sets of document indices removed from that query's
              candidates (e.g. the query's own row when queries and docs are one set).
              An excluded document is neither ranked nor counted as relevant.
    cutoff:   the depth of ``mrr`` and ``ndcg`` (10, as in MRR@10 / nDCG@10).

    Ranking
    -------
    Documents are sorted by decreasing score; equal scores are ordered by increasing
    document index (a stable sort), so results are deterministic. The rank ``r`` of a
    document counts from 1. A document whose score is not a number (``nan``, from ``nan``
    embeddings) or ``-inf`` is never ranked (``ranking.top_k``).

    Definitions (``R_q`` = relevant documents of ``q`` that are not excluded)
    ------------------------------------------------------------------------
    - ``recall@k = |R_q ∩ top_k(q)| / |R_q|``, averaged over queries (hit@k when
      ``|R_q| = 1``).
    - ``mrr@10 = 1 / r`` of the first relevant document if ``r <= 10``, else 0; averaged.
    - ``ndcg@10 = DCG / IDCG`` with binary relevance:
      ``DCG = sum_{d in R_q, r_d <= 10} 1 / log2(r_d + 1)``,
      ``IDCG = sum_{r=1}^{min(|R_q|, 10)} 1 / log2(r + 1)``; averaged.

    Every query must keep at least one relevant document (``ValueError`` otherwise).
    Returns ``{"recall@k" for k in ks, "mrr@10", "ndcg@10"}`` as Python floats.
    """
    qv = _to_numpy(queries, "queries", 2 if score is None else None)
    dv = _to_numpy(docs, "docs", 2 if score is None else None)
    nq, dim = qv.shape[0], qv.shape[-1]
    nc = dv.shape[0]
    if dv.shape[-1] != dim:
        raise ValueError(f"docs must be [C, {dim}] like queries, got shape {tuple(dv.shape)}")
    if nq == 0 or nc == 0:
        raise ValueError(f"need at least one query and one document, got Q={nq}, C={nc}")
    ks = tuple(int(k) for k in ks)
    if any(k < 1 for k in ks) or cutoff < 1:
        raise ValueError(f"cut-offs must be >= 1, got ks={ks}, cutoff={cutoff}")
    rel = _as_sets(relevant, nq, "relevant")
    excl = _as_sets(exclude, nq, "exclude") if exclude is not None else [set() for _ in range(nq)]
    for i, (r, e) in enumerate(zip(rel, excl)):
        bad = [v for v in r | e if not 0 <= v < nc]
        if bad:
            raise ValueError(f"query {i}: document indices {sorted(bad)} outside [0, {nc})")
        if not r - e:
            raise ValueError(f"query {i} has no relevant document left (relevant={sorted(r)}, excluded={sorted(e)})")

    depth = max(max(ks, default=1), cutoff)
    rankings = search(qv, dv, depth, exclude=excl, score=score)
    relevance = [dict.fromkeys(r - e, 1.0) for r, e in zip(rel, excl)]
    m = ranking_metrics([r.tolist() for r in rankings], relevance, ks, cutoff)
    out = {f"recall@{k}": m[f"recall@{k}"] for k in ks}
    out[f"mrr@{cutoff}"] = m[f"mrr@{cutoff}"]
    out[f"ndcg@{cutoff}"] = m[f"ndcg@{cutoff}"]
    return out


# ---------------------------------------------------------------------------------------
# Pair metrics (ms-swift's PairedMetrics)
# ---------------------------------------------------------------------------------------


def _correlations(labels: np.ndarray, scores: np.ndarray) -> tuple[float, float]:
    """(pearson, spearman); nan where undefined instead of scipy's warning or error."""
    from scipy.stats import pearsonr, spearmanr

    if (
        labels.shape[0] < 2
        or not np.all(np.isfinite(labels))
        or not np.all(np.isfinite(scores))
        or np.ptp(labels) == 0
        or np.ptp(scores) == 0
    ):
        return float("nan"), float("nan")
    return float(pearsonr(labels, scores)[0]), float(spearmanr(labels, scores)[0])


def pair_metrics(emb1: Any, emb2: Any, labels: Any) -> dict[str, float]:
    """ms-swift's pair metrics: correlation of the label with four similarity scores.

    Inputs
    ------
    emb1, emb2: ``[n, D]``; row ``i`` of each forms pair ``i``.
    labels:     ``[n]`` float, the gold score of each pair.

    For each pair the scores are ``cosine = x.y / (|x| |y|)``, ``dot = x.y``,
    ``manhattan = -sum |x - y|`` and ``euclidean = -|x - y|_2`` (distances negated so that
    higher means more similar). For each score the Pearson correlation and the Spearman
    rank correlation (average ranks for ties) with ``labels`` are computed by
    ``scipy.stats.pearsonr`` / ``spearmanr``.

    Keys: ``pearson_cosine, spearman_cosine, pearson_dot_product, spearman_dot_product,
    pearson_manhattan, spearman_manhattan, pearson_euclidean, spearman_euclidean``
    (ms-swift spells the dot-product pair ``pearson_dot_product`` / ``spearman_dot_product``).

    A correlation is undefined, and reported as ``nan`` (no warning, no exception), when
    ``n < 2``, when the labels or that score are constant (e.g. all labels equal, or
    identical pairs giving cosine 1 everywhere), or when a score is not finite (a zero
    vector has no cosine).
    """
    x = _to_numpy(emb1, "emb1", 2)
    y = _to_numpy(emb2, "emb2", 2)
    lab = _to_numpy(labels, "labels", 1)
    if x.shape != y.shape:
        raise ValueError(f"emb1 and emb2 must have the same shape, got {x.shape} and {y.shape}")
    if lab.shape[0] != x.shape[0]:
        raise ValueError(f"labels must have one entry per pair ({x.shape[0]}), got {lab.shape[0]}")

    dot = np.einsum("nd,nd->n", x, y)
    norms = np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        cosine = dot / norms
    diff = x - y
    scores = {
        "cosine": cosine,
        "dot_product": dot,
        "manhattan": -np.abs(diff).sum(axis=1),
        "euclidean": -np.sqrt((diff * diff).sum(axis=1)),
    }
    out: dict[str, float] = {}
    for name, value in scores.items():
        out[f"pearson_{name}"], out[f"spearman_{name}"] = _correlations(lab, value)
    return out


# ---------------------------------------------------------------------------------------
# From ms-swift's InfoNCE layout
# ---------------------------------------------------------------------------------------


def embedding_eval_metrics(
    embeddings: Any,
    labels: Any,
    *,
    use_batch: bool = True,
    ks: Sequence[int] = (1, 5, 10),
    candidates: Iterable[tuple[Any, Any]] | None = None,
    score: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
) -> dict[str, float]:
    """All InfoNCE evaluation metrics from ms-swift's evaluation layout.

    Inputs (exactly what the trainer gathers at evaluation)
    -------------------------------------------------------
    embeddings: ``[N, D]`` rows in group order ``a0, p0, n0_0, ..., a1, p1, n1_0, ...``.
    labels:     ``[N - B]`` float, one per non-anchor row: 1.0 for the positive, 0.0 for
                each negative. Each 1.0 starts a group, so groups may hold any number of
                negatives (including none).

    Returns ``infonce_metrics`` (``margin``, ``mean_neg``, ``mean_pos``; ``use_batch`` as
    there; or, given ``candidates``, the loss's own view of the same rows through
    ``candidate_metrics``) together with ``retrieval_metrics`` of the anchors against every evaluation
    document: the ``N - B`` positives and negatives of the whole set, each anchor's
    relevant document being its own positive (``recall@k`` for ``ks``, ``mrr@10``,
    ``ndcg@10``). ``score``: the similarity to rank by when it is not the dot product (a
    multi-vector model's MaxSim over rows ``[N, L, D]``; ``candidates`` must then be given).
    """
    emb = _to_numpy(embeddings, "embeddings", 2 if score is None else 3)
    if score is not None and candidates is None:
        raise ValueError("multi-vector rows need the loss's candidates (its own similarity) for margin / mean_neg")
    lab = _to_numpy(labels, "labels", 1)
    anchor_rows, pos_rows, neg_rows, neg_group = split_groups_numpy(lab, emb.shape[0])
    # the documents in label order (doc j is the row of label j: every row but the anchors),
    # which is the order ties are ranked in
    label_rows = np.delete(np.arange(emb.shape[0]), anchor_rows)
    anchors = emb[anchor_rows]
    if candidates is not None:
        out = candidate_metrics(candidates)
    else:
        out = infonce_metrics(anchors, emb[pos_rows], emb[neg_rows], neg_group, use_batch=use_batch)
    out.update(retrieval_metrics(anchors, emb[label_rows], np.searchsorted(label_rows, pos_rows), ks=ks, score=score))
    return out


def layout_metrics(layout: Layout, embeddings: Any, labels: Any, *,
                   candidates: Iterable[tuple[Any, Any]] | None = None,
                   score: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None) -> dict[str, float]:
    """The evaluation metrics of a set in the batch ``layout`` (a loss's ``layout``).

    - ``Layout.PAIR``: ``embeddings`` ``[2P, D]`` rows ``s1_0, s2_0, ...`` and ``labels``
      ``[P]``: :func:`pair_metrics` of the two sides.
    - ``Layout.GROUP``: ``embeddings`` ``[N, D]`` in group order and ``labels`` ``[N - B]``:
      :func:`embedding_eval_metrics` (``candidates``: a group loss's ``candidate_scores``
      over the same rows, so ``margin`` / ``mean_neg`` are over what the loss weighs).

    Raises:
        ValueError: A malformed layout (the splitters' errors), or ``candidates`` with the
            pair layout (it has none).
    """
    if layout is Layout.PAIR:
        if candidates is not None:
            raise ValueError("candidates rank a group's documents; the pair layout has none")
        emb = _to_numpy(embeddings, "embeddings", 2)
        lab = _to_numpy(labels, "labels", 1)
        return pair_metrics(*split_pair_rows(emb, lab.shape[0]), lab)
    return embedding_eval_metrics(embeddings, labels, candidates=candidates, score=score)
