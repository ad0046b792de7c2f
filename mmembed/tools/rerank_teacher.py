"""``mmembed mine --teacher_reranker CKPT``: a reranker scores each mined row's candidates,
written as the row's ``teacher_scores`` for distillation (``--loss_type distill_kl`` with
``use_batch`` false).

The candidates are read back from the row as written, by the training reader
(:func:`mmembed.data.parse_row`), so the scores are in the order the reader pairs them
with: the row's (first) positive, then every negative the row ends up with, the ones it
had before mining first (unless ``--overwrite``), then the mined ones. ``teacher_scores[j]``
is :meth:`Reranker.score` of the row's query with that candidate, ``raw_scores=True``: the
reranker's raw score (the classifier's logit, or ``logit(yes) - logit(no)``), not the
probability ``sigmoid(s)`` that ``mmembed rerank`` reports (``distill_kl`` takes a softmax of
the scores, over logits). A row's earlier ``teacher_scores`` are replaced.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..data.rows import TEACHER_FIELDS, parse_row
from ..data.sample import MEDIA_KINDS, Item

__all__ = ["add_teacher_scores", "load_teacher_reranker"]


def _takes(item: Item, kinds: frozenset[str]) -> bool:
    return all(kind in kinds for kind in MEDIA_KINDS if item.media(kind))


def add_teacher_scores(rows: list[Any], which: Sequence[int], lines: Sequence[int], source: str, base_dir: str,
                       reranker: Any, batch_size: int = 64) -> list[int]:
    """Set ``teacher_scores`` on ``rows[i]`` for each ``i`` in ``which`` (in place).

    ``rows``: raw rows as written; ``lines[i]``: row ``i``'s line (for errors); relative
    media paths resolve against ``base_dir``. ``reranker``: an object with
    ``score_pairs(pairs, batch_size=, raw_scores=True) -> [n]`` raw scores (a
    :class:`~mmembed.tasks.reranker.scorer.Reranker`) and a ``template.media`` of the media kinds
    it takes.

    Returns:
        The lines of the rows left without scores: their query or a candidate has media
        the reranker does not take.
    """
    kinds = frozenset(getattr(getattr(reranker, "template", None), "media", None) or ())
    pairs: list[tuple[Item, Item]] = []
    spans: list[tuple[int, int, int]] = []  # (row, first pair, pairs)
    skipped = []
    for i in which:
        # earlier teacher fields were for the candidates before mining: not read here
        row = {k: v for k, v in rows[i].items() if k not in TEACHER_FIELDS}
        sample = parse_row(row, source, lines[i], base_dir)
        candidates = [sample.positives[0], *sample.negatives]
        if not all(_takes(it, kinds) for it in (sample.anchor, *candidates)):
            skipped.append(lines[i])
            continue
        spans.append((i, len(pairs), len(candidates)))
        pairs += [(sample.anchor, c) for c in candidates]
    scores = reranker.score_pairs(pairs, batch_size=batch_size, raw_scores=True) if pairs else []
    for i, start, n in spans:
        rows[i] = dict(rows[i], teacher_scores=[float(s) for s in scores[start:start + n]])
    return skipped


def load_teacher_reranker(model: Any, torch_dtype: str | None = None) -> Any:
    """``model``: a reranker folder (loaded with ``Reranker.from_pretrained``), an object with
    ``score_pairs``, or None."""
    if model is None or not isinstance(model, str):
        return model
    from ..task import pair_scorer_task

    return pair_scorer_task(model, flag="--teacher_reranker").load_scorer(model, torch_dtype=torch_dtype)
