"""A late-interaction model's batches: the embedding collator's rows (ms-swift's group layout,
instructions, media, teacher and guide inputs alike), with the query side expanded as ColBERT or
ColQwen expand it and the rows marked for the document skiplist.

What :class:`LateInteractionCollator` adds to :class:`~mmembed.encoding.collator.EmbeddingCollator`'s
batch (the inputs :class:`~mmembed.model.late_interaction.LateInteractionModel` takes):

- ``apply_skiplist`` ``[N]`` bool: the document rows (positives and negatives), whose skiplist
  tokens MaxSim leaves out (present when the model has a skiplist);
- with the ``mask`` expansion, ``token_mask`` ``[N, L]``: the scored positions. The query rows are
  tokenised again as sentence-transformers tokenises a ColBERT query (cut to the query length,
  padded to it) and their padding up to that length becomes the mask token
  (:func:`~mmembed.model.late_interaction.expand_query`); the batch is widened to hold them;
- with the ``augment`` expansion, each query's text ends with the augmentation tokens (ColQwen2's
  pad tokens), attended and scored as its other tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ...data.sample import Sample
from ...encoding.buckets import pad_to_width
from ...encoding.collator import EmbeddingCollator, item_sides
from ...encoding.inputs import InputBuilder
from ...model.late_interaction import expand_query, expansion_token_id
from .settings import LateInteractionSettings


def augmented(sample: Sample, suffix: str) -> Sample:
    """``sample`` with ``suffix`` (the augmentation tokens) after its query's text."""
    return dataclasses.replace(sample, anchor=dataclasses.replace(sample.anchor, text=sample.anchor.text + suffix))


@dataclass
class LateInteractionCollator(EmbeddingCollator):
    """:class:`~mmembed.encoding.collator.EmbeddingCollator` for a late-interaction model
    (``settings``: its :class:`~mmembed.tasks.late_interaction.settings.LateInteractionSettings`)."""

    settings: LateInteractionSettings = dataclasses.field(default_factory=LateInteractionSettings)

    def __post_init__(self):
        super().__post_init__()
        s = self.settings
        self.query_builder = None
        if s.expansion == "mask":
            # queries cut to the query length, as sentence-transformers' fixed expansion cuts them
            length = s.query_length if self.max_length is None else min(s.query_length, self.max_length)
            self.query_builder = InputBuilder(self.template, self.tokenizer, length, self.truncation_side, True,
                                              media=self.media)
            self.expansion_id = expansion_token_id(self.builder.tokenizer, s.expansion_token)

    def _collate(self, samples: Sequence[Sample]) -> dict[str, Any]:
        s = self.settings
        if s.expansion == "augment":
            samples = [augmented(x, s.expansion_token * s.query_length) for x in samples]
        batch = super()._collate(samples)
        query = torch.tensor([side == "query" for x in samples for side in item_sides(x, self.layout)])
        if s.skiplist:
            batch["apply_skiplist"] = ~query
        if self.query_builder is not None:
            self._expand_queries(batch, samples, query)
        return batch

    def _expand_queries(self, batch: dict[str, Any], samples: Sequence[Sample], query: torch.Tensor) -> None:
        """The query rows of ``batch`` replaced by their ColBERT form, with ``token_mask``."""
        s = self.settings
        items = [self._templates.get(x.dataset_id, self.template).with_side(x.anchor, "query") for x in samples]
        origins = [(x.source, x.line, "query") for x in samples]
        enc = self.query_builder(items, origins)
        # sentence-transformers pads a fixed-strategy query to the query length first
        enc = pad_to_width(dict(enc), s.query_length, self.builder.tokenizer.pad_token_id or 0,
                           self.builder.padding_side)
        q = expand_query(enc["input_ids"], enc["attention_mask"], length=s.query_length, token_id=self.expansion_id,
                         attend=s.attend_expansion, token_type_ids=enc.get("token_type_ids"))
        width = max(batch["input_ids"].shape[1], q["input_ids"].shape[1])
        pad_id = self.builder.tokenizer.pad_token_id or 0
        side = self.builder.padding_side
        rows = pad_to_width({k: v for k, v in batch.items() if torch.is_tensor(v)}, width, pad_id, side)
        token_mask_q = _widened(q.pop("token_mask"), width, side)
        q = pad_to_width(q, width, pad_id, side)
        token_mask = rows["attention_mask"].bool().clone()
        for key in ("input_ids", "attention_mask", "token_type_ids"):
            if key in rows:
                value = rows[key].clone()
                value[query] = q[key].to(value.dtype) if key in q else 0
                batch[key] = value
        token_mask[query] = token_mask_q
        batch["token_mask"] = token_mask


def _widened(mask: torch.Tensor, width: int, side: str) -> torch.Tensor:
    extra = width - mask.shape[1]
    if extra <= 0:
        return mask
    return F.pad(mask.long(), (extra, 0) if side == "left" else (0, extra), value=0).bool()
