"""Retrieval evaluation on a BEIR-layout folder: nDCG@10 (graded), MRR@10, recall@k.

    from mmembed.eval.beir import evaluate_beir
    metrics = evaluate_beir("output/checkpoint-60", "data/scifact", split="test")
    # {"ndcg@10": ..., "mrr@10": ..., "recall@1": ..., "recall@10": ..., "recall@100": ...,
    #  "num_queries": ..., "num_docs": ...}

Folder layout (BEIR's)
----------------------
- ``corpus.jsonl``: ``{"_id": str, "title": str, "text": str}`` per line; a document is
  embedded as ``doc_prefix + (title + " " + text).strip()`` (BEIR's own joining).
- ``queries.jsonl``: ``{"_id": str, "text": str}``; a query is ``query_prefix + text``.
- ``qrels/{split}.tsv``: ``query-id <TAB> corpus-id <TAB> score`` with a header line; the
  score is the graded relevance, and a score <= 0 means not relevant.

Prefixes are plain strings put in front of the text (``"query: "``, ``"Instruct: ...\\nQuery: "``);
the model's template (and its default system prompt, if any) applies on top as for any input.

Evaluation
----------
The queries evaluated are those of ``queries.jsonl`` with at least one relevant document in
the split's qrels (a qrels query missing from ``queries.jsonl`` is an error). Every corpus
document is a candidate, except a document whose ``_id`` equals the query's ``_id`` (as BEIR
does, for datasets where queries are also documents). Documents are ranked by cosine
similarity (dot product of the normalized embeddings), equal scores by their order in
``corpus.jsonl``. With ``rel(d)`` the qrels score of ``d`` (0 when unjudged) and ``R_q`` the
documents with ``rel > 0``, per query, then averaged:

- ``ndcg@10 = DCG / IDCG``, ``DCG = sum_{r=1}^{10} rel(d_r) / log2(r + 1)`` (linear gain, as
  trec_eval and BEIR), ``IDCG`` the same sum over the qrels grades sorted in decreasing order;
- ``mrr@10 = 1 / r`` of the first relevant document if ``r <= 10``, else 0;
- ``recall@k = |R_q ∩ top_k| / |R_q|``.

Relevant documents missing from the corpus still count in ``IDCG`` and in ``|R_q|`` (as
trec_eval); a warning gives their number.

Search and metrics are the shared core of ``mmembed.eval.ranking`` (``top_k`` and
``ranking_metrics`` are re-exported here under their old names).
"""

from __future__ import annotations

import csv
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .ranking import ranking_metrics, search, top_k

__all__ = ["BeirData", "load_beir", "top_k", "ranking_metrics", "evaluate_beir"]

logger = logging.getLogger(__name__)

@dataclass
class BeirData:
    """One split of a BEIR folder: the texts (prefixes not applied) and graded qrels."""

    doc_ids: list[str]
    doc_texts: list[str]
    query_ids: list[str]  # only the queries with a relevant document in the split
    query_texts: list[str]
    qrels: dict[str, dict[str, float]]  # query id -> {doc id: score}, every judged pair


def _read_jsonl(path: str) -> list[tuple[int, dict]]:
    rows = []
    with open(path, encoding="utf-8-sig") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: invalid JSON: {e.msg}") from None
            if not isinstance(row, dict) or "_id" not in row:
                raise ValueError(f"{path}:{n}: a row needs '_id'")
            rows.append((n, row))
    return rows


def _read_qrels(path: str) -> dict[str, dict[str, float]]:
    qrels: dict[str, dict[str, float]] = {}
    with open(path, encoding="utf-8-sig", newline="") as f:
        for n, cells in enumerate(csv.reader(f, delimiter="\t"), 1):
            if not cells or not "".join(cells).strip():
                continue
            if len(cells) < 3:
                raise ValueError(f"{path}:{n}: expected query-id, corpus-id, score; got {cells}")
            try:
                score = float(cells[2])
            except ValueError:
                if n == 1:  # the header
                    continue
                raise ValueError(f"{path}:{n}: the score {cells[2]!r} is not a number") from None
            qrels.setdefault(cells[0].strip(), {})[cells[1].strip()] = score
    return qrels


