"""Specification of mmembed.eval.metrics by tiny examples worked out by hand.

Similarities are dot products of 2-D unit vectors chosen so that every score is a short
decimal; the expected numbers are written out with their arithmetic.
"""

import math
import warnings

import numpy as np
import pytest
import torch

from mmembed.encoding.layout import Layout
from mmembed.eval import ranking
from mmembed.eval.metrics import (
    embedding_eval_metrics,
    infonce_metrics,
    layout_metrics,
    pair_metrics,
    retrieval_metrics,
)

# --------------------------------------------------------------------------------------
# A two-group InfoNCE evaluation set
#   group 0: a0=(1,0)  p0=(.8,.6)  n0=(.6,.8)
#   group 1: a1=(0,1)  p1=(.6,.8)  n1=(1,0)  n2=(0,-1)
# Dot products:
#           p0    p1    n0    n1    n2
#   a0     .8    .6    .6    1     0
#   a1     .6    .8    .8    0    -1
# --------------------------------------------------------------------------------------
A = np.array([[1.0, 0.0], [0.0, 1.0]])
P = np.array([[0.8, 0.6], [0.6, 0.8]])
N = np.array([[0.6, 0.8], [1.0, 0.0], [0.0, -1.0]])
G = np.array([0, 1, 1])


def test_infonce_in_batch_by_hand():
    m = infonce_metrics(A, P, N, G)
    # mean_pos = (.8 + .8) / 2
    assert m["mean_pos"] == pytest.approx(0.8)
    # a0's other candidates: p1 .6, n0 .6, n1 1, n2 0   (sum 2.2, max 1)
    # a1's other candidates: p0 .6, n0 .8, n1 0, n2 -1  (sum 0.4, max .8)
    # mean_neg = (2.2 + 0.4) / 8 = 0.325
    assert m["mean_neg"] == pytest.approx(0.325)
    # margin = ((.8 - 1) + (.8 - .8)) / 2 = -0.1
    assert m["margin"] == pytest.approx(-0.1)
    assert set(m) == {"margin", "mean_neg", "mean_pos"}
    assert all(type(v) is float for v in m.values())


def test_infonce_own_negatives_only_by_hand():
    m = infonce_metrics(A, P, N, G, use_batch=False)
    assert m["mean_pos"] == pytest.approx(0.8)
    # pairs (a0,n0)=.6, (a1,n1)=0, (a1,n2)=-1, pooled: (.6 + 0 - 1) / 3
    assert m["mean_neg"] == pytest.approx(-0.4 / 3)
    # margins: a0: .8 - .6 = .2 ; a1: .8 - max(0, -1) = .8 ; mean .5
    assert m["margin"] == pytest.approx(0.5)


def test_infonce_without_negatives():
    # M = 0, in batch: a0's only other candidate is p1 (.6), a1's is p0 (.6)
    for neg, grp in [(np.zeros((0, 2)), np.zeros(0, int)), (None, None), ([], [])]:
        m = infonce_metrics(A, P, neg, grp)
        assert m["mean_pos"] == pytest.approx(0.8)
        assert m["mean_neg"] == pytest.approx(0.6)
        assert m["margin"] == pytest.approx(0.8 - 0.6)
    # M = 0 without the batch, or one group alone: nothing to compare with -> nan
    m = infonce_metrics(A, P, None, None, use_batch=False)
    assert m["mean_pos"] == pytest.approx(0.8)
    assert math.isnan(m["mean_neg"]) and math.isnan(m["margin"])
    m = infonce_metrics(A[:1], P[:1], None, None)
    assert math.isnan(m["mean_neg"]) and math.isnan(m["margin"])


def test_infonce_group_without_negatives_skipped_in_margin():
    # Only group 1 has negatives (n1, n2): its margin .8 - 0 = .8 is the only one.
    m = infonce_metrics(A, P, N[1:], G[1:], use_batch=False)
    assert m["margin"] == pytest.approx(0.8)
    assert m["mean_neg"] == pytest.approx((0.0 - 1.0) / 2)


