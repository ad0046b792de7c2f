"""GIST: in-batch contrastive loss whose candidates are vetted by a guide model.

A plain in-batch contrastive loss treats every other document of the batch as a
negative, including documents that answer the anchor just as well as its own positive
(duplicates, paraphrases, unlabelled relevant passages). GIST asks a second, frozen
embedding model (the *guide*) for its opinion first: a candidate that the guide scores
closer to the anchor than the anchor's own positive (within a margin) is taken out of
the softmax. The student's similarities are what is trained; the guide only decides
which candidates count.

The batch layout is InfoNCE's (ms-swift's): rows ``a0, p0, n0_*, a1, p1, n1_*, ...``,
labels 1.0 / 0.0 for the non-anchor rows, any number of negatives per group. The guide's
embeddings of the same rows, in the same order, arrive in
``outputs["guide_hidden_state"]``; the trainer computes them without gradient.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import (
    GUIDE,
    NEG_INF,
    CrossProcess,
    EmbeddingLoss,
    Groups,
    SideNeeds,
    as_groups,
    check_temperature,
    finite_number,
)
from .config import env_temperature
from .parts import GroupParts, SideRows

#: Temperature used when neither the ``temperature`` option nor ``INFONCE_TEMPERATURE``
#: is given: the value of the GIST paper and of sentence-transformers' GIST loss.
GIST_TEMPERATURE = 0.01

MarginStrategy = Literal["absolute", "relative"]


def default_temperature(environ: Mapping[str, str] | None = None) -> float:
    """The GIST temperature when the caller gives none: ``INFONCE_TEMPERATURE`` when it is
    set, otherwise :data:`GIST_TEMPERATURE` (0.01). ms-swift's InfoNCE default of 0.1 is not
    used: it was tuned for a loss without the guide's mask."""
    return env_temperature(GIST_TEMPERATURE, environ)


