"""What the base class declares, checked on every built-in loss: the parts protocol with named
fields (GroupParts, SideRows, RowParts), the wrapper's delegation of the declarations
(WrapperLoss, under MatryoshkaLoss), and the side rule (SideNeeds.mismatch) behind
check_side and the command line's check_side_flags."""

from __future__ import annotations

import itertools
import re
import types
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mmembed.losses import (
    EmbeddingLoss,
    GroupParts,
    Groups,
    Layout,
    MatryoshkaLoss,
    RowParts,
    Setup,
    SideNeeds,
    SideRows,
    WrapperLoss,
    build_loss,
)
from mmembed.losses.base import CrossProcess, SideMismatch, check_side

COUNTS = [2, 0, 3, 1]  # negatives per group
LABELS = torch.tensor([x for k in COUNTS for x in [1.0] + [0.0] * k], dtype=torch.float64)
N_ROWS = LABELS.numel() + len(COUNTS)


def unit_rows(n_rows: int, dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n_rows, dim, generator=gen, dtype=torch.float64), dim=-1)


OUTPUTS = {"last_hidden_state": unit_rows(N_ROWS, 8, 0), "guide_hidden_state": unit_rows(N_ROWS, 5, 1),
           "teacher_hidden_state": unit_rows(N_ROWS, 8, 2)}


# ---- the parts -------------------------------------------------------------------------


@pytest.mark.parametrize("name, options, side", [
    ("infonce", {}, None), ("infonce", {"use_batch": False}, None), ("gist", {}, "guide"),
    ("distill_kl", {}, "teacher"), ("distill_kl", {"use_batch": False}, "teacher"),
])
def test_group_parts_name_each_tensor(name, options, side):
    loss = build_loss(name, **options)
    parts = loss.split_parts(OUTPUTS, LABELS)
    assert isinstance(parts, GroupParts) and parts.n_queries == len(COUNTS) and parts.width == 8
    assert set(parts.sides()) == ({side} if side else set())
    for other in {"guide", "teacher"} - {side}:
        assert getattr(parts, other) is None
    if side:
        rows = getattr(parts, side)
        assert isinstance(rows, SideRows) and not rows.anchors.requires_grad
        assert rows.anchors.shape[0] == parts.anchors.shape[0] and rows.negatives.shape[0] == parts.negatives.shape[0]
    torch.testing.assert_close(loss.forward_from_parts(parts), loss(OUTPUTS, LABELS), atol=1e-12, rtol=1e-12)


def test_row_parts_of_distill_marginal():
    loss = build_loss("distill_marginal", lam=0.2)
    parts = loss.split_parts(OUTPUTS, None)
    assert isinstance(parts, RowParts) and parts.guide is None and set(parts.tensors()) == {"student", "teacher"}
    assert parts.n_queries == N_ROWS and parts.width == 8
    torch.testing.assert_close(loss.forward_from_parts(parts), loss(OUTPUTS, None), atol=1e-12, rtol=1e-12)
    with pytest.raises(ValueError, match="student and teacher"):
        loss.forward_from_parts(replace(parts, teacher=None))


def test_with_student_changes_the_students_fields_only():
    parts = build_loss("gist").split_parts(OUTPUTS, LABELS)
    cut = parts.with_student(lambda t: t[:, :3])
    assert [cut.anchors.shape[1], cut.positives.shape[1], cut.negatives.shape[1]] == [3, 3, 3]
    assert cut.neg_group is parts.neg_group and cut.guide is parts.guide and cut.teacher is None
    rows = build_loss("distill_marginal").split_parts(OUTPUTS, None)
    cut = rows.with_student(lambda t: t[:, :3])
    assert cut.student.shape[1] == 3 and cut.teacher is rows.teacher


def test_group_parts_check_names_the_field_that_does_not_fit():
    parts = build_loss("distill_kl").split_parts(OUTPUTS, LABELS)
    assert parts.check(slice(1, 3)) == range(1, 3)
    bad = replace(parts, teacher=replace(parts.teacher, positives=parts.teacher.positives[:, :4]))
    with pytest.raises(ValueError, match=r"teacher_positives must be \[4, Dt\]"):
        bad.check(None)
    with pytest.raises(ValueError, match="no teacher rows"):
        replace(parts, teacher=None).check(None, needs=("teacher",))
    with pytest.raises(ValueError, match="neg_group"):
        replace(parts, neg_group=parts.neg_group[:-1]).check(None)
    with pytest.raises(ValueError, match="query_rows"):
        parts.check(slice(0, 4, 2))