def test_infonce_accepts_torch_and_validates():
    m = infonce_metrics(torch.tensor(A, dtype=torch.bfloat16), torch.tensor(P), torch.tensor(N), torch.tensor(G))
    assert m["margin"] == pytest.approx(-0.1, abs=1e-2)  # bf16 rounds .8 and .6
    with pytest.raises(ValueError, match="neg_group"):
        infonce_metrics(A, P, N, [0, 1, 2])
    with pytest.raises(ValueError, match="one entry per negative"):
        infonce_metrics(A, P, N, [0, 1])
    with pytest.raises(ValueError, match="positives"):
        infonce_metrics(A, P[:1], N, G)


def _infonce_reference(a, p, negs_per_group, use_batch):
    """ms-swift's per-group loop, written plainly."""
    pos, negs, margins = [], [], []
    all_docs = [d for i in range(len(a)) for d in [p[i], *negs_per_group[i]]]
    own_pos = np.cumsum([0] + [1 + len(n) for n in negs_per_group[:-1]])
    for i in range(len(a)):
        if use_batch:
            others = [d for j, d in enumerate(all_docs) if j != own_pos[i]]
        else:
            others = list(negs_per_group[i])
        s_pos = float(a[i] @ p[i])
        s_oth = [float(a[i] @ d) for d in others]
        pos.append(s_pos)
        negs.extend(s_oth)
        if s_oth:
            margins.append(s_pos - max(s_oth))
    return {"margin": np.mean(margins), "mean_neg": np.mean(negs), "mean_pos": np.mean(pos)}


@pytest.mark.parametrize("use_batch", [True, False])
def test_infonce_matches_loop_reference_with_uneven_groups(use_batch, monkeypatch):
    rng = np.random.default_rng(0)
    sizes = [0, 3, 1, 7, 2, 0, 5]
    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)
    a = unit(rng.normal(size=(len(sizes), 8)))
    p = unit(rng.normal(size=(len(sizes), 8)))
    negs_per_group = [unit(rng.normal(size=(k, 8))) for k in sizes]
    n = np.concatenate(negs_per_group)
    g = np.repeat(np.arange(len(sizes)), sizes)
    ref = _infonce_reference(a, p, negs_per_group, use_batch)
    got = infonce_metrics(a, p, n, g, use_batch=use_batch)
    for key in ref:
        assert got[key] == pytest.approx(ref[key], abs=1e-12)
    # scoring in blocks of a few rows gives the same numbers
    monkeypatch.setattr(ranking, "_BLOCK_ELEMENTS", 7)
    blocked = infonce_metrics(a, p, n, g, use_batch=use_batch)
    for key in ref:
        assert blocked[key] == pytest.approx(ref[key], abs=1e-12)


# --------------------------------------------------------------------------------------
# Retrieval. One-dimensional "embeddings": the query (1,) and docs v_j = 12 - j score
# 12, 11, ..., 1, so document j sits at rank j + 1.
# --------------------------------------------------------------------------------------
DOCS12 = (12.0 - np.arange(12.0))[:, None]


def test_retrieval_ranks_1_3_and_beyond_10():
    q = np.ones((3, 1))
    m = retrieval_metrics(q, DOCS12, np.array([0, 2, 11]))  # ranks 1, 3, 12
    assert m["recall@1"] == pytest.approx((1 + 0 + 0) / 3)
    assert m["recall@5"] == pytest.approx((1 + 1 + 0) / 3)
    assert m["recall@10"] == pytest.approx((1 + 1 + 0) / 3)
    assert m["mrr@10"] == pytest.approx((1 + 1 / 3 + 0) / 3)
    # nDCG with one relevant doc: (1/log2(1+1)) / 1 = 1 ; 1/log2(3+1) = .5 ; 0 beyond 10
    assert m["ndcg@10"] == pytest.approx((1 + 0.5 + 0) / 3)
    assert set(m) == {"recall@1", "recall@5", "recall@10", "mrr@10", "ndcg@10"}


