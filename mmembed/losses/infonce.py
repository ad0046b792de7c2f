"""InfoNCE over anchor / positive / hard-negative groups, as ms-swift's ``infonce`` loss.

The batch layout is ms-swift's: embeddings in group order ``a0, p0, n0_0, ..., a1, p1,
...`` and one label per non-anchor row (1.0 for the positive, 0.0 for each negative).
Groups may carry different numbers of negatives, including none.

ms-swift loops over the groups in Python when their sizes differ. Here every setting is
one padded, masked computation, so the loss costs a few matrix products whatever the
group sizes. Two of ms-swift's defects are not copied: padding to ``hard_negatives``
samples only the group's own negatives (ms-swift can pick the positive), and the
cross-device extension is meant to gather with gradient (see
:meth:`InfoNCELoss.forward_from_parts`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..data.trainable import NegativesRule
from .base import NEG_INF, CrossProcess, EmbeddingLoss, Groups, as_groups, in_group_scores
from .config import InfoNCEConfig, env_temperature
from .maxsim import DOT, Similarity
from .parts import GroupParts, query_range


def select_hard_negatives(counts: Tensor, hard_negatives: int, generator: torch.Generator | None = None) -> Tensor:
    """Pick exactly ``hard_negatives`` negatives per group, as ``INFONCE_HARD_NEGATIVES`` does.

    A group with at least ``H = hard_negatives`` negatives keeps its first ``H``. A group
    with fewer keeps all of them, then is filled up to ``H`` by sampling its own negatives
    uniformly with replacement (never its positive). One ``[B, H]`` uniform draw is made
    per call, so two generators seeded alike give the same picks.

    Args:
        counts: Long tensor ``[B]``, the number of negatives of each group.
        hard_negatives: ``H >= 1``.
        generator: Random source for the padding; torch's global one when None.

    Returns:
        Long tensor ``[B, H]`` on ``counts.device``: row ``g`` holds indices into group
        ``g``'s own negatives (``0 <= i < counts[g]``).

    Raises:
        ValueError: ``H < 1``, or a group has no negative to sample from.

    Example:
        ::

            select_hard_negatives(torch.tensor([3, 1]), 2)  # [[0, 1], [0, 0]]
    """
    if isinstance(hard_negatives, bool) or not isinstance(hard_negatives, int) or hard_negatives < 1:
        raise ValueError(f"hard_negatives must be an integer >= 1, got {hard_negatives!r}")
    counts = counts.long()
    empty = counts == 0
    if bool(empty.any()):
        g = int(empty.nonzero()[0])
        raise ValueError(
            f"InfoNCE group {g} has no negatives, but hard_negatives={hard_negatives} needs at least one "
            "per group to sample from (INFONCE_HARD_NEGATIVES); give every row a negative or unset it"
        )
    n_groups = counts.numel()
    draw_device = generator.device if generator is not None else counts.device
    u = torch.rand(n_groups, hard_negatives, generator=generator, device=draw_device).to(counts.device)
    cap = counts[:, None]
    # floor(u * count) is uniform over 0..count-1; the clamp only guards float rounding
    sampled = torch.minimum((u * cap).long(), cap - 1)
    slot = torch.arange(hard_negatives, device=counts.device).expand(n_groups, hard_negatives)
    return torch.where(slot < cap, slot, sampled)


def checked_similarity(similarity: Any) -> Similarity:
    """``similarity`` when it is a :class:`~mmembed.losses.maxsim.Similarity`, else a ValueError."""
    if not isinstance(similarity, Similarity):
        raise ValueError(f"InfoNCE similarity must be a mmembed.losses.maxsim.Similarity (DOT, MaxSim(...)), "
                         f"got {similarity!r}")
    return similarity


class InfoNCELoss(EmbeddingLoss):
    """Contrastive InfoNCE loss over groups of anchor, positive and hard negatives.

    For each anchor the logits are its similarities (by default dot products; the embeddings
    are already L2-normalized and are not normalized again) to a set of candidates, divided
    by ``temperature``; the loss is the cross-entropy with the anchor's own positive as
    the target, averaged over anchors. The candidates are:

    - ``use_batch=False``: the anchor's positive and its own negatives.
    - ``use_batch=True``: every positive and every negative of the batch, then, with
      ``include_qq``, every other anchor, then, with ``include_dd``, the similarities of
      the anchor's positive to every document except itself.
    - ``mask_fake_negative`` (with ``use_batch``): a query-document or query-query
      similarity greater than ``s(anchor, positive) + fake_neg_margin`` is dropped
      (the document-document block is never masked).

    This equals ms-swift's ``infonce`` on the same batch and settings, except that
    padding to ``hard_negatives`` samples only negatives.

    Args:
        temperature: Similarities are divided by this. ms-swift's default is 0.1
            (0.01 before ms-swift 3.11).
        use_batch: Use every document of the batch as a candidate.
        hard_negatives: Keep (or sample up to) this many negatives per group; None
            keeps them all.
        mask_fake_negative: Drop candidates that score above the positive by more than
            ``fake_neg_margin``.
        fake_neg_margin: Margin of ``mask_fake_negative``.
        include_qq: Add the other anchors as candidates.
        include_dd: Add the positive-vs-documents block.
        generator: Random source for the ``hard_negatives`` padding; torch's global one
            when None.
        similarity: How a query scores a document (:class:`~mmembed.losses.maxsim.Similarity`):
            :data:`~mmembed.losses.maxsim.DOT` (``[N, D]`` embeddings, the default) or
            :class:`~mmembed.losses.maxsim.MaxSim` (late interaction: ``[N, L, D]`` token
            vectors, absent tokens exactly zero). Every setting above keeps its meaning
            with MaxSim in place of the dot product (the fake-negative margin is then in
            MaxSim's units). ``build_loss("infonce", similarity=MaxSim())`` or the
            registered ``late_interaction_infonce`` build it.
        temperature: None takes the similarity's default: 0.1 (ms-swift's) for the dot
            product; for MaxSim 1.0 (the raw sum, sentence-transformers' / PyLate's
            ``scale=1``) or 0.02 with ``normalize`` (colpali-engine's). :meth:`build` reads
            ``INFONCE_TEMPERATURE`` first: when set, it wins.

    Inputs:
        +---------------------------------------------+----------------------------------------+
        | outputs["last_hidden_state"]                | labels                                 |
        +=============================================+========================================+
        | ``[N, D]``: ``a0, p0, n0_*, a1, p1, n1_*``  | ``[N - B]``: 1.0 for each positive,    |
        | (any number of negatives per group)         | 0.0 for each negative; anchors: none   |
        +---------------------------------------------+----------------------------------------+

    References:
        - van den Oord et al., *Representation Learning with Contrastive Predictive
          Coding*, 2018.
        - Qwen3-Embedding technical report, 2025 (the query-query and document-document
          terms and the fake-negative mask).

    Example:
        ::

            import torch
            import torch.nn.functional as F
            from mmembed.losses import build_loss

            loss_fn = build_loss("infonce")  # reads INFONCE_* like ms-swift
            # two groups: (a0, p0, n0_0) and (a1, p1)
            emb = F.normalize(torch.randn(5, 8, requires_grad=True), dim=-1)
            labels = torch.tensor([1.0, 0.0, 1.0])
            loss = loss_fn({"last_hidden_state": emb}, labels)
            loss.backward()
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
        generator: torch.Generator | None = None,
        similarity: Similarity = DOT,
    ) -> None:
        super().__init__()
        self.similarity = checked_similarity(similarity)
        if temperature is None:
            temperature = similarity.default_temperature(InfoNCEConfig.temperature)
        self.config = InfoNCEConfig(
            temperature=temperature,
            use_batch=use_batch,
            hard_negatives=hard_negatives,
            mask_fake_negative=mask_fake_negative,
            fake_neg_margin=fake_neg_margin,
            include_qq=include_qq,
            include_dd=include_dd,
        )
        self.generator = generator

    @classmethod
    def from_config(cls, config: InfoNCEConfig, generator: torch.Generator | None = None,
                    similarity: Similarity = DOT) -> InfoNCELoss:
        """Build from an :class:`InfoNCEConfig`."""
        return cls(**asdict(config), generator=generator, similarity=similarity)

    @classmethod
    def build(cls, **options: Any) -> InfoNCELoss:
        """Build as ms-swift does: settings from ``INFONCE_*``, with ``options`` winning.

        ``options`` are :class:`InfoNCEConfig` fields, plus ``generator`` and ``similarity``.
        Without a ``temperature`` option and with ``INFONCE_TEMPERATURE`` unset, the
        temperature is the similarity's default (0.1 for the dot product, see the class).
        """
        generator = options.pop("generator", None)
        similarity = checked_similarity(options.pop("similarity", DOT))
        if "temperature" not in options and similarity is not DOT:
            options["temperature"] = env_temperature(similarity.default_temperature(InfoNCEConfig.temperature))
        return cls.from_config(InfoNCEConfig.from_env(**options), generator=generator, similarity=similarity)

    def extra_repr(self) -> str:
        text = ", ".join(f"{k}={v!r}" for k, v in asdict(self.config).items())
        return text if self.similarity is DOT else f"{text}, similarity={self.similarity!r}"

    @property
    def use_batch(self) -> bool:  # type: ignore[override]
        """``INFONCE_USE_BATCH`` (the base class's declaration, from the config)."""
        return self.config.use_batch

    @property
    def cross_process(self) -> CrossProcess:
        """In-batch candidates come from every process; with ``use_batch`` off each group
        only sees itself."""
        return CrossProcess.GROUP_PARTS if self.config.use_batch else CrossProcess.LOCAL_GROUPS

    @property
    def negatives_rule(self) -> NegativesRule | None:
        """A row needs a negative when ``hard_negatives`` is set (the loss fills each group up
        to it by sampling the group's own negatives: none to sample from is an error) or when
        ``use_batch`` is off (its only other candidate would be its positive: loss 0,
        gradient 0). Otherwise every row can train (the batch's other documents are its
        negatives)."""
        cfg = self.config
        if cfg.hard_negatives is not None:
            return NegativesRule(
                1, f"hard_negatives {cfg.hard_negatives} (INFONCE_HARD_NEGATIVES) fills each group up to "
                   f"{cfg.hard_negatives} by sampling its own negatives, and it has none to sample from",
                "give every row at least one negative (rejected_response / negative_messages), or unset "
                "INFONCE_HARD_NEGATIVES", breaks=True)
        if not cfg.use_batch:
            return NegativesRule(
                1, "with use_batch false (INFONCE_USE_BATCH=false) its only candidate is its positive, so its loss "
                   "is 0 and its gradient 0",
                "give the rows negatives (rejected_response / negative_messages), or set INFONCE_USE_BATCH=true")
        return None

    def forward(self, outputs: Mapping[str, Tensor], labels: Tensor | Groups) -> Tensor:
        """Loss of one batch in ms-swift's layout.

        Args:
            outputs: ``{"last_hidden_state": [N, D]}``, L2-normalized, in group order.
            labels: ``[N - B]`` float, 1.0 for each positive and 0.0 for each negative
                (or those labels already split into :class:`Groups`).

        Returns:
            Scalar tensor: the mean over anchors of the cross-entropy.
        """
        anchors, positives, negatives, neg_group, docs = self._parts(outputs, labels)
        return self._loss(anchors, positives, negatives, neg_group, range(anchors.shape[0]), docs=docs)

    def split_parts(self, outputs: Mapping[str, Tensor], labels: Tensor | Groups) -> GroupParts:
        """The batch's groups (``anchors [B, D]``, ``positives [B, D]``, ``negatives [M, D]``,
        ``neg_group [M]``; no side rows), after ``hard_negatives`` selection: what
        :meth:`forward_from_parts` takes, and what a process contributes to a cross-device batch."""
        return GroupParts(*self._parts(outputs, labels)[:4])

    def candidate_scores(self, outputs: Mapping[str, Tensor], labels: Tensor | Groups, *,
                         generator: torch.Generator | None = None, block_rows: int = 1024) -> Iterator[tuple[Tensor, Tensor]]:
        """What the loss's softmax sees for each anchor, block by block: the evaluation's view.

        Args:
            outputs, labels: As for :meth:`forward` (e.g. a whole evaluation set).
            generator: Random source for the ``hard_negatives`` padding (drawn once, for
                the whole set); the loss's own when None.
            block_rows: Anchors per block (bounds the memory of the score matrix).

        Yields:
            ``(scores [b, C], target [b])`` per block of anchors: the similarities of
            :meth:`forward`'s logits before the temperature, ``-inf`` where a candidate is
            absent (a shorter group) or dropped (the fake-negative mask, an anchor or a
            positive's own column), and the column of each anchor's own positive. The
            cross-entropy of ``scores / temperature`` against ``target``, averaged over
            all anchors, is the loss.
        """
        anchors, positives, negatives, neg_group, docs = self._parts(outputs, labels, generator)
        n = anchors.shape[0]
        if not self.config.use_batch:
            scores, _ = in_group_scores(anchors, positives, negatives, neg_group, self.similarity)
            for start in range(0, n, block_rows):
                block = scores[start : start + block_rows]
                yield block, torch.zeros(block.shape[0], dtype=torch.long, device=block.device)
            return
        for start in range(0, n, block_rows):
            yield self._in_batch_scores(anchors, positives, docs, range(start, min(n, start + block_rows)))

    def _parts(self, outputs: Mapping[str, Tensor], labels: Tensor | Groups,
               generator: torch.Generator | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        emb = outputs["last_hidden_state"]
        if self.similarity is DOT:
            if emb.dim() != 2:
                raise ValueError(f"InfoNCE expects last_hidden_state [N, D], got shape {tuple(emb.shape)}")
        else:
            self.similarity.check("InfoNCE", emb)
        groups = as_groups(labels, emb.shape[0], emb.device)
        anchor_idx, pos_idx, neg_idx, neg_group = groups.anchor, groups.positive, groups.negative, groups.neg_group
        n_groups = groups.n_groups
        hard = self.config.hard_negatives
        if hard is not None:
            counts = groups.counts()
            picks = select_hard_negatives(counts, hard, generator if generator is not None else self.generator)
            first = torch.cumsum(counts, 0) - counts  # neg_idx is in group order
            neg_idx = neg_idx[(first[:, None] + picks).reshape(-1)]
            neg_group = torch.arange(n_groups, device=emb.device).repeat_interleave(hard)
        # One gather, then views: one index backward costs a fraction of one per part,
        # and [positives; negatives] is then already contiguous for the in-batch product.
        parts = emb.index_select(0, torch.cat([anchor_idx, pos_idx, neg_idx]))
        anchors, docs = parts.split([n_groups, parts.shape[0] - n_groups])
        # token vectors: queries are usually much shorter than the batch's padded length
        anchors, docs = self.similarity.trim(anchors), self.similarity.trim(docs)
        positives, negatives = docs.split([n_groups, neg_idx.numel()])
        return anchors, positives, negatives, neg_group, docs

    def forward_from_parts(self, parts: GroupParts, *, query_rows: slice | None = None) -> Tensor:
        """Loss from embeddings already split into groups.

        ``hard_negatives`` selection is not applied here: ``parts.negatives`` are used as
        given (:meth:`forward` selects them first); side rows, if any, are not used.

        This is the seam for cross-device training: each process can gather the parts of
        every process (with gradient), concatenate them, offset each ``neg_group`` by the
        number of groups on the processes before it, and pass its own anchors as
        ``query_rows``. The candidate documents are then the whole global batch and each
        local anchor's target is its positive's global index.

        Args:
            parts: ``anchors [B, D]``, one per group; ``positives [B, D]``
                (``positives[g]`` belongs to ``anchors[g]``); ``negatives [M, D]``, any number
                per group (``M`` may be 0); ``neg_group`` long ``[M]``, the group
                (``0 <= g < B``) of each negative.
            query_rows: The anchors whose losses are averaged (a contiguous slice of
                ``0..B``); all of them when None.

        Returns:
            Scalar tensor: the mean cross-entropy over the ``query_rows`` anchors.
        """
        rows = check_parts(parts, query_rows, self.similarity)
        neg_group = parts.neg_group.to(device=parts.anchors.device, dtype=torch.long)
        return self._loss(self.similarity.trim(parts.anchors), parts.positives, parts.negatives, neg_group, rows)

    def _loss(
        self,
        anchors: Tensor,
        positives: Tensor,
        negatives: Tensor,
        neg_group: Tensor,
        rows: range,
        docs: Tensor | None = None,
    ) -> Tensor:
        """Mean loss of the ``rows`` anchors; ``docs`` is ``[positives; negatives]`` if the caller has it."""
        if self.config.use_batch:
            if docs is None:
                docs = cat_docs(positives, negatives)
            losses = self._in_batch_losses(anchors, positives, docs, rows)
        else:
            losses = self._in_group_losses(anchors, positives, negatives, neg_group)[rows.start : rows.stop]
        return losses.mean()

    def _in_group_losses(self, anchors: Tensor, positives: Tensor, negatives: Tensor, neg_group: Tensor) -> Tensor:
        """Per-anchor loss over [own positive, own negatives], padded to the largest group."""
        logits, _ = in_group_scores(anchors, positives, negatives, neg_group, self.similarity)  # -inf: short group
        target = torch.zeros(anchors.shape[0], dtype=torch.long, device=anchors.device)
        return F.cross_entropy(logits / self.config.temperature, target, reduction="none")

    def _in_batch_losses(self, anchors: Tensor, positives: Tensor, docs: Tensor, rows: range) -> Tensor:
        """Per-anchor loss (for ``rows``) over every document ``docs = [positives; negatives]``, plus QQ / DD."""
        scores, target = self._in_batch_scores(anchors, positives, docs, rows)
        return F.cross_entropy(scores / self.config.temperature, target, reduction="none")

    def _in_batch_scores(self, anchors: Tensor, positives: Tensor, docs: Tensor, rows: range) -> tuple[Tensor, Tensor]:
        """The ``rows`` anchors' similarities to every candidate (before the temperature, -inf
        where dropped) and the column of each one's positive."""
        cfg = self.config
        # Documents as [all positives; all negatives] rather than ms-swift's interleaved
        # group order: the cross-entropy does not depend on the order of the columns, and
        # anchor i's target is then simply column i (or its global index across devices).
        every_row = rows.start == 0 and rows.stop == anchors.shape[0]
        queries = anchors if every_row else anchors[rows.start : rows.stop]
        target = torch.arange(rows.start, rows.stop, device=anchors.device)
        own = torch.arange(docs.shape[0], device=anchors.device)[None, :] == target[:, None]  # [b, B + M]

        sim = self.similarity
        qd = sim.matrix(queries, docs)
        blocks = [qd]
        qq = None
        if cfg.include_qq:
            qq = sim.matrix(queries, anchors).masked_fill(own[:, : anchors.shape[0]], NEG_INF)  # drop self
        if cfg.mask_fake_negative:
            # compared before the temperature, as ms-swift does; the positive always stays
            threshold = qd.gather(1, target[:, None]).detach() + cfg.fake_neg_margin
            blocks[0] = qd.masked_fill((qd > threshold) & ~own, NEG_INF)
            if qq is not None:
                qq = qq.masked_fill(qq > threshold, NEG_INF)
        if qq is not None:
            blocks.append(qq)
        if cfg.include_dd:
            dd = sim.matrix(positives if every_row else positives[rows.start : rows.stop], docs)
            blocks.append(dd.masked_fill(own, NEG_INF))  # a positive is not its own candidate
        return torch.cat(blocks, dim=1), target


def cat_docs(positives: Tensor, negatives: Tensor) -> Tensor:
    """``[positives; negatives]``; token vectors of different lengths are padded with zero
    (absent) tokens to the longer, which changes no MaxSim score."""
    if positives.dim() == 3 and positives.shape[1] != negatives.shape[1]:
        width = max(positives.shape[1], negatives.shape[1])
        positives = F.pad(positives, (0, 0, 0, width - positives.shape[1]))
        negatives = F.pad(negatives, (0, 0, 0, width - negatives.shape[1]))
    return torch.cat([positives, negatives], dim=0)


def check_parts(parts: GroupParts, query_rows: slice | None, similarity: Similarity) -> range:
    """:meth:`GroupParts.check` for the dot product's ``[*, D]`` parts; for token vectors
    (``similarity.ndim == 3``) the same checks on ``anchors [B, Lq, D]``, ``positives
    [B, Lp, D]``, ``negatives [M, Ln, D]`` (any lengths) and ``neg_group [M]``. Returns
    ``query_rows`` as a range."""
    if similarity.ndim == 2:
        return parts.check(query_rows)
    anchors, positives, negatives, neg_group = parts.anchors, parts.positives, parts.negatives, parts.neg_group
    if anchors.dim() != 3 or positives.dim() != 3 or positives.shape[0] != anchors.shape[0] \
            or positives.shape[2] != anchors.shape[2]:
        raise ValueError(f"anchors and positives must be [B, Lq, D] and [B, Lp, D] token vectors, got "
                         f"{tuple(anchors.shape)} and {tuple(positives.shape)}")
    n_groups, _, dim = anchors.shape
    if negatives.dim() != 3 or negatives.shape[2] != dim or neg_group.shape != (negatives.shape[0],):
        raise ValueError(f"negatives must be [M, Ln, {dim}] with neg_group [M], got {tuple(negatives.shape)} "
                         f"and {tuple(neg_group.shape)}")
    if neg_group.numel() and not bool(((neg_group >= 0) & (neg_group < n_groups)).all()):
        raise ValueError(f"neg_group values must lie in [0, {n_groups}), the range of group indices")
    return query_range(n_groups, query_rows)
