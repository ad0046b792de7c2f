"""Distillation: a student embedding model learns from a teacher's embeddings or scores.

Two kinds:

- **Embedding distillation** (``distill_cosine``, ``distill_mse``, ``distill_marginal``):
  each student row ``x_i`` (``outputs["last_hidden_state"]``) is pulled towards the
  teacher's embedding ``y_i`` of the same row (``outputs["teacher_hidden_state"]``).
  Labels are ignored, so any batch layout works. Student and teacher must have the same
  width.
- **Score distillation** (``distill_kl``): in an InfoNCE batch, the student's softmax
  over each anchor's candidates is pulled towards the teacher's softmax over the same
  candidates (a KL divergence). The teacher's scores come from its embeddings of the
  same rows, or are given directly per group (``outputs["teacher_scores"]``, e.g. from
  a cross-encoder).

The teacher is a fixed target: its tensors are detached here, whatever the caller passes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from ..data.trainable import NegativesRule
from .base import (
    NEG_INF,
    TEACHER,
    TEACHER_SCORES,
    CrossProcess,
    EmbeddingLoss,
    Groups,
    Setup,
    SideNeeds,
    as_groups,
    check_side,
    check_temperature,
    finite_number,
    in_group_scores,
)
from .parts import GroupParts, RowParts, SideRows, query_range

Distance = Literal["cosine", "mse"]


def student_and_teacher(outputs: Mapping[str, Tensor], loss_name: str) -> tuple[Tensor, Tensor]:
    """``(x [n, D], y [n, D])``: the student's rows and the teacher's (detached, in the
    student's dtype and device).

    Raises:
        ValueError: ``teacher_hidden_state`` is missing, or the two are not 2-D with the
            same number of rows and the same width.
    """
    x = outputs["last_hidden_state"]
    y = outputs.get(TEACHER)
    if y is None:
        raise ValueError(
            f"{loss_name} needs outputs['teacher_hidden_state']: the teacher model's embeddings of the same rows"
        )
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(
            f"{loss_name}: last_hidden_state and teacher_hidden_state must be [n, D] with the same rows, "
            f"got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    if x.shape[1] != y.shape[1]:
        raise ValueError(
            f"{loss_name} compares each student row with the teacher's row, so both need the same width; "
            f"the student's is {x.shape[1]} and the teacher's {y.shape[1]} (use distill_kl, which only "
            "compares similarities, for teachers of another width)"
        )
    return x, y.detach().to(device=x.device, dtype=x.dtype)


def _cosine_rows(x: Tensor, y: Tensor) -> Tensor:
    """``1 - cos(x_i, y_i)`` per row."""
    return 1 - (F.normalize(x, dim=-1) * F.normalize(y, dim=-1)).sum(-1)


def _mse_rows(x: Tensor, y: Tensor) -> Tensor:
    """``||x_i - y_i||^2 / D`` per row."""
    return (x - y).pow(2).mean(-1)


class _EmbeddingDistill(EmbeddingLoss):
    """What the embedding-distillation losses share: a teacher's embeddings of the same
    rows, of the student's width; each row's loss stands alone."""

    name: str  # the loss's name, for error messages
    side = SideNeeds(teacher=frozenset({"embeddings"}))
    cross_process = CrossProcess.LOCAL_ROWS

    def targets(self, labels: Tensor, n_rows: int) -> Tensor:
        """Labels are not used: rows pair with the teacher's rows by position."""
        return labels

    def averaged_over(self, targets: Tensor, n_rows: int) -> int:
        """The loss is a mean over rows."""
        return n_rows

    def check_setup(self, setup: Setup) -> None:
        """The teacher's embeddings are compared with the student's row by row: one width."""
        check_side(self.name, self.side, setup)
        if setup.teacher_width is not None and setup.teacher_width != setup.width:
            raise ValueError(f"{self.name} compares embeddings directly, but the teacher's width is "
                             f"{setup.teacher_width} and the student's {setup.width}; use distill_kl (scores) instead")


class _RowDistill(_EmbeddingDistill):
    """A per-row distance to the own teacher row, averaged: ``mean_i d(x_i, y_i)``."""

    distance: Callable[[Tensor, Tensor], Tensor]  # per row: [n, D], [n, D] -> [n]

    def forward(self, outputs: Mapping[str, Tensor], labels: Tensor | None = None) -> Tensor:
        """Scalar loss; see the class docstring."""
        x, y = student_and_teacher(outputs, self.name)
        return self.distance(x, y).mean()


class DistillCosineLoss(_RowDistill):
    """Embedding distillation by cosine distance: ``loss = mean_i (1 - cos(x_i, y_i))``.

    ``x_i`` is the student's row ``i`` and ``y_i`` the teacher's; both are normalized for
    the cosine, so the loss does not depend on their lengths. Labels are ignored.

    Inputs:
        +-------------------------------------------+--------------------------------+
        | outputs                                   | labels                         |
        +===========================================+================================+
        | ``"last_hidden_state"`` ``[n, D]``,       | ignored (any layout)           |
        | ``"teacher_hidden_state"`` ``[n, D]``     |                                |
        +-------------------------------------------+--------------------------------+

    Example:
        ::

            loss_fn = build_loss("distill_cosine")
            loss = loss_fn({"last_hidden_state": student, "teacher_hidden_state": teacher}, labels)
    """

    name = "distill_cosine"
    distance = staticmethod(_cosine_rows)


class DistillMSELoss(_RowDistill):
    """Embedding distillation by squared error: ``loss = mean_i ||x_i - y_i||^2 / D``.

    That is the mean over every element of ``(x - y)^2`` (``torch.nn.functional.mse_loss``
    with its default reduction): dividing by the width ``D`` keeps the scale independent
    of the model size. The embeddings are used as given (not normalized). Labels are
    ignored.

    Inputs:
        +-------------------------------------------+--------------------------------+
        | outputs                                   | labels                         |
        +===========================================+================================+
        | ``"last_hidden_state"`` ``[n, D]``,       | ignored (any layout)           |
        | ``"teacher_hidden_state"`` ``[n, D]``     |                                |
        +-------------------------------------------+--------------------------------+

    Example:
        ::

            loss_fn = build_loss("distill_mse")
            loss = loss_fn({"last_hidden_state": student, "teacher_hidden_state": teacher}, labels)
    """

    name = "distill_mse"
    distance = staticmethod(_mse_rows)


class DistillMarginalLoss(_EmbeddingDistill):
    """Embedding distillation that also pushes each student row away from the other rows' teachers.

    With ``d`` the chosen distance and ``n`` rows:

    ``loss = (1/n) sum_i [ d(x_i, y_i) - lam/(n-1) sum_{j != i} d(x_i, y_j) ]``

    The second term is ``lam`` times the mean distance of ``x_i`` to the *other* teacher
    rows (hence ``n - 1``, not ``n``: ``lam`` then means the same whatever the batch
    size, and ``y_i`` is not counted on both sides). With one row the second term is
    empty (0). With ``lam = 0`` this is ``distill_cosine`` / ``distill_mse``.

    Distances: ``"cosine"``: ``1 - cos(x, y)``; ``"mse"``: ``||x - y||^2 / D``.

    Args:
        lam: Weight of the push-away term, finite and >= 0. Default 0.1. Keep it below 1
            (with ``lam >= 1`` the loss can fall by moving away from every teacher row,
            the own one included).
        distance: ``"cosine"`` (default) or ``"mse"``.

    Inputs:
        +-------------------------------------------+--------------------------------+
        | outputs                                   | labels                         |
        +===========================================+================================+
        | ``"last_hidden_state"`` ``[n, D]``,       | ignored (any layout)           |
        | ``"teacher_hidden_state"`` ``[n, D]``     |                                |
        +-------------------------------------------+--------------------------------+

    The sums over ``j`` are taken in closed form (``O(n D)``, no ``n x n`` matrix).

    Example:
        ::

            loss_fn = build_loss("distill_marginal", lam=0.2, distance="cosine")
            loss = loss_fn({"last_hidden_state": student, "teacher_hidden_state": teacher}, labels)
    """

    name = "distill_marginal"
    #: each row is pushed away from the teacher rows of every process
    cross_process = CrossProcess.ROW_PARTS

    def __init__(self, lam: float = 0.1, distance: Distance = "cosine") -> None:
        super().__init__()
        self.lam = finite_number("distill_marginal", "lam", lam, minimum=0)
        if distance not in ("cosine", "mse"):
            raise ValueError(f"distill_marginal distance must be 'cosine' or 'mse', got {distance!r}")
        self.distance = distance

    def extra_repr(self) -> str:
        return f"lam={self.lam}, distance={self.distance!r}"

    def forward(self, outputs: Mapping[str, Tensor], labels: Tensor | None = None) -> Tensor:
        """Scalar loss; see the class docstring."""
        return self.forward_from_parts(self.split_parts(outputs, labels))

    def split_parts(self, outputs: Mapping[str, Tensor], labels: Tensor | None = None) -> RowParts:
        """``student [n, D]`` and ``teacher [n, D]``, the teacher detached: what one process
        contributes to a cross-device batch."""
        return RowParts(*student_and_teacher(outputs, "distill_marginal"))

    def forward_from_parts(self, parts: RowParts, *, query_rows: slice | None = None) -> Tensor:
        """Loss from the student and teacher rows of a (possibly gathered) batch.

        Several processes: gather every process's ``student`` rows (with gradient) and
        ``teacher`` rows (without), pass this process's rows as ``query_rows`` and scale
        the result by ``n_r * W / n`` (its rows, the world size, the global rows). The
        push-away term of a row then runs over the teacher rows of every process.

        Args:
            parts: ``student [n, D]`` and ``teacher [n, D]``, aligned with it.
            query_rows: The rows whose losses are averaged (a contiguous slice of
                ``0..n``); all of them when None.

        Returns:
            Scalar tensor: the mean over the ``query_rows`` rows.
        """
        student, teacher = parts.student, parts.teacher
        if teacher is None or student.dim() != 2 or teacher.shape != student.shape:
            raise ValueError(f"student and teacher must both be [n, D], got {tuple(student.shape)} and "
                             f"{None if teacher is None else tuple(teacher.shape)}")
        n, width = student.shape
        rows = query_range(n, query_rows)
        teacher = teacher.detach().to(device=student.device, dtype=student.dtype)
        x = student[rows.start : rows.stop]
        y_own = teacher[rows.start : rows.stop]
        if self.distance == "cosine":
            own = _cosine_rows(x, y_own)
            # sum_j (1 - x^.y^_j) = n - x^ . sum_j y^_j
            total = n - F.normalize(x, dim=-1) @ F.normalize(teacher, dim=-1).sum(0)
        else:
            # sum_j ||x - y_j||^2 = n ||x||^2 - 2 x . sum_j y_j + sum_j ||y_j||^2, then / D
            total = (n * x.pow(2).sum(-1) - 2 * x @ teacher.sum(0) + teacher.pow(2).sum()) / width
            own = _mse_rows(x, y_own)
        others = (total - own) / (n - 1) if n > 1 else torch.zeros_like(own)
        return (own - self.lam * others).mean()


class DistillKLLoss(EmbeddingLoss):
    """Score distillation: KL divergence from the teacher's to the student's candidate softmax.

    The batch is an InfoNCE batch (rows ``a0, p0, n0_*, a1, p1, ...``, labels 1.0 / 0.0).
    For anchor ``a_i`` the candidates are

    - ``use_batch=True``: every positive and every hard negative of the batch;
    - ``use_batch=False``: its own positive and its own negatives.

    Student logits: ``s(a_i, c) / temperature`` (dot products of the given embeddings).
    Teacher logits, one of:

    - ``outputs["teacher_hidden_state"]`` ``[N, Dt]`` (same rows): ``s_t(a_i, c) /
      teacher_temperature``, the teacher's dot products of the same rows (``Dt`` may
      differ from the student's width);
    - ``outputs["teacher_scores"]`` ``[B, W]``, ``W >= 1 + max negatives``: row ``g``
      holds the teacher's scores of group ``g``'s own candidates, own positive first,
      then its negatives in row order; the slots past a group's candidates are padding
      (any value, e.g. NaN or -inf). Logits: ``teacher_scores / teacher_temperature``.
      Only the own group is scored, so this needs ``use_batch=False``.

    ``loss = mean_i sum_c P_t(c | a_i) [log P_t(c | a_i) - log P_s(c | a_i)]``, i.e.
    ``KL(P_t || P_s)`` averaged over anchors (PyTorch's ``batchmean``).

    Args:
        temperature: Divides the student's similarities. Default 0.1 (ms-swift's InfoNCE
            default, so the student's logits are InfoNCE's).
        teacher_temperature: Divides the teacher's similarities or scores; None (the
            default) uses ``temperature``. Cross-encoder scores (logits) usually want 1.0.
        use_batch: Score every document of the batch (True, default) or only the
            anchor's own group (False).

    Inputs:
        +---------------------------------------------+----------------------------------------+
        | outputs                                     | labels                                 |
        +=============================================+========================================+
        | ``"last_hidden_state"`` ``[N, D]`` and      | ``[N - B]``: 1.0 for each positive,    |
        | ``"teacher_hidden_state"`` ``[N, Dt]`` or   | 0.0 for each negative (as ``infonce``) |
        | ``"teacher_scores"`` ``[B, 1 + max_neg]``   |                                        |
        +---------------------------------------------+----------------------------------------+

    References:
        Hinton, Vinyals, Dean, *Distilling the Knowledge in a Neural Network*, 2015;
        Qu et al., *RocketQA*, 2021 (distilling a cross-encoder into a dual encoder).

    Example:
        ::

            loss_fn = build_loss("distill_kl", temperature=0.05, teacher_temperature=1.0, use_batch=False)
            loss = loss_fn({"last_hidden_state": emb, "teacher_scores": scores}, labels)
    """

    def __init__(
        self, temperature: float = 0.1, teacher_temperature: float | None = None, use_batch: bool = True
    ) -> None:
        super().__init__()
        self.temperature = check_temperature("distill_kl", "temperature", temperature)
        if teacher_temperature is None:
            teacher_temperature = self.temperature
        self.teacher_temperature = finite_number("distill_kl", "teacher_temperature", teacher_temperature, above=0)
        if not isinstance(use_batch, bool):
            raise ValueError(f"distill_kl option use_batch must be a bool, got {use_batch!r}")
        self.use_batch = use_batch

    def extra_repr(self) -> str:
        return (
            f"temperature={self.temperature}, teacher_temperature={self.teacher_temperature}, "
            f"use_batch={self.use_batch}"
        )

    @property
    def side(self) -> SideNeeds:
        """The teacher's embeddings; per-group scores too when each group only sees itself."""
        return SideNeeds(teacher=frozenset({"embeddings"} if self.use_batch else {"embeddings", "scores"}))

    @property
    def cross_process(self) -> CrossProcess:
        return CrossProcess.GROUP_PARTS if self.use_batch else CrossProcess.LOCAL_GROUPS

    @property
    def negatives_rule(self) -> NegativesRule | None:
        """With ``use_batch=False`` a row without negatives has one candidate, its positive:
        the teacher's and the student's distributions over it are both ``[1]`` (loss 0)."""
        if self.use_batch:
            return None
        return NegativesRule(1, "with use_batch false its only candidate is its positive, so the teacher's and the "
                                "student's distributions agree (loss 0, gradient 0)",
                             "give the rows negatives (rejected_response / negative_messages), or use_batch true")

    def forward(self, outputs: Mapping[str, Tensor], labels: Tensor | Groups) -> Tensor:
        """Loss of one batch (see the class docstring).

        Returns:
            Scalar tensor: the mean over anchors of ``KL(teacher || student)``.
        """
        scores = outputs.get(TEACHER_SCORES)
        if scores is None:
            return self.forward_from_parts(self.split_parts(outputs, labels))
        if outputs.get(TEACHER) is not None:
            raise ValueError("distill_kl takes one teacher: give teacher_hidden_state or teacher_scores, not both")
        if self.use_batch:
            raise ValueError(
                "distill_kl: teacher_scores scores only each group's own candidates, so it needs use_batch=False "
                "(or give teacher_hidden_state to score every document of the batch)"
            )
        parts = _student_parts(outputs, labels, "distill_kl")
        student, valid = in_group_scores(parts.anchors, parts.positives, parts.negatives, parts.neg_group)
        teacher = _teacher_score_logits(scores, valid)
        return _kl_rows(student / self.temperature, teacher.to(student.dtype) / self.teacher_temperature, valid).mean()

    def split_parts(self, outputs: Mapping[str, Tensor], labels: Tensor | Groups) -> GroupParts:
        """The batch split into groups, for the student and the teacher's embeddings.

        Returns:
            :class:`GroupParts`: ``anchors [B, D]``, ``positives [B, D]``, ``negatives [M, D]``,
            ``neg_group [M]`` and ``teacher`` (its ``anchors [B, Dt]``, ``positives [B, Dt]``,
            ``negatives [M, Dt]``), the teacher's rows detached.

        Raises:
            ValueError: ``teacher_hidden_state`` is missing (``teacher_scores`` has no
                parts: it needs ``use_batch=False``, where nothing crosses processes, so
                call the loss itself), or malformed labels.
        """
        groups = as_groups(labels, outputs["last_hidden_state"].shape[0], outputs["last_hidden_state"].device)
        student = _student_parts(outputs, groups, "distill_kl")
        teacher = outputs.get(TEACHER)
        if teacher is None:
            raise ValueError(
                "distill_kl needs outputs['teacher_hidden_state'] (the teacher's embeddings of the same rows) "
                "or outputs['teacher_scores'] (with use_batch=False)"
            )
        n_rows = outputs["last_hidden_state"].shape[0]
        if teacher.dim() != 2 or teacher.shape[0] != n_rows:
            raise ValueError(
                f"teacher_hidden_state must be [N, Dt] with the N = {n_rows} rows of last_hidden_state, "
                f"got shape {tuple(teacher.shape)}"
            )
        teacher = teacher.detach().to(student.anchors.device)
        return replace(student, teacher=SideRows(teacher[groups.anchor], teacher[groups.positive],
                                                 teacher[groups.negative]))

    def forward_from_parts(self, parts: GroupParts, *, query_rows: slice | None = None) -> Tensor:
        """Loss from a batch already split into groups (student and teacher embeddings).

        Several processes (``use_batch=True``): each process gathers every process's
        parts in rank order (the three student fields with gradient, ``neg_group``
        offset by the groups of the processes before it, the teacher's rows
        without gradient), calls this with its own groups as ``query_rows`` and scales
        the result by ``B_r * W / B``, exactly as for ``infonce``. With
        ``use_batch=False`` nothing needs gathering: the local loss times ``B_r * W / B``.

        Args:
            parts: The student fields as for ``InfoNCELoss.forward_from_parts``, and
                ``teacher``: the teacher's rows, aligned with them: ``[B, Dt]``, ``[B, Dt]``,
                ``[M, Dt]`` (required).
            query_rows: The anchors whose losses are averaged (a contiguous slice of
                ``0..B``); all of them when None.

        Returns:
            Scalar tensor: the mean KL over the ``query_rows`` anchors.
        """
        rows = parts.check(query_rows, needs=("teacher",))
        anchors, positives, negatives = parts.anchors, parts.positives, parts.negatives
        neg_group = parts.neg_group.to(device=anchors.device, dtype=torch.long)
        t = parts.teacher.map(lambda x: x.detach().to(device=anchors.device, dtype=anchors.dtype))
        t_a, t_p, t_n = t.anchors, t.positives, t.negatives
        sel = slice(rows.start, rows.stop)
        if self.use_batch:
            student = anchors[sel] @ torch.cat([positives, negatives]).T
            with torch.no_grad():
                teacher = t_a[sel] @ torch.cat([t_p, t_n]).T
            valid = None
        else:
            student, valid = in_group_scores(anchors, positives, negatives, neg_group)
            with torch.no_grad():
                teacher, _ = in_group_scores(t_a, t_p, t_n, neg_group)
            student, teacher, valid = student[sel], teacher[sel], valid[sel]
        return _kl_rows(student / self.temperature, teacher / self.teacher_temperature, valid).mean()


def _student_parts(outputs: Mapping[str, Tensor], labels: Tensor | Groups, loss_name: str) -> GroupParts:
    """The groups of an InfoNCE batch: the student's rows (with graph), no side rows."""
    emb = outputs["last_hidden_state"]
    if emb.dim() != 2:
        raise ValueError(f"{loss_name} expects last_hidden_state [N, D], got shape {tuple(emb.shape)}")
    g = as_groups(labels, emb.shape[0], emb.device)
    parts = emb.index_select(0, torch.cat([g.anchor, g.positive, g.negative]))
    return GroupParts(*parts.split([g.n_groups, g.n_groups, g.negative.numel()]), g.neg_group)


def _teacher_score_logits(scores: Tensor, valid: Tensor) -> Tensor:
    """``teacher_scores`` cut to the batch's candidate slots, padding set to -inf."""
    n_groups, width = valid.shape
    if scores.dim() != 2 or scores.shape[0] != n_groups or scores.shape[1] < width:
        raise ValueError(
            f"teacher_scores must be [B, W] with B = {n_groups} groups and W >= {width} (own positive, then up to "
            f"{width - 1} negatives), got shape {tuple(scores.shape)}"
        )
    scores = scores.detach().to(valid.device)[:, :width]
    bad = valid & ~torch.isfinite(scores)
    if bool(bad.any()):
        g, slot = (int(v) for v in bad.nonzero()[0])
        what = "its positive" if slot == 0 else f"its negative {slot - 1}"
        raise ValueError(
            f"teacher_scores[{g}, {slot}] (group {g}, {what}) is {scores[g, slot].item()}; "
            "every real candidate needs a finite score (only the padding past a group's candidates may be NaN/-inf)"
        )
    return scores.masked_fill(~valid, NEG_INF)


def _kl_rows(student_logits: Tensor, teacher_logits: Tensor, valid: Tensor | None) -> Tensor:
    """``KL(softmax(teacher) || softmax(student))`` per row, over the ``valid`` columns."""
    log_s = F.log_softmax(student_logits, dim=-1)
    log_t = F.log_softmax(teacher_logits, dim=-1)
    if valid is not None:  # -inf - -inf would be NaN: padding contributes 0 instead
        log_s = log_s.masked_fill(~valid, 0.0)
        log_t = log_t.masked_fill(~valid, 0.0)
        return (log_t.exp() * (log_t - log_s)).masked_fill(~valid, 0.0).sum(-1)
    return (log_t.exp() * (log_t - log_s)).sum(-1)