def load_beir(folder: str, split: str = "test") -> BeirData:
    """Read ``corpus.jsonl``, ``queries.jsonl`` and ``qrels/{split}.tsv`` from ``folder``."""
    paths = {name: os.path.join(folder, name) for name in ("corpus.jsonl", "queries.jsonl")}
    paths["qrels"] = os.path.join(folder, "qrels", f"{split}.tsv")
    for path in paths.values():
        if not os.path.isfile(path):
            raise FileNotFoundError(f"BEIR folder {folder}: missing {os.path.relpath(path, folder)}")
    doc_ids, doc_texts = [], []
    for n, row in _read_jsonl(paths["corpus.jsonl"]):
        title = row.get("title") or ""
        text = row.get("text") or ""
        if not isinstance(title, str) or not isinstance(text, str):
            raise ValueError(f"{paths['corpus.jsonl']}:{n}: 'title' and 'text' must be strings")
        doc_ids.append(str(row["_id"]))
        doc_texts.append(f"{title} {text}".strip())
    if len(set(doc_ids)) != len(doc_ids):
        raise ValueError(f"{paths['corpus.jsonl']}: duplicate document _id")
    if not doc_ids:
        raise ValueError(f"{paths['corpus.jsonl']}: empty corpus")
    queries = {str(row["_id"]): str(row.get("text") or "") for _, row in _read_jsonl(paths["queries.jsonl"])}
    qrels = _read_qrels(paths["qrels"])
    missing = [q for q in qrels if q not in queries]
    if missing:
        raise ValueError(f"{paths['qrels']}: query ids {missing[:5]} are not in queries.jsonl")
    # queries.jsonl order, for determinism; only queries with something relevant
    query_ids = [q for q in queries if any(s > 0 for s in qrels.get(q, {}).values())]
    if not query_ids:
        raise ValueError(f"{paths['qrels']}: no query has a relevant document (score > 0)")
    return BeirData(doc_ids, doc_texts, query_ids, [queries[q] for q in query_ids], qrels)


def evaluate_beir(
    embedder_or_model_path: Any,
    folder: str | BeirData,
    split: str = "test",
    batch_size: int = 64,
    *,
    query_prefix: str = "",
    doc_prefix: str = "",
    ks: Sequence[int] = (1, 10, 100),
    cutoff: int = 10,
    query_system: str | None = None,
    doc_system: str | None = None,
) -> dict[str, float]:
    """Evaluate a model on one split of a BEIR folder.

    ``embedder_or_model_path``: a folder (loaded with ``Embedder.from_pretrained``) or any
    object with ``encode(texts, batch_size=...) -> [n, D]`` L2-normalized, such as an
    already-loaded :class:`~mmembed.model.embedder.Embedder` (the trainer's evaluation hook);
    or a multi-vector scorer with ``search_vectors(texts, "query" | "document", batch_size) ->
    [n, L, D]`` and ``scores(queries, docs) -> [Q, C]`` (a late-interaction model, ranked by MaxSim).
    ``folder``: the BEIR folder, or a :class:`BeirData` already loaded (``split`` is then
    ignored), so that repeated evaluations read the files once.

    ``query_system`` / ``doc_system``: the task instruction of each side, put where the
    model's template puts a system prompt (in place of its default), as training put a
    dataset's ``query_system`` / ``document_system``.

    Returns ``ndcg@10``, ``mrr@10``, ``recall@k`` for ``ks`` (floats) and ``num_queries``,
    ``num_docs`` (ints).
    """
    data = folder if isinstance(folder, BeirData) else load_beir(folder, split)
    embedder = embedder_or_model_path
    if isinstance(embedder, str):
        from ..model.embedder import Embedder

        embedder = Embedder.from_pretrained(embedder)
    def inputs(texts: list[str], prefix: str, system: str | None) -> list[Any]:
        if system is None:
            return [prefix + t for t in texts]
        from ..data.sample import Item

        return [Item(text=prefix + t, system=system) for t in texts]

    score = None
    if hasattr(embedder, "search_vectors"):  # a multi-vector model: [n, L, D] token vectors, its own similarity
        q_emb = embedder.search_vectors(inputs(data.query_texts, query_prefix, query_system), "query", batch_size)
        d_emb = embedder.search_vectors(inputs(data.doc_texts, doc_prefix, doc_system), "document", batch_size)
        score = embedder.scores
    else:
        q_emb = np.asarray(embedder.encode(inputs(data.query_texts, query_prefix, query_system), batch_size=batch_size),
                           dtype=np.float32)
        d_emb = np.asarray(embedder.encode(inputs(data.doc_texts, doc_prefix, doc_system), batch_size=batch_size),
                           dtype=np.float32)
    depth = max(*ks, cutoff)
    doc_pos = {d: i for i, d in enumerate(data.doc_ids)}
    missing = sum(1 for q in data.query_ids for d, g in data.qrels[q].items() if g > 0 and d not in doc_pos)
    if missing:
        logger.warning("%d relevant (query, document) pairs name documents missing from corpus.jsonl", missing)

    own = [(doc_pos[q],) if q in doc_pos else () for q in data.query_ids]  # a query is never its own answer
    found = search(q_emb, d_emb, depth, exclude=own, score=score)
    rankings = [[data.doc_ids[i] for i in ranked] for ranked in found]
    out: dict[str, Any] = ranking_metrics(rankings, [data.qrels[q] for q in data.query_ids], ks, cutoff)
    out["num_queries"] = len(data.query_ids)
    out["num_docs"] = len(data.doc_ids)
    return out
