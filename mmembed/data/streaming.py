"""``--streaming true``: training rows read from the data files as training consumes them.

The usual path (:func:`~mmembed.data.dataset.load_samples`) reads every row once before
training into a memory-mapped Arrow file (so the sampler can shuffle all rows and each
epoch is known in advance). Streaming skips that pass and that copy, as ms-swift's
``--streaming`` does: rows are parsed by the same reader (:func:`parse_row`, errors naming
file, line and field) when the data loader asks for them, through a ``datasets``
IterableDataset, which gives ms-swift's semantics for free: ``file#N`` takes a spec's first
N rows, the specs are concatenated, and ``--dataset_shuffle`` shuffles with a buffer of
``--shuffle_buffer_size`` rows (``IterableDataset.shuffle``), reseeded each epoch; with
``--interleave_prob`` the specs are interleaved (:func:`combine`) instead of concatenated. The
number of rows is unknown, so ``--max_steps`` sets the run's length; epochs follow one
another as the files are read again.

``--dataset_config``'s datasets are one stream each (:func:`stream_samples` with the dataset's
index); :func:`mix_streams` makes them one in ms-swift's order (``--multi_dataset_sampler
mixed``); :class:`~mmembed.training.stream_samplers.StreamBatches` reads whole global batches
from them (:meth:`StreamingSamples.global_batches`), under the other samplers drawing each
global batch's dataset by their rules.

A torch IterableDataset wraps it to turn rows into :class:`Sample` objects, raise or skip
bad rows (``--strict``) and drop rows over ``--max_length`` (``keep``). Data-loader workers
get whole files each (``datasets``' own sharding: with one file, one worker reads and the
others idle). Several processes each read the stream and keep their share of every global
batch (accelerate's ``IterableDatasetShard``).
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch.utils.data

from ..environment import read as read_environment
from .arrow_rows import _expected_rows, _generate
from .dataset import _CACHE_VERSION, spec_files
from .hub import DatasetHubOptions
from .labels import LabelRule
from .paths import MediaFileError
from .sample import DataError, Sample
from .specs import draw_seed, parse_spec

logger = logging.getLogger("mmembed")


class Stream(torch.utils.data.IterableDataset):
    """Training rows read as training consumes them: what the checks of
    :mod:`mmembed.training.row_checks` filter (:meth:`add_filter`) rather than read up front."""

    def add_filter(self, keep: Callable[[Sample], bool]) -> None:
        raise NotImplementedError


def stream_samples(specs: list[str], *, strict: bool, seed: int | None, shuffle: bool, buffer_size: int,
                   columns: dict[str, str] | None = None, label_rule: LabelRule | None = None,
                   media_kinds: frozenset[str] | None = None, several_positives: bool = False,
                   hub: DatasetHubOptions | None = None, take: int | None = None, dataset_id: int = 0,
                   name: str | None = None, interleave: list[float] | None = None,
                   stopping: str = "first_exhausted") -> StreamingSamples:
    """The training rows of ``specs`` as a stream (see the module's description); the seeds
    are drawn as :func:`load_samples` draws them (one per spec, then the shuffle's). A hub
    dataset's splits are written as JSONL first (:func:`mmembed.data.hub.hub_files`), then
    streamed from there.

    ``interleave``: ms-swift's ``--interleave_prob``, one probability per spec (normalised to
    sum 1): the specs interleaved (``datasets.interleave_datasets``, ``stopping`` its stopping
    strategy, seeded with a draw between the specs' and the shuffle's) instead of concatenated.
    ``take``: the first ``take`` rows of the specs together (a ``--dataset_config`` dataset's
    ``sample`` over several paths). ``dataset_id``: the index every sample gets (a
    ``--dataset_config`` dataset's; ``name`` names it in messages)."""
    rng = np.random.RandomState(seed)
    parts = [_spec_stream(spec, rng, strict=strict, columns=columns, label_rule=label_rule, media_kinds=media_kinds,
                          several_positives=several_positives, hub=hub) for spec in specs]
    stream = combine(parts, rng, interleave, stopping)
    if take is not None:
        stream = stream.take(take)
    if shuffle:
        stream = stream.shuffle(seed=draw_seed(rng), buffer_size=buffer_size)
    return StreamingSamples(stream, strict=strict, specs=specs, dataset_id=dataset_id, name=name)


def _spec_stream(spec: str, rng: np.random.RandomState, *, strict: bool, columns, label_rule, media_kinds,
                 several_positives: bool, hub: DatasetHubOptions | None = None):
    """One spec's rows as a ``datasets`` IterableDataset (``path#N``: its first N), with the
    seed :func:`load_samples` would draw for it drawn from ``rng``."""
    import datasets

    target, n = parse_spec(spec)
    draw_seed(rng)
    files, sources = spec_files(target, hub, columns)
    # one shard per file (a list: datasets gives data-loader workers whole files)
    shards = list((f, os.stat(f).st_mtime_ns, os.stat(f).st_size, 0, 1) for f in files)
    part = datasets.IterableDataset.from_generator(
        _generate, gen_kwargs={"shards": shards, "strict": strict, "verify_images": True, "version": _CACHE_VERSION,
                               "work_dir": os.getcwd(), "root_image_dir": read_environment().data.root_image_dir,
                               "columns": None if sources else columns, **({"sources": sources} if sources else {}),
                               "label_rule": label_rule.as_dict() if label_rule else None,
                               "media_kinds": tuple(sorted(media_kinds)) if media_kinds is not None else None,
                               "several_positives": several_positives})
    return part.take(n) if n is not None else part


def combine(parts: list, rng: np.random.RandomState, interleave: list[float] | None = None,
            stopping: str = "first_exhausted"):
    """ms-swift's combination of several streamed datasets (its ``load_dataset``): concatenated,
    or with ``interleave`` (``--interleave_prob``) ``datasets.interleave_datasets`` with the
    probabilities normalised to sum 1, seeded with a draw from ``rng`` (drawn even for one
    dataset, as ms-swift draws it), ``stopping`` (``first_exhausted`` | ``all_exhausted``)."""
    import datasets

    if interleave is None:
        return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    if len(interleave) != len(parts):
        raise ValueError(f"{len(interleave)} interleave probabilities for {len(parts)} streams")
    seed = draw_seed(rng)
    if len(parts) == 1:
        return parts[0]
    total = float(sum(interleave))
    return datasets.interleave_datasets(parts, probabilities=[float(p) / total for p in interleave], seed=seed,
                                        stopping_strategy=stopping)


def mix_streams(streams: list[StreamingSamples], *, seed: int | None, shuffle: bool, buffer_size: int,
                interleave: list[float] | None = None, stopping: str = "first_exhausted") -> StreamingSamples:
    """``--dataset_config``'s datasets (each a stream of :func:`stream_samples`, unshuffled) as one
    stream in ms-swift's order (``--multi_dataset_sampler mixed``): concatenated, or interleaved
    (:func:`combine`), then shuffled with a buffer of ``buffer_size`` rows. The seeds are drawn
    as for ``--dataset`` with every dataset's specs in order, so a file of one-spec datasets
    streams the rows of ``--dataset`` with those specs. Each row keeps its dataset's index, and
    is checked by its dataset's stream's filters (those added to the datasets' streams, before
    or after this call)."""
    rng = np.random.RandomState(seed)
    for s in streams:
        for _ in s.specs:
            draw_seed(rng)
    parts = [s.stream.map(_tag, fn_kwargs={"dataset_id": s.dataset_id}) for s in streams]
    stream = combine(parts, rng, interleave, stopping)
    if shuffle:
        stream = stream.shuffle(seed=draw_seed(rng), buffer_size=buffer_size)
    by_id = {s.dataset_id: s for s in streams}

    def keep(sample: Sample) -> bool:  # the filters of the sample's dataset
        own = by_id[sample.dataset_id].keep
        return own is None or own(sample)

    return StreamingSamples(stream, strict=streams[0].strict, specs=[x for s in streams for x in s.specs],
                            keep=keep, dataset_id=None)


def _tag(row: dict, dataset_id: int) -> dict:
    return {"dataset_id": dataset_id}


def _whole(stream):
    """``stream``'s rows, all of them, even in a data-loader worker (where iterating a ``datasets``
    IterableDataset gives the worker only its share of the files): ``IterableDataset.iter``
    reads it as the main process would."""
    for batch in stream.iter(batch_size=1):
        yield {k: v[0] for k, v in batch.items()}


def count_rows(specs: list[str], hub: DatasetHubOptions | None = None) -> int | None:
    """The training rows ``specs`` hold, counted without parsing: the lines of their ``.jsonl``
    files (a blank line counts too; a hub dataset's written split, a row ms-swift's mapping drops
    being a blank line) and the rows of their ``.parquet`` files, ``path#N`` at most N; None when
    a file of another format is among them (its rows cannot be counted but by reading it)."""
    total = 0
    for spec in specs:
        target, n = parse_spec(spec)
        rows = 0
        for f in spec_files(target, hub)[0]:
            counted = _expected_rows([(f, 0, os.stat(f).st_size, 0, 1)])
            if counted == 0 and os.stat(f).st_size > 0:
                return None
            rows += counted
        total += rows if n is None else min(n, rows)
    return total


class StreamingSamples(Stream):
    """Samples from a ``datasets`` IterableDataset of the reader's rows (``sample`` JSON or an
    ``error``). ``keep(sample) -> bool`` drops rows (counted and logged); it may raise
    :class:`DataError` for a row whose media cannot be loaded (raised under ``strict``, else
    the row is skipped like a bad row). Each sample gets ``dataset_id`` (None: the row's own
    ``dataset_id``, :func:`mix_streams`'s)."""

    def __init__(self, stream: Any, strict: bool, specs: list[str], keep: Callable[[Sample], bool] | None = None,
                 min_rows: int = 1, dataset_id: int | None = 0, name: str | None = None):
        self.stream, self.strict, self.specs, self.keep = stream, strict, specs, keep
        self.dataset_id, self.name = dataset_id, name
        # the rows one batch of every process takes: a pass over the stream that gives fewer
        # completes no batch, and training would read the stream again and again without a step
        self.min_rows = min_rows
        self.min_rows_are = "one batch of every process"  # what min_rows is, for the message
        self.epoch = 0

    def add_filter(self, keep: Callable[[Sample], bool]) -> None:
        """``keep`` after the stream's filters: a row is kept when all keep it."""
        before = self.keep
        self.keep = keep if before is None else (lambda sample: before(sample) and keep(sample))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.stream.set_epoch(epoch)

    def __iter__(self):
        # in a data-loader worker, datasets hands this worker its own shards (files, whole); a
        # worker beyond the shard count reads nothing
        return self._pass(whole=False)

    def global_batches(self, size: int):
        """Endless: the stream's rows cut into batches of ``size``, pass after pass (pass ``p``
        read with the stream's epoch set to ``p``: the shuffle buffer reseeded); the rows of a
        pass that fill no whole batch sit it out. In a data-loader worker each pass is the whole
        stream (every worker reads every row: :func:`_whole`), logged by worker 0 only."""
        worker = torch.utils.data.get_worker_info()
        quiet = worker is not None and worker.id > 0
        if worker is not None:
            # datasets keeps a stream's epoch in shared memory (for persistent workers), so workers
            # reading every row at their own pace would set each other's pass (and shuffle seed)
            # mid-pass: each worker reads a copy with an epoch of its own
            self.stream = copy.deepcopy(self.stream)
        for p in itertools.count():
            self.set_epoch(p)
            batch: list[Sample] = []
            for sample in self._pass(whole=worker is not None, quiet=quiet):
                batch.append(sample)
                if len(batch) == size:
                    yield batch
                    batch = []

    def _pass(self, whole: bool, quiet: bool = False):
        """One pass over the stream: its usable samples (``whole``: all of the stream's rows, in a
        data-loader worker too); ``quiet``: no log lines (another worker logs them)."""
        in_worker = torch.utils.data.get_worker_info() is not None and not whole
        skipped = dropped = served = 0
        where = f"dataset {self.name} ({', '.join(self.specs)})" if self.name else ", ".join(self.specs)
        for row in (_whole(self.stream) if whole else self.stream):
            error = self._error(row)
            sample = None
            if error is None:
                sample = Sample.from_json(row["sample"])
                sample.dataset_id = self.dataset_id if self.dataset_id is not None else int(row.get("dataset_id") or 0)
                try:
                    if self.keep is not None and not self.keep(sample):
                        dropped += 1
                        continue
                except DataError as e:
                    error = e
            if error is not None:
                if self.strict:
                    raise error
                skipped += 1
                if not quiet:
                    logger.warning("skipped a bad row (--strict false): %s", error)
                continue
            served += 1
            yield sample
        if served < self.min_rows and not in_worker:
            if served == 0:
                raise DataError(where, 0, None,
                                f"no usable rows in the stream ({skipped} bad, {dropped} over --max_length)")
            raise DataError(where, 0, None,
                            f"only {served} usable row(s) in a whole pass over the stream ({skipped} bad, {dropped} over "
                            f"--max_length), fewer than {self.min_rows_are} ({self.min_rows}): no batch would be "
                            "complete and training would read the stream again and again without a step; give more "
                            "rows or lower --per_device_train_batch_size")
        if dropped and not quiet:
            logger.warning("%s%d: %d row(s) longer than --max_length were deleted (--truncation_strategy delete)",
                           f"dataset {self.name}, pass " if self.name else "epoch ", self.epoch, dropped)

    @staticmethod
    def _error(row: dict) -> DataError | None:
        if not row.get("error"):
            return None
        info = json.loads(row["error"])
        cls = MediaFileError if info.get("media") else DataError
        return cls(row["source"], row["line"], info["field"], info["reason"])
