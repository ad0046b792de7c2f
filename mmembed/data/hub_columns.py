"""A hub dataset's rows in mmembed's row forms: ms-swift's registered embedding and reranker
datasets mapped as ms-swift maps them, any other dataset by its column names.

Three cases, decided per dataset (:func:`swift_dataset`, :func:`positional_columns`):

* **ms-swift's registered datasets** (:data:`SWIFT_DATASETS`): the same hub ids, subsets,
  splits and row mapping as ms-swift's ``register_dataset(DatasetMeta(...))`` entries
  (``swift/dataset/dataset/llm.py`` and ``mllm.py`` of ms-swift 4.x): its preprocessor's column
  renames first (case-insensitive, ``image`` -> ``images``), then its ``preprocess`` as a
  function of one row (:class:`RowMapper`), returning a messages-form row or None (ms-swift
  drops the row).
* **rows already in mmembed's forms** (``query``/``response``/``rejected_response``,
  ``messages``/``positive_messages``/``negative_messages``, media columns) and
  sentence-transformers' named columns (``anchor``/``positive``/``negative``,
  ``negative_1..n``, ``sentence1``/``sentence2``/``score``, ``question``/``answer``) pass as
  they are: the reader (:mod:`mmembed.data.rows`) reads them and names them in its errors.
* **sentence-transformers' column order**: a dataset none of whose columns the reader knows
  as an anchor, whose other columns are all text, is read as sentence-transformers reads it
  (``sentence_transformers.base.data_collator``: a ``label``/``labels``/``score``/``scores``
  column is the label, the others are inputs in order): the first column is the query, the
  second the response, the rest the hard negatives, e.g. (``sentence_A``, ``sentence_B``,
  ``score``) or (``premise``, ``hypothesis``, ``label``).

Media columns reach the mapping as paths (:mod:`mmembed.data.hub` writes embedded image bytes
to files first), so every mapped row is JSON.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .rows import MESSAGES_FIELDS, QUERY_ALIASES

__all__ = ["SWIFT_DATASETS", "RowMapper", "SwiftDataset", "SwiftSubset", "positional_columns", "swift_dataset",
           "swift_renames"]

#: sentence-transformers' label columns (``DEFAULT_LABEL_COLUMNS`` of its data collator)
ST_LABEL_COLUMNS = ("label", "labels", "score", "scores")
#: the columns the reader takes as a row's anchor (its query-form aliases and messages fields)
_ANCHOR_COLUMNS = frozenset(QUERY_ALIASES["query"] + MESSAGES_FIELDS)


def positional_columns(columns: list[str], text_columns: set[str]) -> dict[str, str] | None:
    """sentence-transformers' reading of a dataset by column order, as renames (old -> new):
    ``{first: "query", second: "response", third: "negative_1", ...}`` plus its label column
    as ``label``; None when the reader reads the columns by name (a column it knows as the
    anchor), or when a column other than the label holds anything but text (then neither
    reading applies and the reader's error names what is missing)."""
    if any(c in _ANCHOR_COLUMNS for c in columns):
        return None
    label = next((c for c in ST_LABEL_COLUMNS if c in columns), None)
    inputs = [c for c in columns if c != label]
    if len(inputs) < 2 or any(c not in text_columns for c in inputs):
        return None
    renames = {inputs[0]: "query", inputs[1]: "response"}
    renames.update({c: f"negative_{i}" for i, c in enumerate(inputs[2:], 1)})
    if label is not None:
        renames[label] = "label"
    return renames


# ----------------------------------------------------------------------------- ms-swift's datasets


class RowMapper:
    """One ms-swift preprocessor as a function of one row (after its renames): ``prepare`` is
    called with each split's rows before they are mapped (a mapper that draws from the whole
    split, TextCaps' reranker negatives, reads them there); ``__call__`` returns the row in
    mmembed's form, or None when ms-swift drops it."""

    #: the columns (after the renames) the mapping reads: a dataset without one is refused
    needs: tuple[str, ...] = ()

    def prepare(self, column: Callable[[str], list[Any]]) -> None:
        """``column(name)``: one column of the split, whole."""

    def __call__(self, row: dict[str, Any]) -> dict[str, Any] | None:
        raise NotImplementedError


def _user(text: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


class StsbPairs(RowMapper):
    """ms-swift's ``StsbPreprocessor``: ``sentence1`` -> messages, ``sentence2`` -> the positive,
    ``score`` -> label; with ``threshold`` only the rows scored at least that (its ``positive``
    subset, 0.75)."""

    needs = ("sentence1", "sentence2", "score")

    def __init__(self, threshold: float | None = None):
        self.threshold = threshold

    def __call__(self, row):
        score = row.get("score")
        if self.threshold is not None and isinstance(score, (int, float)) and score < self.threshold:
            return None
        return {"messages": _user(row.get("sentence1")), "positive_messages": [_user(row.get("sentence2"))],
                "label": score}


class MtebRerank(RowMapper):
    """ms-swift's ``MTEBRerankPreprocessor``: ``query`` -> messages, each of ``positive`` and of
    ``negative`` (a list or one text) -> a group of one assistant message."""

    needs = ("query", "positive", "negative")

    def __call__(self, row):
        def texts(value):
            return value if isinstance(value, list) else [value]

        return {"messages": _user(row.get("query")),
                "positive_messages": [[{"role": "assistant", "content": t}] for t in texts(row.get("positive"))],
                "negative_messages": [[{"role": "assistant", "content": t}] for t in texts(row.get("negative"))]}


def _image_exists(value: Any) -> bool:
    import os

    return isinstance(value, str) and os.path.isfile(value)


class TextCapsEmb(RowMapper):
    """ms-swift's ``TextCapsEmbPreprocessor``: the image is the anchor (``<image>``), the first
    reference caption (``reference_strs``, renamed ``response``) the positive."""

    needs = ("images", "response")

    def __call__(self, row):
        captions = row.get("response") or [None]
        image = row.get("images")
        return {"messages": _user("<image>"), "positive_messages": [_user(captions[0])],
                "images": [image] if image is not None else []}


class TextCapsRerank(RowMapper):
    """ms-swift's ``TextCapsReRankPreprocessor``: as :class:`TextCapsEmb`, plus ``negatives``
    (``MAX_NEGATIVE_SAMPLES``, default 7) captions of other images as negatives, drawn as
    ms-swift draws them: one ``numpy.random.RandomState(42)`` for the whole load, and per row
    whose image file is there a permutation of the split's captions (every ``reference_strs``
    of the split, in order), taking the first ones that are not among the row's own."""

    needs = ("images", "response")

    def __init__(self, negatives: int = 7):
        self.negatives = negatives
        self.random_state = np.random.RandomState(42)
        self.pool: list[str] = []

    def prepare(self, column):
        pool = []
        for value in column("response"):
            if isinstance(value, (list, tuple)):
                pool += [s for s in value if isinstance(s, str)]
            elif isinstance(value, str):
                pool.append(value)
        self.pool = pool

    def __call__(self, row):
        out = TextCapsEmb()(row)
        captions = row.get("response") or []
        negatives: list[str] = []
        if self.pool and _image_exists(row.get("images")):  # ms-swift draws for the rows it keeps
            for i in self.random_state.permutation(len(self.pool)):
                text = self.pool[i]
                if text not in captions:
                    negatives.append(text)
                if len(negatives) >= self.negatives:
                    break
        out["negative_messages"] = [_user(t) for t in negatives]
        return out


@dataclass(frozen=True)
class SwiftSubset:
    """One subset of an ms-swift registered dataset: its name in the spec (``:emb``), the hub's
    subset (configuration) it loads, its splits (None: the dataset's), ms-swift's renames before
    the row mapping, and the mapping (a factory taking ``MAX_NEGATIVE_SAMPLES``); ``refused``: why
    mmembed does not read it (an ms-swift subset of generation or regression rows)."""

    name: str
    hub_subset: str = "default"
    splits: tuple[str, ...] | None = None
    columns: dict[str, str] = field(default_factory=dict)
    mapper: Callable[[int], RowMapper] | None = None
    refused: str = ""


@dataclass(frozen=True)
class SwiftDataset:
    """An ms-swift registered dataset: its ModelScope and Hugging Face ids, default splits and
    mapping (for a subset it does not list), and its subsets."""

    ms_id: str
    hf_id: str
    subsets: tuple[SwiftSubset, ...]
    splits: tuple[str, ...] = ("train",)
    mapper: Callable[[int], RowMapper] | None = None  # None: the dataset's columns read by name

    @property
    def name(self) -> str:
        return self.ms_id

    def subset(self, name: str) -> SwiftSubset:
        """The subset ``name`` with the dataset's splits and mapping where it names none; one
        ms-swift does not list loads the hub's subset of that name (ms-swift's
        ``SubsetDataset(subset=name).set_default(meta)``)."""
        found = next((s for s in self.subsets if s.name == name), None) or SwiftSubset(name, name)
        return replace(found, splits=found.splits or self.splits, mapper=found.mapper or self.mapper)


_GENERATION = "ms-swift's {what} rows for a language model ({how}), not embedding or reranker rows; use {use}"
_TEXTCAPS = {"reference_strs": "response"}

#: ms-swift 4.x's registered embedding and reranker datasets (swift/dataset/dataset/llm.py, mllm.py)
SWIFT_DATASETS: tuple[SwiftDataset, ...] = (
    SwiftDataset("sentence-transformers/stsb", "sentence-transformers/stsb", (
        SwiftSubset("default", mapper=lambda _: StsbPairs()),
        SwiftSubset("positive", mapper=lambda _: StsbPairs(threshold=0.75)),
        SwiftSubset("generate", refused=_GENERATION.format(
            what="similarity-generation", how="a prompt and the score as text",
            use="sentence-transformers/stsb (scored pairs) or :positive (pairs scored >= 0.75)")),
        SwiftSubset("reg", refused=_GENERATION.format(
            what="regression", how="a prompt holding both sentences and the score",
            use="sentence-transformers/stsb (scored pairs) or :positive (pairs scored >= 0.75)")),
    )),
    SwiftDataset("MTEB/scidocs-reranking", "mteb/scidocs-reranking", (SwiftSubset("default"),),
                 splits=("validation", "test"), mapper=lambda _: MtebRerank()),
    SwiftDataset("MTEB/stackoverflowdupquestions-reranking", "mteb/stackoverflowdupquestions-reranking",
                 (SwiftSubset("default"),), splits=("train", "test"), mapper=lambda _: MtebRerank()),
    SwiftDataset("swift/TextCaps", "HuggingFaceM4/TextCaps", (
        SwiftSubset("default", splits=("train", "validation"), refused=_GENERATION.format(
            what="captioning", how="'What is the caption of this image?' and a caption",
            use="swift/TextCaps:emb (image -> caption) or swift/TextCaps:rerank (with negatives)")),
        SwiftSubset("emb", splits=("train", "validation"), columns=_TEXTCAPS, mapper=lambda _: TextCapsEmb()),
        SwiftSubset("rerank", splits=("train", "validation"), columns=_TEXTCAPS, mapper=TextCapsRerank),
    )),
)


def swift_dataset(hub: str, repo_id: str) -> tuple[SwiftDataset | None, bool]:
    """The ms-swift registered dataset of ``repo_id`` on ``hub`` (``"hf"``/``"ms"``) and whether
    the id matched exactly. As ms-swift (``DatasetSyntax.get_dataset_meta``): the id registered
    for that hub, else one whose name (after the last ``/``) is the same (``anyorg/stsb`` takes
    stsb's mapping); ``(None, False)`` for any other id."""
    for entry in SWIFT_DATASETS:
        if repo_id == (entry.hf_id if hub == "hf" else entry.ms_id):
            return entry, True
    name = repo_id.rstrip("/").rsplit("/", 1)[-1]
    for entry in SWIFT_DATASETS:
        if name in (entry.ms_id.rsplit("/", 1)[-1], entry.hf_id.rsplit("/", 1)[-1]):
            return entry, False
    return None, False


def swift_renames(columns: list[str], renames: dict[str, str]) -> dict[str, str]:
    """ms-swift's ``safe_rename_columns`` of a preprocessor's ``columns`` plus its automatic media
    renames (``image`` -> ``images``, ``video`` -> ``videos``, ``audio`` -> ``audios``): names
    matched without case, a target two columns would take left alone, a column named as its
    target kept."""
    out: dict[str, str] = {}
    for mapping in (renames, {k: f"{kind}s" for kind in ("image", "video", "audio") for k in (kind, f"{kind}s")}):
        lower = {c.lower(): c for c in columns}
        safe = {lower[k.lower()]: v for k, v in mapping.items() if k.lower() in lower}
        targets = list(safe.values())
        safe = {k: v for k, v in safe.items() if targets.count(v) == 1 and k != v}
        columns = [safe.get(c, c) for c in columns]
        for old, new in safe.items():
            first = next((k for k, v in out.items() if v == old), old)
            out[first] = new
    return out
