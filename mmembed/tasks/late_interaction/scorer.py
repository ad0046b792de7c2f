"""Encoding and scoring with a late-interaction model: token matrices for queries and
documents (``mmembed embed``), MaxSim of (query, document) pairs (``mmembed rerank``,
``POST /v1/rerank``), and token pooling of documents at inference.

Queries and documents are encoded as in training (:mod:`.inputs`): a query expanded as the
model was trained (ColBERT's mask tokens, ColQwen's augmentation tokens), a document with its
skiplist tokens left out. A document's vectors can be pooled (``pool_factor``,
:func:`~mmembed.model.token_pooling.pool_tokens`: hierarchical clustering, as
sentence-transformers' ``TokenPooling`` and colpali-engine's ``HierarchicalTokenPooler``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ...data.sample import Item
from ...encoding.buckets import pad_to_width
from ...encoding.inputs import InputBuilder
from ...losses.maxsim import MaxSim, maxsim_pairs, trim_tokens
from ...model.embedder import as_item
from ...model.late_interaction import LateInteractionModel, expand_query, expansion_token_id
from ...model.token_pooling import pool_tokens
from ...training.evaluation import numpy_scores
from .folder import load_late_interaction
from .settings import LateInteractionSettings

SIDES = ("query", "document")


class MultiVectorScorer:
    """A late-interaction model for inference.

    ``encode(inputs, input_type="query" | "document")`` -> a list of ``[k_i, dim]`` float32
    arrays (each input's kept token vectors, unit norm); ``score_pairs([(query, document)])``
    -> MaxSim of each pair (divided by the query's token count for a model trained with
    ``--late_interaction_normalize_scores``). An input is a string or a row-like dict with
    ``text`` and ``images`` / ``videos``."""

    task_type = "late_interaction"

    def __init__(self, model: LateInteractionModel, processing: Any, template: Any, max_length: int,
                 settings: LateInteractionSettings, device: str | None = None):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = model.to(self.device).eval()
        self.template = template
        self.max_length = max_length
        self.settings = settings
        self.builder = InputBuilder(template, processing, max_length, truncate=True)
        self.tokenizer = self.builder.tokenizer
        self.query_builder = None
        if settings.expansion == "mask":
            self.query_builder = InputBuilder(template, processing, min(settings.query_length, max_length), truncate=True)
            self.expansion_id = expansion_token_id(self.tokenizer, settings.expansion_token)

    @classmethod
    def from_pretrained(cls, path: str, device: str | None = None, torch_dtype: str | None = None) -> MultiVectorScorer:
        model, processing, template, info, settings = load_late_interaction(path, torch_dtype)
        return cls(model, processing, template, info["max_length"], settings, device)

    @staticmethod
    def _item(x: Any) -> Item:
        if isinstance(x, Item):
            return x
        if isinstance(x, dict) and "text" in x and "query" not in x:
            return Item(x.get("text") or "", x.get("system"), list(x.get("images") or []),
                        list(x.get("videos") or []), list(x.get("audios") or []))
        return as_item(x)

    def _inputs(self, items: list[Item], side: str) -> dict[str, Any]:
        s = self.settings
        items = [self.template.with_side(it, side) for it in items]
        if side == "query" and s.expansion == "augment":
            items = [dataclasses.replace(it, text=it.text + s.expansion_token * s.query_length) for it in items]
        if side == "query" and self.query_builder is not None:
            enc = pad_to_width(dict(self.query_builder(items)), s.query_length, self.tokenizer.pad_token_id or 0,
                               self.query_builder.padding_side)
            return expand_query(enc["input_ids"], enc["attention_mask"], length=s.query_length, token_id=self.expansion_id,
                                attend=s.attend_expansion, token_type_ids=enc.get("token_type_ids"))
        enc = dict(self.builder(items))
        if side == "document" and s.skiplist:
            enc["apply_skiplist"] = torch.ones(len(items), dtype=torch.bool)
        return enc

    @torch.no_grad()
    def token_matrices(self, inputs: Sequence[Any], input_type: str = "document", batch_size: int = 32,
                       origins: Sequence[tuple[str, int]] | None = None) -> list[torch.Tensor]:
        """Each input's ``[L, dim]`` row of the model's output (absent tokens zero), as tensors on
        the CPU; ``origins``: each input's (file, line), for the error a bad one gets."""
        if input_type not in SIDES:
            raise ValueError(f"input_type must be query or document, got {input_type!r}")
        items = [self._item(x) if origins is None else as_item(x, *origins[i]) for i, x in enumerate(inputs)]
        out: list[torch.Tensor] = []
        for start in range(0, len(items), batch_size):
            enc = self._inputs(items[start:start + batch_size], input_type)
            enc = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in enc.items()}
            out.extend(self.model(**enc)["last_hidden_state"].float().cpu())
        return out

    def encode(self, inputs: Sequence[Any], input_type: str = "document", batch_size: int = 32,
               pool_factor: float | None = None, origins: Sequence[tuple[str, int]] | None = None) -> list[np.ndarray]:
        """Each input's kept token vectors ``[k, dim]`` (float32); ``pool_factor`` (documents):
        merged by hierarchical token pooling to about ``k / pool_factor`` vectors."""
        out = []
        for row in self.token_matrices(inputs, input_type, batch_size, origins):
            vectors = row[row.ne(0).any(-1)]
            if pool_factor is not None and pool_factor > 1:
                vectors = pool_tokens(vectors, pool_factor)
            out.append(vectors.numpy().astype(np.float32))
        return out

    def search_vectors(self, inputs: Sequence[Any], input_type: str = "document", batch_size: int = 32) -> np.ndarray:
        """The inputs' token matrices as one padded ``[n, L, dim]`` float32 array (absent tokens
        zero), for :meth:`scores` (retrieval over a corpus: ``mmembed eval --beir``)."""
        rows = [trim_tokens(m[None])[0] for m in self.token_matrices(inputs, input_type, batch_size)]
        if not rows:
            return np.zeros((0, 1, self.settings.dim), dtype=np.float32)
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True).numpy()

    def scores(self, queries: np.ndarray, docs: np.ndarray) -> np.ndarray:
        """MaxSim of every query against every document (``[Q, C]``), as the model was trained
        (the evaluation's scoring of a loss's similarity on numpy rows)."""
        return numpy_scores(MaxSim(self.settings.normalize_scores))(queries, docs)

    def score_pairs(self, pairs: Sequence[tuple[Any, Any]], batch_size: int = 32, lengths: list[int] | None = None,
                    raw_scores: bool = True) -> np.ndarray:
        """``[len(pairs)]`` float32: MaxSim of each (query, document) pair (``raw_scores`` has
        no other meaning here: MaxSim is the score either way); ``lengths``, a list, gets each
        pair's token count appended (query and document tokens scored)."""
        if not pairs:
            return np.zeros(0, dtype=np.float32)
        queries = self.token_matrices([q for q, _ in pairs], "query", batch_size)
        docs = self.token_matrices([d for _, d in pairs], "document", batch_size)
        scores = []
        for q, d in zip(queries, docs):
            scores.append(float(maxsim_pairs(q[None], d[None], normalize=self.settings.normalize_scores)[0]))
            if lengths is not None:
                lengths.append(int(q.ne(0).any(-1).sum() + d.ne(0).any(-1).sum()))
        return np.asarray(scores, dtype=np.float32)

    def relevance(self, raw: np.ndarray) -> np.ndarray:
        """The ``relevance_score`` of raw scores: MaxSim as it is (it is no logit)."""
        return np.asarray(raw, dtype=np.float32)

    def score(self, query: Any, documents: Sequence[Any], batch_size: int = 32, raw_scores: bool = True) -> np.ndarray:
        """``[len(documents)]``: :meth:`score_pairs` of ``query`` with each document."""
        return self.score_pairs([(query, d) for d in documents], batch_size)

    def rank(self, query: Any, documents: Sequence[Any], top_n: int | None = None, batch_size: int = 32
             ) -> list[tuple[int, float]]:
        """``[(index, score)]``, best first (ties in document order), at most ``top_n``."""
        from ...eval.ranking import rank_order

        scores = self.score(query, documents, batch_size)
        return [(int(i), float(scores[i])) for i in rank_order(scores, top_n)]
