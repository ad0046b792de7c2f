"""The colpali-engine losses (mmembed.losses.late_interaction) against colpali-engine 0.3.18's
own values (tests/fixtures/colpali/batches.json, made by make_fixtures.py there: CI does not
install colpali) and against written-out per-anchor loops for what colpali's batches cannot
hold (groups with different numbers of negatives).

Padding differs by design: colpali's zero vectors take part in the max over a document's
tokens (a query token whose real dot products are all negative scores 0), mmembed's absent
tokens never do. The fixture batches have nonnegative components only, so every real dot
product is positive and the two agree there (checked below on the batches themselves)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from reference_losses import reference_maxsim

from mmembed.losses import (
    ColbertNegativeCELoss,
    ColbertPairwiseCELoss,
    ColbertPairwiseNegativeCELoss,
    CrossProcess,
    InfoNCELoss,
    MaxSim,
    build_loss,
)

FIXTURES = json.loads((Path(__file__).parents[1] / "fixtures" / "colpali" / "batches.json").read_text())


def as_group_batch(batch: dict, with_negatives: bool = True):
    """The fixture batch in ms-swift's layout: rows a0, p0, n0_*, a1, ... padded to one length."""
    q = torch.tensor(batch["queries"], dtype=torch.float64)
    p = torch.tensor(batch["positives"], dtype=torch.float64)
    n = torch.tensor(batch["negatives"], dtype=torch.float64)  # [B, k, Ld, D]
    if not with_negatives:
        n = n[:, :0]
    width = max(q.shape[1], p.shape[1])
    pad = lambda x: F.pad(x, (0, 0, 0, width - x.shape[-2]))  # noqa: E731
    rows, labels = [], []
    for i in range(q.shape[0]):
        rows += [pad(q[i]), pad(p[i]), *pad(n[i]).unbind(0)]
        labels += [1.0] + [0.0] * n.shape[1]
    return torch.stack(rows), torch.tensor(labels, dtype=torch.float64)


@pytest.mark.parametrize("index", range(len(FIXTURES["batches"])))
def test_the_fixture_batches_cannot_tell_the_paddings_apart(index):
    batch = FIXTURES["batches"][index]
    q = torch.tensor(batch["queries"], dtype=torch.float64)
    p = torch.tensor(batch["positives"], dtype=torch.float64)
    assert bool((q >= 0).all()) and bool((p >= 0).all())
    colpali_style = torch.einsum("bnd,csd->bcns", q, p).amax(3).sum(2)  # zeros in the max
    torch.testing.assert_close(MaxSim().matrix(q, p), colpali_style, atol=1e-12, rtol=0)


CASES = {
    "colbert_normalized": lambda: InfoNCELoss(temperature=0.02, similarity=MaxSim(normalize=True)),
    "colbert_raw": lambda: InfoNCELoss(temperature=1.0, similarity=MaxSim()),
    "pairwise_ce": lambda: build_loss("colbert_pairwise_ce"),
    "pairwise_ce_raw": lambda: ColbertPairwiseCELoss(normalize_scores=False),
    "negative_ce": lambda: build_loss("colbert_negative_ce"),
    "negative_ce_no_in_batch": lambda: ColbertNegativeCELoss(in_batch_term_weight=0.0),
    "pairwise_negative_ce": lambda: build_loss("colbert_pairwise_negative_ce"),
    "pairwise_negative_ce_no_in_batch": lambda: ColbertPairwiseNegativeCELoss(in_batch_term_weight=0),
}
#: colpali's in-batch losses take no negatives: ColbertLoss is InfoNCE over the positives only
IN_BATCH_ONLY = {"colbert_normalized", "colbert_raw", "pairwise_ce", "pairwise_ce_raw"}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("index", range(len(FIXTURES["batches"])))
def test_equals_colpali_engine(name, index):
    """``ColbertLoss`` (normalize_scores on, T 0.02; off, T 1) is mmembed's InfoNCE over MaxSim
    on a batch without negatives: it needs no class of its own."""
    batch = FIXTURES["batches"][index]
    emb, labels = as_group_batch(batch, with_negatives=name not in IN_BATCH_ONLY)
    got = CASES[name]()({"last_hidden_state": emb}, labels)
    assert float(got) == pytest.approx(batch["losses"][name], abs=1e-6, rel=1e-9)


def test_colpali_defaults():
    for cls, temperature in ((ColbertPairwiseCELoss, 1.0), (ColbertNegativeCELoss, 0.02),
                             (ColbertPairwiseNegativeCELoss, 0.02)):
        loss = cls()
        assert loss.temperature == temperature and loss.similarity.normalize
        assert getattr(loss, "in_batch_term_weight", 0.5) == 0.5
    with pytest.raises(ValueError, match="in_batch_term_weight"):
        ColbertNegativeCELoss(in_batch_term_weight=1.5)


# ---- written-out loops, with groups of different sizes ------------------------------------------

def softplus(x):
    return math.log1p(math.exp(-abs(x))) + max(x, 0.0)


