"""``--streaming true``: training rows read from the data files as training consumes them.

The usual path (:func:`~mmembed.data.dataset.load_samples`) reads every row once before
training into a memory-mapped Arrow file (so the sampler can shuffle all rows and each
epoch is known in advance). Streaming skips that pass and that copy, as ms-swift's
``--streaming`` does: rows are parsed by the same reader (:func:`parse_row`, errors naming
file, line and field) when the data loader asks for them, through a ``datasets``
IterableDataset, which gives ms-swift's semantics for free: ``file#N`` takes a spec's first
N rows, the specs are concatenated, and ``--dataset_shuffle`` shuffles with a buffer of
``--shuffle_buffer_size`` rows (``IterableDataset.shuffle``), reseeded each epoch. The
number of rows is unknown, so ``--max_steps`` sets the run's length; epochs follow one
another as the files are read again.

A torch IterableDataset wraps it to turn rows into :class:`Sample` objects, raise or skip
bad rows (``--strict``) and drop rows over ``--max_length`` (``keep``). Data-loader workers
get whole files each (``datasets``' own sharding: with one file, one worker reads and the
others idle). Several processes each read the stream and keep their share of every global
batch (accelerate's ``IterableDatasetShard``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch.utils.data

from ..environment import read as read_environment
from .dataset import _CACHE_VERSION, _generate, spec_files
from .hub import DatasetHubOptions
from .labels import LabelRule
from .paths import MediaFileError
from .sample import DataError, Sample
from .specs import draw_seed, parse_spec

logger = logging.getLogger("mmembed")


def stream_samples(specs: list[str], *, strict: bool, seed: int | None, shuffle: bool, buffer_size: int,
                   columns: dict[str, str] | None = None, label_rule: LabelRule | None = None,
                   media_kinds: frozenset[str] | None = None, several_positives: bool = False,
                   hub: DatasetHubOptions | None = None) -> StreamingSamples:
    """The training rows of ``specs`` as a stream (see the module's description); the seeds
    are drawn as :func:`load_samples` draws them (one per spec, then the shuffle's). A hub
    dataset's splits are written as JSONL first (:func:`mmembed.data.hub.hub_files`), then
    streamed from there."""
    import datasets

    rng = np.random.RandomState(seed)
    parts = []
    for spec in specs:
        target, n = parse_spec(spec)
        draw_seed(rng)
        files, sources = spec_files(target, hub, columns)
        # one shard per file (a list: datasets gives data-loader workers whole files)
        shards = list((f, os.stat(f).st_mtime_ns, os.stat(f).st_size, 0, 1) for f in files)
        part = datasets.IterableDataset.from_generator(
            _generate, gen_kwargs={"shards": shards, "strict": strict, "verify_images": True, "version": _CACHE_VERSION,
                                   "work_dir": os.getcwd(), "root_image_dir": read_environment().data.root_image_dir,
                                   "columns": None if sources else columns, "sources": sources,
                                   "label_rule": label_rule.as_dict() if label_rule else None,
                                   "media_kinds": tuple(sorted(media_kinds)) if media_kinds is not None else None,
                                   "several_positives": several_positives})
        parts.append(part.take(n) if n is not None else part)
    stream = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    if shuffle:
        stream = stream.shuffle(seed=draw_seed(rng), buffer_size=buffer_size)
    return StreamingSamples(stream, strict=strict, specs=specs)


class StreamingSamples(torch.utils.data.IterableDataset):
    """Samples from a ``datasets`` IterableDataset of the reader's rows (``sample`` JSON or an
    ``error``). ``keep(sample) -> bool`` drops rows (counted and logged); it may raise
    :class:`DataError` for a row whose media cannot be loaded (raised under ``strict``, else
    the row is skipped like a bad row)."""

    def __init__(self, stream: Any, strict: bool, specs: list[str], keep: Callable[[Sample], bool] | None = None,
                 min_rows: int = 1):
        self.stream, self.strict, self.specs, self.keep = stream, strict, specs, keep
        # the rows one batch of every process takes: a pass over the stream that gives fewer
        # completes no batch, and training would read the stream again and again without a step
        self.min_rows = min_rows
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.stream.set_epoch(epoch)

    def __iter__(self):
        # in a data-loader worker, datasets hands this worker its own shards (files, whole); a
        # worker beyond the shard count reads nothing
        in_worker = torch.utils.data.get_worker_info() is not None
        skipped = dropped = served = 0
        for row in self.stream:
            error = self._error(row)
            sample = None
            if error is None:
                sample = Sample.from_json(row["sample"])
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
                logger.warning("skipped a bad row (--strict false): %s", error)
                continue
            served += 1
            yield sample
        if served < self.min_rows and not in_worker:
            if served == 0:
                raise DataError(", ".join(self.specs), 0, None,
                                f"no usable rows in the stream ({skipped} bad, {dropped} over --max_length)")
            raise DataError(", ".join(self.specs), 0, None,
                            f"only {served} usable row(s) in a whole pass over the stream ({skipped} bad, {dropped} over "
                            f"--max_length), fewer than one batch of every process ({self.min_rows}): no batch would be "
                            "complete and training would read the stream again and again without a step; give more "
                            "rows or lower --per_device_train_batch_size")
        if dropped:
            logger.warning("epoch %d: %d row(s) longer than --max_length were deleted (--truncation_strategy delete)",
                           self.epoch, dropped)

    @staticmethod
    def _error(row: dict) -> DataError | None:
        if not row.get("error"):
            return None
        info = json.loads(row["error"])
        cls = MediaFileError if info.get("media") else DataError
        return cls(row["source"], row["line"], info["field"], info["reason"])
