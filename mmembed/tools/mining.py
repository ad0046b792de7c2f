"""Hard-negative mining: give each row negatives that score high for its query but are not
its positive, and drop the candidates that are likely unlabeled positives.

    from mmembed.tools.mining import MiningConfig, mine_file
    stats = mine_file("train.jsonl", "train_hn.jsonl", model="path/to/embedding-model",
                      config=MiningConfig(num_negatives=3, range_min=10, margin=0.05))
    print(stats.summary())

Steps
-----
1. **Rows**: every row of the input (any format mmembed reads, both ms-swift row forms) is
   parsed by the training reader (:func:`mmembed.data.parse_row`), so media tags are bound
   and a broken row is a ``DataError`` naming file, line and field.
2. **Corpus**: the distinct positives (responses) of all rows, then the texts of
   ``corpus`` (optional: a ``.txt`` file, one text per line, or ``.jsonl``/``.json`` rows
   with a ``"text"`` field). Two documents are the same when their text and media paths are
   equal; a document keeps the position of its first appearance (its index).
3. **Scores**: every distinct query against every document.

   - BM25 (the default, no model): ``bm25s`` with its defaults (Lucene variant, k1 = 1.5,
     b = 0.75), texts lower-cased and split by ``bm25s.tokenize`` with English stopwords
     removed. A document must share a term with the query (score > 0) to be a candidate.
     BM25 sees text only.
   - dense (``model``): an :class:`~mmembed.model.embedder.Embedder` embeds queries and
     documents (a document as it first appeared, system prompt included); the score is the
     cosine (dot product of the normalized embeddings), computed exactly in blocks.

4. **Ranking** (per row): candidates are all documents except the row's positives (every
   document paired with the same query anywhere in the file), documents equal to the query
   itself and, unless ``overwrite``, the row's existing negatives. They are sorted by
   decreasing score, equal scores by increasing document index; rank 0 is the best. Only
   ranks ``range_min <= rank < range_max`` are considered.
5. **False-negative filters**, in rank order, with ``s`` the mining score and ``p`` the
   row's own positive:

   - ``margin`` (absolute): drop ``c`` if ``s(q, c) > s(q, p) - margin``;
   - ``relative_margin``: drop ``c`` if ``s(q, c) > s(q, p) * (1 - relative_margin)``;
   - ``guide`` (a second embedder, ``g`` its cosine): drop ``c`` if
     ``g(q, c) >= g(q, p) - guide_margin``.

   The first ``num_negatives`` survivors are the row's new negatives (fewer when the rank
   window runs out). Everything is deterministic.
6. **Output**, in the form the row came in:

   - query form (and ms-swift 3.x ``messages`` rows whose last message is the positive):
     the texts go to ``rejected_response`` (or the alias the row already uses:
     ``negative``/``negatives``/``negative_N``), after the existing negatives unless
     ``overwrite``; the media paths of mined documents are appended to ``images`` /
     ``videos`` / ``audios``, where the reader binds the tags of the negatives (last).
   - messages form: one ``negative_messages`` group per negative (the positive group's
     system message, then ``{"role": "user", "content": text}``), with
     ``negative_images``/``negative_videos``/``negative_audios`` kept aligned with the
     groups whenever a group has media.

   Mined media paths are written relative to the output file's folder, and so are the
   rows' own relative media paths when the output goes to another folder. The output is
   written to a temporary file in the same folder, then renamed over ``output``: a failed
   run leaves no half-written file.

Rows copied unchanged (and counted in the summary): rows with a ``label`` other than 1
(pair-loss rows, whose response need not be a positive) and rows whose query or positive
has media the model cannot embed (all media rows under BM25 or a text-only model). Media
documents join the corpus only when every model in use embeds their media kinds.
"""

from __future__ import annotations

