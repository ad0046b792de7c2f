"""Data assembly for ``mmembed sft``: the training and eval rows as training reads them.

:meth:`TrainingData.load` reads ``--dataset`` / ``--val_dataset`` (or streams them,
``--streaming true``), downloads their remote media up front (:func:`fetch_remote_media`),
counts the rows the loss cannot learn from under its settings (:func:`check_trainable`),
runs the length check (:func:`drop_overlong`), opens the teacher's arrays and finds the
teacher signal the rows carry (:func:`data_teacher`). :func:`check_drop_last` and
:func:`load_eval_tasks` check the rest of what training will read before the model loads.
:func:`read_once` has one process of a run read and check the data while the others wait and
reuse its ``datasets`` cache; each phase logs its rows, removals and time.

The length check
----------------
``--truncation_strategy delete`` drops the rows with an input over ``--max_length``
tokens, measured as the model sees them (media expanded); with ``left`` / ``right`` only the
rows with media are measured (they are never truncated). Measuring decodes every medium,
so a file that opens but does not decode is found before training. The result is cached by
``datasets`` under :func:`length_check_fingerprint`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import TYPE_CHECKING

from ..data import EmbeddingDataset, SpecError, load_samples
from ..data.sample import DataError, Sample
from ..data.streaming import StreamingSamples, stream_samples
from ..data.teacher import TeacherFiles, teacher_signal
from ..data.trainable import NegativesRule, rows_without_negatives
from ..encoding.collator import token_lengths
from ..encoding.inputs import InputBuilder
from ..eval.tasks import HeldOutTasks
from ..losses import EmbeddingLoss
from .arguments import SftArguments, UsageError
from .model_assembly import Encoding

if TYPE_CHECKING:  # the media loader is imported at the first row with media (qwen-vl-utils: about a second)
    from ..encoding.media import MediaSettings
    from ..encoding.remote import DownloadSettings

logger = logging.getLogger("mmembed")


@dataclasses.dataclass
class TrainingData:
    """The training and eval rows, with their teacher signals."""

    train: EmbeddingDataset | StreamingSamples  # (--streaming: rows read as training consumes them)
    val: EmbeddingDataset | None
    teacher_key: str | None = None  # the data's teacher signal the collator passes on
    teacher_width: int | None = None
    # rows read per data file (bad ones included), for the model card
    files: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    parsed: bool = False  # whether a data file was parsed now (False: all came from the Arrow cache)

    @classmethod
    def load(cls, args: SftArguments, encoding: Encoding, loss: EmbeddingLoss, media: MediaSettings,
             reuse: bool = False) -> TrainingData:
        """The rows of ``--dataset`` and ``--val_dataset`` (or ``--split_dataset_ratio``'s
        share), checked, their URLs downloaded and measured with ``media`` (the run's media
        settings), with the teacher's arrays and the teacher signal the rows carry.
        ``reuse``: the rows were just read and checked by another process of the run
        (:func:`read_once`): take the Arrow cache as it is. Each phase logs its rows and time."""
        # ms-swift's order: --data_seed (not --seed) drives the split, #N sampling and --dataset_shuffle.
        # Every row is checked now against what the loss takes as a label and the media the
        # model takes, so a row training could not use is an error (or skipped) before training.
        load_opts = dict(strict=args.strict, seed=args.data_seed, num_proc=args.dataset_num_proc,
                         load_from_cache_file=args.load_from_cache_file,
                         columns=json.loads(args.columns) if args.columns else None,
                         label_rule=loss.label_rule, media_kinds=frozenset(encoding.template.media), reuse=reuse)
        if args.streaming:
            return cls.stream(args, encoding, loss, media, load_opts)
        loaded = load_samples(args.dataset, split_ratio=0.0 if args.val_dataset else args.split_dataset_ratio,
                              shuffle=args.dataset_shuffle, **load_opts)
        _log_phase("parse", loaded.rows_read, loaded.seconds, f"{len(loaded.skipped)} bad row(s) skipped, " if
                   loaded.skipped else "", "parsed" if loaded.parsed else "from the Arrow cache")
        train = loaded.dataset
        try:
            teacher_files = TeacherFiles.open(loaded.files, loaded.records, args.teacher_scores_file,
                                              args.teacher_embeddings_file)
        except ValueError as e:
            raise UsageError(str(e)) from None
        files = {"train": loaded.records}
        if args.val_dataset:
            val_loaded = load_samples(args.val_dataset, split_ratio=1.0, shuffle=args.val_dataset_shuffle, **load_opts)
            val, files["val"] = val_loaded.dataset, val_loaded.records
        else:
            val = loaded.val
        phase = _Phase("trainable check", train, val)
        train = check_trainable(train, loss.negatives_rule, args.strict, "train")
        if val is not None and loss.negatives_rule is not None and loss.negatives_rule.breaks:
            val = check_trainable(val, loss.negatives_rule, args.strict, "val")  # the eval loss would fail on them
        phase.done(train, val, skip=loss.negatives_rule is None)
        phase = _Phase("remote media", train, val)
        train, val = fetch_remote_media(train, val, args.strict, media.downloads)
        phase.done(train, val)
        phase = _Phase("length check", train, val)
        if args.truncation_strategy == "delete" or encoding.template.media:
            # delete: the over-long rows go; left / right: the media rows are decoded and measured now
            truncate = args.truncation_strategy != "delete"
            builder = length_builder(encoding, media)
            train = drop_overlong(train, builder, loss.layout, encoding.max_length,
                                  check_processes(args.dataset_num_proc, len(train)), "train", args.strict, truncate)
            if val is not None:
                val = drop_overlong(val, builder, loss.layout, encoding.max_length,
                                    check_processes(args.dataset_num_proc, len(val)), "val", args.strict, truncate)
            phase.done(train, val)
        if len(train) == 0:  # all deleted by the length check (loading itself refuses empty data): a data error
            raise SpecError(f"no training rows left: every row of {', '.join(args.dataset)} is longer than "
                            f"--max_length {encoding.max_length} or has media that cannot be loaded (listed above; "
                            "--truncation_strategy delete); raise --max_length or use --truncation_strategy right")
        data = cls(EmbeddingDataset(train, teacher_files), EmbeddingDataset(val, teacher_files) if val is not None else None,
                   files=files, parsed=bool(loaded.parsed or (args.val_dataset and val_loaded.parsed)))
        data.teacher_key, data.teacher_width = data_teacher(args, loss, data.train)
        if val is not None:  # data_teacher read the training rows with their arrays; the eval rows' must fit too
            teacher_files.check_rows(val)
        return data

    @classmethod
    def stream(cls, args: SftArguments, encoding: Encoding, loss: EmbeddingLoss, media: MediaSettings,
               load_opts: dict) -> TrainingData:
        """``--streaming true``: the training rows as a stream (:mod:`mmembed.data.streaming`);
        ``--val_dataset`` is read whole as usual. Rows over ``--max_length`` are dropped as
        they are read (``--truncation_strategy delete``), remote media fetched when read; a
        row the loss would fail on (:func:`check_trainable`) is a data error when read, or
        skipped with ``--strict false``."""
        if loss.side.teacher and not args.teacher_model:
            raise UsageError(f"--loss_type {args.loss_type} with the teacher's signals in the rows cannot be checked "
                             "up front with --streaming true: give --teacher_model, or leave out --streaming")
        train = stream_samples(args.dataset, strict=args.strict, seed=args.data_seed, shuffle=args.dataset_shuffle,
                               buffer_size=args.shuffle_buffer_size, columns=load_opts["columns"],
                               label_rule=load_opts["label_rule"], media_kinds=load_opts["media_kinds"])
        val, files = None, {}
        if args.val_dataset:
            val_loaded = load_samples(args.val_dataset, split_ratio=1.0, shuffle=args.val_dataset_shuffle, **load_opts)
            val, files["val"] = val_loaded.dataset, val_loaded.records
            if loss.negatives_rule is not None and loss.negatives_rule.breaks:
                val = check_trainable(val, loss.negatives_rule, args.strict, "val")
            _, val = fetch_remote_media(None, val, args.strict, media.downloads)
        # a row the loss would fail on is met as it is read: a data error naming it, or skipped
        # and logged with --strict false (a row that merely learns nothing is kept)
        rule = loss.negatives_rule if loss.negatives_rule is not None and loss.negatives_rule.breaks else None
        builder = length_builder(encoding, media) if args.truncation_strategy == "delete" else None

        def keep(sample: Sample) -> bool:
            if rule is not None and rule.falls_short(len(sample.negatives)):
                raise DataError(sample.source, sample.line, None, f"{rule.reason()}; {rule.fix}")
            return builder is None or token_lengths([sample], builder, loss.layout)[0] <= encoding.max_length

        if rule is not None or builder is not None:
            train.keep = keep
        train.min_rows = args.per_device_train_batch_size * args.world_size
        if builder is not None and val is not None:
            val = drop_overlong(val, builder, loss.layout, encoding.max_length, args.dataset_num_proc, "val", args.strict)
        return cls(train, EmbeddingDataset(val) if val is not None else None, files=files)


#: the fewest rows per process of a parallel length check (a pool of processes costs about a second)
_MIN_ROWS_PER_PROCESS = 5000


def check_processes(num_proc: int, rows: int) -> int:
    """The processes the length check runs in: ``--dataset_num_proc``, fewer for few rows."""
    return max(1, min(num_proc, rows // _MIN_ROWS_PER_PROCESS))


class _Phase:
    """One phase of reading the data (the trainable check, the remote media, the length check),
    timed from its creation: ``done(train, val)`` logs the rows it took in, those it removed,
    and its time (``skip``: the phase had nothing to do)."""

    def __init__(self, name: str, train, val):
        self.name, self.rows = name, len(train) + (len(val) if val is not None else 0)
        self.started = time.perf_counter()

    def done(self, train, val, skip: bool = False) -> None:
        if skip:
            return
        left = len(train) + (len(val) if val is not None else 0)
        removed = f"{self.rows - left} removed (listed above), " if left < self.rows else ""
        _log_phase(self.name, self.rows, time.perf_counter() - self.started, removed)


def _log_phase(name: str, rows: int, seconds: float, removed: str = "", how: str = "") -> None:
    rate = f", {rows / seconds:,.0f} rows/s" if seconds > 0 and rows else ""
    logger.info("data: %s: %s rows, %s%.1f s%s%s", name, f"{rows:,}", removed, seconds, rate, f" ({how})" if how else "")


def read_once(args: SftArguments, read):
    """``read(reuse)``'s result (:meth:`TrainingData.load`), the data read and checked by one
    process while the others of the run wait, then reuse what it wrote to the ``datasets`` cache
    (``reuse=True``: parse, trainable check, length check and remote media come from its files,
    memory-mapped; no process holds another copy of the rows).

    The process that reads: the run's main process (rank 0), which on one node is the local
    main process; with ``--save_on_each_node true`` (the nodes share no filesystem) the main
    process of each node. A node that does not see the reader's cache reads the files itself
    after the wait (the same rows, read again). The others wait in a collective of the process
    group (``--ddp_timeout``, 30 minutes by default, bounds the wait: raise it for data that
    takes longer to read). When the reader fails (a bad row), the others stop too, with an error
    that points at its message rather than reading the data themselves."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return read(False)
    reader = args.local_process_index == 0 if args.save_on_each_node else args.process_index == 0
    failure = None
    if reader:
        logger.info("data: read and checked by process %d; the other %d process(es) wait and reuse its cache",
                    args.process_index, dist.get_world_size() - 1)
        try:
            data = read(False)
        except BaseException as e:  # noqa: BLE001 (the others must learn of any failure, then it is raised)
            failure = e
    status: list = [None] * dist.get_world_size()
    dist.all_gather_object(status, None if failure is None else f"{type(failure).__name__}: {failure}"[:2000])
    if failure is not None:
        raise failure
    failed = next((s for s in status if s is not None), None)
    if failed is not None:
        raise SpecError(f"the process that read the data failed ({failed.splitlines()[0]})")
    if reader:
        return data
    quiet = logging.getLogger("mmembed")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the reader has said it all (skipped rows, deletions)
    try:
        data = read(True)
    finally:
        quiet.setLevel(level)
    logger.info("data: process %d reused the data of the reading process (%s)", args.process_index,
                "its cache was not there: the files were parsed again" if data.parsed else "nothing parsed again")
    return data


