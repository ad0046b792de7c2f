"""Data assembly for ``mmembed sft``: the training and eval rows as training reads them.

:meth:`TrainingData.load` reads the rows from one of three sources: the files of
``--dataset`` / ``--val_dataset``, those of a ``--dataset_config`` file (each dataset with its
instructions and loss), or ``--streaming true``'s stream. Each source yields
:class:`~mmembed.training.row_checks.Rows`; then
:func:`~mmembed.training.row_checks.check_rows` runs the same phases over any of them, in
order: the rows the loss cannot learn from under its settings, the remote media downloaded up
front, the length check (:mod:`mmembed.training.row_checks`,
:mod:`mmembed.training.length_check`). Then the source opens the teacher's arrays and finds
the teacher signal the rows carry (:func:`data_teacher`). :func:`check_drop_last` and
:func:`load_eval_tasks` check the rest of what training will read before the model loads.
:func:`read_once` has one process of a run read and check the data while the others wait and
reuse its ``datasets`` cache; each phase logs its rows, removals and time.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from ..data import EmbeddingDataset, SpecError, load_samples
from ..data.dataset_config import DatasetEntry, DatasetInfo
from ..data.hub import DatasetHubOptions
from ..data.sample import DataError
from ..data.streaming import Stream, mix_streams, stream_samples
from ..data.teacher import TeacherFiles, teacher_signal
from ..encoding.instructions import Instructions
from ..eval.tasks import HeldOutTasks
from ..losses import EmbeddingLoss
from ..task import get_task
from .arguments import SftArguments, UsageError
from .distributed import world
from .flag_checks import beir_pairs
from .model_assembly import Encoding, make_loss
from .row_checks import Checks, Part, Rows, check_rows, log_phase

if TYPE_CHECKING:  # the media loader is imported at the first row with media (qwen-vl-utils: about a second)
    from ..encoding.media import MediaSettings

logger = logging.getLogger("mmembed")


@dataclasses.dataclass
class TrainingData:
    """The training and eval rows, with their teacher signals."""

    train: EmbeddingDataset | Stream  # (--streaming: rows read as training consumes them)
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
        share), of ``--dataset_config`` or of the stream, checked (:func:`~mmembed.training.row_checks.check_rows`: their
        URLs downloaded and their lengths measured with ``media``, the run's media settings),
        with the teacher's arrays and the teacher signal the rows carry. ``reuse``: the rows
        were just read and checked by another process of the run (:func:`read_once`): take the
        Arrow cache as it is. Each phase logs its rows and time."""
        # ms-swift's order: --data_seed (not --seed) drives the split, #N sampling and --dataset_shuffle.
        # Every row is checked now against what the loss takes as a label and the media the
        # model takes, so a row training could not use is an error (or skipped) before training.
        # A reranker run takes rows with several positive groups (ms-swift's reranker draws
        # MAX_POSITIVE_SAMPLES of them); an embedding run keeps one positive per row.
        load_opts = dict(strict=args.strict, seed=args.data_seed, num_proc=args.dataset_num_proc,
                         load_from_cache_file=args.load_from_cache_file,
                         columns=json.loads(args.columns) if args.columns else None,
                         label_rule=loss.label_rule, media_kinds=frozenset(encoding.template.media), reuse=reuse,
                         several_positives=get_task(args.task_type).several_positives, hub=hub_options(args))
        checks = Checks(args, encoding, loss, media, reuse)
        if getattr(args, "dataset_config", None):
            return cls.stream_config(checks, load_opts) if args.streaming else cls.load_config(checks, load_opts)
        if args.streaming:
            return cls.stream(checks, load_opts)
        return cls.load_files(checks, load_opts)

    @classmethod
    def load_files(cls, checks: Checks, load_opts: dict) -> TrainingData:
        """``--dataset`` (and ``--val_dataset``, or ``--split_dataset_ratio``'s share)."""
        args, loss = checks.args, checks.loss
        loaded = load_samples(args.dataset, split_ratio=0.0 if args.val_dataset else args.split_dataset_ratio,
                              shuffle=args.dataset_shuffle, **load_opts)
        log_phase("parse", loaded.rows_read, loaded.seconds, f"{len(loaded.skipped)} bad row(s) skipped, " if
                   loaded.skipped else "", "parsed" if loaded.parsed else "from the Arrow cache")
        try:
            teacher_files = TeacherFiles.open(loaded.files, loaded.records, args.teacher_scores_file,
                                              args.teacher_embeddings_file)
        except ValueError as e:
            raise UsageError(str(e)) from None
        files, val, parsed = {"train": loaded.records}, loaded.val, loaded.parsed
        if args.val_dataset:
            val_loaded = load_samples(args.val_dataset, split_ratio=1.0, shuffle=args.val_dataset_shuffle, **load_opts)
            val, files["val"], parsed = val_loaded.dataset, val_loaded.records, parsed or val_loaded.parsed
        train, val = check_rows(Rows([Part.of(loaded.dataset, val, loss.negatives_rule)]), checks).whole()
        if len(train) == 0:  # all deleted by the length check (loading itself refuses empty data): a data error
            raise SpecError(f"no training rows left: every row of {', '.join(args.dataset)} is longer than "
                            f"--max_length {checks.encoding.max_length} or has media that cannot be loaded (listed "
                            "above; --truncation_strategy delete); raise --max_length or use --truncation_strategy right")
        data = cls(EmbeddingDataset(train, teacher_files), EmbeddingDataset(val, teacher_files) if val is not None else None,
                   files=files, parsed=bool(parsed))
        data.teacher_key, data.teacher_width = data_teacher(args, loss, data.train)
        if val is not None:  # data_teacher read the training rows with their arrays; the eval rows' must fit too
            teacher_files.check_rows(val)
        return data

    @classmethod
    def stream(cls, checks: Checks, load_opts: dict) -> TrainingData:
        """``--streaming true``: the training rows as a stream (:mod:`mmembed.data.streaming`);
        ``--val_dataset`` is read whole as usual. The phases check the stream's rows as they are
        read: a row the loss would fail on (:func:`~mmembed.training.row_checks.check_trainable`) is a data error, or
        skipped with ``--strict false``; rows over ``--max_length`` are dropped
        (``--truncation_strategy delete``); remote media are fetched when read."""
        args, loss = checks.args, checks.loss
        _stream_teacher(args, loss)
        interleave = _interleave(args, [f"--dataset {spec}" for spec in args.dataset])
        train = stream_samples(args.dataset, strict=args.strict, seed=args.data_seed, shuffle=args.dataset_shuffle,
                               buffer_size=args.shuffle_buffer_size, columns=load_opts["columns"],
                               label_rule=load_opts["label_rule"], media_kinds=load_opts["media_kinds"],
                               several_positives=load_opts["several_positives"], hub=load_opts["hub"],
                               interleave=interleave, stopping=args.stopping_strategy)
        val, files = None, {}
        if args.val_dataset:
            val_loaded = load_samples(args.val_dataset, split_ratio=1.0, shuffle=args.val_dataset_shuffle, **load_opts)
            val, files["val"] = val_loaded.dataset, val_loaded.records
        train, val = check_rows(Rows([Part.of(train, val, loss.negatives_rule)]), checks).whole()
        train.min_rows = args.per_device_train_batch_size * args.world_size
        return cls(train, EmbeddingDataset(val) if val is not None else None, files=files)

    # ------------------------------------------------------------------ --dataset_config
    @classmethod
    def load_config(cls, checks: Checks, load_opts: dict) -> TrainingData:
        """``--dataset_config``: each dataset's rows read (``sample: N`` as ``#N``) and its
        validation rows (its ``val`` files, or its ``--split_dataset_ratio`` share); its
        instructions are not written into the rows but applied where rows are rendered, by each
        row's dataset index (:mod:`mmembed.encoding.instructions`). The phases check
        each dataset's rows against its own loss, then tag them with its index (the
        ``dataset_id`` column), concatenate the datasets (shuffled together,
        ``--dataset_shuffle``), fetch their remote media and check their lengths as for
        ``--dataset``. Logs the start-up report (:func:`dataset_report`)."""
        args, encoding, loss = checks.args, checks.encoding, checks.loss
        entries: list[DatasetEntry] = args.dataset_entries
        sampler = getattr(args, "multi_dataset_sampler", None) or "mixed"  # (mixed: ms-swift's order)
        losses = dataset_losses(args, entries, sampler)
        parts, files = [], {"train": {}, "val": {}}
        for i, entry in enumerate(entries):
            opts = dict(load_opts, seed=(args.data_seed or 0) + i)  # data_seed for the first: one dataset = --dataset
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
            # its val rows are scored with its loss (eval_<name>_*) and, pooled, with the run's (eval_*)
            own = (losses.get(i) or loss).negatives_rule
            parts.append(Part.of(train, val, own, (own, loss.negatives_rule), entry.name))
        train, val = check_rows(Rows(parts, join=lambda parts: _join(parts, args)), checks).whole()
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


    @classmethod
    def stream_config(cls, checks: Checks, load_opts: dict) -> TrainingData:
        """``--dataset_config`` with ``--streaming true``: each dataset a stream of its own
        (:func:`~mmembed.data.streaming.stream_samples`: its files, ``sample: N`` its first N rows,
        its index on every row) whose rows the phases check as a stream's, each against its own
        loss and instructions; its ``val`` rows read whole. Then ``--multi_dataset_sampler mixed``
        makes them one stream in ms-swift's order (:func:`~mmembed.data.streaming.mix_streams`:
        concatenated or ``--interleave_prob``-interleaved, then shuffled with a buffer), the other
        samplers draw from them by their rules, over the datasets' sizes
        (:func:`~mmembed.training.stream_samplers.stream_sizes`); either way the training set is
        whole global batches without end (:class:`~mmembed.training.stream_samplers.StreamBatches`).
        Logs the start-up report."""
        from .stream_samplers import StreamBatches, stream_sizes

        args, loss = checks.args, checks.loss
        entries: list[DatasetEntry] = args.dataset_entries
        sampler = getattr(args, "multi_dataset_sampler", None) or "mixed"
        losses = dataset_losses(args, entries, sampler)
        _stream_teacher(args, loss)
        mixed = sampler == "mixed"
        interleave = _interleave(args, [f"dataset {e.name}" for e in entries])
        sizes = stream_sizes(entries, sampler, args.dataset_config, load_opts["hub"])
        parts, files = [], {}
        for i, entry in enumerate(entries):
            several = entry.sample is not None and len(entry.paths) > 1  # sample: N over the paths together
            # mixed: the datasets' rows are shuffled together (mix_streams); the others: each its own
            stream = stream_samples(entry.paths if several else entry.specs(), strict=args.strict,
                                    seed=(args.data_seed or 0) + i, shuffle=args.dataset_shuffle and not mixed,
                                    buffer_size=args.shuffle_buffer_size, columns=load_opts["columns"],
                                    label_rule=load_opts["label_rule"], media_kinds=load_opts["media_kinds"],
                                    several_positives=load_opts["several_positives"],
                                    take=entry.sample if several else None, dataset_id=i, name=entry.name,
                                    hub=load_opts["hub"])
            val = None
            if entry.val:
                opts = dict(load_opts, seed=(args.data_seed or 0) + i)
                val_loaded = load_samples(entry.val, split_ratio=1.0, shuffle=args.val_dataset_shuffle, **opts)
                val = val_loaded.dataset
                files.setdefault("val", {}).update(val_loaded.records)
            own = (losses.get(i) or loss).negatives_rule
            parts.append(Part.of(stream, val, own, (own, loss.negatives_rule), entry.name))

        def join(parts: list[Part]) -> tuple[Any, Any]:
            streams = [p.train for p in parts]
            batch, accumulation = args.per_device_train_batch_size, int(args.gradient_accumulation_steps or 1)
            seed = args.data_seed if args.data_seed is not None else args.seed
            if mixed:
                train = StreamBatches.mixed(mix_streams(streams, seed=args.data_seed, shuffle=args.dataset_shuffle,
                                                        buffer_size=args.shuffle_buffer_size, interleave=interleave,
                                                        stopping=args.stopping_strategy),
                                            batch, accumulation, args.world_size, seed)
            else:
                train = StreamBatches.homogeneous(streams, sampler, sizes, [e.weight for e in entries], batch,
                                                  accumulation, args.world_size, seed)
            vals = [with_dataset_id(p.val, i) for i, p in enumerate(parts) if p.val is not None]
            val = None if not vals else vals[0] if len(vals) == 1 else _concatenate(vals)
            return train, val

        train, val = check_rows(Rows(parts, join=join), checks).whole()
        val_set = EmbeddingDataset(val) if val is not None else None
        val_rows = np.bincount(val_set.dataset_ids, minlength=len(entries)) if val_set is not None else [0] * len(entries)
        # rows: the size the sampler draws by (declared or counted); None where none is needed (unknown)
        infos = [DatasetInfo(e.name, e.weight, n, e, int(val_rows[i])) for i, (e, (n, _)) in
                 enumerate(zip(entries, sizes))]
        data = cls(train, val_set, files=files, datasets=infos, losses=losses)
        logger.info("%s", stream_report(infos, sizes, checks.encoding, losses, loss, sampler, interleave, args))
        if world()[0] == 0:
            logger.info("%s", train.describe())
        return data


