"""Evaluation tasks on files: STS correlation and pair retrieval from scored pairs.

``evaluate_pairs_file(embedder, path)`` reads rows ``{"query", "response", "label"}``
(label in [0, 1]; the bundled ``stsb_test_scored.jsonl`` is STS-B test with score / 5) and
reports:

- ``spearman_cosine`` / ``pearson_cosine`` (and ms-swift's other pair metrics) of the label
  against the cosine similarity of each pair;
- retrieval: every pair whose label is at least ``positive_threshold`` (0.75, i.e. STS-B
  score >= 3.75) is a query; its ``query`` text searches all distinct ``response`` texts of
  the file, and the relevant document is its own response: recall@1/5/10, MRR@10, nDCG@10.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..data import DataError, read_file
from .metrics import pair_metrics, retrieval_metrics


def evaluate_pairs(embed, queries: list[str], responses: list[str], labels: list[float], positive_threshold: float = 0.75) -> dict[str, float]:
    """``embed(list_of_texts) -> [n, D]`` normalized; see the module docstring for the metrics."""
    if not (len(queries) == len(responses) == len(labels)) or not queries:
        raise ValueError("evaluate_pairs needs equally long, non-empty queries, responses and labels")
    docs = sorted(set(responses))
    doc_index = {d: i for i, d in enumerate(docs)}
    unique_queries = sorted(set(queries))
    q_index = {q: i for i, q in enumerate(unique_queries)}
    emb = embed(unique_queries + docs)
    q_emb, d_emb = emb[: len(unique_queries)], emb[len(unique_queries):]
    e1 = q_emb[[q_index[q] for q in queries]]
    e2 = d_emb[[doc_index[r] for r in responses]]
    metrics: dict[str, float] = dict(pair_metrics(e1, e2, np.asarray(labels, dtype=np.float64)))
    pos = [i for i, y in enumerate(labels) if y >= positive_threshold]
    if pos:
        ret = retrieval_metrics(q_emb[[q_index[queries[i]] for i in pos]], d_emb, [{doc_index[responses[i]]} for i in pos])
        metrics.update(ret)
        metrics["retrieval_queries"] = float(len(pos))
        metrics["retrieval_corpus"] = float(len(docs))
    return metrics


def read_pairs(path: str) -> tuple[list[str], list[str], list[float]]:
    """``(queries, responses, labels)`` of a scored-pairs file (any format mmembed reads).

    Raises:
        DataError: a row without a label, or any row the reader refuses (file, line, field).
    """
    queries, responses, labels = [], [], []
    for s in read_file(path):
        if s.label is None:
            raise DataError(s.source, s.line, "label", "scored pairs need a label on every row")
        queries.append(s.anchor.text)
        responses.append(s.positives[0].text)
        labels.append(float(s.label))
    if not queries:
        raise DataError(path, 0, None, "no scored pairs in the file")
    return queries, responses, labels


def evaluate_pairs_file(embedder: Any, path: str, batch_size: int = 64, positive_threshold: float = 0.75) -> dict[str, float]:
    """Read scored pairs from ``path`` (any format mmembed reads) and evaluate ``embedder`` on them."""
    return evaluate_pairs(lambda texts: embedder.encode(texts, batch_size=batch_size), *read_pairs(path),
                          positive_threshold=positive_threshold)
