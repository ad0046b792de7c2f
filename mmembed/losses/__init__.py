"""Losses, named as ms-swift names them (``--loss_type``).

Every loss is called as ``loss(outputs, labels) -> scalar tensor`` with
``outputs["last_hidden_state"]`` the L2-normalized embeddings ``[N, D]`` in ms-swift's
layout (see each class). :func:`build_loss` builds one by name. Besides ms-swift's losses
there are mmembed's own: ``gist`` (negatives vetted by a guide model), distillation from
a teacher (``distill_cosine``, ``distill_mse``, ``distill_marginal``, ``distill_kl``) and
the ``matryoshka`` wrapper (ms-swift's ``--mrl_dims``), and the late-interaction losses of
``[N, L, D]`` token vectors scored by MaxSim (:mod:`mmembed.losses.late_interaction`,
:mod:`mmembed.losses.maxsim`). The reranker losses
(``pointwise_reranker``, ``listwise_reranker``) take a score per pair instead
(:mod:`mmembed.tasks.reranker.losses`, ``build_rerank_loss``).

The batch layouts (:class:`Layout`) and their splitters (:func:`split_groups`) live in
:mod:`mmembed.encoding.layout`, below the losses; they are exported here as well.
"""

from __future__ import annotations

from ..encoding.layout import Layout, split_groups
from .base import CrossProcess, EmbeddingLoss, Groups, Setup, Side, SideNeeds, WrapperLoss, as_groups
from .config import InfoNCEConfig
from .distill import DistillCosineLoss, DistillKLLoss, DistillMarginalLoss, DistillMSELoss
from .gist import GISTLoss
from .infonce import InfoNCELoss, select_hard_negatives
from .late_interaction import (
    ColbertNegativeCELoss,
    ColbertPairwiseCELoss,
    ColbertPairwiseNegativeCELoss,
    LateInteractionInfoNCELoss,
)
from .matryoshka import MatryoshkaLoss
from .maxsim import DOT, MaxSim, Similarity, maxsim, maxsim_pairs, trim_tokens
from .pairs import ContrastiveLoss, CosineSimilarityLoss, OnlineContrastiveLoss, split_pairs
from .parts import GroupParts, RowParts, SideRows
from .registry import LOSSES, build_loss, loss_class, register_loss

__all__ = [
    "DOT",
    "LOSSES",
    "ContrastiveLoss",
    "ColbertNegativeCELoss",
    "ColbertPairwiseCELoss",
    "ColbertPairwiseNegativeCELoss",
    "CosineSimilarityLoss",
    "CrossProcess",
    "DistillCosineLoss",
    "DistillKLLoss",
    "DistillMSELoss",
    "DistillMarginalLoss",
    "EmbeddingLoss",
    "GISTLoss",
    "GroupParts",
    "Groups",
    "InfoNCEConfig",
    "InfoNCELoss",
    "LateInteractionInfoNCELoss",
    "Layout",
    "MatryoshkaLoss",
    "MaxSim",
    "OnlineContrastiveLoss",
    "RowParts",
    "Setup",
    "Side",
    "SideNeeds",
    "SideRows",
    "Similarity",
    "WrapperLoss",
    "as_groups",
    "build_loss",
    "loss_class",
    "maxsim",
    "maxsim_pairs",
    "register_loss",
    "select_hard_negatives",
    "split_groups",
    "split_pairs",
    "trim_tokens",
]