def split(emb, labels):
    groups, i, li = [], 0, 0
    while i < emb.shape[0]:
        negs, j, li = [], i + 2, li + 1
        while li < len(labels) and labels[li] == 0.0:
            negs.append(emb[j])
            j, li = j + 1, li + 1
        groups.append((emb[i], emb[i + 1], negs))
        i = j
    return groups


def loop_loss(kind, emb, labels, temperature, w=0.5, normalize=True):
    groups = split(emb, labels)
    docs = [d for _, p, ns in groups for d in [p, *ns]]
    own = []
    col = 0
    for _, _, ns in groups:
        own.append(col)
        col += 1 + len(ns)
    total = 0.0
    for gi, (a, p, ns) in enumerate(groups):
        sp = reference_maxsim(a, p, normalize)
        positives = [reference_maxsim(a, p2, normalize) for _, p2, _ in groups]
        if kind == "pairwise":
            others = [reference_maxsim(a, d, normalize) for k, d in enumerate(docs) if k != own[gi]]
            total += softplus((max(others) - sp) / temperature) if others else 0.0
            continue
        explicit = sum(softplus((reference_maxsim(a, n, normalize) - sp) / temperature) for n in ns) / max(len(ns), 1)
        if kind == "negative_ce":
            z = [v / temperature for v in positives]
            in_batch = -(z[gi] - math.log(sum(math.exp(v) for v in z)))
        else:
            others = [v for k, v in enumerate(positives) if k != gi]
            in_batch = softplus((max(others) - sp) / temperature) if others else 0.0
        total += (1 - w) * explicit + w * in_batch
    return total / len(groups)


def random_batch(seed, counts, lq=4, ld=6, dim=5):
    g = torch.Generator().manual_seed(seed)
    rows, labels = [], []
    for c in counts:
        for k in range(2 + c):
            x = F.normalize(torch.randn(ld, dim, generator=g, dtype=torch.float64), dim=-1)
            x[int(torch.randint(1, (lq if k == 0 else ld) + 1, (1,), generator=g)):] = 0
            rows.append(x)
        labels += [1.0] + [0.0] * c
    return torch.stack(rows), torch.tensor(labels, dtype=torch.float64)


@pytest.mark.parametrize("counts", [[2, 0, 1, 3], [1, 1, 1]])
@pytest.mark.parametrize("normalize", [True, False])
def test_equal_the_written_out_loops(counts, normalize):
    emb, labels = random_batch(9, counts)
    out = {"last_hidden_state": emb}
    cases = [
        ("pairwise", ColbertPairwiseCELoss(temperature=0.5, normalize_scores=normalize), 0.5, 0.5),
        ("negative_ce", ColbertNegativeCELoss(temperature=0.1, normalize_scores=normalize), 0.1, 0.5),
        ("negative_ce", ColbertNegativeCELoss(0.1, normalize, in_batch_term_weight=0.3), 0.1, 0.3),
        ("negative_ce", ColbertNegativeCELoss(0.1, normalize, in_batch_term_weight=0.0), 0.1, 0.0),
        ("pairwise_negative", ColbertPairwiseNegativeCELoss(0.2, normalize), 0.2, 0.5),
    ]
    for kind, loss, temperature, w in cases:
        ref = loop_loss(kind, emb, labels, temperature, w, normalize)
        assert float(loss(out, labels)) == pytest.approx(ref, abs=1e-9), (kind, w)
        # the cross-process seam: one anchor at a time averages to the whole
        parts = loss.split_parts(out, labels)
        each = [float(loss.forward_from_parts(parts, query_rows=slice(i, i + 1))) for i in range(len(counts))]
        assert sum(each) / len(each) == pytest.approx(ref, abs=1e-9)


def test_declarations():
    assert ColbertPairwiseCELoss().cross_process is CrossProcess.GROUP_PARTS
    assert ColbertNegativeCELoss().cross_process is CrossProcess.GROUP_PARTS
    assert ColbertNegativeCELoss(in_batch_term_weight=0).cross_process is CrossProcess.LOCAL_GROUPS
    assert ColbertNegativeCELoss().negatives_rule.min_negatives == 1
    assert ColbertPairwiseCELoss().negatives_rule is None
    emb, labels = random_batch(10, [1, 2])
    with pytest.raises(ValueError, match=r"\[N, L, D\]"):
        ColbertPairwiseCELoss()({"last_hidden_state": emb[:, 0]}, labels)
    # the evaluation's view: the scores the loss ranks, the positive's column
    blocks = list(ColbertPairwiseCELoss().candidate_scores({"last_hidden_state": emb}, labels, block_rows=1))
    assert [b[1].tolist() for b in blocks] == [[0], [1]]
    a0, p0, p1 = emb[0], emb[1], emb[4]  # rows a0, p0, n0, a1, p1, n1_0, n1_1
    assert float(blocks[0][0][0, 1]) == pytest.approx(reference_maxsim(a0, p1, True), abs=1e-12)
    assert float(blocks[0][0][0, 0]) == pytest.approx(reference_maxsim(a0, p0, True), abs=1e-12)
    own = list(ColbertNegativeCELoss(in_batch_term_weight=0).candidate_scores({"last_hidden_state": emb}, labels))
    assert own[0][0].shape == (2, 3) and own[0][1].tolist() == [0, 0]