def test_retrieval_two_relevant_docs():
    q = np.ones((2, 1))
    m = retrieval_metrics(q, DOCS12, [{1, 3}, {1, 11}])  # ranks {2, 4} and {2, 12}
    # recall@1: 0/2, 0/2 ; recall@5: 2/2, 1/2 ; recall@10: 2/2, 1/2
    assert m["recall@1"] == 0.0
    assert m["recall@5"] == pytest.approx((1 + 0.5) / 2)
    assert m["recall@10"] == pytest.approx((1 + 0.5) / 2)
    # first relevant doc at rank 2 for both
    assert m["mrr@10"] == pytest.approx(0.5)
    # query 0: DCG = 1/log2(3) + 1/log2(5); IDCG = 1/log2(2) + 1/log2(3)
    # query 1: DCG = 1/log2(3)  (rank 12 is past 10); same IDCG
    idcg = 1 + 1 / math.log2(3)
    ndcg0 = (1 / math.log2(3) + 1 / math.log2(5)) / idcg
    ndcg1 = (1 / math.log2(3)) / idcg
    assert m["ndcg@10"] == pytest.approx((ndcg0 + ndcg1) / 2)


def test_retrieval_more_than_ten_relevant():
    # all 12 docs relevant: ranks 1..12; DCG@10 equals IDCG over min(12, 10) = 10 docs
    m = retrieval_metrics(np.ones((1, 1)), DOCS12, [set(range(12))])
    assert m["ndcg@10"] == pytest.approx(1.0)
    assert m["recall@10"] == pytest.approx(10 / 12)
    assert m["recall@1"] == pytest.approx(1 / 12)
    assert m["mrr@10"] == 1.0


def test_retrieval_ties_broken_by_doc_index():
    # every doc scores the same: the ranking is 0, 1, 2, ...; doc 3 is at rank 4
    docs = np.ones((12, 2)) / math.sqrt(2)
    m = retrieval_metrics(np.array([[1.0, 0.0]]), docs, [3])
    assert (m["recall@1"], m["recall@5"]) == (0.0, 1.0)
    assert m["mrr@10"] == pytest.approx(1 / 4)
    assert m["ndcg@10"] == pytest.approx(1 / math.log2(5))
    # a tie in the middle: query (-1,) scores docs -12..-1, i.e. doc j at rank 12 - j;
    # give doc 11 a twin (doc 10 set to the same value) -> doc 10 ranks 1, doc 11 ranks 2
    docs = DOCS12.copy()
    docs[10] = docs[11]
    m = retrieval_metrics(-np.ones((2, 1)), docs, [11, 10])
    assert m["mrr@10"] == pytest.approx((1 / 2 + 1) / 2)


def test_retrieval_exclude():
    q = np.ones((2, 1))
    # query 0 excludes docs 0 and 1: doc 2 moves from rank 3 to rank 1
    # query 1 has relevant {1, 3} but excludes doc 1: only doc 3 counts, now at rank 3
    m = retrieval_metrics(q, DOCS12, [{2}, {1, 3}], exclude=[{0, 1}, {1}])
    assert m["recall@1"] == pytest.approx((1 + 0) / 2)
    assert m["mrr@10"] == pytest.approx((1 + 1 / 3) / 2)
    assert m["ndcg@10"] == pytest.approx((1 + 1 / math.log2(4)) / 2)
    with pytest.raises(ValueError, match="no relevant document left"):
        retrieval_metrics(q, DOCS12, [{2}, {1}], exclude=[set(), {1}])
    # excluded docs never fill the top k, even when fewer than k candidates remain
    m = retrieval_metrics(np.ones((1, 1)), DOCS12[:3], [2], exclude=[{0, 1}])
    assert m["recall@1"] == 1.0


def test_retrieval_input_forms_and_errors(monkeypatch):
    q = torch.ones(3, 1)
    expected = retrieval_metrics(np.ones((3, 1)), DOCS12, np.array([0, 2, 11]))
    assert retrieval_metrics(q, torch.tensor(DOCS12), torch.tensor([0, 2, 11])) == expected
    assert retrieval_metrics(q, DOCS12, [0, 2, 11]) == expected
    assert retrieval_metrics(q, DOCS12, [{0}, {2}, {11}]) == expected
    monkeypatch.setattr(ranking, "_BLOCK_ELEMENTS", 5)  # one query per block
    assert retrieval_metrics(q, DOCS12, [0, 2, 11]) == expected
    m = retrieval_metrics(q, DOCS12, [0, 2, 11], ks=(2, 3))
    assert m["recall@3"] == pytest.approx(2 / 3) and "recall@1" not in m
    with pytest.raises(ValueError, match="outside"):
        retrieval_metrics(q, DOCS12, [0, 2, 12])
    with pytest.raises(ValueError, match="one entry per query"):
        retrieval_metrics(q, DOCS12, [0, 2])


