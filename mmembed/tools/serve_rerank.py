"""``mmembed serve`` with a reranker: ``POST /v1/rerank`` (also ``/v2/rerank`` and ``/rerank``).

    mmembed serve --model output/reranker/checkpoint-60 --port 8000
    curl -s localhost:8000/v1/rerank -d '{"query": "flute", "documents": ["A man plays a flute.", "A cat."]}'

The server reranks when the model is a reranker: its ``mmembed.json`` says ``task_type``
``reranker`` / ``generative_reranker`` (what ``mmembed sft --task_type ...`` saves), or,
without one, its ``config.json`` names a ``*ForSequenceClassification`` (a cross-encoder);
``--task_type`` overrides (a causal-LM reranker of its own, e.g. Qwen3-Reranker, needs
``--task_type generative_reranker``).

Request (what vLLM, Jina, Cohere and TEI clients send)::

    {"model": "...",            # optional; if given, the served name
     "query": "...",
     "documents": ["...", {"text": "..."}, ...],   # or "texts" (TEI)
     "top_n": 3,                # optional; 0, null or absent: all
     "return_documents": true,  # optional, default true (TEI's "return_text", default false)
     "raw_scores": false}       # optional, default false (TEI's): true gives the raw score

Response, best first (by the raw score; ties: the earlier document first)::

    {"id": "rerank-...", "model": "...",
     "results": [{"index": 1, "relevance_score": 0.985, "document": {"text": "..."}}, ...],
     "usage": {"prompt_tokens": N, "total_tokens": N}}

``POST /rerank`` with TEI's request (``texts`` instead of ``documents``) answers as TEI
does: a bare list ``[{"index": i, "score": s, "text"?: "..."}]``, best first.

Scores are what TEI, Cohere / Jina and sentence-transformers' ``CrossEncoder.predict`` give,
as :meth:`Reranker.score` gives them: the probability of relevance ``sigmoid(s)`` of the raw
score ``s``, the classifier's logit or ``logit(yes) - logit(no)`` for a generative reranker
(``softmax([logit(no), logit(yes)])[1]``, Qwen3-Reranker's own score). ``raw_scores: true``
(TEI's name) gives ``s`` itself (any real number). Higher is more relevant either way, and the
order follows ``s``. A pair longer than the model's ``max_length`` is truncated as in training
and evaluation, not refused; ``usage`` counts the tokens the model saw. Documents are text (a
string or ``{"text": ...}``).

Requests are batched as embeddings are (:class:`~mmembed.tools.serve_batching.Batcher`):
the (query, document) pairs of concurrent requests go through one
:meth:`Reranker.score_pairs` call. A bad request gets ``{"error": {"message", "type",
"param", "code"}}`` with a 4xx status, ``param`` naming the field.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import Request  # at module level: FastAPI resolves the handlers' annotations here

from ..data.sample import MEDIA_KINDS, Item, json_type
from ..eval.ranking import probabilities, rank_order
from .serve_batching import Batcher, RequestError, batching_app
from .serve_config import ServeConfig

__all__ = ["RERANK_PATHS", "RerankRequest", "create_rerank_app", "parse_rerank_request"]

RERANK_PATHS = ("/v1/rerank", "/v2/rerank", "/rerank")
_MEDIA_KEYS = {*MEDIA_KINDS, *(k + "s" for k in MEDIA_KINDS)}


# ---- requests ----------------------------------------------------------------------------
@dataclass
class RerankRequest:
    """A checked rerank request."""

    query: Item
    documents: list[Item]
    top_n: int  # how many results (all when the request asked for 0 / null / more than there are)
    return_documents: bool
    raw_scores: bool  # the raw score s rather than sigmoid(s)
    tei: bool  # TEI's form (``texts``) at /rerank: answered with TEI's bare list


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"'{name}' must be true or false, got {json_type(value)}", name)
    return value


def _text(raw: Any, param: str, what: str) -> str:
    """A query or document: a string, or an object with a ``text`` string."""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, dict):
        media = sorted(_MEDIA_KEYS & set(raw))
        if media:
            raise RequestError(f"this server reranks text; the {what} has {', '.join(media)}", f"{param}.{media[0]}",
                               "unsupported_input")
        if not isinstance(raw.get("text"), str):
            raise RequestError(f"a {what} object needs a 'text' string, got {json_type(raw.get('text'))}",
                               f"{param}.text")
        return raw["text"]
    raise RequestError(f"a {what} is a string or an object with 'text', got {json_type(raw)}", param)


def parse_rerank_request(body: Any, model_name: str, max_inputs: int, tei_path: bool = False) -> RerankRequest:
    """The checked request (see the module docstring); ``tei_path``: it came to ``/rerank``,
    where TEI's form (``texts``) is answered in TEI's shape."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {json_type(body)}")
    if body.get("model") is not None and body["model"] != model_name:
        raise RequestError(f"the model {body['model']!r} does not exist; this server serves {model_name!r}",
                           "model", "model_not_found", status=404)
    if "query" not in body:
        raise RequestError("'query' is required", "query")
    query = _text(body["query"], "query", "query")
    if not query:
        raise RequestError("'query' is empty", "query")
    if "documents" in body and "texts" in body:
        raise RequestError("give 'documents' or 'texts' (TEI's name), not both", "texts")
    name = "texts" if "texts" in body else "documents"
    raw = body.get(name)
    if raw is None:
        raise RequestError("'documents' is required (a list of strings or {\"text\": ...} objects)", "documents")
    if not isinstance(raw, list):
        raise RequestError(f"'{name}' must be an array, got {json_type(raw)}", name)
    if not raw:
        raise RequestError(f"'{name}' is empty", name)
    if len(raw) > max_inputs:
        raise RequestError(f"{len(raw)} documents in one request; at most {max_inputs}", name, "too_many_inputs")
    documents = [Item(_text(d, f"{name}[{i}]", "document")) for i, d in enumerate(raw)]
    top_n = body.get("top_n")
    if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0):
        raise RequestError(f"top_n must be an integer >= 1 (0 or null: all), got {top_n!r}", "top_n")
    top_n = len(documents) if not top_n else min(top_n, len(documents))
    tei = tei_path and name == "texts"
    if tei:
        return_documents = _flag(body, "return_text", False)
    else:
        return_documents = _flag(body, "return_documents", True)
    return RerankRequest(Item(query), documents, top_n, return_documents, _flag(body, "raw_scores", False), tei)


