"""GIST, distillation and Matryoshka losses against their formulas written out plainly.

Batches are spelled in ms-swift's layout: rows ``a0, p0, n0_*, a1, p1, n1_*, ...`` and one
label per non-anchor row (1.0 positive, 0.0 negative); most cases mix groups with 0, 1
and 3 negatives. Each reference below walks anchors and candidates one by one in plain
torch (float64) and shares no code with ``mmembed.losses``; each comparison checks the
loss and its gradient with respect to the student embeddings.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from reference_losses import parse_groups, reference_infonce

from mmembed.losses import (
    LOSSES,
    DistillCosineLoss,
    DistillKLLoss,
    DistillMarginalLoss,
    DistillMSELoss,
    GISTLoss,
    InfoNCELoss,
    MatryoshkaLoss,
    build_loss,
)
from mmembed.losses.gist import GIST_TEMPERATURE, default_temperature
from mmembed.losses.matryoshka import parse_dims

TOL = dict(atol=1e-9, rtol=1e-9)  # float64 throughout; the brief asks for 1e-6
MINUS_INF = torch.tensor(float("-inf"), dtype=torch.float64)


def layout(neg_counts: list[int]) -> torch.Tensor:
    """Labels for groups with these numbers of negatives: [1, 0 * k0, 1, 0 * k1, ...]."""
    return torch.tensor([x for k in neg_counts for x in [1.0] + [0.0] * k], dtype=torch.float64)


def unit_rows(n_rows: int, dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n_rows, dim, generator=gen, dtype=torch.float64), dim=-1)


def batch(neg_counts: list[int], dim: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    n_rows = sum(2 + k for k in neg_counts)
    return unit_rows(n_rows, dim, seed), layout(neg_counts)


def value_and_grad(fn, emb: torch.Tensor):
    x = emb.detach().clone().requires_grad_(True)
    loss = fn(x)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad


def assert_same(fn_got, fn_want, emb: torch.Tensor) -> float:
    """Loss and gradient (w.r.t. ``emb``) agree; returns the value."""
    got, got_grad = value_and_grad(fn_got, emb)
    want, want_grad = value_and_grad(fn_want, emb)
    assert torch.isfinite(got)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_grad, want_grad, **TOL)
    return got.item()


def dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x * y).sum()


def cross_entropy(logits: list[torch.Tensor], target: int) -> torch.Tensor:
    """-log softmax(logits)[target], from a list of scalar logits."""
    return -torch.log_softmax(torch.stack(logits), 0)[target]


MIXED = [0, 1, 3]  # one group without negatives, one with one, one with three
COUNTS = {
    "0_1_3": MIXED,
    "3_0_1_2": [3, 0, 1, 2],
    "all_zero": [0, 0, 0],
    "one_group": [3],
}


# ==== GIST ==============================================================================


def reference_gist(
    emb, guide, labels, *, temperature=0.01, margin=0.0, margin_strategy="absolute",
    contrast_anchors=True, contrast_positives=True, drop=None,
) -> torch.Tensor:
    """GIST one anchor at a time.

    Candidates of anchor i: s(a_i, d) for every document d (every positive and negative,
    in ms-swift's interleaved order); s(a_i, a_j), j != i; s(p_i, p_j), j != i. A candidate
    other than p_i is dropped when the guide's similarity of the same pair exceeds
    t_i - margin (absolute) or t_i * (1 - margin) (relative), t_i = g(a_i, p_i).

    ``drop`` (a set of (i, block, row) with block in "doc", "anchor", "positive") replaces
    the guide's test with an explicit list of dropped candidates.
    """
    groups = parse_groups(emb.shape[0], [float(x) for x in labels])

    def s(i, j):
        return dot(emb[i], emb[j])

    def g(i, j):
        return float(dot(guide[i], guide[j]))

    docs = []
    for _, p, negs in groups:
        docs += [p] + negs
    losses = []
    for i, (a, p, _) in enumerate(groups):
        t = g(a, p)
        threshold = t - margin if margin_strategy == "absolute" else t * (1 - margin)

        def dropped(block, x, y, row, i=i, threshold=threshold):
            if drop is not None:
                return (i, block, row) in drop
            return g(x, y) > threshold

        row, target = [], None
        for d in docs:
            if d == p:
                target = len(row)
                row.append(s(a, d))
            else:
                row.append(MINUS_INF if dropped("doc", a, d, d) else s(a, d))
        for j, (other_a, other_p, _) in enumerate(groups):
            if j == i:
                continue
            if contrast_anchors:
                row.append(MINUS_INF if dropped("anchor", a, other_a, other_a) else s(a, other_a))
            if contrast_positives:
                row.append(MINUS_INF if dropped("positive", p, other_p, other_p) else s(p, other_p))
        losses.append(cross_entropy([x / temperature for x in row], target))
    return torch.stack(losses).mean()


GIST_CONFIGS = {
    "default": dict(),
    "t0.05_margin0.1": dict(temperature=0.05, margin=0.1),
    "negative_margin": dict(margin=-0.2),
    "relative": dict(margin=0.1, margin_strategy="relative"),
    "relative_negative": dict(margin=-0.3, margin_strategy="relative"),
    "no_anchor_block": dict(contrast_anchors=False),
    "no_positive_block": dict(contrast_positives=False),
    "ap_an_only": dict(contrast_anchors=False, contrast_positives=False, temperature=0.1),
}


@pytest.mark.parametrize("counts", list(COUNTS.values()), ids=list(COUNTS))
@pytest.mark.parametrize("options", list(GIST_CONFIGS.values()), ids=list(GIST_CONFIGS))
def test_gist_matches_reference(options, counts):
    emb, labels = batch(counts, dim=6, seed=1)
    guide = unit_rows(emb.shape[0], 4, seed=2)  # a narrow guide: many candidates cross the threshold
    loss_fn = GISTLoss(**options)
    assert_same(
        lambda x: loss_fn({"last_hidden_state": x, "guide_hidden_state": guide}, labels),
        lambda x: reference_gist(x, guide, labels, **options),
        emb,
    )


def gist_masking_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Student rows at random; guide rows built on unit vectors so every guide similarity is known.

    Rows: a0 p0 n0_0 n0_1 n0_2 | a1 p1 | a2 p2 n2_0  (3, 0 and 1 negatives).

    ======  =====================================  ===================================
    row     guide embedding                        guide similarities that matter
    ======  =====================================  ===================================
    a0 (0)  e0
    p0 (1)  0.6 e0 + 0.8 e1                        t0 = g(a0, p0) = 0.60
    n0_0    0.9 e0 + sqrt(0.19) e2                 g(a0, n0_0) = 0.90
    n0_1    0.55 e0 + sqrt(0.6975) e3              g(a0, n0_1) = 0.55
    n0_2    e4                                     g(a0, n0_2) = 0
    a1 (5)  0.8 e0 + 0.6 e5                        g(a0, a1) = 0.80
    p1 (6)  = a1 (a duplicate: t1 = 1)             g(a0, p1) = 0.80, g(p0, p1) = 0.48
    a2 (7)  e6
    p2 (8)  0.5 e6 + sqrt(0.75) e7                 t2 = g(a2, p2) = 0.50
    n2_0    0.52 e6 + sqrt(0.7296) e8              g(a2, n2_0) = 0.52
    ======  =====================================  ===================================

    Every other pair the loss looks at has guide similarity 0 (or below 0.9 for anchor 1).
    """
    e = torch.eye(10, dtype=torch.float64)
    guide = torch.stack([
        e[0],
        0.6 * e[0] + 0.8 * e[1],
        0.9 * e[0] + math.sqrt(0.19) * e[2],
        0.55 * e[0] + math.sqrt(1 - 0.55**2) * e[3],
        e[4],
        0.8 * e[0] + 0.6 * e[5],
        0.8 * e[0] + 0.6 * e[5],
        e[6],
        0.5 * e[6] + math.sqrt(0.75) * e[7],
        0.52 * e[6] + math.sqrt(1 - 0.52**2) * e[8],
    ])
    emb, labels = batch([3, 0, 1], dim=8, seed=5)
    return emb, guide, labels


A0, P0, N00, N01, N02, A1, P1, A2, P2, N20 = range(10)

# (anchor, block, row) of the candidates that must be dropped, worked out from the table above
GIST_DROPS = {
    # t0 - 0 = 0.60: p1 (0.80), n0_0 (0.90), a1 (0.80); n0_1 (0.55) stays. t2 = 0.50: n2_0 (0.52)
    ("absolute", 0.0): {(0, "doc", P1), (0, "doc", N00), (0, "anchor", A1), (2, "doc", N20)},
    # thresholds 0.50 / 0.90 / 0.40: n0_1 (0.55) goes too; p0-p1 (0.48) stays
    ("absolute", 0.1): {(0, "doc", P1), (0, "doc", N00), (0, "doc", N01), (0, "anchor", A1), (2, "doc", N20)},
    # thresholds 0.70 / 1.10 / 0.60: n2_0 (0.52) comes back
    ("absolute", -0.1): {(0, "doc", P1), (0, "doc", N00), (0, "anchor", A1)},
    # t * 0.9 = 0.54 / 0.90 / 0.45: n0_1 (0.55) dropped
    ("relative", 0.1): {(0, "doc", P1), (0, "doc", N00), (0, "doc", N01), (0, "anchor", A1), (2, "doc", N20)},
    # t * 0.95 = 0.57 / 0.95 / 0.475: n0_1 (0.55) stays
    ("relative", 0.05): {(0, "doc", P1), (0, "doc", N00), (0, "anchor", A1), (2, "doc", N20)},
}


@pytest.mark.parametrize("strategy, margin", list(GIST_DROPS), ids=[f"{s}_{m}" for s, m in GIST_DROPS])
def test_gist_drops_exactly_the_flagged_candidates(strategy, margin):
    emb, guide, labels = gist_masking_batch()
    drops = GIST_DROPS[(strategy, margin)]
    loss_fn = GISTLoss(temperature=0.05, margin=margin, margin_strategy=strategy)
    value = assert_same(
        lambda x: loss_fn({"last_hidden_state": x, "guide_hidden_state": guide}, labels),
        lambda x: reference_gist(x, guide, labels, temperature=0.05, drop=drops),
        emb,
    )
    # the explicit list is not vacuous: without it (or with one entry fewer) the value moves
    none_dropped = reference_gist(emb, guide, labels, temperature=0.05, drop=set())
    assert not math.isclose(value, none_dropped.item(), rel_tol=1e-6)
    for entry in drops:
        fewer = reference_gist(emb, guide, labels, temperature=0.05, drop=drops - {entry})
        assert not math.isclose(value, fewer.item(), rel_tol=1e-9), entry


def test_gist_never_drops_the_own_positive():
    """A margin so large that every candidate fails the guide's test: only the positive is left.

    (absolute: threshold t - 10; relative: t * (1 - 10) = -9 t, below every guide
    similarity of this batch, all >= 0.)"""
    emb, guide, labels = gist_masking_batch()
    for strategy, margin in (("absolute", 10.0), ("relative", 10.0)):
        out = {"last_hidden_state": emb, "guide_hidden_state": guide}
        loss = GISTLoss(margin=margin, margin_strategy=strategy)(out, labels)
        assert loss.item() == pytest.approx(0.0, abs=1e-12)  # log softmax of one logit


def test_gist_guide_gets_no_gradient_and_may_have_another_width():
    emb, labels = batch(MIXED, dim=8, seed=3)
    guide = unit_rows(emb.shape[0], 32, seed=4).requires_grad_(True)
    x = emb.clone().requires_grad_(True)
    GISTLoss()({"last_hidden_state": x, "guide_hidden_state": guide}, labels).backward()
    assert guide.grad is None
    assert x.grad.abs().sum() > 0


# ---- GIST and InfoNCE ------------------------------------------------------------------


@pytest.mark.parametrize("counts", [MIXED, [2, 0, 1, 3], [0, 0]], ids=["0_1_3", "2_0_1_3", "0_0"])
def test_gist_with_student_as_guide_is_masked_infonce_with_qq(counts):
    """Guide = student, margin 0, absolute, no positive-positive block:
    GIST == InfoNCE(mask_fake_negative, fake_neg_margin=0, include_qq) at the same temperature.

    Both drop a query-document or query-query candidate scoring above s(a_i, p_i), keep
    the own positive, and drop the anchor itself from the query-query block.
    """
    emb, labels = batch(counts, dim=3, seed=7)  # 3-D rows: many candidates beat the positive
    gist = GISTLoss(temperature=0.05, margin=0.0, contrast_positives=False)
    infonce = InfoNCELoss(temperature=0.05, mask_fake_negative=True, fake_neg_margin=0.0, include_qq=True)
    value = assert_same(
        lambda x: gist({"last_hidden_state": x, "guide_hidden_state": x.detach()}, labels),
        lambda x: infonce({"last_hidden_state": x}, labels),
        emb,
    )
    unmasked = InfoNCELoss(temperature=0.05, include_qq=True)({"last_hidden_state": emb}, labels)
    assert value < unmasked.item() - 1e-3  # the mask did drop candidates


def test_gist_positive_block_is_infonce_dd_only_without_negatives_and_mask():
    """InfoNCE's include_dd block is s(p_i, every document but p_i), never masked; GIST's
    positive-positive block is s(p_i, p_j), j != i, masked by the guide. They coincide only
    when the batch has no hard negatives and nothing is masked (a huge margin)."""
    emb, labels = batch([0, 0, 0, 0], dim=6, seed=8)
    out = {"last_hidden_state": emb, "guide_hidden_state": unit_rows(emb.shape[0], 5, seed=9)}
    infonce_qq_dd = InfoNCELoss(temperature=0.05, include_qq=True, include_dd=True)
    assert_same(  # margin -100: the threshold t + 100 is never reached
        lambda x: GISTLoss(temperature=0.05, margin=-100.0)({**out, "last_hidden_state": x}, labels),
        lambda x: infonce_qq_dd({"last_hidden_state": x}, labels),
        emb,
    )
    # with negatives the blocks differ (InfoNCE's dd row also holds s(p_i, negatives))
    emb, labels = batch(MIXED, dim=6, seed=8)
    out = {"last_hidden_state": emb, "guide_hidden_state": emb}
    gist = GISTLoss(temperature=0.05, margin=-100.0)(out, labels)
    assert not math.isclose(gist.item(), infonce_qq_dd(out, labels).item(), rel_tol=1e-6)


# ---- GIST: parts, options, errors ------------------------------------------------------


def test_gist_parts_equal_forward_and_query_rows_split_the_mean():
    counts = [2, 0, 3, 1, 0]
    emb, labels = batch(counts, dim=6, seed=10)
    guide = unit_rows(emb.shape[0], 4, seed=11)
    out = {"last_hidden_state": emb, "guide_hidden_state": guide}
    for options in (dict(), dict(margin=0.1, margin_strategy="relative", contrast_anchors=False)):
        loss_fn = GISTLoss(**options)
        parts = loss_fn.split_parts(out, labels)
        assert {k: tuple(p.shape) for k, p in parts.tensors().items()} == {
            "anchors": (5, 6), "positives": (5, 6), "negatives": (6, 6), "neg_group": (6,),
            "guide_anchors": (5, 4), "guide_positives": (5, 4), "guide_negatives": (6, 4)}
        assert parts.teacher is None
        whole = loss_fn.forward_from_parts(parts)
        torch.testing.assert_close(whole, loss_fn(out, labels), **TOL)
        first = loss_fn.forward_from_parts(parts, query_rows=slice(0, 2))
        rest = loss_fn.forward_from_parts(parts, query_rows=slice(2, 5))
        torch.testing.assert_close(whole, (2 * first + 3 * rest) / 5, **TOL)
    with pytest.raises(ValueError, match="query_rows"):
        loss_fn.forward_from_parts(parts, query_rows=slice(4, 4))
    with pytest.raises(ValueError, match="guide_negatives"):
        loss_fn.forward_from_parts(replace(parts, guide=replace(parts.guide, negatives=parts.guide.negatives[:-1])))
    with pytest.raises(ValueError, match="guide"):  # GIST's parts without the guide's rows
        loss_fn.forward_from_parts(replace(parts, guide=None))


def test_gist_default_temperature(monkeypatch):
    assert GIST_TEMPERATURE == 0.01
    assert default_temperature({}) == 0.01
    assert build_loss("gist").temperature == 0.01
    assert GISTLoss().temperature == 0.01
    monkeypatch.setenv("INFONCE_TEMPERATURE", "0.05")
    assert build_loss("gist").temperature == 0.05
    assert build_loss("gist", temperature=0.2).temperature == 0.2  # the option wins
    assert GISTLoss().temperature == 0.01  # the constructor does not read the environment
    monkeypatch.setenv("INFONCE_TEMPERATURE", " ")
    assert build_loss("gist").temperature == 0.01  # empty counts as unset
    monkeypatch.setenv("INFONCE_HARD_NEGATIVES", "oops")  # another loss's variable: not read here
    assert build_loss("gist").temperature == 0.01
    monkeypatch.setenv("INFONCE_TEMPERATURE", "hot")
    with pytest.raises(ValueError, match="INFONCE_TEMPERATURE"):
        build_loss("gist")


def test_gist_errors():
    emb, labels = batch(MIXED)
    with pytest.raises(ValueError, match="guide_hidden_state"):
        GISTLoss()({"last_hidden_state": emb}, labels)
    with pytest.raises(ValueError, match="guide_hidden_state must be"):
        GISTLoss()({"last_hidden_state": emb, "guide_hidden_state": emb[:-1]}, labels)
    with pytest.raises(ValueError, match="must have"):  # labels as InfoNCE checks them
        GISTLoss()({"last_hidden_state": emb, "guide_hidden_state": emb}, labels[:-1])
    with pytest.raises(ValueError, match="margin_strategy"):
        GISTLoss(margin_strategy="percent")
    with pytest.raises(ValueError, match="temperature"):
        GISTLoss(temperature=0.0)
    with pytest.raises(ValueError, match="margin"):
        GISTLoss(margin=float("nan"))
    with pytest.raises(ValueError, match="contrast_anchors"):
        GISTLoss(contrast_anchors="yes")
    with pytest.raises(ValueError, match="takes no option .temprature."):
        build_loss("gist", temprature=0.1)


# ==== embedding distillation ============================================================


def reference_distance(x: torch.Tensor, y: torch.Tensor, distance: str) -> torch.Tensor:
    """cosine: 1 - x.y / (|x| |y|); mse: sum_k (x_k - y_k)^2 / D."""
    if distance == "cosine":
        return 1 - dot(x, y) / (x.norm() * y.norm())
    return ((x - y) ** 2).sum() / x.shape[0]


def reference_marginal(x: torch.Tensor, y: torch.Tensor, lam: float, distance: str) -> torch.Tensor:
    """(1/n) sum_i [ d(x_i, y_i) - lam/(n-1) sum_{j != i} d(x_i, y_j) ]; with n = 1 the sum is empty."""
    n = x.shape[0]
    total = 0
    for i in range(n):
        others = sum(reference_distance(x[i], y[j], distance) for j in range(n) if j != i)
        push = lam * others / (n - 1) if n > 1 else 0
        total = total + reference_distance(x[i], y[i], distance) - push
    return total / n


def distill_batch(n_rows: int = 7, dim: int = 6, seed: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """Student rows and a teacher not normalized (the losses must not depend on that)."""
    student = unit_rows(n_rows, dim, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    teacher = 2.0 * torch.randn(n_rows, dim, generator=gen, dtype=torch.float64)
    return student, teacher


def test_distill_cosine_and_mse_match_formulas():
    emb, teacher = distill_batch()
    labels = layout([1, 0, 3])[:0]  # ignored, whatever they are
    n = emb.shape[0]
    assert_same(
        lambda x: DistillCosineLoss()({"last_hidden_state": x, "teacher_hidden_state": teacher}, labels),
        lambda x: sum(reference_distance(x[i], teacher[i], "cosine") for i in range(n)) / n,
        emb,
    )
    assert_same(
        lambda x: DistillMSELoss()({"last_hidden_state": x, "teacher_hidden_state": teacher}, None),
        lambda x: sum(reference_distance(x[i], teacher[i], "mse") for i in range(n)) / n,
        emb,
    )
    # mse as stated: the mean over every element, i.e. F.mse_loss
    out = {"last_hidden_state": emb, "teacher_hidden_state": teacher}
    torch.testing.assert_close(DistillMSELoss()(out, None), F.mse_loss(emb, teacher), **TOL)


@pytest.mark.parametrize("distance", ["cosine", "mse"])
@pytest.mark.parametrize("lam", [0.0, 0.1, 0.7])
@pytest.mark.parametrize("n_rows", [1, 2, 9])
def test_distill_marginal_matches_formula(distance, lam, n_rows):
    emb, teacher = distill_batch(n_rows=n_rows)
    loss_fn = DistillMarginalLoss(lam=lam, distance=distance)
    assert_same(
        lambda x: loss_fn({"last_hidden_state": x, "teacher_hidden_state": teacher}, None),
        lambda x: reference_marginal(x, teacher, lam, distance),
        emb,
    )


def test_distill_marginal_with_lambda_zero_is_the_plain_distance():
    emb, teacher = distill_batch(n_rows=6)
    out = {"last_hidden_state": emb, "teacher_hidden_state": teacher}
    assert_same(
        lambda x: DistillMarginalLoss(lam=0.0, distance="cosine")({**out, "last_hidden_state": x}, None),
        lambda x: DistillCosineLoss()({**out, "last_hidden_state": x}, None),
        emb,
    )
    assert_same(
        lambda x: DistillMarginalLoss(lam=0.0, distance="mse")({**out, "last_hidden_state": x}, None),
        lambda x: DistillMSELoss()({**out, "last_hidden_state": x}, None),
        emb,
    )
    # and lambda does move it
    assert DistillMarginalLoss(lam=0.5)(out, None).item() < DistillCosineLoss()(out, None).item()


def test_distill_marginal_parts_and_query_rows():
    emb, teacher = distill_batch(n_rows=7)
    out = {"last_hidden_state": emb, "teacher_hidden_state": teacher}
    for distance in ("cosine", "mse"):
        loss_fn = DistillMarginalLoss(lam=0.3, distance=distance)
        parts = loss_fn.split_parts(out, None)
        whole = loss_fn.forward_from_parts(parts)
        torch.testing.assert_close(whole, loss_fn(out, None), **TOL)
        first = loss_fn.forward_from_parts(parts, query_rows=slice(0, 3))
        rest = loss_fn.forward_from_parts(parts, query_rows=slice(3, 7))
        torch.testing.assert_close(whole, (3 * first + 4 * rest) / 7, **TOL)


def test_distill_teacher_gets_no_gradient():
    emb, teacher = distill_batch()
    teacher.requires_grad_(True)
    for loss_fn in (DistillCosineLoss(), DistillMSELoss(), DistillMarginalLoss(lam=0.2, distance="mse")):
        x = emb.clone().requires_grad_(True)
        loss_fn({"last_hidden_state": x, "teacher_hidden_state": teacher}, None).backward()
        assert teacher.grad is None
        assert x.grad.abs().sum() > 0


def test_distill_embedding_errors():
    emb, teacher = distill_batch()
    for name in ("distill_cosine", "distill_mse", "distill_marginal"):
        loss_fn = build_loss(name)
        with pytest.raises(ValueError, match="teacher_hidden_state"):
            loss_fn({"last_hidden_state": emb}, None)
        with pytest.raises(ValueError, match="same width"):
            loss_fn({"last_hidden_state": emb, "teacher_hidden_state": teacher[:, :4]}, None)
        with pytest.raises(ValueError, match="same rows"):
            loss_fn({"last_hidden_state": emb, "teacher_hidden_state": teacher[:-1]}, None)
    with pytest.raises(ValueError, match="lam"):
        DistillMarginalLoss(lam=-0.1)
    with pytest.raises(ValueError, match="distance"):
        DistillMarginalLoss(distance="l1")


# ==== score distillation (KL) ===========================================================


def reference_kl(student_logits: list[torch.Tensor], teacher_logits: list[float]) -> torch.Tensor:
    """KL(P_t || P_s) = sum_c P_t(c) (log P_t(c) - log P_s(c)) for one anchor."""
    log_s = torch.log_softmax(torch.stack(student_logits), 0)
    log_t = torch.log_softmax(torch.tensor(teacher_logits, dtype=torch.float64), 0)
    return (log_t.exp() * (log_t - log_s)).sum()


def reference_distill_kl(emb, labels, *, temperature, teacher_temperature, use_batch, teacher=None, scores=None):
    """Per anchor: the candidates (every document of the batch, or the own positive then
    the own negatives), student logits s(a, c) / T, teacher logits s_t(a, c) / T_t or the
    given score / T_t; the KL of the two softmaxes; the mean over anchors."""
    groups = parse_groups(emb.shape[0], [float(x) for x in labels])
    every_doc = [d for _, p, negs in groups for d in [p] + negs]
    losses = []
    for g, (a, p, negs) in enumerate(groups):
        candidates = every_doc if use_batch else [p] + negs
        student = [dot(emb[a], emb[c]) / temperature for c in candidates]
        if scores is not None:
            teacher_logits = [float(scores[g][k]) / teacher_temperature for k in range(len(candidates))]
        else:
            teacher_logits = [float(dot(teacher[a], teacher[c])) / teacher_temperature for c in candidates]
        losses.append(reference_kl(student, teacher_logits))
    return torch.stack(losses).mean()


KL_CONFIGS = {
    "batch": dict(temperature=0.05, teacher_temperature=0.02, use_batch=True),
    "batch_same_t": dict(temperature=0.1, teacher_temperature=None, use_batch=True),
    "group": dict(temperature=0.05, teacher_temperature=0.1, use_batch=False),
}


@pytest.mark.parametrize("counts", list(COUNTS.values()), ids=list(COUNTS))
@pytest.mark.parametrize("options", list(KL_CONFIGS.values()), ids=list(KL_CONFIGS))
def test_distill_kl_teacher_embeddings_match_reference(options, counts):
    emb, labels = batch(counts, dim=6, seed=30)
    teacher = unit_rows(emb.shape[0], 12, seed=31)  # the teacher may be wider
    loss_fn = DistillKLLoss(**options)
    ref = dict(options, teacher_temperature=options["teacher_temperature"] or options["temperature"])
    assert_same(
        lambda x: loss_fn({"last_hidden_state": x, "teacher_hidden_state": teacher}, labels),
        lambda x: reference_distill_kl(x, labels, teacher=teacher, **ref),
        emb,
    )


@pytest.mark.parametrize("pad", [float("nan"), float("-inf"), 123.0])
def test_distill_kl_teacher_scores_match_reference(pad):
    counts = [0, 1, 3, 2]
    emb, labels = batch(counts, dim=6, seed=32)
    gen = torch.Generator().manual_seed(33)
    scores = torch.full((4, 5), pad, dtype=torch.float64)  # one column wider than needed
    for g, k in enumerate(counts):
        scores[g, : 1 + k] = 3 * torch.randn(1 + k, generator=gen, dtype=torch.float64)
    loss_fn = DistillKLLoss(temperature=0.05, teacher_temperature=1.0, use_batch=False)
    assert_same(
        lambda x: loss_fn({"last_hidden_state": x, "teacher_scores": scores}, labels),
        lambda x: reference_distill_kl(
            x, labels, temperature=0.05, teacher_temperature=1.0, use_batch=False, scores=scores.tolist()
        ),
        emb,
    )


def test_distill_kl_is_zero_when_the_teacher_is_the_student():
    emb, labels = batch(MIXED, seed=34)
    for use_batch in (True, False):
        out = {"last_hidden_state": emb, "teacher_hidden_state": emb.clone()}
        assert DistillKLLoss(use_batch=use_batch)(out, labels).item() == pytest.approx(0.0, abs=1e-12)


def test_distill_kl_parts_and_query_rows():
    counts = [2, 0, 3, 1]
    emb, labels = batch(counts, dim=6, seed=35)
    out = {"last_hidden_state": emb, "teacher_hidden_state": unit_rows(emb.shape[0], 9, seed=36)}
    for use_batch in (True, False):
        loss_fn = DistillKLLoss(temperature=0.05, use_batch=use_batch)
        parts = loss_fn.split_parts(out, labels)
        assert {k: tuple(p.shape) for k, p in parts.tensors().items()} == {
            "anchors": (4, 6), "positives": (4, 6), "negatives": (6, 6), "neg_group": (6,),
            "teacher_anchors": (4, 9), "teacher_positives": (4, 9), "teacher_negatives": (6, 9)}
        assert parts.guide is None
        whole = loss_fn.forward_from_parts(parts)
        torch.testing.assert_close(whole, loss_fn(out, labels), **TOL)
        first = loss_fn.forward_from_parts(parts, query_rows=slice(0, 1))
        rest = loss_fn.forward_from_parts(parts, query_rows=slice(1, 4))
        torch.testing.assert_close(whole, (first + 3 * rest) / 4, **TOL)


def test_distill_kl_errors():
    counts = [0, 1, 3]
    emb, labels = batch(counts)
    scores = torch.zeros(3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="use_batch=False"):
        DistillKLLoss(use_batch=True)({"last_hidden_state": emb, "teacher_scores": scores}, labels)
    group_only = DistillKLLoss(use_batch=False)
    with pytest.raises(ValueError, match="not both"):
        group_only({"last_hidden_state": emb, "teacher_scores": scores, "teacher_hidden_state": emb}, labels)
    with pytest.raises(ValueError, match="W >= 4"):
        group_only({"last_hidden_state": emb, "teacher_scores": scores[:, :3]}, labels)
    with pytest.raises(ValueError, match="B = 3 groups"):
        group_only({"last_hidden_state": emb, "teacher_scores": scores[:2]}, labels)
    holes = scores.clone()
    holes[2, 2] = float("nan")  # group 2's second negative is a real candidate
    with pytest.raises(ValueError, match=r"teacher_scores\[2, 2\] \(group 2, its negative 1\)"):
        group_only({"last_hidden_state": emb, "teacher_scores": holes}, labels)
    with pytest.raises(ValueError, match="teacher_hidden_state"):
        DistillKLLoss()({"last_hidden_state": emb}, labels)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        DistillKLLoss(teacher_temperature=0.0)
    with pytest.raises(ValueError, match="use_batch"):
        DistillKLLoss(use_batch="false")


# ==== Matryoshka ========================================================================


def cut(x: torch.Tensor, width: int) -> torch.Tensor:
    """The first ``width`` components, divided by their norm."""
    head = x[:, :width]
    return head / head.norm(dim=1, keepdim=True)


def test_matryoshka_is_the_weighted_sum_over_cut_embeddings():
    """sum_d w_d * InfoNCE(normalize(emb[:, :d])), with the reference InfoNCE (not a mean)."""
    emb, labels = batch(MIXED, dim=8, seed=40)
    dims = {2: 0.5, 4: 1.0, 8: 2.0}
    loss_fn = MatryoshkaLoss(InfoNCELoss(temperature=0.05, include_qq=True), dims)
    assert_same(
        lambda x: loss_fn({"last_hidden_state": x}, labels),
        lambda x: sum(w * reference_infonce(cut(x, d), labels, temperature=0.05, include_qq=True)
                      for d, w in dims.items()),
        emb,
    )


@pytest.mark.parametrize("name, extra", [
    ("infonce", {}),
    ("gist", {"guide_hidden_state": "guide"}),
    ("distill_kl", {"teacher_hidden_state": "teacher"}),
    ("distill_marginal", {"teacher_hidden_state": "teacher"}),
])
def test_matryoshka_full_width_weight_one_is_the_inner_loss(name, extra):
    """Value, and gradient w.r.t. the rows before the model's L2 normalization.

    (The wrapper normalizes the cut rows again; normalizing twice is normalizing once, so
    the gradient reaching the model is unchanged. Only the gradient w.r.t. the already
    normalized rows loses its radial part, which the model's normalization drops anyway.)
    """
    emb, labels = batch(MIXED, dim=8, seed=41)
    hidden = 3.0 * emb + 0.1  # what the model had before its normalization
    side = {"guide": unit_rows(emb.shape[0], 5, seed=42), "teacher": unit_rows(emb.shape[0], 8, seed=43)}
    others = {k: side[v] for k, v in extra.items()}
    inner = build_loss(name)
    wrapped = MatryoshkaLoss(inner, {8: 1.0})
    assert_same(
        lambda h: wrapped({"last_hidden_state": F.normalize(h, dim=-1), **others}, labels),
        lambda h: inner({"last_hidden_state": F.normalize(h, dim=-1), **others}, labels),
        hidden,
    )


def test_matryoshka_pair_loss_and_full_width_identity():
    emb = unit_rows(6, 8, seed=44)  # 3 pairs
    labels = torch.tensor([0.9, 0.1, 0.4], dtype=torch.float64)
    inner = build_loss("cosine_similarity")
    assert_same(
        lambda h: MatryoshkaLoss(inner, {8: 1.0})({"last_hidden_state": F.normalize(h, dim=-1)}, labels),
        lambda h: inner({"last_hidden_state": F.normalize(h, dim=-1)}, labels),
        2.0 * emb - 0.3,
    )
    dims = {3: 1.0, 6: 0.25}
    assert_same(
        lambda x: MatryoshkaLoss(inner, dims)({"last_hidden_state": x}, labels),
        lambda x: sum(w * inner({"last_hidden_state": cut(x, d)}, labels) for d, w in dims.items()),
        emb,
    )


def test_matryoshka_cuts_only_the_student():
    """The guide (width 5) and the teacher (width 8) reach the inner loss uncut."""
    emb, labels = batch(MIXED, dim=8, seed=45)
    guide = unit_rows(emb.shape[0], 5, seed=46)
    teacher = unit_rows(emb.shape[0], 8, seed=47)
    gist = GISTLoss(margin=0.05)
    assert_same(
        lambda x: MatryoshkaLoss(gist, {3: 1.0})({"last_hidden_state": x, "guide_hidden_state": guide}, labels),
        lambda x: reference_gist(cut(x, 3), guide, labels, margin=0.05),
        emb,
    )
    kl = DistillKLLoss(temperature=0.05)
    assert_same(
        lambda x: MatryoshkaLoss(kl, {4: 1.0})({"last_hidden_state": x, "teacher_hidden_state": teacher}, labels),
        lambda x: reference_distill_kl(
            cut(x, 4), labels, temperature=0.05, teacher_temperature=0.05, use_batch=True, teacher=teacher
        ),
        emb,
    )


def test_matryoshka_dims_wider_than_the_embedding_are_refused():
    emb, labels = batch(MIXED, dim=8)
    loss_fn = MatryoshkaLoss(InfoNCELoss(), {4: 1.0, 16: 1.0})
    loss_fn.check_dims(16)
    with pytest.raises(ValueError, match=r"mrl_dims \[16\] exceed the embedding width 8"):
        loss_fn.check_dims(8)
    with pytest.raises(ValueError, match="exceed the embedding width 8"):
        loss_fn({"last_hidden_state": emb}, labels)
    with pytest.raises(ValueError, match="exceed the embedding width 8"):
        loss_fn.split_parts({"last_hidden_state": emb}, labels)


def test_check_setup_before_the_side_inputs_are_known_checks_the_width_only():
    """mmembed sft checks the loss against the config's width before the data is read
    (``sides_known=False``): Matryoshka's widths are refused, side inputs are not asked for."""
    from mmembed.losses import Setup, build_loss

    early = Setup(width=8, sides_known=False)
    with pytest.raises(ValueError, match=r"mrl_dims \[16\] exceed the embedding width 8"):
        MatryoshkaLoss(InfoNCELoss(), {4: 1.0, 16: 1.0}).check_setup(early)
    MatryoshkaLoss(InfoNCELoss(), {4: 1.0, 8: 1.0}).check_setup(early)
    gist = MatryoshkaLoss(build_loss("gist"), {4: 1.0})
    gist.check_setup(early)  # the guide is checked once the side models are known
    with pytest.raises(ValueError, match="needs a guide model"):
        gist.check_setup(Setup(width=8))
    gist.check_setup(Setup(width=8, guide=True))


@pytest.mark.parametrize("name, extra", [
    ("infonce", {}),
    ("gist", {"guide_hidden_state": "guide"}),
    ("distill_kl", {"teacher_hidden_state": "teacher"}),
    ("distill_marginal", {"teacher_hidden_state": "teacher"}),
])
def test_matryoshka_parts_equal_forward(name, extra):
    counts = [2, 0, 3, 1]
    emb, labels = batch(counts, dim=8, seed=48)
    side = {"guide": unit_rows(emb.shape[0], 5, seed=49), "teacher": unit_rows(emb.shape[0], 8, seed=50)}
    out = {"last_hidden_state": emb, **{k: side[v] for k, v in extra.items()}}
    # the teacher is not cut, so embedding distillation only works at the teacher's width
    dims = {8: 0.7} if name == "distill_marginal" else {2: 0.5, 4: 1.0, 8: 1.0}
    loss_fn = MatryoshkaLoss(build_loss(name), dims)
    parts = loss_fn.split_parts(out, labels)
    whole = loss_fn.forward_from_parts(parts)
    torch.testing.assert_close(whole, loss_fn(out, labels), **TOL)
    n = parts.n_queries
    first = loss_fn.forward_from_parts(parts, query_rows=slice(0, 1))
    rest = loss_fn.forward_from_parts(parts, query_rows=slice(1, n))
    torch.testing.assert_close(whole, (first + (n - 1) * rest) / n, **TOL)


def test_matryoshka_passes_the_inner_declarations_and_config_through():
    from mmembed.losses.base import CrossProcess, Layout

    assert MatryoshkaLoss(InfoNCELoss(use_batch=False), {4: 1.0}).cross_process is CrossProcess.LOCAL_GROUPS
    assert MatryoshkaLoss(InfoNCELoss(), {4: 1.0}).cross_process is CrossProcess.GROUP_PARTS
    assert MatryoshkaLoss(InfoNCELoss(), {4: 1.0}).config == InfoNCELoss().config
    assert MatryoshkaLoss(DistillKLLoss(use_batch=False), {4: 1.0}).side.teacher == {"embeddings", "scores"}
    assert MatryoshkaLoss(DistillKLLoss(), {4: 1.0}).side.teacher == {"embeddings"}
    assert MatryoshkaLoss(GISTLoss(), {4: 1.0}).side.guide is True
    marginal = MatryoshkaLoss(build_loss("distill_marginal"), {4: 1.0})
    assert marginal.cross_process is CrossProcess.ROW_PARTS and marginal.side.teacher == {"embeddings"}
    pair = MatryoshkaLoss(build_loss("contrastive"), {4: 1.0})
    assert pair.layout is Layout.PAIR and pair.cross_process is CrossProcess.LOCAL_PAIRS
    assert not hasattr(pair, "config")
    with pytest.raises(TypeError, match="no split_parts"):
        pair.split_parts({"last_hidden_state": torch.zeros(2, 4)}, torch.ones(1))


def test_matryoshka_dims_parsing_and_build(monkeypatch):
    spec = '{"64": 1.0, "128": 0.5}'  # ms-swift's --mrl_dims
    assert parse_dims(spec) == {64: 1.0, 128: 0.5}
    assert parse_dims({"32": 1, 16: 2.0}) == {32: 1.0, 16: 2.0}
    assert list(parse_dims(json.loads(spec))) == [64, 128]
    for bad, message in [
        ("{}", "empty"), ("[64]", "map widths"), ("64:1", "JSON object"), ({0: 1.0}, ">= 1"),
        ({"6.5": 1.0}, "integer"), ({True: 1.0}, "integer"), ({64: -1.0}, ">= 0"), ({64: float("inf")}, "finite number"),
        ({64: 1.0, "64": 1.0}, "twice"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_dims(bad)
    monkeypatch.setenv("INFONCE_TEMPERATURE", "0.05")
    loss_fn = build_loss("matryoshka", dims=spec)
    assert isinstance(loss_fn.inner, InfoNCELoss) and loss_fn.inner.config.temperature == 0.05
    loss_fn = build_loss("matryoshka", dims={8: 1.0}, inner="gist", margin=0.1)
    assert isinstance(loss_fn.inner, GISTLoss) and loss_fn.inner.margin == 0.1
    assert build_loss("matryoshka", dims={8: 1.0}, inner=GISTLoss()).dims == {8: 1.0}
    with pytest.raises(ValueError, match="inner loss given by name"):
        build_loss("matryoshka", dims={8: 1.0}, inner=GISTLoss(), margin=0.1)
    with pytest.raises(ValueError, match="cannot wrap itself"):
        build_loss("matryoshka", dims={8: 1.0}, inner="matryoshka")
    with pytest.raises(ValueError, match="unknown loss"):
        build_loss("matryoshka", dims={8: 1.0}, inner="triplet")
    with pytest.raises(ValueError, match="dims"):
        build_loss("matryoshka")


# ==== registry ==========================================================================


def test_registry_has_the_method_losses():
    assert LOSSES["gist"] is GISTLoss
    assert LOSSES["distill_cosine"] is DistillCosineLoss
    assert LOSSES["distill_mse"] is DistillMSELoss
    assert LOSSES["distill_marginal"] is DistillMarginalLoss
    assert LOSSES["distill_kl"] is DistillKLLoss
    assert LOSSES["matryoshka"] is MatryoshkaLoss
    assert build_loss("distill_marginal", lam=0.3, distance="mse").lam == 0.3
    assert build_loss("distill_kl", temperature=0.02).teacher_temperature == 0.02
    with pytest.raises(ValueError, match="distill_cosine"):
        build_loss("distill_cosine", lam=0.1)