def data_teacher(args: SftArguments, loss: EmbeddingLoss, train: EmbeddingDataset) -> tuple[str | None, int | None]:
    """Distillation without ``--teacher_model``: the teacher signal every training row must
    carry (row fields or ``--teacher_*_file``), checked on every row before training.

    Returns:
        ``("teacher_scores", None)``, ``("teacher_embeddings", width)``, or ``(None, None)``
        when the loss takes no teacher or the teacher is a model.
    """
    accepted = loss.side.teacher
    if not accepted:
        return None, None
    if args.teacher_model:
        first = train[0] if len(train) else None
        if first is not None and (first.teacher_scores is not None or first.teacher_embeddings is not None):
            logger.warning("the rows carry teacher scores or embeddings; --teacher_model is the teacher, so they are unused")
        return None, None
    key, width = teacher_signal((train[i] for i in range(len(train))), accepted, args.loss_type, "training")
    logger.info("teacher from the data: %s%s", key, f" (width {width})" if width else "")
    return key, width


def check_drop_last(args: SftArguments, data: TrainingData) -> None:
    """``--dataloader_drop_last true`` drops each epoch's last incomplete batch: with fewer
    training rows (after the checks) than one batch of every process, it drops them all and
    trains nothing. Refused now, after the data is read and before the model loads."""
    if not args.dataloader_drop_last or not hasattr(data.train, "__len__"):  # a stream: its length is unknown
        return
    batch = args.per_device_train_batch_size * args.world_size
    if len(data.train) < batch:
        raise UsageError(f"--dataloader_drop_last true with {len(data.train)} training row(s), fewer than one batch "
                         f"({batch} = --per_device_train_batch_size {args.per_device_train_batch_size} x "
                         f"{args.world_size} process(es)): every batch would be dropped and nothing trained; "
                         "leave out --dataloader_drop_last or lower --per_device_train_batch_size")


