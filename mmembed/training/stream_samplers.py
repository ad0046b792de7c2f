"""``--streaming true`` with ``--dataset_config``: each dataset a stream, read as training
consumes it, in whole global batches without end.

:class:`StreamBatches` is the training set of such a run. Under ``--multi_dataset_sampler
proportional | round_robin | weighted`` every global batch comes from one dataset: each
dataset's rows are a :class:`~mmembed.data.streaming.StreamingSamples` (its own files, shuffle
buffer, bad-row and length filters) read pass after pass in whole global batches
(:meth:`~mmembed.data.streaming.StreamingSamples.global_batches`: the rows of a pass that fill no
whole global batch sit it out, as in the loaded path), and the dataset of each global batch is
drawn by the rule of the loaded path's sampler (the draws of
:class:`~mmembed.training.samplers.HomogeneousSampler`'s classes): the draws of epoch ``e`` are
those of the loaded rule over the datasets' sizes, declared in the config or counted
(:func:`stream_sizes`); an epoch is that many draws, and the streams go on where they stopped.
Under ``mixed`` the datasets are one stream in ms-swift's order
(:func:`~mmembed.data.streaming.mix_streams`), cut into global batches the same way.

Endless: ``--max_steps`` ends the run (the Trainer sees one epoch), so a resumed run's skipping
of the trained batches lands on the same rows, passes included (everything follows from the
seed and the sizes); :meth:`StreamBatches.state` is the position a checkpoint records.

The global batch (``per_device_batch x world x accumulation`` rows) is yielded whole, one
micro-batch of every process (``per_device_batch x world`` rows) after the other: accelerate's
``IterableDatasetShard`` gives process ``r`` rows ``(k * world + r) * B`` to ``+ B`` of micro-batch
``k`` (the split of :class:`~mmembed.training.samplers.HomogeneousSampler`). With data-loader
workers, worker ``w`` of ``W`` yields micro-batches ``w, w + W, ...`` (the DataLoader takes them
in turn, so the loader's order is the one without workers); every worker reads every row to
know where each batch begins (the parse and the checks are done ``W`` times; the collation,
tokenizing and media decoding, once).
"""

from __future__ import annotations

import itertools
import logging

import numpy as np
import torch.utils.data

from ..data.dataset_config import DatasetEntry
from ..data.hub import DatasetHubOptions
from ..data.streaming import Stream, StreamingSamples, count_rows
from ..errors import UsageError
from .batch_samplers import Part
from .samplers import HOMOGENEOUS_SAMPLERS, HomogeneousSampler, MultiDatasetSampler

logger = logging.getLogger("mmembed")

#: the samplers whose draws depend on the datasets' sizes (round_robin takes them in turn)
BY_SIZE = ("proportional", "weighted")


def stream_sizes(entries: list[DatasetEntry], rule: str, config: str,
                 hub: DatasetHubOptions | None = None) -> list[tuple[int | None, str]]:
    """Each dataset's size as ``rule`` draws by it, and where it comes from: its ``rows``
    (declared), its ``sample`` (a stream takes its first N rows), or counted
    (:func:`~mmembed.data.streaming.count_rows`: the lines of its ``.jsonl`` files, the rows of
    its ``.parquet`` files). ``(None, "not needed")`` for ``round_robin`` and ``mixed``. A dataset
    whose files cannot be counted so is an error naming it."""
    sizes: list[tuple[int | None, str]] = []
    for entry in entries:
        if rule not in BY_SIZE:
            sizes.append((None, "not needed"))
        elif entry.rows is not None:
            sizes.append((entry.rows, "declared: rows"))
        elif entry.sample is not None:
            sizes.append((entry.sample, "declared: sample"))
        else:
            counted = count_rows(entry.specs(), hub)
            if counted is None:
                raise UsageError(f"--dataset_config {config}: dataset {entry.name}: --multi_dataset_sampler {rule} "
                                 "with --streaming true draws the datasets by their sizes, and its files cannot be "
                                 "counted without reading them (only .jsonl lines and .parquet rows are): give its "
                                 "number of training rows in the file ('rows: N')")
            sizes.append((counted, "counted: its files' lines"))
    return sizes