class GISTLoss(EmbeddingLoss):
    """Guided in-batch contrastive loss (GISTEmbed).

    For each anchor ``a_i`` with positive ``p_i``, the candidates are four blocks of
    student similarities (dot products of the given, L2-normalized embeddings):

    - anchor-positive: ``s(a_i, p_j)`` for every positive of the batch (``j = i`` is
      the target);
    - anchor-negative: ``s(a_i, n)`` for every hard negative of the batch;
    - anchor-anchor (``contrast_anchors``): ``s(a_i, a_j)`` for ``j != i``;
    - positive-positive (``contrast_positives``): ``s(p_i, p_j)`` for ``j != i``.

    With ``g`` the guide's similarity of the same two rows and ``t_i = g(a_i, p_i)``, a
    candidate is dropped (its logit set to ``-inf``) when

    - ``margin_strategy="absolute"``: ``g(candidate) > t_i - margin``;
    - ``margin_strategy="relative"``: ``g(candidate) > t_i * (1 - margin)``.

    For a positive-positive candidate ``g(candidate)`` is ``g(p_i, p_j)``. The own
    positive ``p_i`` is never dropped. The remaining logits, divided by ``temperature``,
    go through cross-entropy with ``p_i`` as the target; the loss is the mean over
    anchors. Comparisons use the guide's similarities before any temperature.

    Relation to InfoNCE: with the guide equal to the student, ``margin=0``, absolute
    strategy and ``contrast_positives=False``, this is exactly
    ``InfoNCELoss(mask_fake_negative=True, fake_neg_margin=0, include_qq=True)`` at the
    same temperature. The positive-positive block has no InfoNCE counterpart in
    general (InfoNCE's ``include_dd`` block compares ``p_i`` with the negatives too and
    is never masked); when the batch has no hard negatives and nothing is masked (a
    very negative margin, e.g. -100), the two coincide with ``include_dd=True``.

    Args:
        temperature: Logits are student similarities divided by this. Default (via
            :meth:`build`, i.e. ``build_loss("gist")``): ``INFONCE_TEMPERATURE`` if set,
            else 0.01 (see :func:`default_temperature`). The constructor's own default
            is 0.01 and does not read the environment.
        margin: Slack of the guide's test (see above); 0.0 drops exactly the candidates
            the guide ranks above the positive. A positive margin drops more, a
            negative one fewer.
        margin_strategy: ``"absolute"`` or ``"relative"``.
        contrast_anchors: Add the anchor-anchor block.
        contrast_positives: Add the positive-positive block.

    Inputs:
        +---------------------------------------------+----------------------------------------+
        | outputs                                     | labels                                 |
        +=============================================+========================================+
        | ``"last_hidden_state"`` ``[N, D]`` and      | ``[N - B]``: 1.0 for each positive,    |
        | ``"guide_hidden_state"`` ``[N, Dg]``, both  | 0.0 for each negative; anchors: none   |
        | ``a0, p0, n0_*, a1, p1, n1_*, ...``         | (as ``infonce``)                       |
        +---------------------------------------------+----------------------------------------+

    The guide's embeddings are used as given (no normalization, no gradient); ``Dg``
    may differ from ``D``. Hard-negative selection (``INFONCE_HARD_NEGATIVES``) does not
    apply: every negative is a candidate.

    Several processes: the parts of :meth:`split_parts` are what a process contributes;
    see :meth:`forward_from_parts` for how they are combined.

    References:
        Solatorio, *GISTEmbed: Guided In-sample Selection of Training Negatives for
        Text Embedding Fine-tuning*, 2024.

    Example:
        ::

            import torch
            import torch.nn.functional as F
            from mmembed.losses import build_loss

            loss_fn = build_loss("gist", margin=0.05)
            # two groups: (a0, p0, n0_0) and (a1, p1)
            emb = F.normalize(torch.randn(5, 8, requires_grad=True), dim=-1)
            guide = F.normalize(torch.randn(5, 16), dim=-1)
            labels = torch.tensor([1.0, 0.0, 1.0])
            loss = loss_fn({"last_hidden_state": emb, "guide_hidden_state": guide}, labels)
    """

    #: GIST always scores the anchors against the whole batch.
    use_batch = True
    #: the guide's embeddings of the batch's rows
    side = SideNeeds(guide=True)
    cross_process = CrossProcess.GROUP_PARTS

    def __init__(
        self,
        temperature: float = GIST_TEMPERATURE,
        margin: float = 0.0,
        margin_strategy: MarginStrategy = "absolute",
        contrast_anchors: bool = True,
        contrast_positives: bool = True,
    ) -> None:
        super().__init__()
        self.temperature = check_temperature("GIST", "temperature", temperature)
        self.margin = finite_number("GIST", "margin", margin)
        if margin_strategy not in ("absolute", "relative"):
            raise ValueError(f"GIST margin_strategy must be 'absolute' or 'relative', got {margin_strategy!r}")
        self.margin_strategy = margin_strategy
        for name, value in (("contrast_anchors", contrast_anchors), ("contrast_positives", contrast_positives)):
            if not isinstance(value, bool):
                raise ValueError(f"GIST option {name} must be a bool, got {value!r}")
        self.contrast_anchors = contrast_anchors
        self.contrast_positives = contrast_positives

    @classmethod
    def build(cls, environ: Mapping[str, str] | None = None, **options: Any) -> GISTLoss:
        """Build from ``build_loss`` options; a missing ``temperature`` comes from
        :func:`default_temperature` (``INFONCE_TEMPERATURE`` if set, else 0.01)."""
        if "temperature" not in options:
            options["temperature"] = default_temperature(environ)
        return cls(**options)

    def extra_repr(self) -> str:
        return (
            f"temperature={self.temperature}, margin={self.margin}, margin_strategy={self.margin_strategy!r}, "
            f"contrast_anchors={self.contrast_anchors}, contrast_positives={self.contrast_positives}"
        )

    def forward(self, outputs: Mapping[str, Tensor], labels: Tensor | Groups) -> Tensor:
        """Loss of one batch in ms-swift's layout (see the class docstring).

        Returns:
            Scalar tensor: the mean over anchors of the cross-entropy.
        """
        return self.forward_from_parts(self.split_parts(outputs, labels))

    def split_parts(self, outputs: Mapping[str, Tensor], labels: Tensor | Groups) -> GroupParts:
        """The batch split into groups, for the student and the guide.

        Returns:
            :class:`GroupParts`: ``anchors [B, D]``, ``positives [B, D]``, ``negatives [M, D]``,
            ``neg_group [M]`` and ``guide`` (its ``anchors [B, Dg]``, ``positives [B, Dg]``,
            ``negatives [M, Dg]``): the student rows keep their graph, the guide rows are
            detached. This is what :meth:`forward_from_parts` takes and what one process
            contributes to a cross-device batch.

        Raises:
            ValueError: Malformed labels (as ``infonce``), or a missing or misshapen
                ``guide_hidden_state``.
        """
        emb = outputs["last_hidden_state"]
        if emb.dim() != 2:
            raise ValueError(f"GIST expects last_hidden_state [N, D], got shape {tuple(emb.shape)}")
        guide = outputs.get(GUIDE)
        if guide is None:
            raise ValueError(
                "GIST needs outputs['guide_hidden_state']: the guide model's embeddings of the same rows "
                "(the trainer computes them from the guide model)"
            )
        if guide.dim() != 2 or guide.shape[0] != emb.shape[0]:
            raise ValueError(
                f"guide_hidden_state must be [N, Dg] with the N = {emb.shape[0]} rows of last_hidden_state, "
                f"got shape {tuple(guide.shape)}"
            )
        groups = as_groups(labels, emb.shape[0], emb.device)
        neg_group = groups.neg_group
        index = torch.cat([groups.anchor, groups.positive, groups.negative])
        sizes = [groups.n_groups, groups.n_groups, groups.negative.numel()]
        anchors, positives, negatives = emb.index_select(0, index).split(sizes)
        return GroupParts(anchors, positives, negatives, neg_group,
                          guide=SideRows(*guide.detach().to(emb.device).index_select(0, index).split(sizes)))

    def forward_from_parts(self, parts: GroupParts, *, query_rows: slice | None = None) -> Tensor:
        """Loss from a batch already split into groups (student and guide).

        Several processes: each process gathers every process's parts in rank order
        (``anchors``, ``positives``, ``negatives`` with gradient; ``neg_group`` offset
        by the number of groups on the processes before it; the guide's rows
        without gradient), calls this with its own groups as ``query_rows``, and
        scales the result by ``B_r * W / B`` (its groups, the world size, the global
        groups), exactly as for ``infonce``.

        Args:
            parts: ``anchors [B, D]``, one per group; ``positives [B, D]`` (``positives[g]``
                belongs to ``anchors[g]``); ``negatives [M, D]`` (``M`` may be 0);
                ``neg_group`` long ``[M]``, the group of each negative (validated, otherwise
                unused: every negative is a candidate for every anchor); ``guide``: the
                guide's rows, aligned with the three student fields, ``[B, Dg]``,
                ``[B, Dg]``, ``[M, Dg]`` (required).
            query_rows: The anchors whose losses are averaged (a contiguous slice of
                ``0..B``); all of them when None.

        Returns:
            Scalar tensor: the mean cross-entropy over the ``query_rows`` anchors.
        """
        rows = parts.check(query_rows, needs=("guide",))
        guide = parts.guide.map(Tensor.detach)
        return self._losses(parts.anchors, parts.positives, parts.negatives,
                            guide.anchors, guide.positives, guide.negatives, rows).mean()

    def _losses(
        self,
        anchors: Tensor,
        positives: Tensor,
        negatives: Tensor,
        g_anchors: Tensor,
        g_positives: Tensor,
        g_negatives: Tensor,
        rows: range,
    ) -> Tensor:
        """Per-anchor cross-entropy for the ``rows`` anchors."""
        n_groups = anchors.shape[0]
        device = anchors.device
        sel = slice(rows.start, rows.stop)
        # Documents as [all positives; all negatives]: the cross-entropy does not depend on
        # the column order, and anchor i's target is then column i (its global index).
        docs = torch.cat([positives, negatives], dim=0)
        target = torch.arange(rows.start, rows.stop, device=device)
        own = torch.arange(docs.shape[0], device=device)[None, :] == target[:, None]  # [b, B + M]
        self_col = own[:, :n_groups]

        with torch.no_grad():  # the guide only chooses candidates
            g_docs = torch.cat([g_positives, g_negatives], dim=0).to(g_anchors.device)
            g_qd = g_anchors[sel] @ g_docs.T
            g_pos = g_qd.gather(1, target[:, None].to(g_qd.device))
            if self.margin_strategy == "absolute":
                threshold = g_pos - self.margin
            else:
                threshold = g_pos * (1 - self.margin)
            drop_qd = (g_qd > threshold).to(device) & ~own

        blocks = [(anchors[sel] @ docs.T).masked_fill(drop_qd, NEG_INF)]
        if self.contrast_anchors:
            with torch.no_grad():
                drop_qq = (g_anchors[sel] @ g_anchors.T > threshold).to(device) | self_col
            blocks.append((anchors[sel] @ anchors.T).masked_fill(drop_qq, NEG_INF))
        if self.contrast_positives:
            with torch.no_grad():
                drop_pp = (g_positives[sel] @ g_positives.T > threshold).to(device) | self_col
            blocks.append((positives[sel] @ positives.T).masked_fill(drop_pp, NEG_INF))
        logits = torch.cat(blocks, dim=1) / self.temperature
        return F.cross_entropy(logits, target, reduction="none")
