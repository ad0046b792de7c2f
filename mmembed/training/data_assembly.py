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
import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ..data import EmbeddingDataset, SpecError, load_samples
from ..data.dataset import release_mapped, shared_heap
from ..data.dataset_config import DatasetEntry, DatasetInfo
from ..data.sample import DataError, Sample
from ..data.streaming import StreamingSamples, stream_samples
from ..data.teacher import TeacherFiles, teacher_signal
from ..data.trainable import NegativesRule, rows_without_negatives
from ..encoding.collator import token_lengths
from ..encoding.inputs import InputBuilder
from ..encoding.layout import Layout
from ..encoding.measure import json_text_lengths
from ..eval.tasks import HeldOutTasks
from ..losses import EmbeddingLoss
from .arguments import SftArguments, UsageError, beir_pairs
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
    # the training datasets, indexed by EmbeddingDataset.dataset_ids (one for --dataset)
    datasets: list[DatasetInfo] = dataclasses.field(default_factory=list)
    # --dataset_config: the loss of each dataset with its own loss settings, by its index
    losses: dict[int, EmbeddingLoss] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not self.datasets:
            rows = len(self.train) if hasattr(self.train, "__len__") else 0  # a stream: unknown
            self.datasets = [DatasetInfo("default", 1.0, rows, val_rows=len(self.val) if self.val is not None else 0)]
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
        if getattr(args, "dataset_config", None):
            return cls.load_config(args, encoding, loss, media, load_opts)
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
        train, val = check_lengths(args, encoding, loss, media, train, val)
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
        builder = length_builder(encoding, media, args.check_media) if args.truncation_strategy == "delete" else None

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

    # ------------------------------------------------------------------ --dataset_config
    @classmethod
    def load_config(cls, args: SftArguments, encoding: Encoding, loss: EmbeddingLoss, media: MediaSettings,
                    load_opts: dict) -> TrainingData:
        """``--dataset_config``: each dataset's rows read (``sample: N`` as ``#N``), its
        instructions put on the rows that give no system of their own (``query_system`` on the
        anchors, ``document_system`` on the positives and negatives), checked against its own
        loss, and tagged with its index (the ``dataset_id`` column); the validation rows
        likewise (its ``val`` files, or its ``--split_dataset_ratio`` share). Then the datasets
        are concatenated (and shuffled together, ``--dataset_shuffle``), their remote media
        fetched and their lengths checked as for ``--dataset``. Logs the start-up report
        (:func:`dataset_report`)."""
        import datasets as hf_datasets

        entries: list[DatasetEntry] = args.dataset_entries
        losses = {i: own for i, e in enumerate(entries) if (own := dataset_loss(args, e)) is not None}
        sampler = getattr(args, "multi_dataset_sampler", None) or "mixed"  # (mixed: ms-swift's order)
        if losses and sampler == "mixed":
            named = ", ".join(entries[i].name for i in losses)
            raise UsageError(f"--dataset_config {args.dataset_config}: dataset(s) {named} have loss settings of their "
                             "own, which need every batch from one dataset; --multi_dataset_sampler mixed puts rows of "
                             "all datasets in a batch: use --multi_dataset_sampler proportional, round_robin or "
                             "weighted, or move the settings to the INFONCE_* variables / --loss_kwargs")
        trains, vals, files = [], [], {"train": {}, "val": {}}
        for i, entry in enumerate(entries):
            opts = dict(load_opts, seed=(args.data_seed or 0) + i)  # data_seed for the first: one dataset = --dataset
            rule = (losses.get(i) or loss).negatives_rule
            ratio = 0.0 if entry.val else args.split_dataset_ratio
            try:
                loaded = load_samples(entry.specs(), split_ratio=ratio, shuffle=args.dataset_shuffle, **opts)
            except SpecError as e:
                raise SpecError(f"--dataset_config {args.dataset_config}: dataset {entry.name}: {e}") from None
            train, val = loaded.dataset, loaded.val
            if entry.sample is not None and len(entry.paths) > 1:  # #N over the dataset's files together
                train = sample_rows(train, entry.sample, opts["seed"], args.dataset_shuffle, entry.name)
            files["train"].update(loaded.records)
            if entry.val:
                val_loaded = load_samples(entry.val, split_ratio=1.0, shuffle=args.val_dataset_shuffle, **opts)
                val = val_loaded.dataset
                files["val"].update(val_loaded.records)
            train = with_instructions(train, entry)
            train = check_trainable(train, rule, args.strict, f"train ({entry.name})")
            trains.append(with_dataset_id(train, i))
            if val is not None:
                val = with_instructions(val, entry)
                # scored with the dataset's loss (eval_<name>_*) and, pooled, with the run's (eval_*)
                for each in {id(r): r for r in (rule, loss.negatives_rule) if r is not None and r.breaks}.values():
                    val = check_trainable(val, each, args.strict, f"val ({entry.name})")
                vals.append(with_dataset_id(val, i))
        train = trains[0] if len(trains) == 1 else hf_datasets.concatenate_datasets(trains)
        if len(trains) > 1 and args.dataset_shuffle:
            train = train.shuffle(seed=args.data_seed)
        val = None if not vals else vals[0] if len(vals) == 1 else hf_datasets.concatenate_datasets(vals)
        phase = _Phase("remote media", train, val)
        train, val = fetch_remote_media(train, val, args.strict, media.downloads)
        phase.done(train, val)
        train, val = check_lengths(args, encoding, loss, media, train, val)
        train_set = EmbeddingDataset(train)
        val_set = EmbeddingDataset(val) if val is not None else None
        rows = np.bincount(train_set.dataset_ids, minlength=len(entries))
        val_rows = np.bincount(val_set.dataset_ids, minlength=len(entries)) if val_set is not None else rows * 0
        infos = [DatasetInfo(e.name, e.weight, int(rows[i]), e, int(val_rows[i])) for i, e in enumerate(entries)]
        empty = [info.name for info in infos if info.rows == 0]
        if empty:
            raise SpecError(f"--dataset_config {args.dataset_config}: no training rows left in dataset(s) "
                            f"{', '.join(empty)}: every row is longer than --max_length {encoding.max_length} or has "
                            "media that cannot be loaded (listed above); raise --max_length or use "
                            "--truncation_strategy right")
        data = cls(train_set, val_set, files={k: v for k, v in files.items() if v}, datasets=infos, losses=losses)
        data.teacher_key, data.teacher_width = data_teacher(args, loss, data.train)
        logger.info("%s", dataset_report(infos, data.train, encoding, losses, loss, sampler))
        return data


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
    # a named folder takes the instructions of the --dataset_config dataset of its name
    instructions = {e.name: (e.query_system, e.document_system) for e in getattr(args, "dataset_entries", [])}
    try:
        return HeldOutTasks.load(encoding.template, encoding.max_length or 512, beir=beir_pairs(args.eval_beir),
                                 beir_split=args.eval_beir_split, sts=args.eval_sts, instructions=instructions)
    except ValueError as e:
        if isinstance(e, DataError):
            raise
        raise UsageError(str(e)) from None