def hub_options(args: SftArguments) -> DatasetHubOptions:
    """How the run loads hub dataset ids: ``--use_hf`` (or ``USE_HF``), ``--hub_token``,
    ``--download_mode`` (:class:`~mmembed.data.hub.DatasetHubOptions`)."""
    return DatasetHubOptions.of(args.use_hf, token=getattr(args, "hub_token", None),
                                download_mode=getattr(args, "download_mode", None))


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
        what = "pack(s) of training rows (--packing)" if getattr(args, "packing", False) else "training row(s)"
        raise UsageError(f"--dataloader_drop_last true with {len(data.train)} {what}, fewer than one batch "
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
                                 beir_split=args.eval_beir_split, sts=args.eval_sts, instructions=instructions,
                                 encoder=get_task(args.task_type).eval_encoder(args, encoding))
    except ValueError as e:
        if isinstance(e, DataError):
            raise
        raise UsageError(str(e)) from None


# ----------------------------------------------------------------------------- --dataset_config


def dataset_losses(args: SftArguments, entries: list[DatasetEntry], sampler: str | None = None
                   ) -> dict[int, EmbeddingLoss]:
    """The losses of the datasets with loss settings of their own, by index (:func:`make_loss`);
    refused under ``sampler`` ``mixed``, whose batches mix the datasets."""
    losses = {i: make_loss(args, entry) for i, entry in enumerate(entries) if entry.has_loss_settings}
    if losses and sampler == "mixed":
        named = ", ".join(entries[i].name for i in losses)
        raise UsageError(f"--dataset_config {args.dataset_config}: dataset(s) {named} have loss settings of their "
                         "own, which need every batch from one dataset; --multi_dataset_sampler mixed puts rows of "
                         "all datasets in a batch: use --multi_dataset_sampler proportional, round_robin or "
                         "weighted, or move the settings to the INFONCE_* variables / --loss_kwargs")
    return losses


