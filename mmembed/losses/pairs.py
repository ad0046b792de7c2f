"""Pair losses, as ms-swift's ``cosine_similarity``, ``contrastive`` and ``online_contrastive``.

The batch layout is ms-swift's: the rows of ``outputs["last_hidden_state"]`` alternate
sentence1, sentence2 (``s1_0, s2_0, s1_1, s2_1, ...``) and ``labels`` holds one score per
pair. All three use the cosine of the two embeddings of a pair.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from ..data.labels import LabelRule
from ..encoding.layout import Layout, split_pair_rows
from .base import CrossProcess, EmbeddingLoss, finite_number


def split_pairs(outputs: Mapping[str, Tensor], labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Split an alternating pair batch into its two sides.

    Args:
        outputs: ``{"last_hidden_state": [2P, D]}``, rows ``s1_0, s2_0, s1_1, s2_1, ...``.
        labels: ``[P]``, one score per pair.

    Returns:
        ``(sentence1 [P, D], sentence2 [P, D], labels [P])``, the labels in the
        embeddings' dtype and device.

    Raises:
        ValueError: The embeddings are not 2-D with an even number of rows, or the
            number of labels is not the number of pairs
            (:func:`mmembed.encoding.layout.split_pair_rows`).
    """
    emb = outputs["last_hidden_state"]
    s1, s2 = split_pair_rows(emb, labels.numel())
    return s1, s2, labels.reshape(-1).to(device=emb.device, dtype=emb.dtype)


def _binary(labels: Tensor, loss_name: str) -> None:
    bad = (labels != 0) & (labels != 1)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"{loss_name} labels must be 0 or 1; label {i} is {labels[i].item()}")


class _PairLoss(EmbeddingLoss):
    """Pairs ``s1, s2`` with one score each; a pair's loss involves only its own pair."""

    layout = Layout.PAIR
    cross_process = CrossProcess.LOCAL_PAIRS


class _MarginPairLoss(_PairLoss):
    """A pair loss on cosine distance with a margin for the dissimilar pairs."""

    def __init__(self, margin: float = 0.5) -> None:
        super().__init__()
        self.margin = finite_number(type(self).__name__, "margin", margin, minimum=0)

    def extra_repr(self) -> str:
        return f"margin={self.margin}"


class CosineSimilarityLoss(_PairLoss):
    """Mean squared error between the cosine of each pair and its label.

    ``loss = mean_i (cos(s1_i, s2_i) - y_i)^2``

    Inputs:
        +-------------------------------------------+--------------------------------+
        | outputs["last_hidden_state"]              | labels                         |
        +===========================================+================================+
        | ``[2P, D]``: ``s1_0, s2_0, s1_1, ...``    | ``[P]`` float score, e.g. 0..1 |
        +-------------------------------------------+--------------------------------+

    References:
        sentence-transformers ``CosineSimilarityLoss``; ms-swift ``cosine_similarity``.

    Example:
        ::

            import torch
            from mmembed.losses import build_loss

            loss_fn = build_loss("cosine_similarity")
            emb = torch.nn.functional.normalize(torch.randn(4, 8), dim=-1)  # 2 pairs
            loss = loss_fn({"last_hidden_state": emb}, torch.tensor([0.9, 0.1]))
    """

    #: the cosine of a pair lies in [-1, 1], so a label outside it cannot be fitted
    #: (STS-B's 0-5 scores are the usual case: scale them to 0-1)
    label_rule = LabelRule("cosine_similarity", low=-1.0, high=1.0,
                       meaning="the target of the pair's cosine, which lies in [-1, 1]; scale 0-5 scores to 0-1")

    def forward(self, outputs: Mapping[str, Tensor], labels: Tensor) -> Tensor:
        """Scalar loss; see the class docstring for the layout."""
        s1, s2, y = split_pairs(outputs, labels)
        return F.mse_loss(F.cosine_similarity(s1, s2), y)


