"""Reranker rows -> scored pairs: the text of a (query, document) pair and the training batch.

A reranker reads the same rows as an embedding model (a ``Sample``: the query, its positives,
its negatives) but scores one (query, document) pair per model input. A reranker template
(``task = "reranker"``, :mod:`mmembed.encoding.templates`) says how a pair becomes text:

- ``pair_format`` (Qwen3-Reranker, Qwen3-VL-Reranker, jina-reranker-m0): one text,
  ``pair_format`` filled with the pair's instruction, the query's text and the document's, as
  the ``{content}`` of the template's chat ``format`` (whose system turn is ``default_system``;
  a ``pair_format`` without ``{instruction}`` gives the pair's instruction that place); the
  pair's media are those of the side written first, then the other's (the order of their tags
  in the text). A template's ``score_token_id`` is appended to every pair after tokenization
  (and counts against ``--max_length``): the position its score is read at.
- ``text_pair = true`` (BERT, ModernBERT, XLM-R cross-encoders): the tokenizer's own pair
  encoding ``tokenizer(query, document)``, token type ids included where the tokenizer gives
  them: what sentence-transformers' ``CrossEncoder`` feeds the model.

A pair's instruction is the first present of (ms-swift's "nearest wins", plus mmembed's flags):
the document's own ``system`` (a ``positive_messages`` / ``negative_messages`` group's system
message), the query row's ``system``, ``--query_system`` (a dataset config's ``query_system``
first), the template's ``default_instruction``. ``--document_system`` has no part in a pair.

:class:`RerankCollator` builds ms-swift's reranker batch. In training, for each row in batch
order, it draws ``choice(n_pos, min(n_pos, MAX_POSITIVE_SAMPLES), replace=False)`` positives
and, for each drawn positive, ``choice(n_neg, min(n_neg, MAX_NEGATIVE_SAMPLES), replace=False)``
negatives from one ``numpy.random.RandomState(42)`` made with the collator and kept across its
batches (ms-swift's calls, in its order, so the draws are the same); the batch is ``[pos, its
negatives..., pos, its negatives..., ...]``. Besides the model's inputs the batch holds
``labels`` (float32 ``[N]``: 1.0 for a positive, 0.0 for a negative) and ``group_ids`` (long
``[N]``: the index in the batch of the group, i.e. the drawn positive, each pair belongs to).
With ``train=False`` (evaluation, scoring) nothing is drawn: each positive in order, followed by
every negative in order (a row with several positives repeats its negatives in each group).

Truncation (``--truncation_strategy left|right`` with ``--max_length``): a text pair is cut as
the tokenizer's ``longest_first`` cuts it; a ``pair_format`` pair over the limit loses tokens
of its document first (its end, or its start with ``left``), then of its query, and only what
is still over is cut from the whole text as for an embedding input; a pair with media is not
cut (that would cut its media tokens) but is an error naming the row, as for embeddings.
ms-swift cuts the end of the whole text, which takes the assistant turn, where the score is read.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from ...data.sample import DataError, Item, Sample
from ...encoding.collator import StandInCollation
from ...encoding.inputs import InputBuilder, tokenizer_of
from ...encoding.instructions import Instructions
from ...encoding.layout import Layout
from ...encoding.templates import Template

if TYPE_CHECKING:  # the media loader is imported at the first row with media
    from ...encoding.media import MediaSettings

__all__ = ["GROUP_IDS", "RerankCollator", "document_after_query", "draw_pairs", "pair_instruction", "pair_item",
           "pair_texts", "pair_token_lengths", "with_score_token"]

#: the batch key of each pair's group index (a long tensor [N])
GROUP_IDS = "group_ids"
# the seed of ms-swift's reranker sampling (one RandomState per collator)
SEED = 42
# stands for a side's text while its place in the rendered pair is found (a private-use character)
_MARK = "\ue000"


def _require_reranker(template: Template) -> None:
    if not template.reranker:
        raise ValueError(f"template '{template.name}' is not a reranker template (task = \"reranker\"); "
                         "a reranker needs one of qwen3_reranker, qwen3_vl_reranker, bert_reranker or a file of yours")


def pair_instruction(template: Template, query: Item, document: Item) -> str | None:
    """The instruction of the pair (``query``, ``document``): the document's own system, else
    the query's, else ``template.query_system`` (``--query_system``), else
    ``template.default_instruction`` (None: no instruction)."""
    for value in (document.system, query.system, template.query_system, template.default_instruction):
        if value is not None:
            return value
    return None


def pair_item(template: Template, query: Item, document: Item) -> Item:
    """A ``pair_format`` template's pair as one ``Item``: its text ``pair_format`` filled (media
    tags still in place), no system of its own (the template's ``default_system`` is its
    system turn), the query's media then the document's. ``template.render`` of it is the
    pair's text."""
    _require_reranker(template)
    if template.pair_format is None:
        raise ValueError(f"template '{template.name}' encodes a pair as the tokenizer's text pair; see pair_texts")
    instruction = pair_instruction(template, query, document)
    text = template.pair_format.format(instruction=instruction or "", query=query.text, document=document.text)
    system = None if "{instruction}" in template.pair_format else instruction
    first, second = (query, document) if document_after_query(template) else (document, query)
    return Item(text, system, first.images + second.images, first.videos + second.videos,
                first.audios + second.audios)