@pytest.mark.parametrize("name", ["cosine_similarity", "online_contrastive", "distill_cosine"])
def test_a_loss_without_parts_says_so(name):
    loss = build_loss(name)
    with pytest.raises(TypeError, match=f"{type(loss).__name__} has no split_parts: .*{loss.cross_process.value}"):
        loss.split_parts(OUTPUTS, LABELS)
    with pytest.raises(TypeError, match="no forward_from_parts"):
        loss.forward_from_parts(RowParts(OUTPUTS["last_hidden_state"]))


# ---- the wrapper's declarations are the inner loss's ------------------------------------


def test_the_delegated_declarations_are_the_wrappers_properties():
    properties = {name for name, value in vars(WrapperLoss).items() if isinstance(value, property)}
    assert properties == set(WrapperLoss.DELEGATED)
    assert {"layout", "side", "cross_process", "label_rule", "targets", "averaged_over", "check_setup",
            "candidate_scores"} <= properties


def _same(a, b) -> bool:
    if isinstance(a, Groups):
        return isinstance(b, Groups) and all(torch.equal(getattr(a, f), getattr(b, f))
                                             for f in ("anchor", "positive", "negative", "neg_group"))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def _outcome(fn, *args):
    try:
        fn(*args)
        return None
    except ValueError as e:
        return str(e)


SETUPS = [Setup(width=8), Setup(width=8, guide=True), Setup(width=8, teacher_signal="embeddings", teacher_width=8),
          Setup(width=8, teacher_signal="scores"), Setup(width=8, guide=True, teacher_signal="embeddings")]


@pytest.mark.parametrize("name, options", [
    ("infonce", {}), ("infonce", {"use_batch": False}), ("gist", {}), ("distill_kl", {}),
    ("distill_kl", {"use_batch": False}), ("distill_marginal", {}), ("distill_mse", {}),
    ("contrastive", {}), ("cosine_similarity", {}), ("custom", {}),
])
def test_a_wrapper_declares_what_its_loss_declares(name, options):
    class Custom(EmbeddingLoss):
        use_batch = False

        def forward(self, outputs, labels):
            return outputs["last_hidden_state"].sum()

    inner = Custom() if name == "custom" else build_loss(name, **options)
    wrapper = MatryoshkaLoss(inner, {8: 1.0})
    for declared in ("layout", "side", "cross_process", "label_rule", "use_batch"):
        assert getattr(wrapper, declared) == getattr(inner, declared), declared
    labels = LABELS if inner.layout is Layout.GROUP else torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    n_rows = N_ROWS if inner.layout is Layout.GROUP else 16
    targets = inner.targets(labels, n_rows)
    assert _same(wrapper.targets(labels, n_rows), targets)
    assert wrapper.averaged_over(targets, n_rows) == inner.averaged_over(targets, n_rows)
    for setup in SETUPS:
        assert _outcome(wrapper.check_setup, setup) == _outcome(inner.check_setup, setup), setup
    want = inner.candidate_scores(OUTPUTS, labels) if inner.layout is Layout.GROUP else None
    got = wrapper.candidate_scores(OUTPUTS, labels) if inner.layout is Layout.GROUP else None
    if want is None:
        assert got is None
    else:
        for (s1, t1), (s2, t2) in itertools.zip_longest(want, got):
            assert torch.equal(s1, s2) and torch.equal(t1, t2)


def test_a_wrapped_plain_module_declares_the_base_defaults():
    """A plain ``nn.Module`` declares nothing: the wrapper answers EmbeddingLoss's defaults,
    and, as mmembed.training.distributed treats such a module, passes its labels as given and
    checks nothing at start."""

    class Plain(nn.Module):
        def forward(self, outputs, labels):
            return outputs["last_hidden_state"].sum()

    wrapper = MatryoshkaLoss(Plain(), {8: 1.0})
    assert wrapper.layout is Layout.GROUP and wrapper.side == SideNeeds()
    assert wrapper.cross_process is CrossProcess.WHOLE_BATCH and wrapper.label_rule is None
    assert wrapper.use_batch is None and wrapper.candidate_scores(OUTPUTS, LABELS) is None
    assert wrapper.targets(LABELS, N_ROWS) is LABELS
    assert wrapper.averaged_over(LABELS, N_ROWS) == len(COUNTS)
    wrapper.check_setup(Setup(width=8, guide=True))  # nothing to check but the widths
    with pytest.raises(ValueError, match="exceed the embedding width 4"):
        wrapper.check_setup(Setup(width=4))
    with pytest.raises(TypeError, match="no split_parts"):
        wrapper.split_parts(OUTPUTS, LABELS)
    with pytest.raises(ValueError, match="MatryoshkaLoss needs a loss module to wrap"):
        MatryoshkaLoss("infonce", {8: 1.0})