def load_eval_tasks(args: SftArguments, encoding: Encoding) -> HeldOutTasks | None:
    """``--eval_beir`` and ``--eval_sts``, read and checked before training."""
    if not (args.eval_beir or args.eval_sts):
        return None
    try:
        return HeldOutTasks.load(encoding.template, encoding.max_length or 512, beir=args.eval_beir,
                                 beir_split=args.eval_beir_split, sts=args.eval_sts)
    except ValueError as e:
        if isinstance(e, DataError):
            raise
        raise UsageError(str(e)) from None


# ----------------------------------------------------------------------------- rows that cannot train

#: rows named in a message (file:line); the --strict false list names up to _LISTED
_NAMED, _LISTED = 5, 50


def check_trainable(ds, rule: NegativesRule | None, strict: bool = True, what: str = "train"):
    """The rows of ``ds`` the loss can learn from, as its ``negatives_rule`` says (None:
    every row; ``ds`` is returned as it is), checked before the model loads.

    Rows with fewer negatives than the rule asks for are counted and the first few named
    (``file:line``). None left that can train: a :class:`UsageError`, whatever ``strict`` says.
    Some: with ``strict=False`` they are skipped and listed like the other skipped rows; with
    ``strict`` a row the loss would fail on (``rule.breaks``: ``INFONCE_HARD_NEGATIVES`` with
    nothing to sample) is a :class:`UsageError`, one it merely learns nothing from
    (``INFONCE_USE_BATCH=false``) is kept, with a warning giving the count.
    """
    if rule is None:
        return ds
    short = rows_without_negatives(ds, rule)
    if not short:
        return ds
    reason = rule.reason()
    in_file_order = sorted((source, line) for _, source, line in short)  # the rows may be shuffled
    first = ", ".join(f"{source}:{line}" for source, line in in_file_order[:_NAMED]) + (", ..." if len(short) > _NAMED else "")
    rows = "training rows" if what == "train" else f"{what} rows"
    if len(short) == len(ds):
        raise UsageError(f"no {rows[:-1]} can train: every one of the {len(ds)} has {reason} ({first}); {rule.fix}")
    if strict and rule.breaks:
        raise UsageError(f"{len(short)} of {len(ds)} {rows} have {reason} ({first}); {rule.fix}, or pass --strict false "
                         "to skip them")
    if strict:
        logger.warning("%s: %d of %d rows cannot train: they have %s (%s); they are kept (--strict false skips them); %s",
                       what, len(short), len(ds), reason, first, rule.fix)
        return ds
    listed = "\n".join(f"  {source}:{line}: {reason}" for source, line in in_file_order[:_LISTED])
    if len(short) > _LISTED:
        listed += f"\n  ... {len(short) - _LISTED} more"
    logger.warning("%s: skipped %d of %d row(s) that cannot train (--strict false):\n%s", what, len(short), len(ds),
                   listed)
    dropped = {i for i, _, _ in short}
    return ds.select([i for i in range(len(ds)) if i not in dropped])


