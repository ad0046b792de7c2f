"""mmembed.eval.ranking against a plain reference written here.

The reference ranks every query by a full sort of its scores (decreasing score, then
increasing document index; ``nan`` and ``-inf`` are not candidates) and computes the
metrics by their textbook formulas, one query at a time. Scores are small integers, so
ties are frequent and every dot product is exact.
"""

import math

import numpy as np
import pytest

from mmembed.eval import beir, ranking
from mmembed.eval.metrics import retrieval_metrics
from mmembed.eval.ranking import ranking_metrics, rows_per_block, search, top_k


def ref_ranking(row):
    """Every candidate column of one score row, best first, ties by increasing index."""
    cand = [j for j, v in enumerate(row) if not math.isnan(v) and v != -math.inf]
    return sorted(cand, key=lambda j: (-row[j], j))


def ref_metrics(rankings, relevance, ks, cutoff):
    """recall@k, MRR@cutoff and nDCG@cutoff (linear gain) averaged over queries."""
    per_query = []
    for ranked, grades in zip(rankings, relevance):
        relevant = {d for d, g in grades.items() if g > 0}
        gain = {d: g for d, g in grades.items() if g > 0}
        top = ranked[:cutoff]
        dcg = sum(gain.get(d, 0) / math.log2(r + 1) for r, d in enumerate(top, 1))
        ideal = sorted(gain.values(), reverse=True)[:cutoff]
        idcg = sum(g / math.log2(r + 1) for r, g in enumerate(ideal, 1))
        ranks = [r for r, d in enumerate(top, 1) if d in relevant]
        m = {f"ndcg@{cutoff}": dcg / idcg, f"mrr@{cutoff}": 1 / ranks[0] if ranks else 0.0}
        for k in ks:
            m[f"recall@{k}"] = len(relevant & set(ranked[:k])) / len(relevant)
        per_query.append(m)
    return {key: sum(m[key] for m in per_query) / len(per_query) for key in per_query[0]}


def assert_same_metrics(got, want):
    assert set(got) == set(want)
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-12), key


# ----------------------------------------------------------------------------- top_k, search


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_top_k_matches_full_sort(dtype):
    rng = np.random.default_rng(0)
    s = rng.integers(-3, 4, size=(9, 17)).astype(dtype)  # 7 values over 17 columns: many ties
    s[rng.random(s.shape) < 0.15] = -np.inf
    s[rng.random(s.shape) < 0.1] = np.nan
    s[4] = -np.inf  # a row without any candidate
    for k in (1, 2, 5, 16, 17, 18, 100):  # up to and past the number of columns
        got = top_k(s, k)
        assert len(got) == s.shape[0]
        for row, ranked in zip(s, got):
            assert ranked.tolist() == ref_ranking(row.tolist())[:k]


def test_top_k_by_hand():
    s = np.array([[0.5, 0.9, 0.5, 0.5, -np.inf, np.nan]])
    assert top_k(s, 3)[0].tolist() == [1, 0, 2]  # the tie at 0.5 cut by index
    assert top_k(s, 10)[0].tolist() == [1, 0, 2, 3]  # k past the candidates: all of them
    assert top_k(np.zeros((0, 4)), 2) == [] and top_k(np.zeros((2, 0)), 2)[1].tolist() == []
    with pytest.raises(ValueError):
        top_k(s, 0)
    with pytest.raises(ValueError):
        top_k(s[0], 1)


@pytest.mark.parametrize("block", [None, 50, 1])
def test_search_blockwise_matches_full_sort(block, monkeypatch):
    rng = np.random.default_rng(1)
    q = rng.integers(-1, 2, size=(37, 3)).astype(np.float32)
    d = rng.integers(-1, 2, size=(23, 3)).astype(np.float32)
    d[5] = d[11]  # duplicate documents tie in every row
    if block is not None:
        monkeypatch.setattr(ranking, "_BLOCK_ELEMENTS", block)
        assert rows_per_block(d.shape[0]) < q.shape[0]  # several blocks
    exclude = [set(rng.choice(23, size=i % 4, replace=False).tolist()) for i in range(37)]
    full = q @ d.T
    for k in (1, 10, 23, 40):
        got = search(q, d, k)
        assert [g.tolist() for g in got] == [ref_ranking(row.tolist())[:k] for row in full]
        got = search(q, d, k, exclude=exclude)
        masked = full.copy()
        for i, e in enumerate(exclude):
            masked[i, sorted(e)] = -np.inf
        assert [g.tolist() for g in got] == [ref_ranking(row.tolist())[:k] for row in masked]
    with pytest.raises(ValueError, match="one entry per query"):
        search(q, d, 3, exclude=exclude[:3])
    with pytest.raises(ValueError, match="share D"):
        search(q, d[:, :2], 3)


