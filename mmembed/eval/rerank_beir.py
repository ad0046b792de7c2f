"""A reranker on a BEIR folder: BM25 (or an embedding model: ``--eval_beir_first_stage``) finds
each query's first ``depth`` candidates in the whole corpus, the reranker orders them, and the graded metrics of :mod:`mmembed.eval.ranking` are
taken of both orders, so a run logs what reranking adds to the first stage:
``ndcg@10`` / ``mrr@10`` / ``recall@10`` after reranking and ``ndcg@10_bm25`` /
``mrr@10_bm25`` / ``recall@10_bm25`` of BM25's own order (``_embedder`` for an embedding model's) (the documents past ``depth`` are
never candidates: a relevant one there counts as missed in both).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .beir import BeirData
from .first_stage import Scorer, bm25_scorer
from .ranking import ranking_metrics, top_k

__all__ = ["DEPTH", "rerank_beir"]

#: candidates per query that BM25 hands to the reranker
DEPTH = 100
#: queries whose BM25 rows are held at once ([queries, corpus] float64)
_QUERY_BLOCK = 64


def rerank_beir(score_pairs: Callable[[Sequence[tuple[str, str]]], np.ndarray], data: BeirData,
                depth: int = DEPTH, query_system: str | None = None, first_stage: Scorer | None = None,
                first_stage_name: str = "bm25") -> dict[str, float]:
    """The metrics of the module docstring. ``score_pairs([(query, document), ...])`` gives the
    reranker's scores (higher: more relevant); ``query_system``: an instruction for every
    pair (None: the reranker's own); ``first_stage``: another first stage (a
    :func:`~mmembed.eval.first_stage.dense_scorer` of an embedding model's vectors of the
    queries and the corpus), whose metrics are suffixed ``first_stage_name``; None: BM25."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    scorer = first_stage or bm25_scorer(data.query_texts, data.doc_texts)
    first: list[np.ndarray] = []
    for start in range(0, len(data.query_ids), _QUERY_BLOCK):
        ids = np.arange(start, min(start + _QUERY_BLOCK, len(data.query_ids)))
        first.extend(top_k(scorer(ids), depth))
    pairs = [((data.query_texts[q] if query_system is None else {"text": data.query_texts[q], "system": query_system}),
              data.doc_texts[d]) for q, cands in enumerate(first) for d in cands]
    scores = np.asarray(score_pairs(pairs), dtype=np.float64) if pairs else np.zeros(0)
    reranked, offset = [], 0
    for cands in first:
        own = scores[offset:offset + len(cands)]
        offset += len(cands)
        reranked.append(cands[np.argsort(-own, kind="stable")])  # equal scores keep BM25's order
    relevance = [data.qrels[q] for q in data.query_ids]
    names = lambda ranked: [[data.doc_ids[d] for d in row] for row in ranked]  # noqa: E731
    after = ranking_metrics(names(reranked), relevance, ks=(10,))
    before = ranking_metrics(names(first), relevance, ks=(10,))
    return {**after, **{f"{k}_{first_stage_name}": v for k, v in before.items()},
            "num_queries": float(len(data.query_ids))}
