"""The length check of ``mmembed sft``: the rows over ``--max_length`` found before training.

``--truncation_strategy delete`` drops the rows with an input over ``--max_length``
tokens, measured as the model sees them (media expanded); with ``left`` / ``right`` only the
rows with media are measured (they are never truncated). Text is tokenized a batch of rows
at a time. Media are counted as ``--check_media`` says: ``header`` (the default) reads each
file's header (an image's size, a video's frame count, rate and size, an audio file's
length) and applies the loader's budget and the processor's own rules, which gives the
same counts as decoding (:mod:`mmembed.encoding.measure`; a medium the header cannot decide
is decoded); a missing file or one whose header does not open is an error naming its row
before training, and pixels that do not decode are found when their batch is built.
``full`` decodes every medium and runs the processor, so a file that opens but does not
decode is found before training too. The result is cached by ``datasets`` under
:func:`length_check_fingerprint`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from typing import TYPE_CHECKING

import numpy as np

from ..data.arrow_rows import shared_heap
from ..data.dataset import DATASET_ID, release_mapped
from ..data.sample import DataError, Sample
from ..encoding.inputs import InputBuilder
from ..encoding.instructions import Instructions
from ..encoding.layout import Layout
from ..encoding.measure import json_text_lengths
from ..losses import EmbeddingLoss
from ..task import Task, get_task
from .arguments import SftArguments
from .model_assembly import Encoding

if TYPE_CHECKING:  # the media loader is imported at the first row with media (qwen-vl-utils: about a second)
    from ..encoding.media import MediaSettings

logger = logging.getLogger("mmembed")


#: the fewest rows per process of a parallel length check (a pool of processes costs about a second)
_MIN_ROWS_PER_PROCESS = 5000


def check_processes(num_proc: int, rows: int) -> int:
    """The processes the length check runs in: ``--dataset_num_proc``, fewer for few rows."""
    return max(1, min(num_proc, rows // _MIN_ROWS_PER_PROCESS))


def check_lengths(args: SftArguments, encoding: Encoding, loss: EmbeddingLoss, media: MediaSettings, train, val,
                  reuse: bool = False):
    """The length check of the training and eval rows as the run's settings say: with
    ``--truncation_strategy delete`` the rows over ``--max_length`` go; with ``left`` /
    ``right`` only the rows with media are measured (they are never cut). ``train`` None: only
    ``val`` (a stream's rows are measured as they are read: :func:`length_filter`). Returns
    ``(train, val)``."""
    if not (args.truncation_strategy == "delete" or encoding.template.media):
        return train, val
    truncate = args.truncation_strategy != "delete"
    builder, builders = run_length_builders(args, encoding, media)
    checked = []
    for what, ds in (("train", train), ("val", val)):
        if ds is not None:
            ds = drop_overlong(ds, builder, loss.layout, encoding.max_length,
                               check_processes(args.dataset_num_proc, len(ds)), what, args.strict, truncate,
                               builders=builders, reuse=reuse, task=get_task(args.task_type))
        checked.append(ds)
    return checked[0], checked[1]


def length_filter(encoding: Encoding, media: MediaSettings | None, check_media: str, layout: Layout,
                  templates: dict | None = None, task: Task | None = None):
    """``--truncation_strategy delete`` on rows read one at a time (``--streaming``):
    ``keep(sample)``, False for a row over ``--max_length``. ``templates``: ``{dataset: its
    template}`` for the ``--dataset_config`` datasets with instructions of their own
    (:meth:`~mmembed.encoding.instructions.Instructions.templates`): their rows (by
    ``Sample.dataset_id``) are measured with it."""
    builder = length_builder(encoding, media, check_media)
    builders = {d: length_builder(dataclasses.replace(encoding, template=t), media, check_media)
                for d, t in (templates or {}).items()}

    def keep(sample: Sample) -> bool:
        own = builders.get(sample.dataset_id, builder)
        return measured_lengths([sample], own, layout, task)[0] <= encoding.max_length

    return keep


def measured_lengths(samples: list[Sample], builder: InputBuilder, layout: Layout, task: Task | None = None,
                     total_within: int | None = None) -> list[int]:
    """The longest model input of each sample, as ``task`` (None: embedding) measures it
    (:meth:`~mmembed.task.Task.input_lengths`): an embedding model's longest item, a reranker's
    longest (query, document) pair. ``total_within``: the sum of its inputs instead, each
    counted to at most that many tokens (``--packing``)."""
    return (task or get_task(None)).input_lengths(samples, builder, layout, total_within=total_within)


def row_token_totals(args: SftArguments, encoding: Encoding, media: MediaSettings | None, layout: Layout, task: Task,
                     rows) -> list[int]:
    """Each training row's tokens, all its inputs together (``--packing``'s lengths), as the model
    sees them: media expanded (``--check_media``), an input cut to ``--max_length`` where rows
    are truncated. ``rows``: an :class:`~mmembed.data.dataset.EmbeddingDataset`. Measured a batch
    of rows at a time and cached by ``datasets`` with the rows."""
    import datasets

    ds = rows.dataset
    builder, builders = run_length_builders(args, encoding, media)
    within = encoding.max_length if args.truncation_strategy != "delete" else 10 ** 12

    def measure_rows(rows: list[str], builder: InputBuilder) -> dict[str, list]:
        samples = [Sample.from_json(s) for s in rows]
        return {"n_total": measured_lengths(samples, builder, layout, task, total_within=within)}

    num_proc = check_processes(args.dataset_num_proc, len(ds))
    measured = ds.map(lambda batch: by_dataset(batch, builder, builders, measure_rows), batched=True,
                      num_proc=num_proc if num_proc > 1 else None,
                      features=datasets.Features({"n_total": datasets.Value("int64")}), remove_columns=ds.column_names,
                      desc="packing (row lengths)", load_from_cache_file=True,
                      new_fingerprint=hashlib.sha256(  # datasets takes 64 characters at most
                          f"{length_check_fingerprint(ds, builder, layout, True, builders)}-total-{within}-{task.name}"
                          .encode()).hexdigest()[:32])
    return measured[:]["n_total"]  # the column at once (a `datasets` 5 column reads row by row)


def run_length_builders(args: SftArguments, encoding: Encoding,
                        media: MediaSettings | None) -> tuple[InputBuilder, dict[int, InputBuilder]]:
    """The run's measuring builder (:func:`length_builder`) and, by dataset index, those of the
    ``--dataset_config`` datasets with instructions of their own (measured with their template)."""
    builder = length_builder(encoding, media, args.check_media)
    own = Instructions.of(getattr(args, "dataset_entries", None) or []).templates(encoding.template)
    return builder, {d: length_builder(dataclasses.replace(encoding, template=t), media, args.check_media)
                     for d, t in own.items()}


def by_dataset(batch: dict[str, list], builder: InputBuilder, builders: dict[int, InputBuilder],
               measure_rows) -> dict[str, list]:
    """``measure_rows(rows, builder) -> {column: values}`` over a batch of stored rows, each row
    with its dataset's builder (``builders``, by the ``dataset_id`` column; else ``builder``),
    the columns put back in the batch's row order."""
    if not builders or DATASET_ID not in batch:
        return measure_rows(batch["sample"], builder)
    groups: dict[int | None, list[int]] = {}
    for i, d in enumerate(batch[DATASET_ID]):
        groups.setdefault(d if d in builders else None, []).append(i)
    out: dict[str, list] = {}
    for d, rows in groups.items():
        got = measure_rows([batch["sample"][i] for i in rows], builders.get(d, builder))
        for k, v in got.items():
            column = out.setdefault(k, [None] * len(batch["sample"]))
            for i, x in zip(rows, v):
                column[i] = x
    return out