def document_after_query(template: Template) -> bool:
    """Whether ``template.pair_format`` writes the query before the document."""
    return template.pair_format.find("{query}") < template.pair_format.find("{document}")


def pair_texts(template: Template, query: Item, document: Item) -> tuple[str] | tuple[str, str]:
    """The text(s) the tokenizer is called with for the pair (``query``, ``document``): one
    rendered string for a ``pair_format`` template; ``(query text, document text)`` for a
    ``text_pair`` template (the query preceded by the pair's instruction, if any, as
    ``format_with_system`` puts it)."""
    _require_reranker(template)
    if template.text_pair:
        return (template.format_text(query.text, pair_instruction(template, query, document)),
                template.format_text(document.text, None))
    return (template.render(pair_item(template, query, document)),)


def pair_token_lengths(samples: Sequence[Sample], builder: InputBuilder, total_within: int | None = None) -> list[int]:
    """The longest pair of each sample as the model sees it (the query with each of its
    positives and negatives, the pair's instruction and media included): what
    ``--truncation_strategy delete`` checks for a reranker. ``builder``: the reranker
    template's, not truncating. ``total_within``: the sum of the sample's pairs instead, each
    counted to at most that many tokens (``--packing``)."""
    template = builder.template
    flat: list[tuple[Item, Item]] = []
    owner: list[int] = []
    for i, s in enumerate(samples):
        for document in (*s.positives, *s.negatives):
            flat.append((s.anchor, document))
            owner.append(i)
    lengths = [0] * len(samples)
    if not flat:
        return lengths
    if template.text_pair:
        texts = [pair_texts(template, q, d) for q, d in flat]
        enc = builder.tokenizer([t[0] for t in texts], [t[1] for t in texts], add_special_tokens=template.add_special_tokens,
                        truncation=False)
        measured = [len(ids) for ids in enc["input_ids"]]
    else:
        items = [pair_item(template, q, d) for q, d in flat]
        origins = [(samples[i].source, samples[i].line, "query + document") for i in owner] if builder.multimodal else None
        measured = builder.lengths(items, origins)
    if template.score_token_id is not None:
        measured = [n + 1 for n in measured]
    for i, n in zip(owner, measured):
        lengths[i] = lengths[i] + min(n, total_within) if total_within is not None else max(lengths[i], n)
    return lengths


def draw_pairs(random_state: np.random.RandomState | None, n_positive: int, n_negative: int,
               max_positive: int, max_negative: int) -> list[tuple[int, list[int]]]:
    """``[(positive index, [negative indices])]`` of one row: ms-swift's draws from
    ``random_state`` (positives first, then each drawn positive's negatives); None: no draws,
    every positive in order with every negative in order."""
    if random_state is None:
        return [(i, list(range(n_negative))) for i in range(n_positive)]
    drawn = []
    for i in random_state.choice(n_positive, min(n_positive, max_positive), replace=False):
        negatives = random_state.choice(n_negative, min(n_negative, max_negative), replace=False)
        drawn.append((int(i), [int(j) for j in negatives]))
    return drawn


@dataclass
class _Pair:
    query: Item
    document: Item
    template: Template  # the student's template with the row's dataset instructions
    source: str
    line: int
    field: str  # the document's field in the row, for messages


