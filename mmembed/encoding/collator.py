"""Samples -> a tokenized batch in ms-swift's row layout.

Two layouts, chosen by the loss:

- ``group`` (InfoNCE and other group losses): rows ``a0, p0, n0_0, ..., a1, p1, ...``;
  ``labels`` is float ``[N - B]``, 1.0 for each positive and 0.0 for each negative.
  A row with several positives contributes its first (ms-swift uses one per group too).
- ``pair`` (cosine_similarity, contrastive, online_contrastive): rows ``s1_0, s2_0, s1_1,
  s2_1, ...``; ``labels`` holds one score per pair (the row's ``label``).

Tokenization (and media loading) happens here, lazily, batch by batch, through
``InputBuilder``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..data.sample import DataError, Item, Sample
from .inputs import InputBuilder
from .templates import Template

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


def item_origins(sample: Sample, layout: str) -> list[tuple[str, int, str]]:
    """(file, line, field) of each row ``sample_items`` gives, for error messages."""
    names = ["query", "response"]
    if layout != "pair":
        names += [f"rejected_response[{k}]" for k in range(len(sample.negatives))]
    return [(sample.source, sample.line, n) for n in names]


@dataclass
class EmbeddingCollator:
    """Collate ``Sample``s into the model's inputs (``input_ids``, ``attention_mask``, pixel
    tensors for media rows, ...) plus ``labels``."""

    template: Template
    tokenizer: Any  # the tokenizer, or the processor for a multimodal template
    layout: str = "group"
    max_length: int | None = None
    truncation_side: str = "right"
    truncate: bool = True
    # other models that embed the same items (a GIST guide, a distillation teacher), each
    # with its own template and tokenizer: batch["<name>_inputs"]
    aux_builders: dict[str, InputBuilder] | None = None
    # distillation from the data: the Sample attributes ("teacher_scores",
    # "teacher_embeddings") collated into batch[<same name>]
    teacher_keys: tuple[str, ...] = ()

    def __post_init__(self):
        self.builder = InputBuilder(self.template, self.tokenizer, self.max_length, self.truncation_side, self.truncate)

    def tokenize(self, items: Sequence[Item], origins=None) -> dict[str, torch.Tensor]:
        return self.builder(items, origins)

    def __call__(self, samples: Sequence[Sample]) -> dict[str, torch.Tensor]:
        items: list[Item] = []
        origins: list[tuple[str, int, str]] = []
        labels: list[float] = []
        for s in samples:
            its, labs = sample_items(s, self.layout)
            items.extend(its)
            origins.extend(item_origins(s, self.layout))
            labels.extend(labs)
        batch = self.builder(items, origins)
        for name, builder in (self.aux_builders or {}).items():
            batch[f"{name}_inputs"] = builder(items, origins)
        for key in self.teacher_keys:
            value = teacher_tensor(samples, key)
            if value is not None:
                batch[key] = value
        batch["labels"] = torch.tensor(labels, dtype=torch.float32)
        return batch


def teacher_tensor(samples: Sequence[Sample], key: str) -> torch.Tensor | None:
    """The batch's teacher signal ``key`` (group layout), or None when no sample has it.

    ``teacher_scores``: ``[B, W]``, row ``g`` the positive's and the negatives' scores of
    group ``g``, NaN past its candidates. ``teacher_embeddings``: ``[N, D]``, one row per
    batch row (anchor, positive, negatives of each group in turn).
    """
    values = [getattr(s, key) for s in samples]
    if all(v is None for v in values):
        return None
    for s, v in zip(samples, values):
        if v is None:
            raise DataError(s.source, s.line, key, "missing, while other rows of the batch have it; every row needs it")
    if key == "teacher_embeddings":
        return torch.tensor([vec for v in values for vec in v], dtype=torch.float32)
    out = torch.full((len(values), max(len(v) for v in values)), float("nan"))
    for g, v in enumerate(values):
        out[g, : len(v)] = torch.tensor(v, dtype=torch.float32)
    return out


def token_lengths(samples: Sequence[Sample], builder: InputBuilder, layout: str) -> list[int]:
    """The longest encoded row of each sample, media expanded (what ``--truncation_strategy delete`` checks)."""
    flat: list[Item] = []
    origins: list[tuple[str, int, str]] = []
    owner: list[int] = []
    for i, s in enumerate(samples):
        its, _ = sample_items(s, layout)
        flat.extend(its)
        origins.extend(item_origins(s, layout))
        owner.extend([i] * len(its))
    lengths = [0] * len(samples)
    for i, n in zip(owner, builder.lengths(flat, origins) if flat else []):
        lengths[i] = max(lengths[i], n)
    return lengths