# ----------------------------------------------------------------------------- metrics


def test_ranking_metrics_graded_by_hand():
    # scores 0.5, 0.9, 0.5, 0.5 rank documents 1, 0, 2, 3 (the tie at 0.5 by index);
    # grades: doc 0 -> 1, doc 2 -> 3, doc 3 -> 0 (not relevant), doc 9 -> 2 (not in the corpus)
    ranked = top_k(np.array([[0.5, 0.9, 0.5, 0.5]]), 10)[0].tolist()
    assert ranked == [1, 0, 2, 3]
    grades = {0: 1, 2: 3, 3: 0, 9: 2}
    got = ranking_metrics([ranked], [grades], ks=(1, 2, 3, 50), cutoff=3)
    # DCG@3 = 0/log2(2) + 1/log2(3) + 3/log2(4); IDCG@3 = 3/log2(2) + 2/log2(3) + 1/log2(4)
    dcg = 1 / math.log2(3) + 3 / 2
    idcg = 3 + 2 / math.log2(3) + 1 / 2
    assert got["ndcg@3"] == pytest.approx(dcg / idcg)
    assert got["mrr@3"] == pytest.approx(1 / 2)  # first relevant (doc 0) at rank 2
    # |R_q| = 3 (docs 0, 2, 9); doc 9 is never found
    assert (got["recall@1"], got["recall@2"]) == (0.0, pytest.approx(1 / 3))
    assert got["recall@3"] == pytest.approx(2 / 3) and got["recall@50"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("cutoff", [1, 3, 10])
def test_ranking_metrics_graded_matches_formulas(cutoff):
    rng = np.random.default_rng(2)
    n_docs = 12
    scores = rng.integers(0, 4, size=(30, n_docs)).astype(float)
    rankings = [[f"d{j}" for j in ref_ranking(row.tolist())] for row in scores]
    relevance = []
    for _ in rankings:
        judged = rng.choice(n_docs + 3, size=rng.integers(1, 8), replace=False)  # d12..d14 are not ranked
        grades = {f"d{j}": float(rng.integers(-1, 4)) for j in judged}
        grades[f"d{rng.integers(n_docs)}"] = float(rng.integers(1, 4))  # at least one relevant
        relevance.append(grades)
    ks = (1, 2, 5, 12, 100)  # 100: past the number of documents
    got = ranking_metrics(rankings, relevance, ks=ks, cutoff=cutoff)
    assert_same_metrics(got, ref_metrics(rankings, relevance, ks, cutoff))
    # binary relevance is the special case: every grade 1
    binary = [{d: 1.0 for d, g in r.items() if g > 0} for r in relevance]
    assert_same_metrics(ranking_metrics(rankings, binary, ks, cutoff), ref_metrics(rankings, binary, ks, cutoff))


def test_ranking_metrics_errors():
    with pytest.raises(ValueError, match="score > 0"):
        ranking_metrics([[0, 1]], [{0: 0.0, 1: -1.0}])
    with pytest.raises(ValueError, match="one relevance dict per ranking"):
        ranking_metrics([[0], [1]], [{0: 1.0}])
    with pytest.raises(ValueError, match=">= 1"):
        ranking_metrics([[0]], [{0: 1.0}], ks=(0,))


@pytest.mark.parametrize("block", [None, 40])
def test_retrieval_metrics_is_the_binary_case(block, monkeypatch):
    rng = np.random.default_rng(3)
    q = rng.integers(-1, 2, size=(25, 2)).astype(float)
    d = rng.integers(-1, 2, size=(15, 2)).astype(float)
    if block is not None:
        monkeypatch.setattr(ranking, "_BLOCK_ELEMENTS", block)
        assert rows_per_block(d.shape[0]) < q.shape[0]
    relevant = [set(rng.choice(15, size=rng.integers(1, 6), replace=False).tolist()) for _ in range(25)]
    exclude = [set(rng.choice(sorted(r), size=len(r) - 1, replace=False).tolist()) if i % 3 == 0 else set()
               for i, r in enumerate(relevant)]  # every third query keeps one relevant document
    full = q @ d.T
    for i, e in enumerate(exclude):
        full[i, sorted(e)] = -np.inf
    rankings = [ref_ranking(row.tolist()) for row in full]
    kept = [{j: 1 for j in r - e} for r, e in zip(relevant, exclude)]
    ks = (1, 3, 20)  # 20 > 15 documents
    got = retrieval_metrics(q, d, relevant, ks, exclude=exclude, cutoff=5)
    assert list(got) == ["recall@1", "recall@3", "recall@20", "mrr@5", "ndcg@5"]
    assert_same_metrics(got, ref_metrics(rankings, kept, ks, 5))


def test_beir_uses_the_core():
    assert beir.top_k is top_k and beir.ranking_metrics is ranking_metrics
