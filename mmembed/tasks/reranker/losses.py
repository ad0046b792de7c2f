"""Reranker losses: a score per (query, document) pair, learned from 1.0 / 0.0 labels.

A reranker (:mod:`mmembed.tasks.reranker.model`) gives one score per pair, ``scores: [N]``; the
collator lays a batch out as ms-swift does, ``[pos, its negatives..., pos, its negatives...,
...]`` with ``labels`` 1.0 for a positive and 0.0 for a negative. Each loss is called as
``loss(scores, labels) -> scalar float32`` and computes in float32 whatever the scores' dtype.

==================================  ===========================================================
``--loss_type``                     loss
==================================  ===========================================================
``pointwise_reranker``              :class:`PointwiseRerankLoss`: binary cross-entropy with logits
                                    over every pair, the mean
``listwise_reranker``               :class:`ListwiseRerankLoss`: per group (a positive and the
                                    negatives after it, up to the next positive) cross-entropy
                                    with the positive as the class, mean over the groups
``generative_reranker``             ms-swift 3's name: ``pointwise_reranker`` on a generative
                                    reranker (:func:`rerank_task_of` says which model)
``listwise_generative_reranker``    ms-swift 3's name: ``listwise_reranker`` on a generative reranker
==================================  ===========================================================

``ListwiseRerankLoss`` reads ``LISTWISE_RERANKER_TEMPERATURE`` (default 1.0) and
``LISTWISE_RERANKER_MIN_GROUP_SIZE`` (default 2) through :mod:`mmembed.environment` when
:func:`build_rerank_loss` builds it. Unlike ms-swift's loss, the groups are not visited one by
one: they are laid out as one padded ``[groups, longest group]`` matrix (the padding masked to
``-inf``), so the cost is one ``cross_entropy`` whatever the number of groups.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...encoding.layout import Layout
from ...environment import Environment, read
from ...errors import UsageError
from ...losses.base import MIN_TEMPERATURE, MIN_TEMPERATURE_TEXT, SideNeeds

__all__ = [
    "RERANK_LOSSES", "RERANK_LOSS_CLASSES", "ListwiseRerankLoss", "PointwiseRerankLoss", "RerankLoss",
    "build_rerank_loss", "is_rerank_loss", "rerank_task_of",
]  # fmt: skip

#: every reranker ``--loss_type``: ms-swift 4's two and ms-swift 3's generative names
RERANK_LOSSES = ("pointwise_reranker", "listwise_reranker", "generative_reranker", "listwise_generative_reranker")

TEMPERATURE_VAR = "LISTWISE_RERANKER_TEMPERATURE"
MIN_GROUP_SIZE_VAR = "LISTWISE_RERANKER_MIN_GROUP_SIZE"
DEFAULT_TEMPERATURE = 1.0
DEFAULT_MIN_GROUP_SIZE = 2


def _flat(scores: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """``scores`` ``[N]`` (or ms-swift's ``[N, 1]``) as float32, ``labels`` ``[N]`` as float32."""
    if scores.dim() == 2 and scores.shape[1] == 1:
        scores = scores[:, 0]
    if scores.dim() != 1:
        raise ValueError(f"reranker scores must be one per pair, [N] or [N, 1]; got shape {tuple(scores.shape)}")
    labels = labels.reshape(-1)
    if labels.shape[0] != scores.shape[0]:
        raise ValueError(f"reranker scores and labels differ in length: {scores.shape[0]} scores, {labels.shape[0]} "
                         "labels")
    return scores.float(), labels.to(device=scores.device, dtype=torch.float32)


def _zero(scores: Tensor) -> Tensor:
    """0.0 tied to ``scores`` (an empty sum: its gradient is 0 everywhere, even where a score
    is not finite), so that backward runs and every parameter gets its zero gradient."""
    zero = scores[:0].sum()
    return zero if zero.requires_grad else zero.requires_grad_()


class RerankLoss(nn.Module):
    """A reranker loss: ``forward(scores [N], labels [N]) -> scalar float32``.

    Attributes:
        name: its ``--loss_type`` (ms-swift 4's name).
        listwise: the loss needs the batch's groups (a positive followed by its negatives),
            so the batch must keep ms-swift's order; a pointwise loss takes each pair alone.
    """

    name: ClassVar[str] = ""
    listwise: ClassVar[bool] = False
    #: what the data reading asks of a loss (mmembed.training.row_checks): a reranker batch
    #: scores pairs; no label rule (the 1.0 / 0.0 labels come from the row's positives and
    #: negatives), no negatives needed (a row with a positive only trains the pointwise loss,
    #: and gives the listwise loss a group of one, skipped under LISTWISE_RERANKER_MIN_GROUP_SIZE
    #: 2 as in ms-swift), nothing beside the model's scores
    layout: ClassVar[Layout] = Layout.RERANK
    label_rule: ClassVar[None] = None
    negatives_rule: ClassVar[None] = None
    side: ClassVar[SideNeeds] = SideNeeds()

    def forward(self, scores: Tensor, labels: Tensor) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError


class PointwiseRerankLoss(RerankLoss):
    """``pointwise_reranker``: binary cross-entropy with logits over every pair, the mean
    (ms-swift's ``BCEWithLogitsLoss()``), in float32."""

    name = "pointwise_reranker"
    listwise = False

    def forward(self, scores: Tensor, labels: Tensor) -> Tensor:
        scores, labels = _flat(scores, labels)
        if scores.numel() == 0:
            return _zero(scores)
        return F.binary_cross_entropy_with_logits(scores, labels)


class ListwiseRerankLoss(RerankLoss):
    """``listwise_reranker``: each positive (label 1) starts a group that runs to the next
    positive (or the batch's end); a group's loss is the cross-entropy of its scores divided by
    ``temperature``, its positive (the first entry) the class. Groups of fewer than
    ``min_group_size`` pairs are left out; the loss is the mean over the groups kept, 0 (with a
    gradient, all zeros) when there is none. Pairs before the first positive belong to no group.

    Args:
        temperature: scores are divided by this (> 0, finite, at least 2**-30).
        min_group_size: the fewest pairs a group needs to count (an integer >= 1).
    """

    name = "listwise_reranker"
    listwise = True

    def __init__(self, temperature: float = DEFAULT_TEMPERATURE, min_group_size: int = DEFAULT_MIN_GROUP_SIZE):
        super().__init__()
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
                or temperature < MIN_TEMPERATURE:
            raise ValueError(f"listwise reranker temperature must be a finite number >= {MIN_TEMPERATURE_TEXT}, got "
                             f"{temperature!r}")
        if isinstance(min_group_size, bool) or not isinstance(min_group_size, int) or min_group_size < 1:
            raise ValueError(f"listwise reranker min_group_size must be an integer >= 1, got {min_group_size!r}")
        self.temperature = float(temperature)
        self.min_group_size = min_group_size

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}, min_group_size={self.min_group_size}"

    def forward(self, scores: Tensor, labels: Tensor) -> Tensor:
        scores, labels = _flat(scores, labels)
        n = scores.shape[0]
        positive = labels == 1
        starts = positive.nonzero().reshape(-1)  # [G]: each group's first pair
        if starts.numel() == 0:
            return _zero(scores)
        ends = torch.cat([starts[1:], starts.new_tensor([n])])
        sizes = ends - starts  # [G]
        width = int(sizes.max())
        # every pair's group (-1: before the first positive) and place in it
        group = torch.cumsum(positive.long(), 0) - 1
        member = group >= 0
        rows = group[member]
        cols = torch.arange(n, device=scores.device)[member] - starts[rows]
        logits = scores.new_full((starts.numel(), width), float("-inf"))
        logits = logits.index_put((rows, cols), scores[member] / self.temperature)
        logits = logits[sizes >= self.min_group_size]  # the groups kept
        if logits.shape[0] == 0:
            return _zero(scores)
        # cross-entropy, the positive at 0, as ms-swift's CrossEntropyLoss computes it (log-softmax:
        # x0 - max - log(sum), not x0 - logsumexp, which rounds the positive's gradient to 0 once
        # its share is within float32's step of 1; ms-swift's gradient is then its rounding, not 0)
        target = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        return F.cross_entropy(logits, target)