# ----------------------------------------------------------------------------- remote media


def fetch_remote_media(train, val, strict: bool = True, downloads: DownloadSettings | None = None):
    """Download every http(s) media file of the rows into the media cache now (once; a cached
    one is not fetched again) with ``downloads`` (the run's settings; None: the environment's),
    so that a URL that fails does so before training, and steps,
    epochs and data-loader workers read the cache. Logs one line per download and a summary.
    A URL that cannot be fetched is an error naming its row, or with ``strict=False`` each row
    naming it is skipped and listed like the other skipped rows. Returns ``(train, val)``."""
    from ..encoding import remote

    named = [(what, ds) for what, ds in (("train", train), ("val", val)) if ds is not None]

    def urls(ds):
        # most rows have no URL: find the stored rows whose JSON holds "://" in Arrow (vectorized,
        # in storage order: no gather through a shuffle's index), then decode only those, in order
        import numpy as np
        import pyarrow.compute as pc

        if "remote" in ds.column_names:  # marked when the rows were parsed
            stored = np.flatnonzero(ds.data.column("remote").to_numpy(zero_copy_only=False))
        else:
            stored = np.flatnonzero(pc.fill_null(pc.match_substring(ds.data.column("sample"), "://"), False)
                                    .to_numpy(zero_copy_only=False))
        if not len(stored):
            return
        indices = getattr(ds, "_indices", None)
        rows = stored if indices is None else np.flatnonzero(np.isin(indices.column(0).to_numpy(), stored))
        for i in rows:
            for url, where in remote.sample_urls(Sample.from_json(ds[int(i)]["sample"])):
                yield int(i), url, where

    failed: dict[str, str] | None = None if strict else {}
    remote.prefetch(((url, where) for _, ds in named for _, url, where in urls(ds)), failed=failed, settings=downloads)
    if not failed:
        return train, val
    kept = {}
    for what, ds in named:
        skipped: dict[int, DataError] = {}
        for i, url, (source, line, fieldname) in urls(ds):
            if url.strip() in failed and i not in skipped:
                skipped[i] = DataError(source, line, fieldname,
                                       f"cannot download ({failed[url.strip()]}): {remote.redact(url)!r}")
        if skipped:
            listed = "\n".join(f"  {e}" for e in skipped.values())
            logger.warning("%s: skipped %d row(s) whose media cannot be downloaded (--strict false):\n%s", what,
                           len(skipped), listed)
            ds = ds.select([i for i in range(len(ds)) if i not in skipped])
        kept[what] = ds
    return kept.get("train", train), kept.get("val", val)