class StreamBatches(Stream):
    """The training rows of a streamed ``--dataset_config`` run, whole global batches without end
    (see the module's description): ``streams[d]`` is dataset ``d``'s stream; ``rule`` the loaded
    path's sampler over parts of the datasets' sizes, of which only the draws are used (None:
    ``mixed``, one stream of all datasets' rows, every global batch from it); ``sizes`` what
    :func:`stream_sizes` found (recorded in :meth:`state`)."""

    def __init__(self, streams: list[StreamingSamples], size: int, per_device_batch: int, world: int,
                 accumulation: int, seed: int, rule: HomogeneousSampler | None = None,
                 sizes: list[tuple[int | None, str]] | None = None):
        self.streams, self.rule, self.seed = streams, rule, seed
        self.size, self.per_device_batch, self.world, self.accumulation = size, per_device_batch, world, accumulation
        self.sizes = sizes or [(None, "not needed")] * len(streams)
        for s in streams:  # a pass that fills no global batch is a data error naming the dataset
            s.min_rows, s.min_rows_are = size, "one global batch"

    @classmethod
    def homogeneous(cls, streams: list[StreamingSamples], rule: str, sizes: list[tuple[int | None, str]],
                    weights: list[float], per_device_batch: int, accumulation: int, world: int, seed: int
                    ) -> StreamBatches:
        """Every global batch from one of ``streams``, drawn by ``rule`` (``proportional``,
        ``round_robin``, ``weighted``) over the datasets' ``sizes`` (:func:`stream_sizes`; None:
        not needed, one global batch per round) and ``weights``; refuses a dataset smaller than
        one global batch."""
        size = per_device_batch * world * accumulation
        parts = [Part(s.name or f"dataset {d}", w, range(n if n is not None else size))  # (a range: never made)
                 for d, (s, (n, _), w) in enumerate(zip(streams, sizes, weights))]
        sampler = HOMOGENEOUS_SAMPLERS[MultiDatasetSampler(rule)](parts, per_device_batch, accumulation, seed, 0, world,
                                                                  shuffle=False)
        return cls(streams, size, per_device_batch, world, accumulation, seed, sampler, sizes)

    @classmethod
    def mixed(cls, stream: StreamingSamples, per_device_batch: int, accumulation: int, world: int, seed: int
              ) -> StreamBatches:
        """``--multi_dataset_sampler mixed``: the global batches of one stream (all datasets' rows
        in ms-swift's order, :func:`~mmembed.data.streaming.mix_streams`)."""
        return cls([stream], per_device_batch * world * accumulation, per_device_batch, world, accumulation, seed)

    def add_filter(self, keep) -> None:
        for s in self.streams:
            s.add_filter(keep)

    def set_epoch(self, epoch: int) -> None:
        """Nothing: the streams' passes follow from the batches drawn (the Trainer sees one epoch)."""

    def draws(self, epoch: int) -> list[int]:
        """The stream of each global batch of ``epoch`` (the rule's draws; ``mixed``: one, the only stream)."""
        return [0] if self.rule is None else self.rule.draws(epoch, cache=False).tolist()

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        micro = self.per_device_batch * self.world  # one micro-batch of every process
        batches = [s.global_batches(self.size) for s in self.streams]
        n = 0  # micro-batches so far
        for epoch in itertools.count():
            for d in self.draws(epoch):
                rows = next(batches[d])
                for k in range(self.accumulation):
                    if n % workers == worker:
                        yield from rows[k * micro:(k + 1) * micro]
                    n += 1

    def state(self, global_step: int) -> dict:
        """The position after ``global_step`` optimizer steps (what a checkpoint records): the rule,
        the global batch, and for a rule the epoch of draws and each dataset's size and global
        batches drawn (``mixed``: the stream's global batches are the steps)."""
        common = {"streaming": True, "seed": self.seed, "global_batch_size": self.size, "global_step": global_step}
        if self.rule is None:
            return {"sampler": "mixed", **common, "datasets": self.streams[0].specs}
        rule = self.rule
        epoch, batches = divmod(global_step, rule.batches_per_epoch)
        positions = rule.positions(epoch, batches)
        datasets = [{"name": part.name, "rows": n, "size": how, "weight": part.weight, "global_batches_drawn": position}
                    for part, (n, how), position in zip(rule.parts, self.sizes, positions)]
        return {"sampler": rule.rule.value, **common, "epoch": epoch, "batch_in_epoch": batches,
                "batches_per_epoch": rule.batches_per_epoch, "datasets": datasets}

    def describe(self) -> str:
        """The start-up line: the rule, the global batch, and per dataset its size, global batches
        per pass and steps in the first epoch of draws."""
        if self.rule is None:
            return (f"--multi_dataset_sampler mixed --streaming true: global batches of {self.size} rows of the "
                    "datasets' stream, read pass after pass (the rows of a pass that fill no whole global batch sit "
                    "it out)")
        counts = np.bincount(self.rule.draws(0), minlength=len(self.streams)).tolist()
        lines = []
        for part, (n, how), k in zip(self.rule.parts, self.sizes, counts):
            size = f"{n:,} rows ({how}), {n // self.size} global batches per pass, " if n is not None else ""
            lines.append(f"{part.name}: {size}{k} of the first {self.rule.batches_per_epoch} steps")
        return (f"--multi_dataset_sampler {self.rule.rule} --streaming true: every global batch of {self.size} rows "
                f"from one dataset, each dataset a stream read pass after pass (the rows of a pass that fill no "
                f"whole global batch sit it out); {'; '.join(lines)}")