def test_matryoshka_cuts_the_student_parts_only():
    """The wrapper's parts path: each width sees the student fields cut and normalized again,
    the guide's rows (width 5) uncut."""
    gist = build_loss("gist")
    wrapper = MatryoshkaLoss(gist, {3: 0.5, 8: 1.0})
    parts = wrapper.split_parts(OUTPUTS, LABELS)
    assert parts.width == 8 and parts.guide.anchors.shape[1] == 5
    want = sum(w * gist.forward_from_parts(parts.with_student(lambda t, d=d: F.normalize(t[:, :d], dim=-1)))
               for d, w in {3: 0.5, 8: 1.0}.items())
    torch.testing.assert_close(wrapper.forward_from_parts(parts), want, atol=1e-12, rtol=1e-12)


# ---- the side rule -----------------------------------------------------------------------


NEEDS = [SideNeeds(guide=g, teacher=frozenset(t)) for g in (False, True)
         for t in ((), ("embeddings",), ("scores",), ("embeddings", "scores"))]


def test_side_mismatch_is_the_rule_check_side_words():
    """Every need against every side input: the mismatch written out here, and check_side's
    message for it."""
    words = {
        SideMismatch.NEEDS_GUIDE: "needs a guide model (--guide_model)",
        SideMismatch.TAKES_NO_GUIDE: "takes no guide model; drop --guide_model",
        SideMismatch.NEEDS_TEACHER: "needs a teacher: --teacher_model, or teacher signals in the data",
        SideMismatch.TAKES_NO_TEACHER: "takes no teacher; drop --teacher_model",
        SideMismatch.OTHER_TEACHER_SIGNAL: "takes the teacher's",
    }
    for need, guide, signal in itertools.product(NEEDS, (False, True), (None, "embeddings", "scores")):
        if need.guide and not guide:
            want = SideMismatch.NEEDS_GUIDE
        elif guide and not need.guide:
            want = SideMismatch.TAKES_NO_GUIDE
        elif need.teacher and signal is None:
            want = SideMismatch.NEEDS_TEACHER
        elif signal is not None and not need.teacher:
            want = SideMismatch.TAKES_NO_TEACHER
        elif signal is not None and signal not in need.teacher:
            want = SideMismatch.OTHER_TEACHER_SIGNAL
        else:
            want = None
        assert need.mismatch(guide, signal) is want, (need, guide, signal)
        # a teacher may still come with the data: then its absence is no mismatch
        late = need.mismatch(guide, signal, teacher_known=False)
        assert late is (None if want is SideMismatch.NEEDS_TEACHER else want)
        setup = Setup(width=8, guide=guide, teacher_signal=signal)
        if want is None:
            check_side("L", need, setup)
        else:
            with pytest.raises(ValueError, match="^L " + re.escape(words[want])):
                check_side("L", need, setup)
        check_side("L", need, replace(setup, sides_known=False))  # nothing known yet: nothing checked


def test_the_flags_are_checked_by_the_same_rule():
    """check_side_flags refuses exactly what SideNeeds.mismatch finds in the flags (a teacher
    from the data's rows left open), in the words of the flags."""
    from mmembed.errors import UsageError
    from mmembed.training.flag_checks import check_side_flags

    for need, guide, model, scores, embeddings in itertools.product(
            NEEDS, (None, "g"), (None, "t"), (None, ["s.npy"]), (None, ["e.npy"])):
        args = types.SimpleNamespace(loss_type="L", guide_model=guide, teacher_model=model,
                                     teacher_scores_file=scores, teacher_embeddings_file=embeddings)
        signal = "scores" if scores else "embeddings" if embeddings or model else None
        problem = need.mismatch(bool(guide), signal, teacher_known=False)
        if problem is None:
            check_side_flags(args, need)
            continue
        with pytest.raises(UsageError) as e:
            check_side_flags(args, need)
        flag = "--teacher_scores_file" if scores else "--teacher_embeddings_file" if embeddings else "--teacher_model"
        assert {
            SideMismatch.NEEDS_GUIDE: "--loss_type L needs --guide_model",
            SideMismatch.TAKES_NO_GUIDE: "--guide_model is for losses that take a guide (gist)",
            SideMismatch.TAKES_NO_TEACHER: f"{flag} feeds the distillation losses",
            SideMismatch.OTHER_TEACHER_SIGNAL: f"{flag}: --loss_type L takes the teacher's",
        }[problem] in str(e.value)