def length_builder(encoding: Encoding, media: MediaSettings | None = None, check_media: str = "header") -> InputBuilder:
    """The builder the length check measures with: the student's, encoding rows whole, loading
    media with ``media`` (the run's settings, as the collator's builder) and counting their
    tokens as ``check_media`` (``--check_media``) says: from headers, or by decoding them."""
    return InputBuilder(encoding.template, encoding.processing, encoding.max_length, truncate=False, media=media,
                        check_media=check_media)


def drop_overlong(ds, builder: InputBuilder, layout: Layout, max_length: int, num_proc: int, what: str,
                  strict: bool = True, truncate: bool = False, builders: dict[int, InputBuilder] | None = None,
                  reuse: bool = False, task: Task | None = None):
    """``--truncation_strategy delete``: remove rows with any input over ``max_length`` tokens
    (media expanded, as the model sees them), and say how many.

    Measuring opens every row's media (their headers, or with the builder's
    ``check_media="full"`` their pixels too), so a media file that is missing or does not
    open (or with ``full``, does not decode) is found here, before training: an error naming
    its row, or with ``strict=False`` the row is skipped and listed like the rows skipped
    when the data was read.

    With ``truncate`` (``--truncation_strategy left|right``) only the rows with media are
    measured, for the same reason: their media are opened here (decoded with ``full``) rather
    than first in the middle of training, and since a row with media is never truncated, one over
    ``max_length`` is a data error naming it (or, with ``strict=False``, skipped and listed).
    Text rows are left to be truncated.

    ``builders``: ``{dataset: builder}`` for the rows whose ``dataset_id`` names a dataset with
    instructions of its own (its template's; :mod:`mmembed.encoding.instructions`), measured
    with it; the other rows with ``builder``.

    A text row whose inputs are ASCII and provably within ``max_length`` tokens (at most so many
    tokens per character for the tokenizer: :func:`~mmembed.encoding.measure.ascii_token_bound`)
    is kept without being tokenized; its ``n_tokens`` is then that bound (the same rows are kept
    and deleted as by counting every row).

    ``reuse``: another process of this run has just measured the same rows
    (:func:`~mmembed.training.data_assembly.read_once`), so its result is read from the cache
    even with ``strict=False`` (where a result of an earlier run is measured again).
    """
    builders = builders or {}

    def lengths_of(samples: list[Sample], builder: InputBuilder) -> list[int]:
        if not truncate:
            return measured_lengths(samples, builder, layout, task)
        media = [i for i, s in enumerate(samples) if any(it.has_media for it in (s.anchor, *s.positives, *s.negatives))]
        out = [0] * len(samples)
        for i, n in zip(media, measured_lengths([samples[i] for i in media], builder, layout, task) if media else []):
            out[i] = n
            if n > max_length:
                raise DataError(samples[i].source, samples[i].line, None,
                                f"{n} tokens with its media, over --max_length {max_length}; a row with media is not "
                                "truncated (that would cut its media tokens): raise --max_length, lower MAX_PIXELS, or "
                                "use --truncation_strategy delete")
        return out

    mapped = frozenset(f["filename"] for f in ds.cache_files)
    batches = [0]

    def measure_rows(rows: list[str], builder: InputBuilder) -> dict[str, list]:
        if not truncate and (task or get_task(None)).measures_items:  # text-only rows without a Sample object each (None: the general path)
            fast = json_text_lengths(builder.template, builder.text_counter(), rows, layout, within=max_length)
            if fast is not None:
                return {"n_tokens": fast, "load_error": [""] * len(fast)}
        samples = [Sample.from_json(s) for s in rows]
        try:
            return {"n_tokens": lengths_of(samples, builder), "load_error": [""] * len(samples)}
        except DataError:
            if strict:
                raise
        lengths, errors = [], []
        for sample in samples:  # one at a time, to find the rows that fail
            try:
                lengths.append(lengths_of([sample], builder)[0])
                errors.append("")
            except DataError as e:
                lengths.append(0)
                errors.append(json.dumps([e.source, e.line, e.field, e.reason], ensure_ascii=False))
        return {"n_tokens": lengths, "load_error": errors}

    def measure(batch: dict[str, list]) -> dict[str, list]:
        batches[0] += 1
        if batches[0] % 4 == 0:  # the cache pages read so far leave this process's resident set
            release_mapped(mapped)
        return by_dataset(batch, builder, builders, measure_rows)

    import datasets

    # only the two new columns are written (not another copy of the rows). A result kept from
    # an earlier run is reused only when no row could be skipped (strict): a skip recorded
    # for a media file since mended would otherwise drop its row for good. This run's own
    # result (reuse: the reading process wrote it moments ago) is read whatever strict says.
    features = datasets.Features({"n_tokens": datasets.Value("int64"), "load_error": datasets.Value("string")})
    # the rows are measured in the cache's order (a shuffled set's batch would gather its rows from
    # all over the cache: a page read per row), then put back in the set's order
    order = None if getattr(ds, "_indices", None) is None else np.argsort(ds._indices.column(0).to_numpy(), kind="stable")
    stored = ds if order is None else ds.select(order, keep_in_memory=True)
    with shared_heap(num_proc > 1):
        measured = stored.map(measure, batched=True, num_proc=num_proc if num_proc > 1 else None, features=features,
                              remove_columns=ds.column_names, desc=f"length check ({what})",
                              new_fingerprint=length_check_fingerprint(ds, builder, layout, strict, builders)
                              + ("-media" if truncate else ""), load_from_cache_file=strict or reuse)
    columns = measured[:]  # both columns as lists at once (a column of `datasets` 5 is read row by row)
    lengths, errors = columns["n_tokens"], columns["load_error"]
    if order is not None:  # stored row k is the set's row order[k]
        back = np.empty_like(order)
        back[order] = np.arange(len(order))
        back = back.tolist()
        lengths, errors = [lengths[k] for k in back], [errors[k] for k in back]
    skipped = [DataError(*json.loads(e)) for e in errors if e]
    if skipped:
        listed = "\n".join(f"  {e}" for e in skipped)
        logger.warning("%s: skipped %d row(s) whose media cannot be loaded%s (--strict false):\n%s", what,
                       len(skipped), " or are over --max_length with them" if truncate else "", listed)
    keep = [i for i, (n, e) in enumerate(zip(lengths, errors)) if not e and n <= max_length]
    dropped = len(ds) - len(skipped) - len(keep)
    if dropped:
        logger.warning(
            "%s: %d of %d rows are longer than --max_length %d tokens and were deleted (--truncation_strategy delete; "
            "use left/right to truncate them instead)", what, dropped, len(ds), max_length,
        )
    return ds.select(keep) if len(keep) < len(ds) else ds


