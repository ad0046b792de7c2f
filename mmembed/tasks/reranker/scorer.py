"""Scoring with a trained reranker: ``Reranker.from_pretrained(folder).rank(query, documents)``.

The folder is what ``mmembed sft --task_type reranker | generative_reranker`` writes (a
checkpoint, full or a LoRA adapter over its base model), what ``mmembed export`` writes, or a
reranker of its own (a ``*ForSequenceClassification`` folder such as a CrossEncoder's, or
Qwen3-Reranker's causal LM): its ``mmembed.json`` says the task, the template, the tokens and
the length; without one, the task comes from the config's ``architectures`` and the template
from its ``model_type``. Pairs are built and tokenized as in training
(:class:`~mmembed.tasks.reranker.inputs.RerankCollator`, no draws), so a raw score here is the
score the trained model gives in training and in evaluation.

Scores are reported as TEI, Cohere / Jina clients and sentence-transformers'
``CrossEncoder.predict`` report them: the probability that the pair is relevant,
``sigmoid(s)`` of the model's raw score ``s`` (:func:`probabilities`). For a classifier ``s`` is
its one logit; for a generative reranker ``s = logit(yes) - logit(no)`` and ``sigmoid(s)`` is
``softmax([logit(no), logit(yes)])[1]``, Qwen3-Reranker's own score. ``raw_scores=True`` gives
``s`` itself. A model trained from a sentence-transformers CrossEncoder folder reports
``activation_fn(s)``, the folder's own (:mod:`.st_folder`), as its ``predict`` does. Rankings follow ``s`` (the probabilities of two large scores can round to one
value), ties in the documents' order (:func:`rank_order`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ...data.sample import Item, Sample
from ...encoding.templates import Template, get_template, template_from_config
from ...errors import UsageError
from ...eval.ranking import probabilities, rank_order
from ...model.embedding import default_max_length, require_local_model
from ...model.io import read_mmembed_config
from .inputs import RerankCollator
from .model import RERANK_TASKS, RerankerModel, load_reranker

__all__ = ["Reranker", "load_reranker_folder", "pair_batches", "probabilities", "rank_order", "reranker_task_of"]


def reranker_task_of(path: str, cfg: dict[str, Any] | None = None) -> str:
    """The ``--task_type`` of the reranker folder ``path``: its ``mmembed.json``'s, else
    ``reranker`` for a sequence-classification model and ``generative_reranker`` for a causal
    LM (its config's ``architectures``)."""
    cfg = read_mmembed_config(path) if cfg is None else cfg
    if cfg and cfg.get("task_type") in RERANK_TASKS:
        return cfg["task_type"]
    if cfg and cfg.get("task_type") is None and cfg.get("pooling"):
        raise UsageError(f"{path}: an embedding model (its mmembed.json), not a reranker; use mmembed embed")
    base = _base_of(path, cfg)
    with open(os.path.join(base, "config.json"), encoding="utf-8") as f:
        architectures = json.load(f).get("architectures") or []
    if any(a.endswith("ForSequenceClassification") for a in architectures) or _jina(architectures):
        return "reranker"
    if any(a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in architectures):
        return "generative_reranker"
    raise UsageError(f"{path}: not a reranker (config.json's architectures {architectures}); pass --task_type "
                     "reranker or generative_reranker")


def _jina(architectures: Any) -> bool:
    from .jina import is_jina_reranker  # transformers' Qwen2-VL classes: imported when a folder is read

    return is_jina_reranker(architectures)


def _base_of(path: str, cfg: dict[str, Any] | None) -> str:
    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        return path
    if cfg and cfg.get("base_model") and os.path.isdir(cfg["base_model"]):
        return cfg["base_model"]
    with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as f:
        base = json.load(f).get("base_model_name_or_path")
    if not base or not os.path.isdir(base):
        raise UsageError(f"{path}: the adapter's base model {base!r} is not a local folder")
    return base


def load_reranker_folder(path: str, task_type: str | None = None, torch_dtype: str | None = None,
                         merge: bool = True) -> tuple[RerankerModel, Any, Template, dict[str, Any]]:
    """Load ``path`` as a :class:`RerankerModel` (a LoRA adapter over its base model, merged
    unless ``merge=False``). Returns ``(model, processing, template, info)``: the tokenizer (or
    processor), the template with the folder's instruction settings, and ``info``
    (``task_type``, ``max_length``, ``base_model``, ``is_adapter``, ``tokens``)."""
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    require_local_model(path)
    cfg = read_mmembed_config(path) or {}
    task = task_type or reranker_task_of(path, cfg)
    base = _base_of(path, cfg)
    is_adapter = base != path
    if cfg.get("template"):
        template = template_from_config(cfg["template"])
    else:
        config = AutoConfig.from_pretrained(base)
        jina = _jina(getattr(config, "architectures", None))  # model_type qwen2_vl: the class says it
        template = get_template("jina_reranker_m0" if jina else None, config_model_type=config.model_type,
                                task="reranker")
    if cfg.get("default_system") is not None:
        template = dataclasses.replace(template, default_system=cfg["default_system"])
    instruction = (cfg.get("instructions") or {}).get("query")
    if instruction is not None:
        template = dataclasses.replace(template, query_system=instruction)
    tok_dir = path if os.path.isfile(os.path.join(path, "tokenizer_config.json")) else base
    processing = (AutoProcessor if template.media else AutoTokenizer).from_pretrained(tok_dir)
    tokens = cfg.get("tokens") or [None, None]
    model = load_reranker(base, task, torch_dtype=torch_dtype, tokenizer=processing,
                          positive_token=tokens[0], negative_token=tokens[1], head_from_adapter=is_adapter)
    if model.cross_encoder is not None:  # a CrossEncoder's default prompt is its query instruction
        if template.query_system is None and model.cross_encoder.instruction is not None:
            template = dataclasses.replace(template, query_system=model.cross_encoder.instruction)
        model.cross_encoder = model.cross_encoder.with_instruction(template)
    if is_adapter:
        from peft import PeftModel

        model.backbone = PeftModel.from_pretrained(model.backbone, path)
        if merge:
            model.backbone = model.backbone.merge_and_unload()
    model.eval()
    tokenizer = getattr(processing, "tokenizer", None) or processing
    max_length = int(cfg["max_length"]) if cfg.get("max_length") else default_max_length(base, tokenizer)
    info = {"task_type": task, "max_length": max_length, "base_model": base, "is_adapter": is_adapter,
            "tokens": list(model.tokens) if model.kind == "generative" else None}
    return model, processing, template, info


def pair_batches(collator: RerankCollator, pairs: Sequence[tuple[Any, Any]], batch_size: int,
                 source: str = "<input>"):
    """The collated batches of ``(query, document)`` pairs (strings, ``Item``s or dicts as
    :meth:`Reranker._item` takes them), ``batch_size`` pairs each, built by ``collator``
    (``train=False``: one pair per sample, nothing drawn); pair ``i`` is named line ``i + 1``
    of ``source`` in an error."""
    for start in range(0, len(pairs), batch_size):
        yield collator([Sample(anchor=Reranker._item(q), positives=[Reranker._item(d)], source=source,
                               line=start + k + 1) for k, (q, d) in enumerate(pairs[start:start + batch_size])])


class Reranker:
    """Scores (query, document) pairs with a reranker folder.

    ``score(query, documents)`` -> numpy ``[len(documents)]`` float32 of probabilities
    ``sigmoid(s)`` of the raw scores ``s`` (the classifier's logit, or ``logit(yes) -
    logit(no)``), as ``CrossEncoder.predict`` gives them by default; ``raw_scores=True``: ``s``
    itself (``CrossEncoder.predict(..., activation_fn=torch.nn.Identity())``). Higher is more
    relevant either way. ``rank(query, documents, top_n)`` -> ``[(index, score)]`` best first
    (by ``s``, ties in document order); ``score_pairs([(query, document), ...])``. A query or
    document is a string, or a dict with ``text`` and ``images`` / ``videos`` / ``audios`` for
    a multimodal reranker."""

    def __init__(self, model: RerankerModel, processing: Any, template: Template, max_length: int,
                 device: str | None = None, task_type: str = "reranker"):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = model.to(self.device).eval()
        self.template = template
        self.max_length = max_length
        self.task_type = task_type
        self.collator = RerankCollator(template, processing, max_length, truncate=True, train=False,
                                       max_positive=1, max_negative=0)

    @classmethod
    def from_pretrained(cls, path: str, device: str | None = None, torch_dtype: str | None = None,
                        task_type: str | None = None) -> Reranker:
        model, processing, template, info = load_reranker_folder(path, task_type, torch_dtype)
        return cls(model, processing, template, info["max_length"], device, info["task_type"])

    @staticmethod
    def _item(x: Any) -> Item:
        if isinstance(x, Item):
            return x
        if isinstance(x, str):
            return Item(x)
        if isinstance(x, dict) and isinstance(x.get("text", ""), str):
            return Item(x.get("text", ""), x.get("system"), list(x.get("images") or []), list(x.get("videos") or []),
                        list(x.get("audios") or []))
        raise TypeError(f"a query or document is a string or a dict with 'text' (and media lists), got {type(x).__name__}")

    @torch.no_grad()
    def score_pairs(self, pairs: Sequence[tuple[Any, Any]], batch_size: int = 32,
                    lengths: list[int] | None = None, raw_scores: bool = False) -> np.ndarray:
        """``[len(pairs)]`` float32: each pair's probability of relevance (:func:`probabilities`
        of the raw score), or with ``raw_scores`` the raw score; ``lengths``, a list, gets each
        pair's token count as the model sees it (after truncation) appended."""
        out = []
        for batch in pair_batches(self.collator, pairs, batch_size):
            inputs = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
                      if k not in ("labels", "group_ids")}
            out.append(self.model(**inputs)["scores"].float().cpu().numpy())
            if lengths is not None:
                lengths.extend(int(n) for n in batch["attention_mask"].sum(1).tolist())
        raw = np.concatenate(out) if out else np.zeros(0, dtype=np.float32)
        return raw if raw_scores else self.relevance(raw)

    def relevance(self, raw: np.ndarray) -> np.ndarray:
        """The ``relevance_score`` of raw scores: :func:`~mmembed.eval.ranking.probabilities`, or
        for a model trained from a CrossEncoder folder its ``activation_fn`` (``predict``'s default)."""
        if self.model.cross_encoder is not None:
            return self.model.cross_encoder.activate(raw)
        return probabilities(raw)

    def score(self, query: Any, documents: Sequence[Any], batch_size: int = 32,
              raw_scores: bool = False) -> np.ndarray:
        """``[len(documents)]`` float32: :meth:`score_pairs` of ``query`` with each document."""
        return self.score_pairs([(query, d) for d in documents], batch_size, raw_scores=raw_scores)

    def rank(self, query: Any, documents: Sequence[Any], top_n: int | None = None, batch_size: int = 32,
             raw_scores: bool = False) -> list[tuple[int, float]]:
        """``[(index, score)]``, at most ``top_n``, best first: ordered by the raw scores (ties
        in document order, :func:`rank_order`), each score as :meth:`score` gives it."""
        raw = self.score(query, documents, batch_size, raw_scores=True)
        shown = raw if raw_scores else self.relevance(raw)
        return [(int(i), float(shown[i])) for i in rank_order(raw, top_n)]
