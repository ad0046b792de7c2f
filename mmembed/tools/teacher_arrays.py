"""``mmembed embed --teacher_arrays``: a teacher's embeddings and scores of every row of a
training file, aligned with its rows, for ``--teacher_embeddings_file`` /
``--teacher_scores_file``."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..data.reader import read_file
from ..encoding.collator import item_origins, sample_items
from ..encoding.layout import Layout


def teacher_arrays(embedder: Any, path: str, batch_size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """A teacher's view of every row of a training file, as ``--teacher_embeddings_file``
    and ``--teacher_scores_file`` take it (``mmembed embed --teacher_arrays``).

    ``embedder``: anything with ``encode(items, batch_size=, origins=) -> [n, D]``
    L2-normalized (an :class:`~mmembed.model.embedder.Embedder` of the teacher).

    Returns:
        ``(embeddings [rows, 2 + K, D], scores [rows, 1 + K])`` float32, ``K`` the most
        negatives of a row, NaN past each row's own members. ``scores[r, j]`` is the dot
        product of row ``r``'s anchor with its positive (``j = 0``) and its negatives.

    Raises:
        DataError: the first row the reader refuses (every row needs its slot).
    """
    samples = read_file(path)
    items, origins, sizes = [], [], []
    for s in samples:
        its, _ = sample_items(s, Layout.GROUP)
        items += its
        origins += item_origins(s, Layout.GROUP)
        sizes.append(len(its))
    flat = np.asarray(embedder.encode(items, batch_size=batch_size, origins=origins), dtype=np.float32)
    width = max(sizes, default=2)
    emb = np.full((len(samples), width, flat.shape[1] if flat.ndim == 2 else 0), np.nan, dtype=np.float32)
    scores = np.full((len(samples), width - 1), np.nan, dtype=np.float32)
    at = 0
    for r, n in enumerate(sizes):
        rows = flat[at: at + n]
        at += n
        emb[r, :n] = rows
        scores[r, : n - 1] = rows[1:] @ rows[0]
    return emb, scores