# --------------------------------------------------------------------------------------
# Pair metrics
#   emb1 = (1,0) three times; emb2 = (1,0), (.6,.8), (0,1); labels 3, 1, 0
#   cosine = dot = 1, .6, 0 ; -manhattan = 0, -1.2, -2 ; -euclidean = 0, -sqrt(.8), -sqrt(2)
# --------------------------------------------------------------------------------------
E1 = np.array([[1.0, 0.0]] * 3)
E2 = np.array([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]])
LABELS = np.array([3.0, 1.0, 0.0])


def test_pair_metrics_by_hand():
    m = pair_metrics(E1, E2, LABELS)
    assert set(m) == {
        "pearson_cosine", "spearman_cosine", "pearson_dot_product", "spearman_dot_product",
        "pearson_manhattan", "spearman_manhattan", "pearson_euclidean", "spearman_euclidean",
    }
    # labels minus mean 4/3: (5, -1, -4)/3, sum of squares 42/9
    # cosine minus mean 8/15: (7, 1, -8)/15, sum of squares 114/225
    # covariance sum: (35 - 1 + 32)/45 = 66/45 -> r = 66 / sqrt(42 * 114)
    assert m["pearson_cosine"] == pytest.approx(66 / math.sqrt(42 * 114))
    assert m["pearson_dot_product"] == pytest.approx(66 / math.sqrt(42 * 114))
    # -manhattan minus mean -16/15: (16, -2, -14)/15, sum of squares 456/225
    # covariance sum: (80 + 2 + 56)/45 = 138/45 -> r = 138 / sqrt(42 * 456)
    assert m["pearson_manhattan"] == pytest.approx(138 / math.sqrt(42 * 456))
    # every score falls as the label falls: rank correlation 1
    for name in ("cosine", "dot_product", "manhattan", "euclidean"):
        assert m[f"spearman_{name}"] == pytest.approx(1.0)


def _ranks(x):
    """1-based ranks, ties get the average of the ranks they span."""
    x = list(x)
    order = sorted(range(len(x)), key=lambda i: x[i])
    ranks = [0.0] * len(x)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def _pearson(x, y):
    x, y = np.asarray(x, float), np.asarray(y, float)
    dx, dy = x - x.mean(), y - y.mean()
    return float((dx * dy).sum() / math.sqrt((dx * dx).sum() * (dy * dy).sum()))


def test_pair_metrics_against_manual_formulas_with_ties():
    rng = np.random.default_rng(1)
    e1 = rng.normal(size=(9, 4))
    e2 = rng.normal(size=(9, 4))
    e2[4] = e1[4]  # identical pair: cosine 1, distance 0
    labels = np.array([0.0, 1.0, 1.0, 0.5, 1.0, 0.0, 0.2, 0.5, 0.5])  # tied labels
    m = pair_metrics(e1, e2, labels)
    scores = {
        "cosine": [a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) for a, b in zip(e1, e2)],
        "dot_product": [a @ b for a, b in zip(e1, e2)],
        "manhattan": [-np.abs(a - b).sum() for a, b in zip(e1, e2)],
        "euclidean": [-np.linalg.norm(a - b) for a, b in zip(e1, e2)],
    }
    for name, s in scores.items():
        assert m[f"pearson_{name}"] == pytest.approx(_pearson(labels, s), abs=1e-12)
        assert m[f"spearman_{name}"] == pytest.approx(_pearson(_ranks(labels), _ranks(s)), abs=1e-12)
    # ties in the scores too: spearman uses average ranks on both sides
    lab = [1.0, 2.0, 2.0, 3.0]
    s = [0.1, 0.5, 0.5, 0.4]
    # ranks: labels 1, 2.5, 2.5, 4 ; scores 1, 3.5, 3.5, 2
    assert _ranks(lab) == [1, 2.5, 2.5, 4] and _ranks(s) == [1, 3.5, 3.5, 2]
    e1 = np.array([[1.0, 0.0]] * 4)
    e2 = np.array([[v, 1.0] for v in s])  # dot = s
    got = pair_metrics(e1, e2, lab)
    assert got["spearman_dot_product"] == pytest.approx(_pearson([1, 2.5, 2.5, 4], [1, 3.5, 3.5, 2]))


