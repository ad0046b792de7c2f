"""Pair losses against their formulas written out in numpy.

Layout (ms-swift's): rows alternate sentence1, sentence2 (``s1_0, s2_0, s1_1, s2_1, ...``)
and ``labels`` holds one score per pair. Gradients are checked against central finite
differences of the numpy formulas.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmembed.losses import ContrastiveLoss, CosineSimilarityLoss, OnlineContrastiveLoss, build_loss

MARGIN = 0.5


def cosines(x: np.ndarray) -> np.ndarray:
    """cos(s1_i, s2_i) for rows alternating s1, s2."""
    s1, s2 = x[0::2], x[1::2]
    return np.array([a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) for a, b in zip(s1, s2, strict=True)])


def np_cosine_similarity(x, y, margin=None):
    return float(np.mean((cosines(x) - y) ** 2))


def np_contrastive(x, y, margin=MARGIN):
    d = 1 - cosines(x)
    per_pair = [0.5 * (yi * di**2 + (1 - yi) * max(0.0, margin - di) ** 2) for di, yi in zip(d, y, strict=True)]
    return float(np.mean(per_pair))


def hard_pairs(x, y):
    """Which pairs online_contrastive keeps, with ms-swift's fallbacks for <= 1 positive / negative."""
    d = 1 - cosines(x)
    pos = [di for di, yi in zip(d, y, strict=True) if yi == 1]
    neg = [di for di, yi in zip(d, y, strict=True) if yi == 0]
    neg_bound = max(pos) if len(pos) > 1 else np.mean(neg)
    pos_bound = min(neg) if len(neg) > 1 else np.mean(pos)
    keep_pos = [di for di in pos if di > pos_bound]
    keep_neg = [di for di in neg if di < neg_bound]
    return keep_pos, keep_neg


def np_online_contrastive(x, y, margin=MARGIN):
    keep_pos, keep_neg = hard_pairs(x, y)
    return float(sum(di**2 for di in keep_pos) + sum(max(0.0, margin - di) ** 2 for di in keep_neg))


def numeric_grad(f, x, h=1e-6):
    g = np.zeros_like(x)
    for idx in np.ndindex(*x.shape):
        up, down = x.copy(), x.copy()
        up[idx] += h
        down[idx] -= h
        g[idx] = (f(up) - f(down)) / (2 * h)
    return g


# 6 pairs in 4 dimensions, not normalized (the losses use the cosine, like ms-swift).
# Cosine distances d = 1 - cos of the pairs: 0.059, 0.449, 1.000, 0.040, 0.657, 0.073.
# fmt: off
X = np.array([
    [1.0, 0.2, 0.0, 0.1], [0.9, 0.1, 0.3, 0.0],  # pair 0: s1_0, s2_0
    [0.0, 1.0, 0.5, 0.0], [0.4, 0.2, 1.0, 0.3],  # pair 1
    [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.2],  # pair 2
    [0.3, 0.3, 0.3, 1.0], [0.2, 0.5, 0.1, 0.9],  # pair 3
    [0.5, 1.0, 0.0, 0.0], [0.1, 0.4, 0.0, 1.1],  # pair 4
    [0.0, 0.2, 1.0, 0.0], [0.1, 0.0, 1.2, 0.4],  # pair 5
])
# fmt: on
# online_contrastive keeps positives 1, 4 (d > min negative d = 0.073) and negative 5
# (d < max positive d = 0.657); pair 5 is inside the margin, pair 2 outside it.
BINARY = np.array([1.0, 1.0, 0.0, 1.0, 1.0, 0.0])
SCORES = np.array([0.9, 0.4, 0.05, 0.8, 0.3, 0.7])

CASES = [
    ("cosine_similarity", CosineSimilarityLoss, np_cosine_similarity, SCORES),
    ("contrastive", ContrastiveLoss, np_contrastive, BINARY),
    ("online_contrastive", OnlineContrastiveLoss, np_online_contrastive, BINARY),
]


def torch_value_and_grad(loss_fn, x, y):
    emb = torch.tensor(x, requires_grad=True)
    loss = loss_fn({"last_hidden_state": emb}, torch.tensor(y))
    loss.backward()
    return loss.item(), emb.grad.numpy()


