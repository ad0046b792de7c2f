"""``mmembed rerank``: score documents against queries with a reranker folder and rank them.

Inputs (read and checked whole before the model loads; a bad one is a
:class:`~mmembed.data.DataError` naming file, line and field):

- ``--query TEXT --documents FILE``: one query; FILE is a ``.txt`` file (one document per
  line, blank lines skipped) or rows (``.jsonl``, ``.json``, ...) each a string or
  ``{"text": ..., "images" / "videos" / "audios": [...]}``.
- ``--input FILE``: rows ``{"query": ..., "documents": [...]}``, the query and each document a
  string or such a dict; other keys of a row are ignored.

Media paths that are not absolute (nor URLs) are relative to the file that names them.

Output, one JSON line per query, the shape of the ``/v1/rerank`` APIs (TEI, Jina, Cohere):
``{"query": ..., "results": [{"index": i, "relevance_score": s, "document": {"text": ...}}]}``,
best first (ties in document order), ``document`` only with ``--return_documents true``,
``index`` the document's 0-based position in its list. A score is what TEI, Cohere / Jina and
sentence-transformers' ``CrossEncoder.predict`` report: the probability of relevance,
``sigmoid(s)`` of the reranker's raw score ``s`` (the classifier's logit, or ``logit(yes) -
logit(no)``: ``softmax([logit(no), logit(yes)])[1]``); with ``--raw_scores true``, ``s`` itself
(:mod:`mmembed.tasks.reranker.scorer`). The order follows ``s`` either way.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..data import DataError
from ..data.sample import json_type
from ..eval.ranking import probabilities, rank_order

__all__ = ["RerankQuery", "rank_queries", "read_documents", "read_rerank_input", "result_line"]

MEDIA_KEYS = ("images", "videos", "audios")
ITEM_KEYS = ("text", *MEDIA_KEYS)


@dataclass
class RerankQuery:
    """One query and its documents, as read (``query`` / ``documents``: a string or a dict
    with ``text`` and media lists, media paths resolved), and where it came from."""

    query: Any
    documents: list[Any]
    source: str
    line: int
    # the field that names document j in a message: "documents[j]" for --input rows; the
    # documents file's own line for --documents (see :meth:`where`)
    document_lines: list[int] | None = None

    def where(self, j: int) -> tuple[str, int, str | None]:
        """``(file, line, field)`` of document ``j``."""
        if self.document_lines is not None:
            return self.source, self.document_lines[j], None
        return self.source, self.line, f"documents[{j}]"


def _is_remote(path: str) -> bool:
    return "://" in path or path.startswith("data:")


def _sub(field: str, key: str) -> str:
    return f"{field}.{key}" if field else key


def check_item(value: Any, source: str, line: int, field: str, base_dir: str) -> Any:
    """A query or document as scored: a string as it is; a dict with a ``text`` string and /
    or media lists of strings (``images``, ``videos``, ``audios``), its local media paths
    resolved against ``base_dir`` and there. Anything else is a DataError naming ``field``
    (``""``: the row itself, its keys named alone)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, dict):
        raise DataError(source, line, field or None, f"must be a string or an object with 'text' (and {', '.join(MEDIA_KEYS)}), "
                                             f"got {json_type(value)}")
    unknown = sorted(set(value) - set(ITEM_KEYS))
    if unknown:
        raise DataError(source, line, _sub(field, unknown[0]),
                        f"unknown key; an object here has {', '.join(ITEM_KEYS)}")
    text = value.get("text", "")
    if not isinstance(text, str):
        raise DataError(source, line, _sub(field, "text"), f"must be a string, got {json_type(text)}")
    out: dict[str, Any] = {"text": text}
    for key in MEDIA_KEYS:
        media = value.get(key)
        if media is None:
            continue
        if not isinstance(media, list):
            raise DataError(source, line, _sub(field, key), f"must be a list of paths or URLs, got {json_type(media)}")
        resolved = []
        for k, path in enumerate(media):
            if not isinstance(path, str) or not path:
                raise DataError(source, line, _sub(field, f"{key}[{k}]"), f"must be a path or URL, got {json_type(path)}")
            if not _is_remote(path):
                path = path if os.path.isabs(path) else os.path.join(base_dir, path)
                if not os.path.isfile(path):
                    raise DataError(source, line, _sub(field, f"{key}[{k}]"), f"no such file: {path}")
            resolved.append(path)
        out[key] = resolved
    if not out["text"] and not any(out.get(k) for k in MEDIA_KEYS):
        raise DataError(source, line, _sub(field, "text"), "empty: an object needs a 'text' or media")
    return out


