"""Samples -> a tokenized batch in ms-swift's row layout.

Two layouts; the loss says which (its ``layout``, a :class:`~mmembed.encoding.layout.Layout`;
the functions here take the enum only):

- ``group`` (InfoNCE and other group losses): rows ``a0, p0, n0_0, ..., a1, p1, ...``;
  ``labels`` is float ``[N - B]``, 1.0 for each positive and 0.0 for each negative.
  A row with several positives contributes its first (ms-swift uses one per group too).
- ``pair`` (cosine_similarity, contrastive, online_contrastive): rows ``s1_0, s2_0, s1_1,
  s2_1, ...``; ``labels`` holds one score per pair (the row's ``label``).

Tokenization (and media loading) happens here, lazily, batch by batch, through
``InputBuilder``. A row that fails here (a media file that opens but does not decode) is a
:class:`~mmembed.data.sample.DataError` naming file, line and field; in a data-loader worker
it travels to the main process as the batch itself (:data:`DATA_ERROR`, raised there by
:func:`raise_batch_error`), since torch would turn it into a multi-line RuntimeError.

What the loss takes beside the student's embeddings (its ``side``) is prepared here too,
as a :class:`SideBatch` under ``batch["side"]``: the guide's and the teacher's model inputs
for the same rows, or the teacher signals the data carries.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch
import torch.utils.data

from ..data.sample import DataError, Item, Sample
from .inputs import InputBuilder
from .instructions import Instructions
from .layout import Layout
from .templates import Template

if TYPE_CHECKING:  # the media loader is imported at the first row with media
    from .media import MediaSettings

#: The key of the one-entry batch a data-loader worker returns in place of a batch it could
#: not build: ``{DATA_ERROR: DataError}``. torch re-raises a worker's exception in the main
#: process by calling its type with the worker's traceback as the only argument, which a
#: DataError (file, line, field, reason) does not take, so it would arrive as a RuntimeError
#: holding a traceback; pickled inside the batch it arrives whole.
DATA_ERROR = "data_error"
#: the stand-ins tried for a row skipped at batch time (--strict false) before giving up
STAND_IN_TRIES = 20

logger = logging.getLogger("mmembed")

#: the batch key of each sample's dataset index (:attr:`EmbeddingCollator.with_dataset_ids`)
DATASET_IDS = "dataset_ids"


def raise_batch_error(batch: Any) -> None:
    """Raise the DataError a data-loader worker returned in place of ``batch``, if it did."""
    if isinstance(batch, dict) and DATA_ERROR in batch:
        raise batch[DATA_ERROR]


def sample_items(sample: Sample, layout: Layout) -> tuple[list[Item], list[float]]:
    """The rows one sample contributes, and their labels (see the module docstring)."""
    if not sample.positives:
        raise DataError(sample.source, sample.line, "response", "a positive (response / positive_messages) is required")
    if layout is Layout.PAIR:
        if sample.label is None:
            raise DataError(sample.source, sample.line, "label", "pair losses need a numeric label on every row")
        return [sample.anchor, sample.positives[0]], [float(sample.label)]
    return [sample.anchor, sample.positives[0], *sample.negatives], [1.0] + [0.0] * len(sample.negatives)


def item_sides(sample: Sample, layout: Layout) -> list[str]:
    """The side of each row ``sample_items`` gives: the anchor (a pair's ``sentence1``) is the
    query, the positive and the negatives (a pair's ``sentence2``) are documents."""
    return ["query"] + ["document"] * (1 + (len(sample.negatives) if layout is Layout.GROUP else 0))


def sided_items(sample: Sample, layout: Layout, template: Template) -> list[Item]:
    """``sample_items``' rows as ``template`` renders them: each with its side's instruction
    (:meth:`Template.with_side`)."""
    items, _ = sample_items(sample, layout)
    return [template.with_side(it, side) for it, side in zip(items, item_sides(sample, layout))]


def item_origins(sample: Sample, layout: Layout) -> list[tuple[str, int, str]]:
    """(file, line, field) of each row ``sample_items`` gives, for error messages."""
    names = ["query", "response"]
    if layout is Layout.GROUP:
        names += [f"rejected_response[{k}]" for k in range(len(sample.negatives))]
    return [(sample.source, sample.line, n) for n in names]


@dataclass
class SideBatch:
    """The side inputs of one batch as the collator prepares them (what the loss's
    ``side`` asks for); the trainer turns them into :class:`mmembed.losses.Side`.

    Attributes:
        guide_inputs: The guide model's inputs for the batch's rows (its own template
            and tokenizer).
        teacher_inputs: The teacher model's inputs for the batch's rows.
        teacher_embeddings: ``[N, Dt]``: the data's teacher embeddings, one per row.
        teacher_scores: ``[B, W]``: the data's teacher scores, per group, NaN-padded.
    """

    guide_inputs: dict[str, torch.Tensor] | None = None
    teacher_inputs: dict[str, torch.Tensor] | None = None
    teacher_embeddings: torch.Tensor | None = None
    teacher_scores: torch.Tensor | None = None

    def to(self, device, non_blocking: bool = False) -> SideBatch:
        """A copy on ``device`` (the Trainer and accelerate call this to move a batch)."""
        def move(v):
            if isinstance(v, dict):
                return {k: move(t) for k, t in v.items()}
            return v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v

        return SideBatch(**{f.name: move(getattr(self, f.name)) for f in fields(self)})


@dataclass
class CollatedBatch:
    """A collated batch taken apart, the one way the trainer, the evaluation and the charts
    read it: the model's inputs (``input_ids``, ``attention_mask``, media tensors, ...), the
    ``labels``, the rows' dataset indices (``dataset_ids``; None when the collator gives none)
    and the :class:`SideBatch` (None when the loss takes no side inputs).

    The collator returns a plain dict (the Trainer moves dicts to the device and counts their
    tokens); :meth:`unpack` splits it, raising first the DataError a data-loader worker
    returned in its place (:func:`raise_batch_error`)."""

    inputs: dict[str, Any]
    labels: torch.Tensor
    dataset_ids: torch.Tensor | None = None
    side: SideBatch | None = None

    @classmethod
    def unpack(cls, batch: dict[str, Any]) -> CollatedBatch:
        raise_batch_error(batch)
        inputs = dict(batch)
        return cls(inputs, inputs.pop("labels"), inputs.pop(DATASET_IDS, None), inputs.pop("side", None))


class StandInCollation:
    """What a collator of ``Sample``s does with a row that fails at batch time (shared by
    :class:`EmbeddingCollator` and the reranker's collator): the subclass builds a batch in
    ``_collate`` and has a ``strict`` attribute; calling the collator in a data-loader worker
    returns a :class:`DataError` as the batch (:data:`DATA_ERROR`)."""

    strict: bool

    def _collate(self, samples: Sequence[Sample]) -> dict[str, Any]:
        raise NotImplementedError

    def __call__(self, samples: Sequence[Sample] | Sequence[list[Sample]]) -> dict[str, Any]:
        try:
            return self.collate(rows_of(samples))
        except DataError as e:
            if torch.utils.data.get_worker_info() is None:
                raise
            return {DATA_ERROR: e}  # see DATA_ERROR: the main process raises it

    def collate(self, samples: Sequence[Sample]) -> dict[str, Any]:
        """The batch of ``samples`` (what calling the collator gives, outside workers).

        A row whose media fail to load (a file whose header opens but whose pixels do not
        decode) is a :class:`DataError` naming file, line and field. With ``strict=False`` the
        row is skipped instead: logged as a warning (``file:line field: reason``, once per
        row and process) and replaced by another row of the dataset it came from, so the batch
        keeps its size: the stand-in is drawn by ``EmbeddingDataset.replacement`` from the
        bad row's index alone (the same in every epoch, run and process), skipping rows
        already in the batch and rows known to be bad; up to :data:`STAND_IN_TRIES` draws.
        Rows that do not come from an ``EmbeddingDataset`` (a stream, a list) have no stand-in:
        their error is raised."""
        if self.strict:
            return self._collate(samples)
        samples = list(samples)
        bad: set[tuple[str, int]] = getattr(self, "_bad_rows", set())
        self._bad_rows = bad
        while True:
            try:
                return self._collate(samples)
            except DataError as e:
                at = next((i for i, s in enumerate(samples) if (s.source, s.line) == (e.source, e.line)), None)
                drawn = getattr(samples[at], "drawn_from", None) if at is not None else None
                if drawn is None:
                    raise
                if (e.source, e.line) not in bad:
                    bad.add((e.source, e.line))
                    logger.warning("skipped a row whose media cannot be loaded (--strict false): %s", e)
                samples[at] = self._stand_in(drawn, samples, bad, e)

    def _stand_in(self, drawn, samples: list[Sample], bad: set[tuple[str, int]], error: DataError) -> Sample:
        dataset, index = drawn
        taken = {(s.source, s.line) for s in samples}
        for attempt in range(STAND_IN_TRIES):
            other = dataset.replacement(index, attempt)
            if (other.source, other.line) not in bad and (other.source, other.line) not in taken:
                logger.info("row %s:%d replaced in its batch by %s:%d", error.source, error.line, other.source, other.line)
                return other
        raise DataError(error.source, error.line, error.field,
                        f"{error.reason}; skipped (--strict false), but {STAND_IN_TRIES} stand-ins drawn for it "
                        "were unusable too (bad, or already in the batch)")


@dataclass
class EmbeddingCollator(StandInCollation):
    """Collate ``Sample``s into the model's inputs (``input_ids``, ``attention_mask``, pixel
    tensors for media rows, ...) plus ``labels``, and ``side`` (a :class:`SideBatch`)
    when the loss takes side inputs."""

    template: Template
    tokenizer: Any  # the tokenizer, or the processor for a multimodal template
    layout: Layout = Layout.GROUP  # the loss's
    max_length: int | None = None
    truncation_side: str = "right"
    truncate: bool = True
    # models that embed the same items (a GIST guide, a distillation teacher), each with
    # its own template and tokenizer or processor
    guide: InputBuilder | None = None
    teacher: InputBuilder | None = None
    # distillation from the data: "teacher_scores" or "teacher_embeddings" (the Sample
    # attribute collated into SideBatch's field of the same name)
    teacher_signal: str | None = None
    # pad text batches to a bucketed width (--length_buckets)
    bucket: bool = False
    # how media are loaded (pixel and frame budgets, downloads; None: the environment's, read
    # at the first row with media); kept on the builder, so it travels to data-loader workers
    media: MediaSettings | None = None
    # add ``dataset_ids``: a LongTensor [B], each sample's dataset index (``Sample.dataset_id``;
    # ``--dataset_config``), which the trainer pops before the model's call
    with_dataset_ids: bool = False
    # --strict false: a row whose media fail to load here is skipped, logged, and replaced in
    # its batch by a stand-in drawn from its dataset (see collate); True: the DataError is raised
    strict: bool = True
    # --dataset_config's instructions of each dataset, over the template's (the row's own system
    # first; mmembed.encoding.instructions): a sample's dataset_id picks its dataset's
    instructions: Instructions = dataclasses.field(default_factory=Instructions)

    def __post_init__(self):
        if not isinstance(self.layout, Layout):
            raise TypeError(f"layout must be Layout.GROUP or Layout.PAIR (the loss's layout), got {self.layout!r}")
        self.builder = InputBuilder(self.template, self.tokenizer, self.max_length, self.truncation_side, self.truncate,
                                    bucket=self.bucket, media=self.media)
        self._templates = self.instructions.templates(self.template)  # the datasets with instructions of their own

    def _collate(self, samples: Sequence[Sample]) -> dict[str, Any]:
        items: list[Item] = []
        origins: list[tuple[str, int, str]] = []
        labels: list[float] = []
        for s in samples:
            its, labs = sample_items(s, self.layout)
            items.extend(its)
            origins.extend(item_origins(s, self.layout))
            labels.extend(labs)
        # the student's rows carry their side's instruction, their dataset's where it has one (the
        # guide and the teacher have their own templates)
        sides = [(side, self._templates.get(s.dataset_id, self.template))
                 for s in samples for side in item_sides(s, self.layout)]
        batch: dict[str, Any] = self.builder([tpl.with_side(it, sd) for it, (sd, tpl) in zip(items, sides)], origins)
        side = SideBatch(
            guide_inputs=self.guide(items, origins) if self.guide is not None else None,
            teacher_inputs=self.teacher(items, origins) if self.teacher is not None else None,
        )
        if self.teacher_signal is not None:
            setattr(side, self.teacher_signal, teacher_tensor(samples, self.teacher_signal))
        if any(getattr(side, f.name) is not None for f in fields(side)):
            batch["side"] = side
        batch["labels"] = torch.tensor(labels, dtype=torch.float32)
        if self.with_dataset_ids:
            batch[DATASET_IDS] = torch.tensor([s.dataset_id for s in samples], dtype=torch.long)
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


def rows_of(batch: Sequence) -> Sequence[Sample]:
    """A batch of packs (``--packing``: lists of rows, :mod:`mmembed.training.sample_packs`) as the
    rows they hold, in order; a batch of rows as it is."""
    if batch and isinstance(batch[0], list):
        return [row for pack in batch for row in pack]
    return batch


def token_lengths(samples: Sequence[Sample], builder: InputBuilder, layout: Layout,
                  total_within: int | None = None) -> list[int]:
    """The longest encoded row of each sample, media expanded (what ``--truncation_strategy delete``
    checks): every row of the samples measured in one ``builder.lengths`` call (one tokenizer
    call for their text; media counted as the builder's ``check_media`` says). ``total_within``:
    the sum of the sample's rows instead, each counted to at most that many tokens (``--packing``)."""
    flat: list[Item] = []
    owner: list[int] = []
    origins: list[tuple[str, int, str]] | None = [] if builder.multimodal else None  # only media rows name theirs
    for i, s in enumerate(samples):
        its = sided_items(s, layout, builder.template)
        flat.extend(its)
        if origins is not None:
            origins.extend(item_origins(s, layout))
        owner.extend([i] * len(its))
    lengths = [0] * len(samples)
    for i, n in zip(owner, builder.lengths(flat, origins) if flat else []):
        if total_within is not None:
            lengths[i] += min(n, total_within)
        elif n > lengths[i]:
            lengths[i] = n
    return lengths
