"""The row layout of a batch: ms-swift's two, named by :class:`Layout`, and the one rule that
splits each into its parts.

- :attr:`Layout.GROUP`: rows ``a0, p0, n0_0, ..., a1, p1, n1_0, ...`` (anchor, positive, any
  number of negatives per group, none included) and ``labels`` ``[N - B]``, one per
  non-anchor row: 1.0 for the positive, 0.0 for each negative. Each 1.0 starts a group.
  :func:`split_groups` finds the rows (torch); :func:`split_groups_numpy` is the same rule on
  numpy arrays (it calls :func:`split_groups`), so the evaluation and the losses cannot read
  a batch differently, and raise the same errors.
- :attr:`Layout.PAIR`: rows ``s1_0, s2_0, s1_1, s2_1, ...`` and ``labels`` ``[P]``, one score
  per pair. :func:`split_pair_rows` splits them (torch tensors or numpy arrays alike).
- :attr:`Layout.RERANK`: a reranker's batch, one row per (query, document) pair (the pair is
  one model input), ``labels`` ``[N]`` 1.0 / 0.0; built by
  :class:`~mmembed.tasks.reranker.inputs.RerankCollator`.

The collator builds batches in these layouts (``encoding.collator``), the losses read them
(``mmembed.losses``), the evaluation and the charts score them (``eval.metrics``,
``training.charts``); this module is below all of them, so each imports the one rule.
"""

from __future__ import annotations

import enum
from typing import TypeVar

import numpy as np
import torch
from torch import Tensor


class Layout(str, enum.Enum):
    """The row layout of a batch (ms-swift's two)."""

    #: rows ``a0, p0, n0_0, ..., a1, p1, ...``; labels ``[N - B]``: 1.0 per positive, 0.0 per negative
    GROUP = "group"
    #: rows ``s1_0, s2_0, s1_1, s2_1, ...``; labels ``[P]``: one score per pair
    PAIR = "pair"
    #: a reranker's batch: one row per scored (query, document) pair, ``pos, its negatives...,
    #: pos, ...``; labels ``[N]``: 1.0 per positive pair, 0.0 per negative pair (and the
    #: batch's ``group_ids``); see :mod:`mmembed.tasks.reranker.inputs`
    RERANK = "rerank"


def split_groups(labels: Tensor, n_rows: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Find the anchor, positive and negative rows of a group batch from its labels.

    The rows are ``a0, p0, n0_0, ..., n0_k0, a1, p1, n1_0, ...``; ``labels`` has one entry
    per non-anchor row, 1.0 for a positive and 0.0 for a negative, so each 1.0 starts a
    new group.

    Args:
        labels: Float tensor ``[n_rows - B]`` of 1.0 / 0.0, where ``B`` is the number of
            1.0 entries (the number of groups).
        n_rows: ``N``, the number of embedding rows.

    Returns:
        ``(anchor_idx [B], pos_idx [B], neg_idx [M], neg_group [M])``: long tensors on
        ``labels.device``. ``anchor_idx[g]`` and ``pos_idx[g]`` are the rows of group
        ``g``'s anchor and positive, ``neg_idx`` the rows of all ``M`` negatives in
        group order and ``neg_group`` the group of each (non-decreasing).

    Raises:
        ValueError: ``labels`` is not 1-D, is empty, holds a value other than 0 or 1, holds
            no positive, its length is not ``n_rows - B``, or it starts with a negative (a
            group without a positive); checked in that order.

    Example:
        ::

            # a0 p0 n0_0 n0_1 | a1 p1 | a2 p2 n2_0
            labels = torch.tensor([1.0, 0, 0, 1, 1, 0])
            anchor_idx, pos_idx, neg_idx, neg_group = split_groups(labels, 9)
            # anchor_idx = [0, 4, 6], pos_idx = [1, 5, 7]
            # neg_idx = [2, 3, 8], neg_group = [0, 0, 2]
    """
    if labels.dim() != 1:
        raise ValueError(f"InfoNCE labels must be 1-D [N - B], got shape {tuple(labels.shape)}")
    if labels.numel() == 0:
        raise ValueError("InfoNCE labels are empty, so there is no group (each group needs a positive)")
    is_pos = labels == 1
    is_neg = labels == 0
    bad = ~(is_pos | is_neg)
    # one device-to-host copy for all the checks
    n_bad, n_groups, starts_with_pos = torch.stack([bad.sum(), is_pos.sum(), is_pos[0].long()]).tolist()
    if n_bad:
        i = int(bad.nonzero()[0])
        raise ValueError(f"InfoNCE labels must be 1.0 (positive) or 0.0 (negative); labels[{i}] = {labels[i].item()}")
    if n_groups == 0:
        raise ValueError("InfoNCE labels hold no 1.0 entry, so there is no group (each group needs a positive)")
    if labels.numel() + n_groups != n_rows:
        raise ValueError(
            f"InfoNCE labels have {labels.numel()} entries and {n_groups} positives, so the batch must have "
            f"{labels.numel() + n_groups} rows (one anchor per group plus one row per label), but it has {n_rows}"
        )
    if not starts_with_pos:
        raise ValueError(
            "InfoNCE labels must start with a 1.0: each group is anchor, positive, then negatives, "
            "so the first labelled row cannot be a negative (group 0 has no positive)"
        )
    group = torch.cumsum(is_pos.long(), 0) - 1  # group of each labelled row
    # labelled row k sits after the anchors of groups 0..group[k]
    row = torch.arange(labels.numel(), device=labels.device) + group + 1
    pos_idx = row[is_pos]
    return pos_idx - 1, pos_idx, row[is_neg], group[is_neg]


def split_groups_numpy(labels: np.ndarray, n_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`split_groups` on a numpy array: the same rule (it is called on a copy of
    ``labels`` as a float64 tensor) and the same errors.

    Returns:
        ``(anchor_idx [B], pos_idx [B], neg_idx [M], neg_group [M])`` as int64 arrays.
    """
    # a copy: torch.from_numpy shares memory and warns on a read-only array; labels are small
    tensor = torch.from_numpy(np.array(labels, dtype=np.float64))
    return tuple(t.numpy() for t in split_groups(tensor, n_rows))  # type: ignore[return-value]


Rows = TypeVar("Rows", Tensor, np.ndarray)


def split_pair_rows(rows: Rows, n_labels: int) -> tuple[Rows, Rows]:
    """Split a pair batch's rows ``s1_0, s2_0, s1_1, s2_1, ...`` into its two sides.

    Args:
        rows: ``[2P, D]``, a torch tensor or a numpy array.
        n_labels: The number of labels, which must be ``P`` (one score per pair).

    Returns:
        ``(sentence1 [P, D], sentence2 [P, D])``, views of ``rows``.

    Raises:
        ValueError: ``rows`` is not 2-D with an even number of rows, or ``n_labels`` is
            not the number of pairs.
    """
    if rows.ndim != 2 or rows.shape[0] % 2:
        raise ValueError(
            f"pair losses expect last_hidden_state [2 * n_pairs, D] (rows alternate sentence1, sentence2), "
            f"got shape {tuple(rows.shape)}"
        )
    n_pairs = rows.shape[0] // 2
    if n_labels != n_pairs:
        raise ValueError(f"pair losses expect one label per pair: {n_pairs} pairs but {n_labels} labels")
    return rows[0::2], rows[1::2]