def test_pair_metrics_constant_input_is_nan_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = pair_metrics(E1, E2, np.ones(3))  # constant labels
        assert all(math.isnan(v) for v in m.values())
        m = pair_metrics(E2, E2, LABELS)  # identical pairs: cosine 1, distances 0
        assert math.isnan(m["pearson_cosine"]) and math.isnan(m["spearman_euclidean"])
        m = pair_metrics(E1[:1], E2[:1], LABELS[:1])  # a single pair
        assert all(math.isnan(v) for v in m.values())
        # zero vectors have no cosine; distances to (1,0), (2,0), (0,3) are 1, 2, 3
        m = pair_metrics(np.zeros((3, 2)), np.array([[1.0, 0.0], [2.0, 0.0], [0.0, 3.0]]), LABELS)
        assert math.isnan(m["pearson_cosine"]) and not math.isnan(m["pearson_euclidean"])


def test_pair_metrics_accepts_torch():
    m = pair_metrics(torch.tensor(E1), torch.tensor(E2), torch.tensor(LABELS))
    assert m["pearson_cosine"] == pytest.approx(66 / math.sqrt(42 * 114))


# --------------------------------------------------------------------------------------
# ms-swift's InfoNCE layout: rows a0, p0, n0, a1, p1, n1, n2 ; labels 1,0, 1,0,0
# --------------------------------------------------------------------------------------
ROWS = np.array([A[0], P[0], N[0], A[1], P[1], N[1], N[2]])
ROW_LABELS = np.array([1.0, 0.0, 1.0, 0.0, 0.0])


def test_embedding_eval_metrics_from_layout():
    m = embedding_eval_metrics(ROWS, ROW_LABELS)
    assert m["mean_pos"] == pytest.approx(0.8)
    assert m["mean_neg"] == pytest.approx(0.325)
    assert m["margin"] == pytest.approx(-0.1)
    # documents in label order: p0, n0, p1, n1, n2
    # a0 scores .8, .6, .6, 1, 0   -> n1 first, own p0 at rank 2
    # a1 scores .6, .8, .8, 0, -1  -> n0 and p1 tie at .8; n0 (index 1) first, p1 at rank 2
    assert m["recall@1"] == 0.0
    assert m["recall@5"] == 1.0 and m["recall@10"] == 1.0
    assert m["mrr@10"] == pytest.approx(0.5)
    assert m["ndcg@10"] == pytest.approx(1 / math.log2(3))
    m = embedding_eval_metrics(torch.tensor(ROWS, dtype=torch.float32), torch.tensor(ROW_LABELS), use_batch=False)
    assert m["margin"] == pytest.approx(0.5)


def test_embedding_eval_metrics_without_negatives():
    rows = np.array([A[0], P[0], A[1], P[1]])
    m = embedding_eval_metrics(rows, np.array([1.0, 1.0]))
    # a0: p0 .8 vs p1 .6 ; a1: p1 .8 vs p0 .6 -> both own positives first
    assert m["margin"] == pytest.approx(0.2)
    assert m["mean_neg"] == pytest.approx(0.6)
    assert m["recall@1"] == 1.0 and m["ndcg@10"] == 1.0


def test_embedding_eval_metrics_rejects_bad_layouts():
    with pytest.raises(ValueError, match="start with a 1.0"):
        embedding_eval_metrics(ROWS[:6], np.array([0.0, 1.0, 1.0, 0.0]))
    with pytest.raises(ValueError, match="rows"):
        embedding_eval_metrics(ROWS[:6], ROW_LABELS)
    with pytest.raises(ValueError, match="1.0 .positive. or 0.0"):
        embedding_eval_metrics(ROWS, np.array([1.0, 0.5, 1.0, 0.0, 0.0]))


