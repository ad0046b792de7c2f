"""Samples -> a tokenized batch in ms-swift's row layout.

Two layouts, chosen by the loss:

- ``group`` (InfoNCE and other group losses): rows ``a0, p0, n0_0, ..., a1, p1, ...``;
  ``labels`` is float ``[N - B]``, 1.0 for each positive and 0.0 for each negative.
  A row with several positives contributes its first (ms-swift uses one per group too).
- ``pair`` (cosine_similarity, contrastive, online_contrastive): rows ``s1_0, s2_0, s1_1,
  s2_1, ...``; ``labels`` holds one score per pair (the row's ``label``).

Tokenization happens here, lazily, batch by batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..templates import Template
from .sample import DataError, Item, Sample

PAIR_LOSSES = ("cosine_similarity", "contrastive", "online_contrastive")


def layout_for_loss(loss_type: str) -> str:
    return "pair" if loss_type in PAIR_LOSSES else "group"


def sample_items(sample: Sample, layout: str) -> tuple[list[Item], list[float]]:
    """The rows one sample contributes, and their labels (see the module docstring)."""
    if not sample.positives:
        raise DataError(sample.source, sample.line, "response", "a positive (response / positive_messages) is required")
    if layout == "pair":
        if sample.label is None:
            raise DataError(sample.source, sample.line, "label", "pair losses need a numeric label on every row")
        return [sample.anchor, sample.positives[0]], [float(sample.label)]
    return [sample.anchor, sample.positives[0], *sample.negatives], [1.0] + [0.0] * len(sample.negatives)


@dataclass
class EmbeddingCollator:
    """Collate ``Sample``s into ``{"input_ids", "attention_mask", ..., "labels"}``."""

    template: Template
    tokenizer: Any
    layout: str = "group"
    max_length: int | None = None
    truncation_side: str = "right"

    def __post_init__(self):
        self.tokenizer.padding_side = self.template.padding_side
        self.tokenizer.truncation_side = "left" if self.truncation_side == "left" else "right"

    def tokenize(self, items: Sequence[Item]) -> dict[str, torch.Tensor]:
        texts = [self.template.render(it) for it in items]
        return self.tokenizer(
            texts,
            padding=True,
            truncation=self.max_length is not None,
            max_length=self.max_length,
            add_special_tokens=self.template.add_special_tokens,
            return_tensors="pt",
        )

    def __call__(self, samples: Sequence[Sample]) -> dict[str, torch.Tensor]:
        items: list[Item] = []
        labels: list[float] = []
        for s in samples:
            its, labs = sample_items(s, self.layout)
            items.extend(its)
            labels.extend(labs)
        batch = dict(self.tokenize(items))
        batch["labels"] = torch.tensor(labels, dtype=torch.float32)
        return batch


def token_lengths(samples: Sequence[Sample], template: Template, tokenizer: Any, layout: str) -> list[int]:
    """The longest tokenized row of each sample (what ``--truncation_strategy delete`` checks)."""
    flat: list[str] = []
    owner: list[int] = []
    for i, s in enumerate(samples):
        its, _ = sample_items(s, layout)
        flat.extend(template.render(it) for it in its)
        owner.extend([i] * len(its))
    lengths = [0] * len(samples)
    if not flat:
        return lengths
    enc = tokenizer(flat, add_special_tokens=template.add_special_tokens)["input_ids"]
    for i, ids in zip(owner, enc):
        lengths[i] = max(lengths[i], len(ids))
    return lengths
