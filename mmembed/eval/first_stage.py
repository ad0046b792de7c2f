"""First-stage retrieval scorers: what finds the candidates ``mmembed mine`` mines from and a
reranker's ``--eval_beir`` reorders.

- :func:`bm25_scorer`: BM25 over a list of texts (``bm25s`` with its defaults: the Lucene
  variant, k1 = 1.5, b = 0.75; texts lower-cased and split by ``bm25s.tokenize`` with English
  stopwords);
- :func:`dense_scorer`: dot products of normalized embeddings.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["Scorer", "bm25_scorer", "dense_scorer"]

#: ``score(query_indices [B]) -> [B, documents]``
Scorer = Callable[[np.ndarray], np.ndarray]


def _bm25_tokenize(texts: Sequence[str]) -> list[list[str]]:
    import bm25s

    return bm25s.tokenize(list(texts), stopwords="en", return_ids=False, show_progress=False)


def bm25_scorer(queries: Sequence[str], docs: Sequence[str]) -> Scorer:
    """BM25 scores (``bm25s`` defaults) of ``queries`` against ``docs``."""
    import bm25s

    logging.getLogger("bm25s").setLevel(logging.WARNING)  # bm25s sets its own logger to DEBUG on import
    index = bm25s.BM25()
    index.index(_bm25_tokenize(docs), show_progress=False)
    query_ids = [index.get_tokens_ids(tokens) for tokens in _bm25_tokenize(queries)]

    def score(ids: np.ndarray) -> np.ndarray:
        out = np.zeros((len(ids), len(docs)), dtype=np.float64)
        for row, q in enumerate(ids):
            if query_ids[q]:
                out[row] = index.get_scores_from_ids(query_ids[q])
        return out

    return score


def dense_scorer(query_emb: np.ndarray, doc_emb: np.ndarray) -> Scorer:
    """Dot products of normalized embeddings (``[Q, D]`` and ``[C, D]``)."""

    def score(ids: np.ndarray) -> np.ndarray:
        return (query_emb[ids] @ doc_emb.T).astype(np.float64)

    return score