def test_layout_metrics_are_the_pair_or_the_group_metrics():
    """The one choice by layout: pairs ``s1_0, s2_0, ...`` get pair_metrics of the two sides,
    groups get embedding_eval_metrics (with the loss's candidates when given)."""
    pairs = np.array([A[0], P[0], A[1], P[1], A[0], N[2]])  # cosines .8, .8, 0
    scores = np.array([0.9, 0.7, 0.1])
    want = pair_metrics(pairs[0::2], pairs[1::2], scores)
    got = layout_metrics(Layout.PAIR, pairs, scores)
    assert got.keys() == want.keys()
    assert all(got[k] == pytest.approx(want[k], nan_ok=True) for k in want)
    assert layout_metrics(Layout.GROUP, ROWS, ROW_LABELS) == embedding_eval_metrics(ROWS, ROW_LABELS)
    candidates = [(np.array([[0.8, 0.6], [0.8, 0.0]]), np.array([0, 0]))]
    assert layout_metrics(Layout.GROUP, ROWS, ROW_LABELS, candidates=iter(candidates)) == \
        embedding_eval_metrics(ROWS, ROW_LABELS, candidates=iter(candidates))
    with pytest.raises(ValueError, match="alternate sentence1, sentence2"):
        layout_metrics(Layout.PAIR, pairs[:5], scores)
    with pytest.raises(ValueError, match="3 pairs but 2 labels"):
        layout_metrics(Layout.PAIR, pairs, scores[:2])
    with pytest.raises(ValueError, match="pair layout has none"):
        layout_metrics(Layout.PAIR, pairs, scores, candidates=iter(candidates))
    with pytest.raises(ValueError, match="start with a 1.0"):
        layout_metrics(Layout.GROUP, ROWS[:6], np.array([0.0, 1.0, 1.0, 0.0]))


# --------------------------------------------------------------------------------------
# The evaluation sees what the loss sees (INFONCE_* settings included)
# --------------------------------------------------------------------------------------
LOSS_SETTINGS = [
    {},
    {"use_batch": False},
    {"hard_negatives": 2},
    {"hard_negatives": 3, "use_batch": False},
    {"mask_fake_negative": True, "fake_neg_margin": 0.0},
    {"include_qq": True, "include_dd": True, "mask_fake_negative": True, "fake_neg_margin": 0.05},
]


def _reference_view(rows):
    """mean_pos / mean_neg / margin from the reference's per-anchor logits: every finite
    candidate other than the positive is a negative."""
    pos, negs, margins = [], [], []
    for row, target in rows:
        values = row.tolist()
        s_pos = values[target]
        others = [v for j, v in enumerate(values) if j != target and math.isfinite(v)]
        pos.append(s_pos)
        negs += others
        if others:
            margins.append(s_pos - max(others))
    return {"margin": np.mean(margins), "mean_neg": np.mean(negs), "mean_pos": np.mean(pos)}


@pytest.mark.parametrize("settings", LOSS_SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "defaults")
def test_eval_metrics_use_the_losss_infonce_settings(settings, monkeypatch):
    """The INFONCE_* variables (as a user sets them) shape margin / mean_neg exactly as they
    shape the loss: checked against the naive per-anchor reference on the same rows, and the
    reference's cross-entropy against the loss itself (same hard-negative picks)."""
    from reference_losses import reference_infonce, reference_rows

    from mmembed.losses import build_loss
    from mmembed.losses.config import ENV_VARS
    from mmembed.losses.infonce import select_hard_negatives

    for key, value in settings.items():
        monkeypatch.setenv(ENV_VARS[key], str(value).lower())
    sizes = [1, 3, 1, 2, 4, 1, 2]
    torch.manual_seed(0)
    labels = torch.tensor(sum(([1.0] + [0.0] * k for k in sizes), []))
    emb = torch.nn.functional.normalize(torch.randn(len(labels) + len(sizes), 6, dtype=torch.float64), dim=-1)
    hard = settings.get("hard_negatives")
    picks = select_hard_negatives(torch.tensor(sizes), hard, torch.Generator().manual_seed(5)).tolist() if hard else None
    options = {k: v for k, v in settings.items() if k != "hard_negatives"}
    rows = reference_rows(emb, labels, picks=picks, **options)

    loss = build_loss("infonce", generator=torch.Generator().manual_seed(5))
    view = loss.candidate_scores({"last_hidden_state": emb}, labels, generator=torch.Generator().manual_seed(5),
                                 block_rows=3)
    got = embedding_eval_metrics(emb, labels, candidates=view)
    ref = _reference_view(rows)
    for key in ref:
        assert got[key] == pytest.approx(ref[key], abs=1e-12), key
    value = loss({"last_hidden_state": emb}, labels)
    assert value.item() == pytest.approx(reference_infonce(emb, labels, temperature=0.1, picks=picks, **options).item(),
                                         abs=1e-12)
    if settings == {"use_batch": False}:  # ms-swift's own metric agrees where it has no mask / QQ / DD
        plain = embedding_eval_metrics(emb, labels, use_batch=False)
        for key in ("margin", "mean_neg", "mean_pos"):
            assert got[key] == pytest.approx(plain[key], abs=1e-12)