# ----------------------------------------------------------------------------- --dataset_config


def infonce_overrides(entry: DatasetEntry, file: str) -> dict[str, Any]:
    """A dataset's ``infonce`` settings as :class:`~mmembed.losses.InfoNCEConfig` fields, each
    read as its ``INFONCE_*`` variable's text would be (a null: the variable unset)."""
    from ..data.dataset_config import INFONCE_KEYS, ConfigError
    from ..losses import InfoNCEConfig

    by_var = {v: k for k, v in INFONCE_KEYS.items()}
    out: dict[str, Any] = {}
    for var, text in entry.infonce.items():
        name = by_var[var]
        try:
            out[name] = getattr(InfoNCEConfig.from_env({var: text}), name)
        except ValueError as e:
            raise UsageError(str(ConfigError(file, entry.name, f"infonce.{name}", str(e)))) from None
    return out


def dataset_loss(args: SftArguments, entry: DatasetEntry) -> EmbeddingLoss | None:
    """The loss of a dataset with loss settings of its own (None without): ``--loss_type``
    built as :func:`~mmembed.training.model_assembly.make_loss` builds it, with the
    dataset's ``loss_kwargs`` over ``--loss_kwargs`` and its ``infonce`` settings over both
    (and over the ``INFONCE_*`` variables, which the loss reads for the settings not given)."""
    from ..data.dataset_config import ConfigError
    from ..errors import one_line
    from ..losses import build_loss

    if not entry.has_loss_settings:
        return None
    file = os.path.abspath(args.dataset_config)
    infonce = infonce_overrides(entry, file)
    options = {**(json.loads(args.loss_kwargs) if args.loss_kwargs else {}), **entry.loss_kwargs, **infonce}
    try:
        if args.mrl_dims:
            return build_loss("matryoshka", dims=args.mrl_dims, inner=args.loss_type, **options)
        return build_loss(args.loss_type, **options)
    except ValueError as e:
        text = one_line(e)
        key = next((f"infonce.{k}" for k in infonce if repr(k) in text), None)
        key = key or next((f"loss_kwargs.{k}" for k in entry.loss_kwargs if repr(k) in text), "loss_kwargs")
        raise UsageError(str(ConfigError(file, entry.name, key, f"--loss_type {args.loss_type}: {text}"))) from None