def length_check_fingerprint(ds, builder: InputBuilder, layout: Layout, strict: bool,
                             builders: dict[int, InputBuilder] | None = None) -> str:
    """The name of the length check's result among ``datasets``' cache files: the rows (their
    fingerprint), the template (and each dataset's of ``builders``), the tokenizer's files,
    ``max_length``, the batch layout, the builder's media budget and how it counts media
    (``--check_media``). Given explicitly,
    because ``datasets`` would otherwise name it by pickling the measuring function with
    everything it holds, the tokenizer included: about
    10 seconds for a Qwen tokenizer of 151k tokens, on every run."""
    import hashlib

    h = hashlib.sha256()
    tokenizer = builder.tokenizer
    folder = getattr(tokenizer, "name_or_path", "") or ""
    for part in ("stored-order", ds._fingerprint, repr(builder.template), type(tokenizer).__name__, folder, len(tokenizer),
                 builder.max_length, builder.truncate, builder.truncation_side, layout, strict,
                 repr(builder.media_settings().budget), type(builder.processor).__name__,
                 getattr(builder, "check_media", "full")):
        h.update(repr(part).encode("utf-8") + b"\0")
    for d, own in sorted((builders or {}).items()):
        h.update(repr((d, repr(own.template))).encode("utf-8") + b"\0")
    if os.path.isdir(folder):  # the files the tokenizer and processor were read from
        for name in sorted(os.listdir(folder)):
            if name.startswith(("tokenizer", "vocab", "merges", "special_tokens", "added_tokens", "chat_template",
                                "preprocessor", "processor", "video_preprocessor")):
                with open(os.path.join(folder, name), "rb") as f:
                    h.update(name.encode("utf-8") + hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:32]