def _stream_teacher(args: SftArguments, loss: EmbeddingLoss) -> None:
    """A stream's rows cannot all be checked for the teacher's signals before training."""
    if loss.side.teacher and not args.teacher_model:
        raise UsageError(f"--loss_type {args.loss_type} with the teacher's signals in the rows cannot be checked "
                         "up front with --streaming true: give --teacher_model, or leave out --streaming")


def _interleave(args: SftArguments, names: list[str]) -> list[float] | None:
    """``--interleave_prob`` for a stream of the datasets ``names`` (one probability each), logged."""
    probs = getattr(args, "interleave_prob", None)
    if probs is None:
        return None
    if len(probs) != len(names):
        raise UsageError(f"--interleave_prob gives {len(probs)} probabilities for {len(names)} dataset(s) "
                         f"({', '.join(names)}): give one per dataset")
    total = float(sum(probs))
    logger.info("--interleave_prob %s --streaming true: the streams interleaved row by row with probabilities %s "
                "(normalised to sum 1), --stopping_strategy %s", " ".join(str(x) for x in probs),
                ", ".join(f"{n} {x / total:.4g}" for n, x in zip(names, probs)), args.stopping_strategy)
    return list(probs)


def _concatenate(parts):
    import datasets as hf_datasets

    return hf_datasets.concatenate_datasets(parts)