def sample_rows(ds, n: int, seed: int, shuffle: bool, name: str):
    """``sample: N`` over a dataset of several files: N of their rows together, drawn as
    ms-swift's ``#N`` draws them from one file (:func:`~mmembed.data.dataset.sample_indices`)."""
    from ..data.dataset import sample_indices

    if n > len(ds):
        logger.warning("dataset %s: sample %d is more than its %d rows, so rows repeat", name, n, len(ds))
    return ds.select(sample_indices(len(ds), n, np.random.RandomState(seed), shuffle))


def with_instructions(ds, entry: DatasetEntry):
    """``ds`` with the dataset's ``query_system`` on every anchor and ``document_system`` on
    every positive and negative whose row gives no system of its own (a row's own wins)."""
    if entry.query_system is None and entry.document_system is None:
        return ds
    import hashlib

    query, document = entry.query_system, entry.document_system

    def apply(batch: dict[str, list]) -> dict[str, list]:
        out = []
        for text in batch["sample"]:
            sample = Sample.from_json(text)
            if query is not None and sample.anchor.system is None:
                sample.anchor.system = query
            if document is not None:
                for item in (*sample.positives, *sample.negatives):
                    if item.system is None:
                        item.system = document
            out.append(sample.to_json())
        return {"sample": out}

    key = hashlib.sha256(json.dumps([ds._fingerprint, query, document]).encode()).hexdigest()[:32]
    return ds.map(apply, batched=True, new_fingerprint=key, desc=f"instructions ({entry.name})")


def with_dataset_id(ds, index: int):
    """``ds`` with its ``dataset_id`` column (:data:`~mmembed.data.dataset.DATASET_ID`) set to ``index``."""
    from ..data.dataset import DATASET_ID

    if DATASET_ID in ds.column_names:
        ds = ds.remove_columns(DATASET_ID)
    return ds.add_column(DATASET_ID, np.full(len(ds), index, dtype=np.int64))


#: how each --multi_dataset_sampler shares the steps among the datasets
SHARES = {"proportional": "by size", "mixed": "by size (rows of all datasets in every batch)",
          "weighted": "by weight", "round_robin": "equal"}


def expected_shares(infos: list[DatasetInfo], sampler: str | None) -> list[float]:
    """Each dataset's expected share of the training steps (``mixed``: of the rows) under
    ``sampler``: ``weighted`` by weight, ``round_robin`` equal, otherwise by size."""
    if sampler == "weighted":
        values = [info.weight for info in infos]
    elif sampler == "round_robin":
        values = [1.0 for _ in infos]
    else:
        values = [float(info.rows) for info in infos]
    total = sum(values) or 1.0
    return [v / total for v in values]


def dataset_report(infos: list[DatasetInfo], train: EmbeddingDataset, encoding: Encoding,
                   losses: dict[int, EmbeddingLoss], loss: EmbeddingLoss, sampler: str | None) -> str:
    """The start-up report of a ``--dataset_config`` run: per dataset its rows, weight,
    expected share of the steps, one query and one document as the model reads them
    (instructions applied, template rendered) and the loss settings in force."""
    sampler_name = sampler or "mixed"
    shares = expected_shares(infos, sampler_name)
    ids = train.dataset_ids
    lines = [f"{len(infos)} training datasets (--multi_dataset_sampler {sampler_name}: shares "
             f"{SHARES.get(sampler_name, 'by size')}):"]
    for i, (info, share) in enumerate(zip(infos, shares)):
        first = np.flatnonzero(ids == i)
        sample = train[int(first[0])] if len(first) else None
        lines.append(f"  {info.name}: {info.rows} rows" + (f" (+{info.val_rows} val)" if info.val_rows else "")
                     + f", weight {info.weight:g}, expected share {share:.1%}")
        if sample is not None:
            lines.append(f"    query:    {encoding.template.render(sample.anchor)!r}")
            if sample.positives:
                lines.append(f"    document: {encoding.template.render(sample.positives[0])!r}")
        settings = " ".join(repr(losses.get(i, loss)).split())
        lines.append(f"    loss: {settings}" + ("" if i in losses else " (the run's)"))
    return "\n".join(lines)


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