@dataclass
class RerankCollator(StandInCollation):
    """Collate ``Sample``s into scored pairs: the model's inputs (``input_ids``,
    ``attention_mask``, ``token_type_ids`` where the tokenizer gives them, media tensors and
    ``media_counts`` for media batches), ``labels`` (float32 ``[N]``) and ``group_ids`` (long
    ``[N]``); see the module docstring for the order and the sampling."""

    #: the batch layout (the trainer checks it against its loss's)
    layout: ClassVar[Layout] = Layout.RERANK

    template: Template
    tokenizer: Any  # the tokenizer, or the processor for a multimodal template
    max_length: int | None = None
    truncation_side: str = "right"
    truncate: bool = True
    # training: ms-swift's draws; False (evaluation, scoring): every pair
    train: bool = True
    # positives drawn per row, negatives per drawn positive (None: MAX_POSITIVE_SAMPLES /
    # MAX_NEGATIVE_SAMPLES, read from the environment when the collator is made)
    max_positive: int | None = None
    max_negative: int | None = None
    bucket: bool = False
    media: MediaSettings | None = None
    # --strict false: a row whose media fail to load is replaced by a stand-in (EmbeddingCollator's rule)
    strict: bool = True
    # --dataset_config's instructions (a dataset's query_system is its pairs' instruction)
    instructions: Instructions = dataclasses.field(default_factory=Instructions)

    def __post_init__(self):
        _require_reranker(self.template)
        if self.max_positive is None or self.max_negative is None:
            from ... import environment

            sampling = environment.read().rerank_sampling
            self.max_positive = sampling.max_positive if self.max_positive is None else self.max_positive
            self.max_negative = sampling.max_negative if self.max_negative is None else self.max_negative
        if self.max_positive < 1 or self.max_negative < 0:
            raise ValueError(f"max_positive must be >= 1 and max_negative >= 0, got {self.max_positive} and "
                             f"{self.max_negative}")
        # the score token is appended after the text is cut to the rest of --max_length
        room = self.max_length - 1 if self.max_length and self.template.score_token_id is not None else self.max_length
        self.builder = InputBuilder(self.template, self.tokenizer, room, self.truncation_side, self.truncate,
                                    bucket=self.bucket, media=self.media)
        self._templates = self.instructions.templates(self.template)
        self.random_state = np.random.RandomState(SEED)

    def pairs(self, samples: Sequence[Sample]) -> tuple[list[_Pair], list[float], list[int]]:
        """The batch's pairs, labels and group ids, drawing from the collator's random state
        when training."""
        pairs: list[_Pair] = []
        labels: list[float] = []
        groups: list[int] = []
        state = self.random_state if self.train else None
        for s in samples:
            if not s.positives:
                raise DataError(s.source, s.line, "response",
                                "a reranker row needs a positive (response / positive_messages)")
            template = self._templates.get(s.dataset_id, self.template)
            several = len(s.positives) > 1
            for i, negatives in draw_pairs(state, len(s.positives), len(s.negatives), self.max_positive,
                                           self.max_negative):
                group = groups[-1] + 1 if groups else 0
                where = f"positive_messages[{i}]" if several else "response"
                pairs.append(_Pair(s.anchor, s.positives[i], template, s.source, s.line, where))
                labels.append(1.0)
                groups.append(group)
                for j in negatives:
                    pairs.append(_Pair(s.anchor, s.negatives[j], template, s.source, s.line, f"rejected_response[{j}]"))
                    labels.append(0.0)
                    groups.append(group)
        return pairs, labels, groups

    def _collate(self, samples: Sequence[Sample]) -> dict[str, Any]:
        # a batch that fails leaves the random state as it found it: its stand-in batch (--strict
        # false) draws what the batch would have drawn with the stand-in in the bad row's place
        state = self.random_state.get_state()
        try:
            pairs, labels, groups = self.pairs(samples)
            batch = self._encode(pairs)
        except BaseException:
            self.random_state.set_state(state)
            raise
        batch["labels"] = torch.tensor(labels, dtype=torch.float32)
        batch[GROUP_IDS] = torch.tensor(groups, dtype=torch.long)
        return batch

    def _encode(self, pairs: list[_Pair]) -> dict[str, Any]:
        if self.template.text_pair:
            for p in pairs:
                for item, where in ((p.query, "query"), (p.document, p.field)):
                    if item.has_media:
                        raise DataError(p.source, p.line, where, f"template '{self.template.name}' encodes text pairs "
                                                                 "and takes no media")
            texts = [pair_texts(p.template, p.query, p.document) for p in pairs]
            return self.builder.encode_pairs([t[0] for t in texts], [t[1] for t in texts])
        if self.builder.truncate:
            pairs = self._shortened(pairs)
        items = [pair_item(p.template, p.query, p.document) for p in pairs]
        origins = [(p.source, p.line, f"#{k}") for k, p in enumerate(pairs)]
        try:
            batch = self.builder(items, origins)
        except DataError as e:
            raise _named(e, pairs) from None
        if self.template.score_token_id is not None:
            batch = with_score_token(batch, self.template.score_token_id, tokenizer_of(self.tokenizer).pad_token_id)
        return batch

    # ---- truncation: the document first --------------------------------------------------
    def _shortened(self, pairs: list[_Pair]) -> list[_Pair]:
        """``pairs`` with each text-only pair over ``max_length`` cut: its document's tokens
        first, then its query's (see the module docstring); the others as they are."""
        tokenizer = tokenizer_of(self.tokenizer)
        if not getattr(tokenizer, "is_fast", False):  # no offsets: the builder cuts the whole text
            return pairs
        text_rows = [k for k, p in enumerate(pairs) if not (p.query.has_media or p.document.has_media)]
        lengths = self.builder.text_lengths([p.template.render(pair_item(p.template, p.query, p.document))
                                             for p in (pairs[k] for k in text_rows)])
        out = list(pairs)
        for k, n in zip(text_rows, lengths):
            if n > self.builder.max_length:
                out[k] = self._cut(pairs[k], tokenizer)
        return out

    def _cut(self, pair: _Pair, tokenizer: Any) -> _Pair:
        for side in ("document", "query"):
            while True:
                item = getattr(pair, side)
                marked = dataclasses.replace(pair, **{side: dataclasses.replace(item, text=_MARK)})
                rendered = marked.template.render(pair_item(marked.template, marked.query, marked.document))
                start = rendered.index(_MARK)
                end = start + len(item.text)
                enc = tokenizer(rendered.replace(_MARK, item.text), add_special_tokens=self.template.add_special_tokens,
                                return_offsets_mapping=True)
                over = len(enc["input_ids"]) - self.builder.max_length
                if over <= 0:
                    return pair
                inside = [t for t, (a, b) in enumerate(enc["offset_mapping"]) if a >= start and b <= end and b > a]
                if len(inside) <= over:
                    text = ""
                elif self.truncation_side == "left":
                    text = item.text[enc["offset_mapping"][inside[over - 1]][1] - start:]
                else:
                    text = item.text[: enc["offset_mapping"][inside[-over]][0] - start]
                if text == item.text:  # no token of this side can go: try the next
                    break
                pair = dataclasses.replace(pair, **{side: dataclasses.replace(item, text=text)})
                if not text:
                    break
        return pair  # still over: the builder cuts the rest


