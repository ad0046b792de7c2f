"""Losses, named as ms-swift names them (``--loss_type``).

Every loss is called as ``loss(outputs, labels) -> scalar tensor`` with
``outputs["last_hidden_state"]`` the L2-normalized embeddings ``[N, D]`` in ms-swift's
layout (see each class). :func:`build_loss` builds one by name.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .config import InfoNCEConfig
from .infonce import InfoNCELoss, select_hard_negatives, split_groups
from .pairs import ContrastiveLoss, CosineSimilarityLoss, OnlineContrastiveLoss, split_pairs

LOSSES: dict[str, type[nn.Module]] = {
    "infonce": InfoNCELoss,
    "cosine_similarity": CosineSimilarityLoss,
    "contrastive": ContrastiveLoss,
    "online_contrastive": OnlineContrastiveLoss,
}


def build_loss(name: str, **options: Any) -> nn.Module:
    """Build the loss ms-swift calls ``name``.

    Args:
        name: One of :data:`LOSSES` (``infonce``, ``cosine_similarity``,
            ``contrastive``, ``online_contrastive``).
        **options: The loss's settings. For ``infonce`` the ``INFONCE_*`` environment
            variables are read now, as ms-swift does, and ``options`` (fields of
            :class:`InfoNCEConfig`, plus ``generator``) override them. For the contrastive
            losses: ``margin``.

    Returns:
        An ``nn.Module`` called as ``loss(outputs, labels) -> scalar tensor``.

    Raises:
        ValueError: An unknown name or option, or an invalid value.

    Example:
        ::

            from mmembed.losses import build_loss

            loss_fn = build_loss("infonce", temperature=0.05)
            loss = loss_fn({"last_hidden_state": embeddings}, labels)
    """
    try:
        cls = LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; known: {', '.join(LOSSES)}") from None
    try:
        return cls.build(**options)
    except TypeError as exc:  # an option the constructor does not take
        raise ValueError(f"loss {name!r}: {exc}") from None


__all__ = [
    "LOSSES",
    "ContrastiveLoss",
    "CosineSimilarityLoss",
    "InfoNCEConfig",
    "InfoNCELoss",
    "OnlineContrastiveLoss",
    "build_loss",
    "select_hard_negatives",
    "split_groups",
    "split_pairs",
]