#: ``--loss_type`` -> the loss class it builds (ms-swift 3's generative names are the same losses)
RERANK_LOSS_CLASSES: dict[str, type[RerankLoss]] = {
    "pointwise_reranker": PointwiseRerankLoss,
    "listwise_reranker": ListwiseRerankLoss,
    "generative_reranker": PointwiseRerankLoss,
    "listwise_generative_reranker": ListwiseRerankLoss,
}

# ms-swift 3's names that say the model is generative too
_GENERATIVE_NAMES = ("generative_reranker", "listwise_generative_reranker")


def is_rerank_loss(loss_type: str | None) -> bool:
    """Whether ``--loss_type`` names a reranker loss (one of :data:`RERANK_LOSSES`)."""
    return loss_type in RERANK_LOSS_CLASSES


def rerank_task_of(loss_type: str) -> str | None:
    """The ``--task_type`` an ms-swift 3 loss name implies: ``generative_reranker`` for
    ``generative_reranker`` and ``listwise_generative_reranker``; None for any other name
    (the task type is then the user's ``--task_type``)."""
    return "generative_reranker" if loss_type in _GENERATIVE_NAMES else None


def build_rerank_loss(loss_type: str, values: Mapping[str, str] | Environment | None = None) -> RerankLoss:
    """The reranker loss ``--loss_type loss_type`` names (one of :data:`RERANK_LOSSES`).

    Args:
        loss_type: ``pointwise_reranker``, ``listwise_reranker``, or ms-swift 3's
            ``generative_reranker`` (pointwise) / ``listwise_generative_reranker`` (listwise).
        values: the ``LISTWISE_RERANKER_*`` variables as text (a mapping, or an
            :class:`~mmembed.environment.Environment`); None: read through
            :mod:`mmembed.environment` now. A pointwise loss reads none.

    Raises:
        UsageError: an unknown ``loss_type`` (naming ``--loss_type``), or a variable that does
            not parse or is out of range (naming it and its value).
    """
    cls = RERANK_LOSS_CLASSES.get(loss_type)
    if cls is None:
        raise UsageError(f"--loss_type {loss_type!r} is not a reranker loss; known: {', '.join(RERANK_LOSSES)}")
    if cls is PointwiseRerankLoss:
        return cls()
    variables = read(values).reranker
    return ListwiseRerankLoss(temperature=_temperature(variables.get(TEMPERATURE_VAR)),
                              min_group_size=_min_group_size(variables.get(MIN_GROUP_SIZE_VAR)))


def _temperature(raw: str | None) -> float:
    if raw is None or not raw.strip():
        return DEFAULT_TEMPERATURE
    allowed = f"use a finite number >= {MIN_TEMPERATURE_TEXT} (default {DEFAULT_TEMPERATURE})"
    try:
        value = float(raw)
    except ValueError:
        raise UsageError(f"environment variable {TEMPERATURE_VAR}={raw!r} is not a number; {allowed}") from None
    if not math.isfinite(value) or value < MIN_TEMPERATURE:
        raise UsageError(f"environment variable {TEMPERATURE_VAR}={raw!r} is out of range; {allowed}")
    return value


def _min_group_size(raw: str | None) -> int:
    if raw is None or not raw.strip():
        return DEFAULT_MIN_GROUP_SIZE
    allowed = f"use an integer >= 1 (default {DEFAULT_MIN_GROUP_SIZE})"
    try:
        value = int(raw.strip())
    except ValueError:
        raise UsageError(f"environment variable {MIN_GROUP_SIZE_VAR}={raw!r} is not an integer; {allowed}") from None
    if value < 1:
        raise UsageError(f"environment variable {MIN_GROUP_SIZE_VAR}={raw!r} is out of range; {allowed}")
    return value