# ----------------------------------------------------------------------------- the length check


def length_builder(encoding: Encoding, media: MediaSettings | None = None) -> InputBuilder:
    """The builder the length check measures with: the student's, encoding rows whole, loading
    media with ``media`` (the run's settings, as the collator's builder)."""
    return InputBuilder(encoding.template, encoding.processing, encoding.max_length, truncate=False, media=media)


def drop_overlong(ds, builder: InputBuilder, layout: str, max_length: int, num_proc: int, what: str,
                  strict: bool = True, truncate: bool = False):
    """``--truncation_strategy delete``: remove rows with any input over ``max_length`` tokens
    (media expanded, as the model sees them), and say how many.

    Measuring loads every row's media, so a media file that opens but does not decode is
    found here, before training: an error naming its row, or with ``strict=False`` the row
    is skipped and listed like the rows skipped when the data was read.

    With ``truncate`` (``--truncation_strategy left|right``) only the rows with media are
    measured, for the same reason: their media are decoded here rather than first in the
    middle of training, and since a row with media is never truncated, one over
    ``max_length`` is a data error naming it (or, with ``strict=False``, skipped and listed).
    Text rows are left to be truncated.
    """

    def lengths_of(samples: list[Sample]) -> list[int]:
        if not truncate:
            return token_lengths(samples, builder, layout)
        media = [i for i, s in enumerate(samples) if any(it.has_media for it in (s.anchor, *s.positives, *s.negatives))]
        out = [0] * len(samples)
        for i, n in zip(media, token_lengths([samples[i] for i in media], builder, layout) if media else []):
            out[i] = n
            if n > max_length:
                raise DataError(samples[i].source, samples[i].line, None,
                                f"{n} tokens with its media, over --max_length {max_length}; a row with media is not "
                                "truncated (that would cut its media tokens): raise --max_length, lower MAX_PIXELS, or "
                                "use --truncation_strategy delete")
        return out

    def measure(batch: dict[str, list]) -> dict[str, list]:
        samples = [Sample.from_json(s) for s in batch["sample"]]
        try:
            return {"n_tokens": lengths_of(samples), "load_error": [""] * len(samples)}
        except DataError:
            if strict:
                raise
        lengths, errors = [], []
        for sample in samples:  # one at a time, to find the rows that fail
            try:
                lengths.append(lengths_of([sample])[0])
                errors.append("")
            except DataError as e:
                lengths.append(0)
                errors.append(json.dumps([e.source, e.line, e.field, e.reason], ensure_ascii=False))
        return {"n_tokens": lengths, "load_error": errors}

    import datasets

    # only the two new columns are written (not another copy of the rows). A result kept from
    # an earlier run is reused only when no row could be skipped (strict): a skip recorded
    # for a media file since mended would otherwise drop its row for good.
    features = datasets.Features({"n_tokens": datasets.Value("int64"), "load_error": datasets.Value("string")})
    measured = ds.map(measure, batched=True, num_proc=num_proc if num_proc > 1 else None, features=features,
                      remove_columns=ds.column_names, desc=f"length check ({what})",
                      new_fingerprint=length_check_fingerprint(ds, builder, layout, strict) + ("-media" if truncate else ""),
                      load_from_cache_file=strict)
    lengths, errors = measured["n_tokens"], measured["load_error"]
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