def _join(parts: list[Part], args: SftArguments) -> tuple[Any, Any]:
    """``--dataset_config``'s datasets as one: each tagged with its index, concatenated, the
    training rows shuffled together (``--dataset_shuffle``)."""
    import datasets as hf_datasets

    trains = [with_dataset_id(p.train, i) for i, p in enumerate(parts)]
    vals = [with_dataset_id(p.val, i) for i, p in enumerate(parts) if p.val is not None]
    train = trains[0] if len(trains) == 1 else hf_datasets.concatenate_datasets(trains)
    if len(trains) > 1 and args.dataset_shuffle:
        train = train.shuffle(seed=args.data_seed)
    val = None if not vals else vals[0] if len(vals) == 1 else hf_datasets.concatenate_datasets(vals)
    return train, val


def sample_rows(ds, n: int, seed: int, shuffle: bool, name: str):
    """``sample: N`` over a dataset of several files: N of their rows together, drawn as
    ms-swift's ``#N`` draws them from one file (:func:`~mmembed.data.specs.sample_indices`)."""
    from ..data.specs import sample_indices

    if n > len(ds):
        logger.warning("dataset %s: sample %d is more than its %d rows, so rows repeat", name, n, len(ds))
    return ds.select(sample_indices(len(ds), n, np.random.RandomState(seed), shuffle))


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