@pytest.mark.parametrize("name, cls, formula, labels", CASES, ids=[c[0] for c in CASES])
def test_loss_and_gradient_match_formula(name, cls, formula, labels):
    value, grad = torch_value_and_grad(build_loss(name), X, labels)
    assert isinstance(build_loss(name), cls)
    assert value == pytest.approx(formula(X, labels), rel=1e-10, abs=1e-12)
    np.testing.assert_allclose(grad, numeric_grad(lambda x: formula(x, labels), X), atol=1e-7)
    assert np.abs(grad).sum() > 0


def test_case_is_not_trivial():
    """The fixed data exercises each branch: hinge active and inactive, pairs dropped."""
    d = 1 - cosines(X)
    neg_d = d[BINARY == 0]
    assert (neg_d < MARGIN).any() and (neg_d > MARGIN).any()
    keep_pos, keep_neg = hard_pairs(X, BINARY)
    assert 0 < len(keep_pos) < (BINARY == 1).sum()
    assert 0 < len(keep_neg) < (BINARY == 0).sum()


def test_losses_differ():
    out = {"last_hidden_state": torch.tensor(X)}
    names = ("cosine_similarity", "contrastive", "online_contrastive")
    values = [build_loss(n)(out, torch.tensor(BINARY)).item() for n in names]
    assert len({round(v, 9) for v in values}) == 3


@pytest.mark.parametrize(
    "name, formula", [("contrastive", np_contrastive), ("online_contrastive", np_online_contrastive)]
)
def test_margin_option(name, formula):
    default, _ = torch_value_and_grad(build_loss(name), X, BINARY)
    wider, grad = torch_value_and_grad(build_loss(name, margin=0.9), X, BINARY)
    assert wider == pytest.approx(formula(X, BINARY, margin=0.9), rel=1e-10)
    np.testing.assert_allclose(grad, numeric_grad(lambda x: formula(x, BINARY, margin=0.9), X), atol=1e-7)
    assert wider != pytest.approx(default, rel=1e-6)


@pytest.mark.parametrize(
    "labels",
    [
        np.array([1.0, 0.0, 0.0, 0.0, 0.0, 0.0]),  # one positive: negatives kept below their mean
        np.array([1.0, 1.0, 1.0, 0.0, 1.0, 1.0]),  # one negative: positives kept above their mean
        np.array([1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),  # no negative
        np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0]),  # no positive
    ],
)
def test_online_contrastive_fallbacks(labels):
    value, grad = torch_value_and_grad(OnlineContrastiveLoss(), X, labels)
    assert value == pytest.approx(np_online_contrastive(X, labels), rel=1e-10, abs=1e-12)
    np.testing.assert_allclose(grad, numeric_grad(lambda x: np_online_contrastive(x, labels), X), atol=1e-7)


def test_normalized_float32_inputs():
    x = X / np.linalg.norm(X, axis=1, keepdims=True)
    emb = torch.tensor(x, dtype=torch.float32)
    got = CosineSimilarityLoss()({"last_hidden_state": emb}, torch.tensor(SCORES, dtype=torch.float32))
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(np_cosine_similarity(x, SCORES), abs=1e-6)


def test_layout_errors():
    emb = torch.tensor(X)
    with pytest.raises(ValueError, match="alternate"):
        CosineSimilarityLoss()({"last_hidden_state": emb[:5]}, torch.tensor(SCORES[:2]))
    with pytest.raises(ValueError, match="6 pairs but 5 labels"):
        CosineSimilarityLoss()({"last_hidden_state": emb}, torch.tensor(SCORES[:5]))
    with pytest.raises(ValueError, match="must be 0 or 1"):
        ContrastiveLoss()({"last_hidden_state": emb}, torch.tensor(SCORES))
    with pytest.raises(ValueError, match="must be 0 or 1"):
        OnlineContrastiveLoss()({"last_hidden_state": emb}, torch.tensor(SCORES))
    with pytest.raises(ValueError, match="margin"):
        ContrastiveLoss(margin=-1.0)
    with pytest.raises(ValueError, match="margin"):
        build_loss("online_contrastive", margin=float("nan"))
    with pytest.raises(ValueError, match="takes no option .margin."):
        build_loss("cosine_similarity", margin=0.5)