def check_lengths(args: SftArguments, encoding: Encoding, loss: EmbeddingLoss, media: MediaSettings, train, val):
    """The length check of the training and eval rows as the run's settings say (a logged
    phase): with ``--truncation_strategy delete`` the rows over ``--max_length`` go; with
    ``left`` / ``right`` only the rows with media are measured (they are never cut). Returns
    ``(train, val)``."""
    if not (args.truncation_strategy == "delete" or encoding.template.media):
        return train, val
    phase = _Phase("length check", train, val)
    truncate = args.truncation_strategy != "delete"
    builder = length_builder(encoding, media, args.check_media)
    train = drop_overlong(train, builder, loss.layout, encoding.max_length,
                          check_processes(args.dataset_num_proc, len(train)), "train", args.strict, truncate)
    if val is not None:
        val = drop_overlong(val, builder, loss.layout, encoding.max_length,
                            check_processes(args.dataset_num_proc, len(val)), "val", args.strict, truncate)
    phase.done(train, val)
    return train, val


def length_builder(encoding: Encoding, media: MediaSettings | None = None, check_media: str = "header") -> InputBuilder:
    """The builder the length check measures with: the student's, encoding rows whole, loading
    media with ``media`` (the run's settings, as the collator's builder) and counting their
    tokens as ``check_media`` (``--check_media``) says: from headers, or by decoding them."""
    return InputBuilder(encoding.template, encoding.processing, encoding.max_length, truncate=False, media=media,
                        check_media=check_media)


def drop_overlong(ds, builder: InputBuilder, layout: Layout, max_length: int, num_proc: int, what: str,
                  strict: bool = True, truncate: bool = False):
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

    mapped = frozenset(f["filename"] for f in ds.cache_files)
    batches = [0]

    def measure(batch: dict[str, list]) -> dict[str, list]:
        batches[0] += 1
        if batches[0] % 4 == 0:  # the cache pages read so far leave this process's resident set
            release_mapped(mapped)
        if not truncate:  # text-only rows without a Sample object each (None: the general path)
            fast = json_text_lengths(builder, batch["sample"], layout)
            if fast is not None:
                return {"n_tokens": fast, "load_error": [""] * len(fast)}
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
    # the rows are measured in the cache's order (a shuffled set's batch would gather its rows from
    # all over the cache: a page read per row), then put back in the set's order
    order = None if getattr(ds, "_indices", None) is None else np.argsort(ds._indices.column(0).to_numpy(), kind="stable")
    stored = ds if order is None else ds.select(order, keep_in_memory=True)
    with shared_heap(num_proc > 1):
        measured = stored.map(measure, batched=True, num_proc=num_proc if num_proc > 1 else None, features=features,
                              remove_columns=ds.column_names, desc=f"length check ({what})",
                              new_fingerprint=length_check_fingerprint(ds, builder, layout, strict)
                              + ("-media" if truncate else ""), load_from_cache_file=strict)
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


def length_check_fingerprint(ds, builder: InputBuilder, layout: Layout, strict: bool) -> str:
    """The name of the length check's result among ``datasets``' cache files: the rows (their
    fingerprint), the template, the tokenizer's files, ``max_length``, the batch layout, the
    builder's media budget and how it counts media (``--check_media``). Given explicitly,
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
    if os.path.isdir(folder):  # the files the tokenizer and processor were read from
        for name in sorted(os.listdir(folder)):
            if name.startswith(("tokenizer", "vocab", "merges", "special_tokens", "added_tokens", "chat_template",
                                "preprocessor", "processor", "video_preprocessor")):
                with open(os.path.join(folder, name), "rb") as f:
                    h.update(name.encode("utf-8") + hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:32]