def stream_report(infos: list[DatasetInfo], sizes: list[tuple[int | None, str]], encoding: Encoding,
                  losses: dict[int, EmbeddingLoss], loss: EmbeddingLoss, sampler: str, interleave: list[float] | None,
                  args: SftArguments) -> str:
    """The start-up report of a streamed ``--dataset_config`` run: per dataset its size (declared,
    counted, or not needed), validation rows, weight, expected share of the steps under the
    sampler (``mixed``: how the streams are combined) and the loss settings in force. (No row is
    shown: the streams are read when training starts.)"""
    if sampler == "mixed":
        how = (f"interleaved row by row (--interleave_prob, --stopping_strategy {args.stopping_strategy})"
               if interleave else "concatenated in this order") + (
            f", then shuffled with a buffer of {args.shuffle_buffer_size} rows" if args.dataset_shuffle else "")
        shares = [x / sum(interleave) for x in interleave] if interleave else None
    else:
        how = f"every global batch from one dataset, shares {SHARES[sampler]}"
        shares = expected_shares(infos, sampler)
    lines = [f"{len(infos)} training datasets, each a stream (--streaming true; --multi_dataset_sampler {sampler}: "
             f"{how}):"]
    for i, (info, (n, source)) in enumerate(zip(infos, sizes)):
        size = f"{n:,} rows ({source})" if n is not None else "rows read as training goes"
        share = f", expected share {shares[i]:.1%}" + (" of the rows" if sampler == "mixed" else "") if shares else ""
        lines.append(f"  {info.name}: {size}" + (f" (+{info.val_rows} val)" if info.val_rows else "")
                     + f", weight {info.weight:g}{share}")
        settings = " ".join(repr(losses.get(i, loss)).split())
        lines.append(f"    loss: {settings}" + ("" if i in losses else " (the run's)"))
    return "\n".join(lines)


def dataset_report(infos: list[DatasetInfo], train: EmbeddingDataset, encoding: Encoding,
                   losses: dict[int, EmbeddingLoss], loss: EmbeddingLoss, sampler: str | None) -> str:
    """The start-up report of a ``--dataset_config`` run: per dataset its rows, weight,
    expected share of the steps, one query and one document as the model reads them
    (instructions applied, template rendered) and the loss settings in force."""
    sampler_name = sampler or "mixed"
    shares = expected_shares(infos, sampler_name)
    instructions = Instructions.of([info.entry for info in infos if info.entry is not None])
    ids = train.dataset_ids
    lines = [f"{len(infos)} training datasets (--multi_dataset_sampler {sampler_name}: shares "
             f"{SHARES.get(sampler_name, 'by size')}):"]
    for i, (info, share) in enumerate(zip(infos, shares)):
        first = np.flatnonzero(ids == i)
        sample = train[int(first[0])] if len(first) else None
        lines.append(f"  {info.name}: {info.rows} rows" + (f" (+{info.val_rows} val)" if info.val_rows else "")
                     + f", weight {info.weight:g}, expected share {share:.1%}")
        if sample is not None:
            template = instructions.template_for(encoding.template, i)
            lines.append(f"    query:    {template.render(sample.anchor, 'query')!r}")
            if sample.positives:
                lines.append(f"    document: {template.render(sample.positives[0], 'document')!r}")
        settings = " ".join(repr(losses.get(i, loss)).split())
        lines.append(f"    loss: {settings}" + ("" if i in losses else " (the run's)"))
    return "\n".join(lines)
