"""Late-interaction (ColBERT / ColPali / ColQwen) losses: MaxSim instead of the dot product.

The model gives every row token vectors: ``outputs["last_hidden_state"]`` is ``[N, L, D]``
in ms-swift's group order (``a0, p0, n0_*, a1, ...``, labels as for InfoNCE), each kept
token L2-normalised and every other position exactly zero (see :mod:`mmembed.losses.maxsim`).

- ``late_interaction_infonce`` (:class:`LateInteractionInfoNCELoss`): InfoNCE over MaxSim,
  every ``INFONCE_*`` setting as for ``infonce``; the temperature defaults (when
  ``INFONCE_TEMPERATURE`` is unset) to 1.0 (raw sums: sentence-transformers'
  ``MultiVectorMultipleNegativesRankingLoss`` / PyLate, ``scale=1``) or 0.02 with
  ``normalize_scores`` (colpali-engine). colpali-engine's ``ColbertLoss`` *is* this loss
  with ``normalize_scores=True``, T 0.02, on a batch without negatives (shown by
  tests/losses/test_late_interaction_losses.py), so it has no class of its own.
- ``colbert_pairwise_ce`` (:class:`ColbertPairwiseCELoss`): colpali-engine's
  ``ColbertPairwiseCELoss``.
- ``colbert_negative_ce`` (:class:`ColbertNegativeCELoss`) and
  ``colbert_pairwise_negative_ce`` (:class:`ColbertPairwiseNegativeCELoss`): colpali-engine's
  losses with explicit negatives.

Differences from colpali-engine, by design:

- Padding: colpali pads documents with zero vectors that take part in the max (a query
  token whose every real dot product with a document is negative scores 0 there); here
  absent tokens never win the max. They agree whenever a query token's best real dot
  product is >= 0 (the fixtures are drawn so that it always is).
- colpali counts a query's tokens by their first component being nonzero; here a token is
  present when any component is nonzero.
- colpali takes a fixed number of negatives per query (``[B, n, L, D]``); here groups may
  carry any number, and the explicit-negative term is the mean over groups of each
  group's mean over its own negatives (colpali's mean over ``B * n`` when every group has
  ``n``).
- colpali prints a line when normalised scores leave ``[0, 1]``; nothing is printed here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..data.trainable import NegativesRule
from .base import (
    NEG_INF,
    CrossProcess,
    EmbeddingLoss,
    Groups,
    as_groups,
    check_temperature,
    finite_number,
    in_group_scores,
)
from .config import InfoNCEConfig
from .infonce import InfoNCELoss, cat_docs, check_parts
from .maxsim import DEFAULT_CHUNK, MaxSim
from .parts import GroupParts


class LateInteractionInfoNCELoss(InfoNCELoss):
    """:class:`~mmembed.losses.InfoNCELoss` over MaxSim: ``InfoNCELoss(similarity=MaxSim(normalize_scores, chunk))``.

    Args:
        temperature, use_batch, hard_negatives, mask_fake_negative, fake_neg_margin,
        include_qq, include_dd, generator: As for :class:`~mmembed.losses.InfoNCELoss`
            (``build_loss`` reads ``INFONCE_*``); ``temperature`` None: 1.0, or 0.02 with
            ``normalize_scores``.
        normalize_scores: Divide each MaxSim by the query's number of present tokens.
        chunk: MaxSim's bound on its transient product, in elements (:func:`~mmembed.losses.maxsim.maxsim`).

    Inputs:
        ``outputs["last_hidden_state"]``: ``[N, L, D]`` token vectors, absent tokens zero, in
        ms-swift's group order; ``labels``: as for ``infonce``.
    """

    def __init__(
        self,
        temperature: float | None = None,
        use_batch: bool = InfoNCEConfig.use_batch,
        hard_negatives: int | None = InfoNCEConfig.hard_negatives,
        mask_fake_negative: bool = InfoNCEConfig.mask_fake_negative,
        fake_neg_margin: float = InfoNCEConfig.fake_neg_margin,
        include_qq: bool = InfoNCEConfig.include_qq,
        include_dd: bool = InfoNCEConfig.include_dd,
        *,
        normalize_scores: bool = False,
        chunk: int = DEFAULT_CHUNK,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(temperature, use_batch, hard_negatives, mask_fake_negative, fake_neg_margin, include_qq,
                         include_dd, generator=generator, similarity=MaxSim(normalize_scores, chunk))

    @classmethod
    def build(cls, **options: Any) -> LateInteractionInfoNCELoss:
        """Settings from ``INFONCE_*`` with ``options`` winning (as ``infonce``), plus
        ``normalize_scores`` and ``chunk``; without ``temperature`` and with
        ``INFONCE_TEMPERATURE`` unset, MaxSim's default."""
        normalize = options.pop("normalize_scores", False)
        chunk = options.pop("chunk", DEFAULT_CHUNK)
        built = InfoNCELoss.build(similarity=MaxSim(normalize, chunk), **options)
        return cls(**asdict(built.config), normalize_scores=normalize, chunk=chunk, generator=built.generator)