class ContrastiveLoss(_MarginPairLoss):
    """Contrastive loss on cosine distance: pull positives together, push negatives past a margin.

    With ``d = 1 - cos(s1, s2)``:
    ``loss = mean_i 0.5 * (y_i d_i^2 + (1 - y_i) relu(margin - d_i)^2)``

    Args:
        margin: Negatives closer than this cosine distance are penalized (ms-swift: 0.5).

    Inputs:
        +-------------------------------------------+------------------------------------+
        | outputs["last_hidden_state"]              | labels                             |
        +===========================================+====================================+
        | ``[2P, D]``: ``s1_0, s2_0, s1_1, ...``    | ``[P]``: 1 similar, 0 dissimilar   |
        +-------------------------------------------+------------------------------------+

    References:
        Hadsell, Chopra, LeCun, *Dimensionality Reduction by Learning an Invariant
        Mapping*, CVPR 2006; ms-swift ``contrastive``.

    Example:
        ::

            loss_fn = build_loss("contrastive")
            loss = loss_fn({"last_hidden_state": emb}, torch.tensor([1.0, 0.0]))
    """

    label_rule = LabelRule("contrastive", values=(0.0, 1.0), meaning="1 similar, 0 dissimilar")

    def forward(self, outputs: Mapping[str, Tensor], labels: Tensor) -> Tensor:
        """Scalar loss; see the class docstring for the layout."""
        s1, s2, y = split_pairs(outputs, labels)
        _binary(y, "contrastive")
        d = 1 - F.cosine_similarity(s1, s2)
        return (0.5 * (y * d.pow(2) + (1 - y) * F.relu(self.margin - d).pow(2))).mean()


class OnlineContrastiveLoss(_MarginPairLoss):
    """Contrastive loss on the hard pairs of the batch only.

    With ``d = 1 - cos(s1, s2)``, the kept pairs are the negatives closer than the
    farthest positive (``d < max d_pos``) and the positives farther than the closest
    negative (``d > min d_neg``);
    ``loss = sum_{kept positives} d^2 + sum_{kept negatives} relu(margin - d)^2`` (a sum,
    not a mean).

    As in ms-swift (and sentence-transformers, where it comes from): when the batch has
    at most one positive, negatives are kept if closer than the mean negative distance
    instead; when it has at most one negative, positives are kept if farther than the
    mean positive distance.

    Args:
        margin: Negatives closer than this cosine distance are penalized (ms-swift: 0.5).

    Inputs:
        +-------------------------------------------+------------------------------------+
        | outputs["last_hidden_state"]              | labels                             |
        +===========================================+====================================+
        | ``[2P, D]``: ``s1_0, s2_0, s1_1, ...``    | ``[P]``: 1 similar, 0 dissimilar   |
        +-------------------------------------------+------------------------------------+

    References:
        sentence-transformers ``OnlineContrastiveLoss``; ms-swift ``online_contrastive``.

    Example:
        ::

            loss_fn = build_loss("online_contrastive")
            loss = loss_fn({"last_hidden_state": emb}, torch.tensor([1.0, 0.0]))
    """

    #: which pairs count depends on statistics of the whole batch
    cross_process = CrossProcess.WHOLE_BATCH
    label_rule = LabelRule("online_contrastive", values=(0.0, 1.0), meaning="1 similar, 0 dissimilar")

    def forward(self, outputs: Mapping[str, Tensor], labels: Tensor) -> Tensor:
        """Scalar loss; see the class docstring for the layout."""
        s1, s2, y = split_pairs(outputs, labels)
        _binary(y, "online_contrastive")
        d = 1 - F.cosine_similarity(s1, s2)
        neg, pos = d[y == 0], d[y == 1]
        with torch.no_grad():  # the thresholds only choose pairs
            neg_bound = pos.max() if pos.numel() > 1 else neg.mean()
            pos_bound = neg.min() if neg.numel() > 1 else pos.mean()
        hard_neg = neg[neg < neg_bound]
        hard_pos = pos[pos > pos_bound]
        return hard_pos.pow(2).sum() + F.relu(self.margin - hard_neg).pow(2).sum()
