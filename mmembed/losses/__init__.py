"""Losses, named as ms-swift names them (``--loss_type``).

Every loss is called as ``loss(outputs, labels) -> scalar tensor`` with
``outputs["last_hidden_state"]`` the L2-normalized embeddings ``[N, D]`` in ms-swift's
layout (see each class). :func:`build_loss` builds one by name. Besides ms-swift's losses
there are mmembed's own: ``gist`` (negatives vetted by a guide model), distillation from
a teacher (``distill_cosine``, ``distill_mse``, ``distill_marginal``, ``distill_kl``) and
the ``matryoshka`` wrapper (ms-swift's ``--mrl_dims``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .config import InfoNCEConfig
from .distill import DistillCosineLoss, DistillKLLoss, DistillMarginalLoss, DistillMSELoss
from .gist import GISTLoss
from .infonce import InfoNCELoss, select_hard_negatives, split_groups
from .matryoshka import MatryoshkaLoss
from .pairs import ContrastiveLoss, CosineSimilarityLoss, OnlineContrastiveLoss, split_pairs

LOSSES: dict[str, type[nn.Module]] = {
    "infonce": InfoNCELoss,
    "cosine_similarity": CosineSimilarityLoss,
    "contrastive": ContrastiveLoss,
    "online_contrastive": OnlineContrastiveLoss,
    "gist": GISTLoss,
    "distill_cosine": DistillCosineLoss,
    "distill_mse": DistillMSELoss,
    "distill_marginal": DistillMarginalLoss,
    "distill_kl": DistillKLLoss,
    "matryoshka": MatryoshkaLoss,
}


def build_loss(name: str, **options: Any) -> nn.Module:
    """Build the loss ms-swift calls ``name``.

    Args:
        name: One of :data:`LOSSES`: ms-swift's ``infonce``, ``cosine_similarity``,
            ``contrastive``, ``online_contrastive``; mmembed's ``gist``,
            ``distill_cosine``, ``distill_mse``, ``distill_marginal``, ``distill_kl``,
            ``matryoshka``.
        **options: The loss's settings (its class's constructor arguments):

            - ``infonce``: the ``INFONCE_*`` environment variables are read now, as
              ms-swift does, and ``options`` (fields of :class:`InfoNCEConfig`, plus
              ``generator``) override them.
            - ``contrastive``, ``online_contrastive``: ``margin``.
            - ``gist``: ``temperature`` (default ``INFONCE_TEMPERATURE`` if set, else
              0.01), ``margin`` (0.0), ``margin_strategy`` (``"absolute"`` /
              ``"relative"``), ``contrast_anchors``, ``contrast_positives`` (True).
            - ``distill_cosine``, ``distill_mse``: none. ``distill_marginal``: ``lam``
              (0.1), ``distance`` (``"cosine"`` / ``"mse"``).
            - ``distill_kl``: ``temperature`` (0.1), ``teacher_temperature`` (None:
              the same), ``use_batch`` (True).
            - ``matryoshka``: ``dims`` (``{width: weight}`` or its JSON text),
              ``inner`` (a loss name, default ``"infonce"``, or a module), and the
              inner loss's options.

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
    "DistillCosineLoss",
    "DistillKLLoss",
    "DistillMSELoss",
    "DistillMarginalLoss",
    "GISTLoss",
    "InfoNCEConfig",
    "InfoNCELoss",
    "MatryoshkaLoss",
    "OnlineContrastiveLoss",
    "build_loss",
    "select_hard_negatives",
    "split_groups",
    "split_pairs",
]