def _rows(path: str) -> Iterator[tuple[int, Any]]:
    from ..data.formats import iter_raw_rows

    yield from iter_raw_rows(path)


def read_documents(path: str) -> tuple[list[Any], list[int]]:
    """``--documents``: the documents of ``path`` and the line of each: a ``.txt`` file's
    non-blank lines, or rows that are strings or ``{"text", "images", ...}`` objects."""
    base = os.path.dirname(os.path.abspath(path))
    documents: list[Any] = []
    lines: list[int] = []
    if path.endswith(".txt"):
        with open(path, encoding="utf-8") as f:
            for n, text in enumerate(f, 1):
                text = text.rstrip("\r\n")
                if text.strip():
                    documents.append(text)
                    lines.append(n)
    else:
        for n, row in _rows(path):
            documents.append(check_item(row, path, n, "", base))
            lines.append(n)
    if not documents:
        raise DataError(path, 0, None, "no documents (a .txt file: one document per line)")
    return documents, lines


def read_rerank_input(path: str) -> list[RerankQuery]:
    """``--input``: rows ``{"query": ..., "documents": [...]}``, checked whole."""
    base = os.path.dirname(os.path.abspath(path))
    queries: list[RerankQuery] = []
    for n, row in _rows(path):
        if not isinstance(row, dict):
            raise DataError(path, n, None, f"a row must be an object with 'query' and 'documents', got {json_type(row)}")
        if "query" not in row:
            raise DataError(path, n, "query", "missing")
        if "documents" not in row:
            raise DataError(path, n, "documents", "missing")
        query = check_item(row["query"], path, n, "query", base)
        documents = row["documents"]
        if not isinstance(documents, list):
            raise DataError(path, n, "documents", f"must be a list of documents, got {json_type(documents)}")
        if not documents:
            raise DataError(path, n, "documents", "empty: a query needs at least one document")
        documents = [check_item(d, path, n, f"documents[{j}]", base) for j, d in enumerate(documents)]
        queries.append(RerankQuery(query, documents, path, n))
    if not queries:
        raise DataError(path, 0, None, "no rows")
    return queries


def score_queries(reranker: Any, queries: list[RerankQuery], batch_size: int = 32) -> list[np.ndarray]:
    """The raw scores of every query's documents (all pairs batched together); an error about a
    pair names its row and document."""
    pairs = [(q.query, d) for q in queries for d in q.documents]
    owner = [(i, j) for i, q in enumerate(queries) for j in range(len(q.documents))]
    try:
        scores = reranker.score_pairs(pairs, batch_size=batch_size, raw_scores=True)
    except DataError as e:
        if e.source != "<input>" or not 1 <= e.line <= len(owner):
            raise
        i, j = owner[e.line - 1]
        source, line, field = queries[i].where(j)
        document = field or "document"
        named = (e.field or "").replace("positive_messages[0]", document).replace("response", document)
        raise DataError(source, line, named or field, e.reason) from None
    out, start = [], 0
    for q in queries:
        out.append(scores[start:start + len(q.documents)])
        start += len(q.documents)
    return out


def result_line(query: RerankQuery, scores: np.ndarray, top_n: int | None = None,
                return_documents: bool = False, raw_scores: bool = False, relevance=probabilities) -> dict[str, Any]:
    """One query's output: ``{"query", "results": [{"index", "relevance_score"[, "document"]}]}``
    best first by the raw ``scores`` (a stable sort: ties keep the documents' order), at most
    ``top_n``; ``relevance_score`` the probability ``sigmoid(score)`` (the scorer's ``relevance``
    of the raw scores: a late-interaction model's MaxSim as it is), or with ``raw_scores`` the
    raw score."""
    shown = scores if raw_scores else relevance(scores)
    results = []
    for i in rank_order(scores, top_n):
        result: dict[str, Any] = {"index": int(i), "relevance_score": float(shown[i])}
        if return_documents:
            document = query.documents[i]
            result["document"] = {"text": document} if isinstance(document, str) else document
        results.append(result)
    return {"query": query.query, "results": results}


def rank_queries(reranker: Any, queries: list[RerankQuery], top_n: int | None = None, return_documents: bool = False,
                 batch_size: int = 32, raw_scores: bool = False) -> list[dict[str, Any]]:
    """Every query's output line (:func:`result_line`)."""
    return [result_line(q, s, top_n, return_documents, raw_scores, getattr(reranker, "relevance", probabilities))
            for q, s in zip(queries, score_queries(reranker, queries, batch_size))]


def dumps(line: dict[str, Any]) -> str:
    return json.dumps(line, ensure_ascii=False)
