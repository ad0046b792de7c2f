"""The one place where loss names mean something: ms-swift's names (and mmembed's own) to
classes, a user's own losses added with :func:`register_loss`, or named as
``package.module:ClassName``. The Matryoshka wrapper builds its inner loss by name here, so
it registers itself (``matryoshka.py``) instead of being imported here."""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from ..task import task_of_loss
from .base import EmbeddingLoss
from .distill import DistillCosineLoss, DistillKLLoss, DistillMarginalLoss, DistillMSELoss
from .gist import GISTLoss
from .infonce import InfoNCELoss
from .late_interaction import LATE_INTERACTION_LOSSES
from .pairs import ContrastiveLoss, CosineSimilarityLoss, OnlineContrastiveLoss

LOSSES: dict[str, type[EmbeddingLoss]] = {
    "infonce": InfoNCELoss,
    "cosine_similarity": CosineSimilarityLoss,
    "contrastive": ContrastiveLoss,
    "online_contrastive": OnlineContrastiveLoss,
    "gist": GISTLoss,
    "distill_cosine": DistillCosineLoss,
    "distill_mse": DistillMSELoss,
    "distill_marginal": DistillMarginalLoss,
    "distill_kl": DistillKLLoss,
    # late interaction (ColBERT / ColPali): [N, L, D] token vectors scored by MaxSim
    **LATE_INTERACTION_LOSSES,
}  # and "matryoshka": MatryoshkaLoss, registered by mmembed.losses.matryoshka


def register_loss(name: str, cls: type[EmbeddingLoss] | None = None):
    """Make ``--loss_type name`` (and ``build_loss(name)``) build ``cls``, a subclass of
    :class:`~mmembed.losses.base.EmbeddingLoss`; returns ``cls``. Without ``cls``, a
    decorator::

        @register_loss("my_loss")
        class MyLoss(EmbeddingLoss): ...

    Raises:
        ValueError: ``name`` is taken by another class, or ``cls`` is not an ``EmbeddingLoss``.
    """
    if cls is None:
        return lambda c: register_loss(name, c)
    if not (isinstance(cls, type) and issubclass(cls, EmbeddingLoss)):
        raise ValueError(f"register_loss({name!r}, ...): {cls!r} is not a subclass of mmembed.losses.EmbeddingLoss")
    if not name or ":" in name:
        raise ValueError(f"register_loss: {name!r} is not a usable loss name (no ':', not empty)")
    if LOSSES.get(name, cls) is not cls:
        raise ValueError(f"register_loss: the name {name!r} is taken by {LOSSES[name].__name__}")
    LOSSES[name] = cls
    return cls


def loss_class(name: str) -> type[EmbeddingLoss]:
    """The class ``--loss_type name`` builds: a registered name, or ``package.module:ClassName``
    (imported now; the module may call :func:`register_loss` itself).

    Raises:
        ValueError: an unknown name, a module that does not import, or a class that is not
            an ``EmbeddingLoss``.
    """
    if name in LOSSES:
        return LOSSES[name]
    owner = task_of_loss(name)
    if owner is not None:
        raise ValueError(f"loss {name!r} is {owner.article} loss (--task_type {owner.name}), built by its task's "
                         f"package ({type(owner).__module__})")
    if ":" not in name:
        known = ", ".join(n for n in LOSSES if n != "matryoshka")
        raise ValueError(f"unknown loss {name!r}; known: {known} (Matryoshka: --mrl_dims; "
                         "your own: package.module:ClassName)")
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"loss {name!r}: cannot import {module_name!r} ({e})") from None
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, EmbeddingLoss)):
        raise ValueError(f"loss {name!r}: {module_name}.{attr} is not a subclass of mmembed.losses.EmbeddingLoss")
    return cls


def build_loss(name: str, **options: Any) -> nn.Module:
    """Build the loss ms-swift calls ``name``.

    Args:
        name: One of :data:`LOSSES` (or ``package.module:ClassName``): ms-swift's ``infonce``, ``cosine_similarity``,
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
            - ``late_interaction_infonce``: as ``infonce`` (``INFONCE_*``), plus
              ``normalize_scores`` (False) and ``chunk``; ``infonce`` itself also takes
              ``similarity=MaxSim(...)`` (:mod:`mmembed.losses.maxsim`).
            - ``colbert_pairwise_ce``: ``temperature`` (1.0), ``normalize_scores`` (True),
              ``chunk``. ``colbert_negative_ce``, ``colbert_pairwise_negative_ce``:
              ``temperature`` (0.02), ``normalize_scores`` (True), ``in_batch_term_weight``
              (0.5), ``chunk`` (colpali-engine's; :mod:`mmembed.losses.late_interaction`).
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
    cls = loss_class(name)
    accepted = cls.option_names()
    unknown = sorted(set(options) - accepted) if accepted is not None else []
    if unknown:
        raise ValueError(f"loss {name!r} takes no option {', '.join(map(repr, unknown))}; its options: "
                         f"{', '.join(sorted(accepted)) or 'none'}")
    try:
        return cls.build(**options)
    except TypeError as exc:  # an option the constructor does not take
        raise ValueError(f"loss {name!r}: {exc}") from None