def length_check_fingerprint(ds, builder: InputBuilder, layout: str, strict: bool) -> str:
    """The name of the length check's result among ``datasets``' cache files: the rows (their
    fingerprint), the template, the tokenizer's files, ``max_length``, the batch layout and
    the builder's media budget. Given explicitly, because ``datasets`` would otherwise name it by
    pickling the measuring function with everything it holds, the tokenizer included: about
    10 seconds for a Qwen tokenizer of 151k tokens, on every run."""
    import hashlib

    h = hashlib.sha256()
    tokenizer = builder.tokenizer
    folder = getattr(tokenizer, "name_or_path", "") or ""
    for part in (ds._fingerprint, repr(builder.template), type(tokenizer).__name__, folder, len(tokenizer),
                 builder.max_length, builder.truncate, builder.truncation_side, layout, strict,
                 repr(builder.media_settings().budget), type(builder.processor).__name__):
        h.update(repr(part).encode("utf-8") + b"\0")
    if os.path.isdir(folder):  # the files the tokenizer and processor were read from
        for name in sorted(os.listdir(folder)):
            if name.startswith(("tokenizer", "vocab", "merges", "special_tokens", "added_tokens", "chat_template",
                                "preprocessor", "processor", "video_preprocessor")):
                with open(os.path.join(folder, name), "rb") as f:
                    h.update(name.encode("utf-8") + hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:32]