import math
import os
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..data.formats import iter_raw_rows
from ..data.rows import (
    has_group_messages,
    parse_row,
)
from ..data.sample import MEDIA_KINDS, DataError, Item, Sample
from ..eval.first_stage import bm25_scorer, dense_scorer
from ..eval.ranking import top_k
from .mined_rows import check_output_path, rebase_media, with_negative_groups, with_rejected_responses, write_rows
from .rerank_teacher import add_teacher_scores, load_teacher_reranker

__all__ = [
    "MiningConfig",
    "MiningStats",
    "mine_rows",
    "mine_file",
    "read_corpus",
    "bm25_scorer",
    "dense_scorer",
    "check_output_path",
]

# A scorer maps the indices of some distinct queries to their scores against every
# document: [len(query_ids), num_docs], float64.
DocKey = tuple  # (text, images, videos, audios)


@dataclass
class MiningConfig:
    """What to mine; see the module docstring for the exact rules."""

    num_negatives: int = 3
    range_min: int = 0
    range_max: int = 100
    margin: float | None = None
    relative_margin: float | None = None
    guide_margin: float = 0.0
    overwrite: bool = False
    batch_size: int = 64

    def validate(self) -> None:
        """A ValueError naming the flag (``mmembed mine``'s spelling) of the first bad value."""
        if self.num_negatives < 1:
            raise ValueError(f"--num_negatives must be an integer >= 1, got {self.num_negatives}")
        if not 0 <= self.range_min < self.range_max:
            raise ValueError(f"--range_min and --range_max need 0 <= range_min < range_max, got --range_min "
                             f"{self.range_min} --range_max {self.range_max}")
        if self.relative_margin is not None and not 0 <= self.relative_margin < 1:
            raise ValueError(f"--relative_margin must lie in [0, 1), got {self.relative_margin}")
        for name in ("margin", "guide_margin"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"--{name} must be a finite number, got {value}")
        if self.batch_size < 1:
            raise ValueError(f"--batch_size must be an integer >= 1, got {self.batch_size}")


@dataclass
class MiningStats:
    """What a mining run did."""

    rows: int = 0
    mined_rows: int = 0
    corpus_size: int = 0
    histogram: dict[int, int] = field(default_factory=dict)  # new negatives per mined row -> rows
    dropped_margin: int = 0
    dropped_guide: int = 0
    copied: dict[str, list[int]] = field(default_factory=dict)  # reason -> lines copied unchanged
    teacher_scored: int | None = None  # rows given teacher_scores (None: no --teacher_reranker)
    teacher_skipped: list[int] = field(default_factory=list)  # mined rows the reranker could not score

    @property
    def dropped(self) -> int:
        return self.dropped_margin + self.dropped_guide

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "mined_rows": self.mined_rows,
            "corpus_size": self.corpus_size,
            "negatives_per_row": {str(k): v for k, v in sorted(self.histogram.items())},
            "dropped_false_negatives": self.dropped,
            "dropped_margin": self.dropped_margin,
            "dropped_guide": self.dropped_guide,
            "copied_unchanged": {reason: len(lines) for reason, lines in self.copied.items()},
            **({} if self.teacher_scored is None else {"teacher_scored": self.teacher_scored,
                                                       "teacher_skipped": len(self.teacher_skipped)}),
        }

    def summary(self) -> str:
        hist = ", ".join(f"{k}: {v}" for k, v in sorted(self.histogram.items())) or "none"
        lines = [
            f"rows: {self.rows}, mined: {self.mined_rows}, corpus: {self.corpus_size} documents",
            f"new negatives per row (negatives: rows): {hist}",
            f"candidates dropped as likely false negatives: {self.dropped} "
            f"(margin: {self.dropped_margin}, guide model: {self.dropped_guide})",
        ]
        for reason, where in self.copied.items():
            shown = ", ".join(map(str, where[:10])) + (", ..." if len(where) > 10 else "")
            lines.append(f"copied unchanged, {reason}: {len(where)} row(s) (lines {shown})")
        if self.teacher_scored is not None:
            lines.append(f"teacher_scores from the reranker: {self.teacher_scored} row(s)" + (
                f"; not scored (media it does not take): lines {self.teacher_skipped[:10]}"
                if self.teacher_skipped else ""))
        return "\n".join(lines)