# ---- batching ----------------------------------------------------------------------------
class BatchingReranker(Batcher):
    """Scores queued (query, document) pairs, several requests per :meth:`Reranker.score_pairs`
    call. A job's rows: ``[raw score, tokens]`` per pair (each request maps its own through the
    sigmoid, or not)."""

    def __init__(self, reranker: Any, max_batch_size: int, max_wait_ms: float, batching: bool,
                 score_batch_size: int):
        super().__init__(max_batch_size, max_wait_ms, batching)
        self.reranker = reranker
        self.score_batch_size = score_batch_size

    def _check(self, items: list[tuple[Item, Item]]) -> list[int]:
        return []  # nothing is refused: pairs over the model's length are truncated

    def _encode(self, items: list[tuple[Item, Item]]) -> np.ndarray:
        lengths: list[int] = []
        scores = self.reranker.score_pairs(items, batch_size=self.score_batch_size, lengths=lengths, raw_scores=True)
        self._count(items)
        return np.stack([np.asarray(scores, dtype=np.float64), np.asarray(lengths, dtype=np.float64)], axis=1)


# ---- the app -----------------------------------------------------------------------------
def create_rerank_app(reranker: Any, config: ServeConfig):
    """The FastAPI application serving ``reranker`` as ``config`` says."""
    from fastapi.responses import JSONResponse

    model_name = config.name()
    task = getattr(reranker, "task_type", "reranker")
    self_relevance = getattr(reranker, "relevance", probabilities)  # raw scores -> relevance_score
    batcher = BatchingReranker(reranker, config.max_batch_size, config.max_wait_ms, config.batching,
                               config.encode_batch_size)
    app = batching_app(batcher, "mmembed reranker", {"model": model_name, "task_type": task})

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "mmembed"}]}

    async def rerank(request: Request, tei_path: bool):
        try:
            body = await request.json()
        except Exception:  # noqa: BLE001 - any undecodable body
            raise RequestError("the request body is not valid JSON") from None
        req = parse_rerank_request(body, model_name, config.max_inputs, tei_path)
        batcher.stats.requests += 1
        rows, _ = await batcher.submit([(req.query, d) for d in req.documents])
        scores = rows[:, 0]
        order = rank_order(scores, req.top_n)  # as Reranker.rank orders them: by the raw score
        relevance = scores if req.raw_scores else self_relevance(scores)
        shown = [float(relevance[i]) for i in order]
        if req.tei:
            return JSONResponse([{"index": int(i), "score": s, **({"text": req.documents[i].text}
                                                                   if req.return_documents else {})}
                                 for i, s in zip(order, shown)])
        results = []
        for i, s in zip(order, shown):
            result: dict[str, Any] = {"index": int(i), "relevance_score": s}
            if req.return_documents:
                result["document"] = {"text": req.documents[i].text}
            results.append(result)
        total = int(rows[:, 1].sum())
        return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": model_name, "results": results,
                             "usage": {"prompt_tokens": total, "total_tokens": total}})

    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank_v1(request: Request):
        return await rerank(request, tei_path=False)

    @app.post("/rerank")
    async def rerank_tei(request: Request):
        return await rerank(request, tei_path=True)

    @app.post("/v1/embeddings")
    @app.post("/embeddings")
    async def embeddings_refused():
        raise RequestError(f"{model_name!r} is a reranker (--task_type {task}): it scores (query, document) pairs "
                           "and has no embeddings; POST /v1/rerank with a query and documents", None,
                           "unsupported_endpoint")

    return app