def _weight(owner: str, value: Any) -> float:
    value = finite_number(owner, "in_batch_term_weight", value, minimum=0)
    if value > 1:
        raise ValueError(f"{owner} option in_batch_term_weight must be <= 1, got {value!r}")
    return value


class _ColbertLoss(EmbeddingLoss):
    """Shared by the colpali-engine losses: MaxSim settings, the split into groups, and the
    terms. ``forward(outputs, labels)`` is ``forward_from_parts(split_parts(outputs, labels))``."""

    def __init__(self, temperature: float, normalize_scores: bool, chunk: int) -> None:
        super().__init__()
        self.temperature = check_temperature(type(self).__name__, "temperature", temperature)
        self.similarity = MaxSim(normalize_scores, chunk)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature!r}, similarity={self.similarity!r}"

    def split_parts(self, outputs: Mapping[str, Tensor], labels: Tensor | Groups) -> GroupParts:
        """``anchors [B, Lq, D]`` (trimmed), ``positives``, ``negatives`` ``[*, Ld, D]``, ``neg_group [M]``."""
        emb = outputs["last_hidden_state"]
        self.similarity.check(type(self).__name__, emb)
        groups = as_groups(labels, emb.shape[0], emb.device)
        n = groups.n_groups
        rows = emb.index_select(0, torch.cat([groups.anchor, groups.positive, groups.negative]))
        anchors, docs = rows.split([n, rows.shape[0] - n])
        docs = self.similarity.trim(docs)
        positives, negatives = docs.split([n, groups.negative.numel()])
        return GroupParts(self.similarity.trim(anchors), positives, negatives, groups.neg_group)

    def forward(self, outputs: Mapping[str, Tensor], labels: Tensor | Groups) -> Tensor:
        """The mean loss over the batch's groups."""
        return self.forward_from_parts(self.split_parts(outputs, labels))

    def forward_from_parts(self, parts: GroupParts, *, query_rows: slice | None = None) -> Tensor:
        """The mean loss of the ``query_rows`` groups' anchors (all when None) against parts
        that may hold every process's groups."""
        rows = check_parts(parts, query_rows, self.similarity)
        neg_group = parts.neg_group.to(device=parts.anchors.device, dtype=torch.long)
        return self._losses(self.similarity.trim(parts.anchors), parts.positives, parts.negatives, neg_group,
                            rows).mean()

    def _losses(self, anchors: Tensor, positives: Tensor, negatives: Tensor, neg_group: Tensor, rows: range) -> Tensor:
        raise NotImplementedError

    # the terms, each ``[b]`` for the anchors of ``rows``

    def _hardest_pairwise(self, anchors: Tensor, docs: Tensor, rows: range) -> Tensor:
        """``softplus((max over other documents of s(a, d) - s(a, p)) / T)``; ``docs`` starts
        with the positives (anchor ``i``'s at column ``i``)."""
        scores = self.similarity.matrix(anchors[rows.start : rows.stop], docs)  # [b, C]
        target = torch.arange(rows.start, rows.stop, device=scores.device)
        own = torch.arange(docs.shape[0], device=scores.device)[None, :] == target[:, None]
        pos = scores.gather(1, target[:, None]).squeeze(1)
        hardest = scores.masked_fill(own, NEG_INF).amax(1)  # -inf (softplus 0) when there is no other
        return F.softplus((hardest - pos) / self.temperature)

    def _in_batch_ce(self, anchors: Tensor, positives: Tensor, rows: range) -> Tensor:
        """Cross-entropy over the batch's positives (colpali's ``ColbertLoss``)."""
        scores = self.similarity.matrix(anchors[rows.start : rows.stop], positives)
        target = torch.arange(rows.start, rows.stop, device=scores.device)
        return F.cross_entropy(scores / self.temperature, target, reduction="none")

    def _explicit(self, anchors: Tensor, positives: Tensor, negatives: Tensor, neg_group: Tensor,
                  rows: range) -> Tensor:
        """Per group, the mean over its own negatives of ``softplus((s(a, n) - s(a, p)) / T)``
        (0 for a group without negatives)."""
        mine = (neg_group >= rows.start) & (neg_group < rows.stop)
        local = slice(rows.start, rows.stop)
        scores, valid = in_group_scores(anchors[local], positives[local], negatives[mine],
                                        neg_group[mine] - rows.start, self.similarity)
        per_neg = F.softplus((scores[:, 1:] - scores[:, :1]) / self.temperature)
        per_neg = per_neg.masked_fill(~valid[:, 1:], 0.0)
        return per_neg.sum(1) / valid[:, 1:].sum(1).clamp_min(1)

    def candidate_scores(self, outputs: Mapping[str, Tensor], labels: Tensor | Groups, *,
                         generator: torch.Generator | None = None, block_rows: int = 1024
                         ) -> Iterator[tuple[Tensor, Tensor]]:
        """Per block of anchors, MaxSim against every document of the set and each anchor's
        positive column (``generator``: unused)."""
        parts = self.split_parts(outputs, labels)
        docs = cat_docs(parts.positives, parts.negatives)
        n = parts.n_queries
        for start in range(0, n, block_rows):
            stop = min(n, start + block_rows)
            yield (self.similarity.matrix(parts.anchors[start:stop], docs),
                   torch.arange(start, stop, device=docs.device))