# ----------------------------------------------------------------------------- scorers


# ----------------------------------------------------------------------------- corpus


def _doc_key(item: Item) -> DocKey:
    return (item.text, tuple(item.images), tuple(item.videos), tuple(item.audios))


def _query_key(item: Item) -> tuple:
    return (item.system, *_doc_key(item))


def read_corpus(path: str) -> list[str]:
    """Extra documents: a ``.txt`` file (one text per non-empty line) or rows with ``"text"``."""
    if path.endswith(".txt"):
        with open(path, encoding="utf-8") as f:
            return [line.rstrip("\n") for line in f if line.strip()]
    texts = []
    for line, raw in iter_raw_rows(path):
        if not isinstance(raw, dict) or not isinstance(raw.get("text"), str):
            raise DataError(path, line, "text", "a corpus row needs a 'text' string")
        if raw["text"].strip():
            texts.append(raw["text"])
    return texts


def _supports(item: Item, kinds: frozenset[str]) -> bool:
    return all(kind in kinds for kind in MEDIA_KINDS if item.media(kind))


def _media_kinds(embedder: Any) -> frozenset[str]:
    template = getattr(embedder, "template", None)
    return frozenset(getattr(template, "media", None) or ())


# ----------------------------------------------------------------------------- mining


@dataclass
class _Row:
    """One input row and, once ranked, its candidate window and picks."""

    index: int  # position in the input
    line: int
    raw: Any
    sample: Sample
    messages_form: bool
    query: int = -1  # index into the distinct queries
    positive: int = -1  # document index of the own positive
    excluded: np.ndarray | None = None
    window: np.ndarray | None = None  # candidate documents in rank order, ranks [range_min, range_max)
    window_scores: np.ndarray | None = None  # their mining scores
    positive_score: float = 0.0  # the mining score of the own positive
    picked: list[int] = field(default_factory=list)