# the batch keys with one entry per token (media tensors have other rows)
_SEQUENCE_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


def with_score_token(batch: dict[str, Any], token_id: int, pad_id: int | None) -> dict[str, Any]:
    """``batch`` with ``token_id`` after each row's last real token (``attention_mask`` 1 there;
    the row's padding, on either side, stays where it was): each tensor of one entry per token
    (``input_ids``, ``attention_mask``, ``token_type_ids``, ``mm_token_type_ids``) becomes ``[N, L + 1]``."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    n, width = ids.shape
    lengths = mask.sum(1)
    left = bool(n) and bool((mask[:, -1] == 1).all()) and not bool((mask[:, 0] == 1).all())
    # each old position's new column: after the row's real tokens the padding moves one right
    cols = torch.arange(width).expand(n, width)
    moved = cols + (0 if left else (cols >= lengths[:, None]).long())
    at = torch.full((n,), width) if left else lengths  # the score token's column
    out = dict(batch)
    for key in _SEQUENCE_KEYS:
        value = batch.get(key)
        if value is None:
            continue
        fill = {"input_ids": pad_id if pad_id is not None else 0}.get(key, 0)
        new = value.new_full((n, width + 1), fill)
        new.scatter_(1, moved if not left else cols, value)
        new[torch.arange(n), at] = {"input_ids": token_id, "attention_mask": 1}.get(key, 0)
        out[key] = new
    return out


_PAIR_FIELD = re.compile(r"^#(\d+)(?: (images|videos|audios)\[(\d+)\])?$")


def _named(error: DataError, pairs: list[_Pair]) -> DataError:
    """The builder's error about pair ``#k`` (its medium ``j`` of the pair's list), naming the
    row's field: the query's medium, or the document's."""
    m = _PAIR_FIELD.match(error.field or "")
    if m is None:
        return error
    pair = pairs[int(m.group(1))]
    if m.group(2) is None:
        return DataError(error.source, error.line, f"query + {pair.field}", error.reason)
    kind, j = m.group(2), int(m.group(3))
    own = len(getattr(pair.query, kind))
    field = f"query {kind}[{j}]" if j < own else f"{pair.field} {kind}[{j - own}]"
    return DataError(error.source, error.line, field, error.reason)