class ColbertPairwiseCELoss(_ColbertLoss):
    """colpali-engine's ``ColbertPairwiseCELoss``: per anchor,
    ``softplus((s(a, d_hard) - s(a, p)) / T)`` with ``d_hard`` the highest-scoring document
    of the batch other than its own positive; the mean over anchors.

    The candidates are every document of the batch (every positive and every negative; in
    colpali's batches, which hold no negatives, every positive). An anchor with no other
    candidate contributes 0. Under several processes the candidates are those of every
    process (``GROUP_PARTS``).

    Args:
        temperature: colpali's default 1.0.
        normalize_scores: Divide MaxSim by the query's number of tokens (colpali: True).
        chunk: MaxSim's bound on its transient product, in elements.

    Inputs:
        ``outputs["last_hidden_state"]`` ``[N, L, D]`` in group order, ``labels`` as for
        ``infonce``.
    """

    use_batch = True

    def __init__(self, temperature: float = 1.0, normalize_scores: bool = True, chunk: int = DEFAULT_CHUNK) -> None:
        super().__init__(temperature, normalize_scores, chunk)

    @property
    def cross_process(self) -> CrossProcess:
        return CrossProcess.GROUP_PARTS

    def _losses(self, anchors, positives, negatives, neg_group, rows):
        return self._hardest_pairwise(anchors, cat_docs(positives, negatives), rows)