def mine_rows(
    rows: Sequence[tuple[int, Any]],
    source: str,
    base_dir: str,
    *,
    embedder: Any = None,
    guide: Any = None,
    extra_docs: Sequence[str] = (),
    config: MiningConfig | None = None,
    media_root: str | None = None,
    teacher: Any = None,
) -> tuple[list[Any], MiningStats]:
    """Mine negatives for raw ``rows`` (``(line, row)`` as :func:`iter_raw_rows` yields them).

    ``embedder``/``guide`` are objects with ``encode(inputs, batch_size=...) -> [n, D]``
    normalized (an :class:`~mmembed.model.embedder.Embedder`); ``embedder=None`` mines with BM25.
    Relative media paths resolve against ``base_dir``. With ``media_root`` (the output's
    folder) every relative media path written, the rows' own and the mined ones, is relative
    to it; with ``None`` the rows' paths are left as they are and mined paths are absolute.
    ``teacher``: a reranker (``score_pairs``); each mined row then gets ``teacher_scores``
    (:func:`~mmembed.tools.rerank_teacher.add_teacher_scores`). Returns the new rows, in
    input order, and the statistics; the input rows are not modified.
    """
    cfg = config or MiningConfig()
    cfg.validate()
    stats = MiningStats(rows=len(rows))
    kinds = _media_kinds(embedder) if embedder is not None else frozenset()
    if guide is not None:
        kinds &= _media_kinds(guide)

    parsed = [
        _Row(i, line, raw, parse_row(raw, source, line, base_dir), has_group_messages(raw))
        for i, (line, raw) in enumerate(rows)
    ]

    # Corpus: distinct positives, then the extra texts.
    docs: list[Item] = []
    doc_index: dict[DocKey, int] = {}

    def add_doc(item: Item) -> None:
        key = _doc_key(item)
        if key not in doc_index and _supports(item, kinds):
            doc_index[key] = len(docs)
            docs.append(item)

    for r in parsed:
        for p in r.sample.positives:
            add_doc(p)
    for text in extra_docs:
        add_doc(Item(text=text))
    stats.corpus_size = len(docs)

    # Positives of each query, over the whole file.
    positives_of: dict[DocKey, set[int]] = defaultdict(set)
    for r in parsed:
        for p in r.sample.positives:
            if _doc_key(p) in doc_index:
                positives_of[_doc_key(r.sample.anchor)].add(doc_index[_doc_key(p)])

    mined: list[_Row] = []
    queries: list[Item] = []
    query_index: dict[tuple, int] = {}
    for r in parsed:
        s = r.sample
        if s.label is not None and s.label != 1.0:
            stats.copied.setdefault("label other than 1 (pair rows)", []).append(r.line)
            continue
        if not (_supports(s.anchor, kinds) and _doc_key(s.positives[0]) in doc_index):
            reason = "media the model cannot embed" if embedder is not None else "media (BM25 mines text only)"
            stats.copied.setdefault(reason, []).append(r.line)
            continue
        qkey = _query_key(s.anchor)
        if qkey not in query_index:
            query_index[qkey] = len(queries)
            queries.append(s.anchor)
        r.query = query_index[qkey]
        r.positive = doc_index[_doc_key(s.positives[0])]
        excluded = set(positives_of[_doc_key(s.anchor)])
        if _doc_key(s.anchor) in doc_index:
            excluded.add(doc_index[_doc_key(s.anchor)])
        if not cfg.overwrite:
            excluded.update(doc_index[k] for k in map(_doc_key, s.negatives) if k in doc_index)
        r.excluded = np.fromiter(sorted(excluded), dtype=np.int64)
        mined.append(r)

    if mined:
        _rank_windows(mined, queries, docs, embedder, cfg)
        _filter_and_pick(mined, queries, docs, guide, cfg, stats)
    stats.mined_rows = len(mined)
    stats.histogram = dict(sorted(Counter(len(r.picked) for r in mined).items()))

    out = [r.raw for r in parsed]
    if media_root is not None and os.path.abspath(media_root) != os.path.abspath(base_dir):
        out = [rebase_media(row, base_dir, media_root) for row in out]
    for r in parsed:
        r.raw = out[r.index]
    for r in mined:
        new = [docs[i] for i in r.picked]
        if r.messages_form:
            out[r.index] = with_negative_groups(r.raw, r.sample, new, cfg.overwrite, media_root)
        else:
            out[r.index] = with_rejected_responses(r.raw, new, cfg.overwrite, media_root)
    if teacher is not None:
        lines = [r.line for r in parsed]
        stats.teacher_skipped = add_teacher_scores(out, [r.index for r in mined], lines, source,
                                                   media_root or base_dir, teacher, cfg.batch_size)
        stats.teacher_scored = len(mined) - len(stats.teacher_skipped)
    return out, stats


def _embed(embedder: Any, items: Sequence[Item], batch_size: int) -> np.ndarray:
    emb = np.asarray(embedder.encode(list(items), batch_size=batch_size), dtype=np.float32)
    if emb.ndim != 2 or emb.shape[0] != len(items):
        raise ValueError(f"the embedder returned shape {emb.shape} for {len(items)} inputs")
    return emb