def test_eval_metrics_under_matryoshka_are_the_inner_losss_at_full_width(monkeypatch):
    from mmembed.losses import build_loss

    monkeypatch.setenv("INFONCE_USE_BATCH", "false")
    torch.manual_seed(1)
    labels = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    emb = torch.nn.functional.normalize(torch.randn(10, 8, dtype=torch.float64), dim=-1)
    inner = embedding_eval_metrics(emb, labels, candidates=build_loss("infonce").candidate_scores(
        {"last_hidden_state": emb}, labels))
    wrapped = embedding_eval_metrics(emb, labels, candidates=build_loss("matryoshka", dims={"4": 1.0, "8": 1.0})
                                     .candidate_scores({"last_hidden_state": emb}, labels))
    assert inner == wrapped
    assert build_loss("cosine_similarity").candidate_scores({"last_hidden_state": emb}, labels) is None


def _by_hand(emb: np.ndarray, sizes: list[int], use_batch: bool) -> dict:
    """margin / mean_neg / mean_pos with each anchor's candidates written out: every positive
    and negative of the set (use_batch) or its own group's negatives."""
    groups, row = [], 0
    for k in sizes:
        groups.append((row, row + 1, list(range(row + 2, row + 2 + k))))
        row += 2 + k
    docs = [d for _, p, negs in groups for d in [p] + negs]
    pos, negs, margins = [], [], []
    for a, p, own in groups:
        others = [d for d in docs if d != p] if use_batch else own
        s_pos = float(emb[a] @ emb[p])
        s_other = [float(emb[a] @ emb[d]) for d in others]
        pos.append(s_pos)
        negs += s_other
        if s_other:
            margins.append(s_pos - max(s_other))
    return {"margin": np.mean(margins), "mean_neg": np.mean(negs), "mean_pos": np.mean(pos)}


@pytest.mark.parametrize("name, options, use_batch", [("gist", {}, True), ("distill_kl", {}, True),
                                                      ("distill_kl", {"use_batch": False}, False)])
def test_eval_metrics_of_gist_and_distill_kl_follow_their_use_batch(name, options, use_batch):
    """The group losses other than InfoNCE declare their candidates (``use_batch``) through the
    loss protocol, and the evaluation's margin / mean_neg are over those: checked against the
    metric computed by hand on the same rows (groups of 0 to 4 negatives)."""
    from mmembed.losses import build_loss

    sizes = [1, 3, 0, 2, 4, 1]
    torch.manual_seed(2)
    labels = torch.tensor(sum(([1.0] + [0.0] * k for k in sizes), []))
    emb = torch.nn.functional.normalize(torch.randn(len(labels) + len(sizes), 6, dtype=torch.float64), dim=-1)
    loss = build_loss(name, **options)
    assert loss.use_batch is use_batch
    got = embedding_eval_metrics(emb, labels, candidates=loss.candidate_scores(
        {"last_hidden_state": emb}, labels, generator=torch.Generator().manual_seed(0), block_rows=4))
    ref = _by_hand(emb.numpy(), sizes, use_batch)
    for key in ref:
        assert got[key] == pytest.approx(ref[key], abs=1e-12), key
    # a loss that declares no candidates (per-row distillation) leaves the evaluation its default
    assert build_loss("distill_cosine").candidate_scores({"last_hidden_state": emb}, labels) is None