class _ExplicitNegativesLoss(_ColbertLoss):
    """The colpali-engine losses with explicit negatives: ``(1 - w) * explicit + w * in_batch``."""

    def __init__(self, temperature: float = 0.02, normalize_scores: bool = True, in_batch_term_weight: float = 0.5,
                 chunk: int = DEFAULT_CHUNK) -> None:
        super().__init__(temperature, normalize_scores, chunk)
        self.in_batch_term_weight = _weight(type(self).__name__, in_batch_term_weight)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, in_batch_term_weight={self.in_batch_term_weight!r}"

    @property
    def use_batch(self) -> bool:  # type: ignore[override]
        """With an in-batch term, the batch's positives are candidates of every anchor."""
        return self.in_batch_term_weight > 0

    @property
    def cross_process(self) -> CrossProcess:
        """The in-batch term sees every process's positives; without it each group only
        sees itself."""
        return CrossProcess.GROUP_PARTS if self.in_batch_term_weight > 0 else CrossProcess.LOCAL_GROUPS

    @property
    def negatives_rule(self) -> NegativesRule | None:
        """The explicit term needs a negative per group (a group without one contributes 0 to it)."""
        return NegativesRule(1, f"{type(self).__name__}'s explicit-negative term has nothing to compare its "
                                "positive with (that term is 0 for the row)",
                             "give every row a negative (rejected_response / negative_messages)")

    def _losses(self, anchors, positives, negatives, neg_group, rows):
        w = self.in_batch_term_weight
        loss = self._explicit(anchors, positives, negatives, neg_group, rows)
        if w > 0:
            loss = loss * (1 - w) + self._in_batch(anchors, positives, rows) * w
        return loss

    def _in_batch(self, anchors: Tensor, positives: Tensor, rows: range) -> Tensor:
        raise NotImplementedError

    def candidate_scores(self, outputs, labels, *, generator=None, block_rows: int = 1024):
        """Without an in-batch term, each anchor's own ``[positive, negatives]`` (target 0);
        with one, every document of the set."""
        if self.in_batch_term_weight > 0:
            yield from super().candidate_scores(outputs, labels, generator=generator, block_rows=block_rows)
            return
        parts = self.split_parts(outputs, labels)
        scores, _ = in_group_scores(parts.anchors, parts.positives, parts.negatives, parts.neg_group, self.similarity)
        for start in range(0, scores.shape[0], block_rows):
            block = scores[start : start + block_rows]
            yield block, torch.zeros(block.shape[0], dtype=torch.long, device=block.device)


class ColbertNegativeCELoss(_ExplicitNegativesLoss):
    """colpali-engine's ``ColbertNegativeCELoss``:
    ``(1 - w) * mean softplus((s(a, n) - s(a, p)) / T) + w * CE over the batch's positives``.

    The explicit term is over each group's own negatives (the mean over groups of each
    group's mean); the in-batch term is colpali's ``ColbertLoss``, the cross-entropy of
    ``s(a, p_j) / T`` over every positive ``p_j`` of the batch (explicit negatives are not
    candidates there, as in colpali), target the own positive.

    Args:
        temperature: colpali's default 0.02.
        normalize_scores: colpali's default True.
        in_batch_term_weight: ``w`` in ``[0, 1]``, colpali's default 0.5.
        chunk: MaxSim's bound on its transient product, in elements.
    """

    def _in_batch(self, anchors, positives, rows):
        return self._in_batch_ce(anchors, positives, rows)


class ColbertPairwiseNegativeCELoss(_ExplicitNegativesLoss):
    """colpali-engine's ``ColbertPairwiseNegativeCELoss``: the explicit term of
    :class:`ColbertNegativeCELoss` with, as in-batch term, :class:`ColbertPairwiseCELoss`'s
    over the batch's positives (the hardest other positive), at the same temperature.

    Args:
        temperature: colpali's default 0.02.
        normalize_scores: colpali's default True.
        in_batch_term_weight: ``w`` in ``[0, 1]``, colpali's default 0.5.
        chunk: MaxSim's bound on its transient product, in elements.
    """

    def _in_batch(self, anchors, positives, rows):
        return self._hardest_pairwise(anchors, positives, rows)


#: the registered names (``--loss_type``)
LATE_INTERACTION_LOSSES: dict[str, type[EmbeddingLoss]] = {
    "late_interaction_infonce": LateInteractionInfoNCELoss,
    "colbert_pairwise_ce": ColbertPairwiseCELoss,
    "colbert_negative_ce": ColbertNegativeCELoss,
    "colbert_pairwise_negative_ce": ColbertPairwiseNegativeCELoss,
}