def _rank_windows(mined: list[_Row], queries: list[Item], docs: list[Item], embedder: Any, cfg: MiningConfig) -> None:
    """Score the distinct queries against the corpus in blocks; store each row's window and
    the mining scores it needs (``r.window_scores``, ``r.positive_score``)."""
    if embedder is None:
        scorer = bm25_scorer([q.text for q in queries], [d.text for d in docs])
        sparse = True
    else:
        scorer = dense_scorer(_embed(embedder, queries, cfg.batch_size), _embed(embedder, docs, cfg.batch_size))
        sparse = False
    rows_of: dict[int, list[_Row]] = defaultdict(list)
    for r in mined:
        rows_of[r.query].append(r)
    block = max(1, (1 << 22) // max(1, len(docs)))
    for start in range(0, len(queries), block):
        ids = np.arange(start, min(len(queries), start + block))
        scores = scorer(ids)
        for q, s in zip(ids, scores):
            for r in rows_of[int(q)]:
                masked = s.copy()
                if sparse:
                    masked[masked <= 0] = -np.inf  # no shared term: not a candidate
                masked[r.excluded] = -np.inf
                ranked = top_k(masked[None, :], cfg.range_max)[0]  # -inf never ranked
                r.window = ranked[cfg.range_min:]
                r.window_scores = s[r.window]
                r.positive_score = float(s[r.positive])


def _filter_and_pick(
    mined: list[_Row], queries: list[Item], docs: list[Item], guide: Any, cfg: MiningConfig, stats: MiningStats
) -> None:
    """Walk each row's window in rank order: drop likely false negatives (margins, guide),
    keep the first ``num_negatives`` survivors in ``r.picked``."""
    guide_q = guide_d = None
    doc_slot: dict[int, int] = {}
    if guide is not None:
        # Embed only what the filter looks at: the windows and the positives.
        needed = sorted({int(i) for r in mined for i in r.window} | {r.positive for r in mined})
        doc_slot = {d: j for j, d in enumerate(needed)}
        guide_q = _embed(guide, queries, cfg.batch_size)
        guide_d = _embed(guide, [docs[i] for i in needed], cfg.batch_size)
    for r in mined:
        thresholds = []
        if cfg.margin is not None:
            thresholds.append(r.positive_score - cfg.margin)
        if cfg.relative_margin is not None:
            thresholds.append(r.positive_score * (1.0 - cfg.relative_margin))
        if guide_q is not None:
            g = guide_d[[doc_slot[int(i)] for i in r.window]] @ guide_q[r.query] if len(r.window) else np.zeros(0)
            g_pos = float(guide_d[doc_slot[r.positive]] @ guide_q[r.query])
        for j, (doc, score) in enumerate(zip(r.window, r.window_scores)):
            if len(r.picked) == cfg.num_negatives:
                break
            if any(score > t for t in thresholds):
                stats.dropped_margin += 1
                continue
            if guide_q is not None and g[j] >= g_pos - cfg.guide_margin:
                stats.dropped_guide += 1
                continue
            r.picked.append(int(doc))


# ----------------------------------------------------------------------------- writing rows


def mine_file(
    dataset: str,
    output: str,
    *,
    model: Any = None,
    guide_model: Any = None,
    corpus: str | None = None,
    config: MiningConfig | None = None,
    torch_dtype: str | None = None,
    teacher_reranker: Any = None,
) -> MiningStats:
    """Mine ``dataset`` into ``output`` (see the module docstring).

    ``model``/``guide_model``: a folder path (loaded with ``Embedder.from_pretrained``) or an
    object with ``encode``; ``model=None`` mines with BM25. ``corpus``: extra documents
    (:func:`read_corpus`). ``teacher_reranker``: a reranker folder (or an object with
    ``score_pairs``) whose scores of each mined row's candidates become its
    ``teacher_scores``. Returns the statistics; ``stats.summary()`` is what the CLI prints.
    """
    cfg = config or MiningConfig()
    cfg.validate()
    check_output_path(output)  # before any work
    rows = list(iter_raw_rows(dataset))
    extra = read_corpus(corpus) if corpus else []
    embedder = _load(model, torch_dtype)
    guide = _load(guide_model, torch_dtype)
    teacher = load_teacher_reranker(teacher_reranker, torch_dtype)
    out_rows, stats = mine_rows(
        rows,
        dataset,
        os.path.dirname(os.path.abspath(dataset)),
        embedder=embedder,
        guide=guide,
        extra_docs=extra,
        config=cfg,
        media_root=os.path.dirname(os.path.abspath(output)),
        teacher=teacher,
    )
    write_rows(out_rows, output)
    return stats


def _load(model: Any, torch_dtype: str | None) -> Any:
    if model is None or not isinstance(model, str):
        return model
    from ..model.embedder import Embedder

    return Embedder.from_pretrained(model, torch_dtype=torch_dtype)
