"""The order in which training rows reach each process.

A sampler here is a small class over the dataset's row indices (``0 .. len - 1``) that
yields the rows of one process for one epoch; the trainer asks :func:`train_sampler` for
it and falls back to transformers' own samplers where it returns None. The flags are
:class:`MultiDatasetSampler` (``--multi_dataset_sampler``) and
:class:`~mmembed.training.batch_samplers.BatchSamplerKind` (``--batch_sampler``).

- :class:`SwiftOrderSampler`: ms-swift's order (``mixed``, the default), so that the same flags
  and data train on the same rows in the same steps as ``swift sft``
  (tests/tools/test_swift_compat.py holds it against ms-swift's recorded orders, one and two
  processes); :class:`MappedSampler`: that order over the rows ``--interleave_prob`` draws
  (:func:`interleaved_rows`).
- :class:`HomogeneousSampler`: every global batch from one dataset, drawn from a batch sampler per
  dataset (:mod:`mmembed.training.batch_samplers`: plain or no-duplicates); one class per rule
  of which dataset each step draws: :class:`ProportionalSampler`, :class:`RoundRobinSampler`,
  :class:`WeightedSampler`, and :class:`PooledSampler` (``mixed`` with ``--batch_sampler
  no_duplicates``: every dataset's rows pooled into one dataset).
- :func:`plan_sampling` decides from the flags and the datasets' sizes alone which sampler the
  run gets, refusing what cannot work (:func:`check_sampling` runs it before the model loads);
  :func:`build_sampler` builds it (:func:`train_sampler`: both).
- :func:`pass_through_shards`: such a sampler has split each epoch among the processes
  already, so accelerate's batch-level sharding of the data loader must hand every batch
  through unchanged.
- resuming: :func:`sampler_state` is what each checkpoint records of the position
  (``sampler_state.json``), :func:`check_resumed_state` holds a resumed run to it, and
  :func:`resumed_epoch` sets the resumed epoch where accelerate's skipping loader does not.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from enum import Enum
from typing import ClassVar

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from ..errors import UsageError
from .batch_samplers import BatchSamplerKind, DatasetBatches, Part, dataset_batches, dataset_parts, row_keys
from .distributed import world

logger = logging.getLogger("mmembed")


class MultiDatasetSampler(str, Enum):
    """``--multi_dataset_sampler``: ``mixed`` is ms-swift's order (every dataset's rows shuffled
    together); the others make every global batch come from one dataset. The order of the
    members seeds the draws (:meth:`HomogeneousSampler.draws`): do not reorder them."""

    MIXED = "mixed"
    PROPORTIONAL = "proportional"
    ROUND_ROBIN = "round_robin"
    WEIGHTED = "weighted"

    def __str__(self) -> str:
        return self.value


#: ``--multi_dataset_sampler`` values
MULTI_DATASET_SAMPLERS = tuple(m.value for m in MultiDatasetSampler)
#: ``--batch_sampler`` values
BATCH_SAMPLERS = tuple(m.value for m in BatchSamplerKind)
#: the file of a checkpoint that records the sampler's position
STATE_FILE = "sampler_state.json"


# ----------------------------------------------------------------------------- ms-swift's order

class SwiftOrderSampler(Sampler):
    """The training rows of one process in ms-swift's order (its ``BatchSamplerShard``): each
    epoch a permutation of the rows drawn with ``seed + epoch`` (``torch.randperm``; in file order
    without shuffling), cut to a multiple of the process count (the last ``len % world`` rows
    sit the epoch out), of which process ``rank`` takes every ``world``-th from its ``rank``.
    With one process this is transformers' seeded random sampler, row for row."""

    def __init__(self, num_rows: int, shuffle: bool, seed: int, rank: int = 0, world: int = 1):
        self.num_rows, self.shuffle, self.seed, self.rank, self.world = num_rows, shuffle, seed, rank, world
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_rows // self.world

    def __iter__(self):
        total = self.num_rows // self.world * self.world
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(total, generator=generator).tolist()
        else:
            order = list(range(total))
        return iter(order[self.rank::self.world])


class MappedSampler(Sampler):
    """``inner``'s positions read through ``rows``: ms-swift's order over the rows of
    ``--interleave_prob`` (:func:`interleaved_rows`, where a row may appear more than once or
    not at all)."""

    def __init__(self, inner: SwiftOrderSampler, rows: np.ndarray):
        self.inner, self.rows = inner, rows

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        return self.inner.epoch

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self):
        return (int(self.rows[i]) for i in self.inner)

    def state(self, global_step: int) -> dict:
        return {"sampler": "mixed", "interleave": True, "rows": len(self.rows), "seed": self.inner.seed,
                "global_step": global_step}


def interleaved_rows(parts: list[Part], probabilities: list[float], seed: int, stopping_strategy: str) -> np.ndarray:
    """The training rows ``--interleave_prob`` makes, as ms-swift makes them: ``datasets.interleave_datasets``
    over the datasets (each in its loaded order) with the probabilities normalised to sum 1,
    seeded with ``seed``; ``first_exhausted`` stops when one dataset has given all its rows,
    ``all_exhausted`` when every one has (the others start over: oversampled)."""
    import datasets as hf

    columns = [hf.Dataset.from_dict({"i": p.rows.astype(np.int64)}) for p in parts]
    total = float(sum(probabilities))
    mixed = hf.interleave_datasets(columns, probabilities=[float(x) / total for x in probabilities], seed=seed,
                                   stopping_strategy=stopping_strategy)
    return np.asarray(mixed["i"], dtype=np.int64)


# ----------------------------------------------------------------------------- one dataset per global batch

class HomogeneousSampler(Sampler):
    """The training rows of one process when every global batch (all processes, all
    gradient-cache chunks, all accumulation micro-batches of one optimizer step: ``size =
    per_device_batch x world x accumulation`` rows) comes from one dataset.

    Each dataset is a batch sampler of global batches (:func:`~mmembed.training.batch_samplers.
    dataset_batches`: duplicate-free with the rows' texts ``keys``, plain without); an epoch is a
    sequence of draws of a dataset (:meth:`draws`, the subclass's rule), each taking that
    dataset's next global batch. A dataset's position (global batches drawn from it) carries over
    epochs. The global batch is split with process ``r``'s micro-batch ``k`` being rows ``(k *
    world + r) * B`` to ``+ B`` of it, so this sampler yields ``accumulation x B`` rows per
    optimizer step, the data loader cuts them into the process's micro-batches, and accelerate
    must not shard them again (:func:`pass_through_shards`). Everything follows from the seed and
    the epoch, so the Trainer's skipping of the batches trained before a resume lands exactly
    where the interrupted run stopped; :meth:`state` is the position a checkpoint records.
    """

    rule: ClassVar[MultiDatasetSampler]

    def __init__(self, parts: list[Part], per_device_batch: int, accumulation: int, seed: int,
                 rank: int = 0, world: int = 1, shuffle: bool = True, keys=None):
        self.check(parts, per_device_batch, accumulation, world)
        self.parts, self.seed, self.rank, self.world = parts, seed, rank, world
        self.per_device_batch, self.accumulation = per_device_batch, accumulation
        self.size = per_device_batch * world * accumulation
        self.epoch = 0
        self.streams: list[DatasetBatches] = [dataset_batches(p.rows, self.size, seed, d, shuffle, keys)
                                              for d, p in enumerate(parts)]
        self.nominal = [len(p.rows) // self.size for p in parts]  # global batches per pass without no_duplicates
        self._draws: dict[int, np.ndarray] = {}

    @classmethod
    def check(cls, parts: list[Part], per_device_batch: int, accumulation: int, world: int) -> None:
        """Refuse what this rule cannot sample: a dataset smaller than one global batch."""
        size = per_device_batch * world * accumulation
        for part in parts:
            if len(part.rows) < size:
                raise UsageError(
                    f"dataset {part.name!r} has {len(part.rows)} training row(s), fewer than one global batch of "
                    f"{size} rows (--per_device_train_batch_size {per_device_batch} x {world} process(es) x "
                    f"--gradient_accumulation_steps {accumulation}); with --multi_dataset_sampler {cls.rule} every "
                    "global batch comes from one dataset: give it more rows, lower the batch size, or leave it out")

    @staticmethod
    def epoch_length(nominal: list[int]) -> int:
        """Global batches per epoch, given each dataset's per pass."""
        return sum(nominal)

    @property
    def no_duplicates(self) -> bool:
        return self.streams[0].no_duplicates

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def batches_per_epoch(self) -> int:
        return self.epoch_length(self.nominal)

    def __len__(self) -> int:
        return self.batches_per_epoch * self.accumulation * self.per_device_batch

    def draw(self, epoch: int, rng: np.random.Generator) -> np.ndarray:
        """The rule: the dataset of each global batch of ``epoch``, ``rng`` seeded with ``(seed, epoch, rule)``."""
        raise NotImplementedError

    def drawn_before(self, epoch: int) -> np.ndarray:
        """Global batches drawn from each dataset in the epochs before ``epoch``."""
        return np.array(self.nominal, dtype=np.int64) * epoch

    def draws(self, epoch: int, cache: bool = True) -> np.ndarray:
        """The dataset of each global batch of ``epoch``, in order (``cache``: kept for the next call)."""
        if epoch in self._draws:
            return self._draws[epoch]
        rng = np.random.default_rng([self.seed, epoch, 1 + list(MultiDatasetSampler).index(self.rule)])
        draws = self.draw(epoch, rng)
        if cache:
            self._draws[epoch] = draws
        return draws

    def positions(self, epoch: int, batches: int = 0) -> list[int]:
        """Global batches drawn from each dataset before batch ``batches`` of ``epoch``."""
        counts = self.drawn_before(epoch)
        counts += np.bincount(self.draws(epoch)[:batches], minlength=len(self.parts))
        return counts.tolist()

    def global_batches(self, epoch: int):
        """``(dataset, rows)`` of each global batch of ``epoch``."""
        position = self.positions(epoch)
        for d in self.draws(epoch).tolist():
            try:
                rows = self.streams[d].batch(position[d])
            except ValueError:
                raise UsageError(f"--batch_sampler no_duplicates: dataset {self.parts[d].name!r} cannot fill one "
                                 f"global batch of {self.size} rows in which no text appears twice") from None
            position[d] += 1
            yield d, rows

    def share(self, rows: list[int]) -> list[int]:
        """This process's rows of a global batch: its micro-batch of each accumulation step."""
        b, w = self.per_device_batch, self.world
        return [i for k in range(self.accumulation) for i in rows[(k * w + self.rank) * b:(k * w + self.rank + 1) * b]]

    def __iter__(self):
        for _, rows in self.global_batches(self.epoch):
            yield from self.share(rows)

    def state(self, global_step: int) -> dict:
        """The position after ``global_step`` optimizer steps (what a checkpoint records)."""
        epoch, batches = divmod(global_step, self.batches_per_epoch)
        positions = self.positions(epoch, batches)
        datasets = []
        for part, stream, position in zip(self.parts, self.streams, positions):
            p, j = stream.locate(position)
            datasets.append({"name": part.name, "rows": len(part.rows), "weight": part.weight,
                             "global_batches_drawn": position, "pass": p, "batch_in_pass": j})
        return {"sampler": self.rule.value, "no_duplicates": self.no_duplicates, "seed": self.seed,
                "global_batch_size": self.size, "global_step": global_step, "epoch": epoch,
                "batch_in_epoch": batches, "batches_per_epoch": self.batches_per_epoch, "datasets": datasets}


class ProportionalSampler(HomogeneousSampler):
    """``--multi_dataset_sampler proportional``: each dataset ``floor(rows / size)`` times, in an
    order shuffled with ``(seed, epoch)``: one pass over every dataset, datasets drawn by their size."""

    rule = MultiDatasetSampler.PROPORTIONAL

    def draw(self, epoch: int, rng: np.random.Generator) -> np.ndarray:
        return rng.permutation(np.repeat(np.arange(len(self.parts)), self.nominal))


class PooledSampler(ProportionalSampler):
    """``--multi_dataset_sampler mixed --batch_sampler no_duplicates``: every dataset's rows (or the
    rows ``--interleave_prob`` drew) pooled into the one part it is given, cut into global batches
    with no text twice; ms-swift's ``mixed`` order itself is :class:`SwiftOrderSampler`."""

    rule = MultiDatasetSampler.MIXED

    @classmethod
    def check(cls, parts: list[Part], per_device_batch: int, accumulation: int, world: int) -> None:
        if len(parts) != 1:
            raise ValueError(f"a pooled sampler draws from one part of all rows, got {len(parts)}")
        size = per_device_batch * world * accumulation
        if len(parts[0].rows) < size:
            raise UsageError(f"--batch_sampler no_duplicates takes whole global batches: {len(parts[0].rows)} training "
                             f"row(s) are fewer than one global batch of {size} rows "
                             f"(--per_device_train_batch_size {per_device_batch} x {world} process(es) x "
                             f"--gradient_accumulation_steps {accumulation})")


class RoundRobinSampler(HomogeneousSampler):
    """``--multi_dataset_sampler round_robin``: the datasets in turn, as many rounds as the
    smallest has global batches; the larger ones go on where they stopped in the next epoch."""

    rule = MultiDatasetSampler.ROUND_ROBIN

    @staticmethod
    def epoch_length(nominal: list[int]) -> int:
        return min(nominal) * len(nominal)

    def draw(self, epoch: int, rng: np.random.Generator) -> np.ndarray:
        return np.tile(np.arange(len(self.parts)), min(self.nominal))

    def drawn_before(self, epoch: int) -> np.ndarray:
        return np.full(len(self.parts), epoch * min(self.nominal), dtype=np.int64)


class WeightedSampler(HomogeneousSampler):
    """``--multi_dataset_sampler weighted``: as many draws as ``proportional`` makes, each drawing
    a dataset with probability ``weight / sum of weights`` (seeded with ``(seed, epoch)``); a
    dataset whose pass is used up starts a new one (a new permutation)."""

    rule = MultiDatasetSampler.WEIGHTED

    def __init__(self, parts: list[Part], per_device_batch: int, accumulation: int, seed: int,
                 rank: int = 0, world: int = 1, shuffle: bool = True, keys=None):
        super().__init__(parts, per_device_batch, accumulation, seed, rank, world, shuffle, keys)
        weights = np.array([p.weight for p in parts], dtype=np.float64)
        self.probabilities = weights / weights.sum()

    @classmethod
    def check(cls, parts: list[Part], per_device_batch: int, accumulation: int, world: int) -> None:
        super().check(parts, per_device_batch, accumulation, world)
        weights = np.array([p.weight for p in parts], dtype=np.float64)
        if (weights < 0).any() or not np.isfinite(weights).all() or weights.sum() <= 0:
            raise UsageError(f"--multi_dataset_sampler weighted needs weights >= 0 with a positive sum, got "
                             f"{', '.join(f'{p.name}={p.weight}' for p in parts)}")

    def draw(self, epoch: int, rng: np.random.Generator) -> np.ndarray:
        return rng.choice(len(self.parts), size=self.batches_per_epoch, p=self.probabilities)

    def drawn_before(self, epoch: int) -> np.ndarray:
        counts = np.zeros(len(self.parts), dtype=np.int64)
        for e in range(epoch):
            counts += np.bincount(self.draws(e), minlength=len(self.parts))
        return counts


#: the sampler of each ``--multi_dataset_sampler`` when every global batch comes from one
#: dataset (``mixed``: with ``--batch_sampler no_duplicates``)
HOMOGENEOUS_SAMPLERS: dict[MultiDatasetSampler, type[HomogeneousSampler]] = {
    MultiDatasetSampler.MIXED: PooledSampler, MultiDatasetSampler.PROPORTIONAL: ProportionalSampler,
    MultiDatasetSampler.ROUND_ROBIN: RoundRobinSampler, MultiDatasetSampler.WEIGHTED: WeightedSampler}


# ----------------------------------------------------------------------------- the plan, the sampler

@dataclasses.dataclass
class SamplingPlan:
    """Which sampler a run gets, decided from the flags and the datasets' sizes alone
    (:func:`plan_sampling`): ms-swift's order over ``num_rows`` rows (or over ``rows``, those
    ``--interleave_prob`` drew) when ``sampler`` is None, else that :class:`HomogeneousSampler`
    over ``parts``."""

    rule: MultiDatasetSampler
    batch_sampler: BatchSamplerKind
    shuffle: bool
    seed: int
    rank: int
    world: int
    num_rows: int
    per_device_batch: int = 0  # (a homogeneous sampler's)
    accumulation: int = 1
    datasets: list[Part] | None = None  # the datasets the rows come from (where the flags need them)
    parts: list[Part] | None = None  # the parts a homogeneous sampler draws from: the datasets, or all rows pooled
    rows: np.ndarray | None = None  # --interleave_prob's rows
    interleave: list[float] | None = None
    stopping: str = "first_exhausted"
    sampler: type[HomogeneousSampler] | None = None


def plan_sampling(args, dataset, infos=None, rank: int = 0, world: int = 1) -> SamplingPlan | None:
    """The sampler of ``dataset``'s training rows for process ``rank`` of ``world`` under the
    training arguments ``args`` (``train_sampling_strategy``, ``train_dataloader_shuffle``,
    ``data_seed`` / ``seed``, ``per_device_train_batch_size``, ``gradient_accumulation_steps``,
    and mmembed's ``multi_dataset_sampler``, ``batch_sampler``, ``interleave_prob``,
    ``stopping_strategy``), refusing (UsageError) what cannot work. Reads the dataset's length and
    ``dataset_ids`` only, never a row; ``infos``: the datasets' names and weights
    (``TrainingData.datasets``). None for a dataset without a length (a stream) and for
    transformers' length-grouped strategies, which the Trainer's own sampler serves."""
    rule = str(getattr(args, "multi_dataset_sampler", None) or "mixed")
    no_duplicates = str(getattr(args, "batch_sampler", None) or "default") == "no_duplicates"
    interleave = getattr(args, "interleave_prob", None)
    strategy = str(getattr(args, "train_sampling_strategy", "random"))
    if dataset is None or not hasattr(dataset, "__len__"):
        return None
    if strategy not in ("random", "sequential"):
        if rule != "mixed" or no_duplicates or interleave:
            raise UsageError(f"--train_sampling_strategy {strategy} cannot be combined with --multi_dataset_sampler "
                             f"{rule} / --batch_sampler / --interleave_prob; leave it at random")
        return None
    rule = MultiDatasetSampler(rule)
    kind = BatchSamplerKind.NO_DUPLICATES if no_duplicates else BatchSamplerKind.DEFAULT
    plan = SamplingPlan(rule, kind, shuffle=strategy == "random" and getattr(args, "train_dataloader_shuffle", True),
                        seed=args.data_seed if args.data_seed is not None else args.seed, rank=rank, world=world,
                        num_rows=len(dataset))
    if rule != "mixed" or no_duplicates or interleave:
        plan.datasets = plan.parts = dataset_parts(dataset, infos)
    if interleave:
        parts = plan.datasets
        if len(interleave) != len(parts):
            raise UsageError(f"--interleave_prob gives {len(interleave)} probabilities for {len(parts)} dataset(s) "
                             f"({', '.join(p.name for p in parts)}): give one per dataset")
        empty = [p.name for p in parts if not len(p.rows)]
        if empty:
            raise UsageError(f"--interleave_prob: dataset(s) {', '.join(empty)} have no training rows")
        plan.interleave, plan.stopping = interleave, str(getattr(args, "stopping_strategy", None) or "first_exhausted")
        plan.rows = interleaved_rows(parts, interleave, plan.seed, plan.stopping)
    if rule == "mixed" and not no_duplicates:
        return plan
    if rule == "mixed":  # no_duplicates over every row (or the interleaved ones): one dataset
        plan.parts = [Part("all rows", 1.0, plan.rows if plan.rows is not None else np.arange(len(dataset)))]
    plan.per_device_batch = int(args.per_device_train_batch_size)
    plan.accumulation = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
    plan.sampler = HOMOGENEOUS_SAMPLERS[rule]
    plan.sampler.check(plan.parts, plan.per_device_batch, plan.accumulation, world)
    size = plan.per_device_batch * world * plan.accumulation
    if plan.sampler.epoch_length([len(p.rows) // size for p in plan.parts]) == 0:
        raise UsageError(f"{len(dataset)} training rows make no global batch of {size} rows")
    return plan


def check_sampling(args, dataset, infos=None) -> None:
    """The sampler flags against the data, before the model loads (:func:`train_sampler`
    builds the sampler when training starts): :func:`plan_sampling` with the process count of
    the arguments (no process group runs yet): the datasets' sizes against one global batch,
    ``--interleave_prob``'s length against the datasets."""
    if dataset is None or not hasattr(dataset, "__len__"):
        return
    rank, size = world()
    plan_sampling(args, dataset, infos, rank, max(size, int(getattr(args, "world_size", 1) or 1)))


def build_sampler(plan: SamplingPlan, dataset) -> Sampler:
    """The sampler ``plan`` names, over ``dataset`` (whose rows' texts a no-duplicates sampler
    reads, :func:`~mmembed.training.batch_samplers.row_keys`), with its start-up log lines."""
    first = plan.rank == 0
    if plan.interleave and first:
        total = float(sum(plan.interleave))
        logger.info("--interleave_prob %s: datasets drawn row by row with probabilities %s (normalised to sum 1), "
                    "--stopping_strategy %s: %d training rows", " ".join(str(x) for x in plan.interleave),
                    ", ".join(f"{p.name} {x / total:.4g}" for p, x in zip(plan.datasets, plan.interleave)),
                    plan.stopping, len(plan.rows))
    if plan.sampler is None:
        if plan.rows is not None:
            return MappedSampler(SwiftOrderSampler(len(plan.rows), plan.shuffle, plan.seed, plan.rank, plan.world),
                                 plan.rows)
        return SwiftOrderSampler(plan.num_rows, plan.shuffle, plan.seed, plan.rank, plan.world)
    keys = row_keys(dataset) if plan.batch_sampler is BatchSamplerKind.NO_DUPLICATES else None
    if plan.rule != "mixed" and len(plan.parts) == 1 and first:
        logger.warning("--multi_dataset_sampler %s: the training rows are one dataset, so every global batch "
                       "is from it whatever the rule (several datasets: --dataset_config)", plan.rule)
    sampler = plan.sampler(plan.parts, plan.per_device_batch, plan.accumulation, plan.seed, plan.rank, plan.world,
                           plan.shuffle, keys)
    _log_plan(sampler)
    return sampler


def _log_plan(sampler: HomogeneousSampler) -> None:
    """The start-up line of a :class:`HomogeneousSampler`: per dataset, its rows, global batches
    per pass, the rows sitting each pass out and its steps in the first epoch."""
    if world()[0] != 0:
        return
    lines = []
    counts = np.bincount(sampler.draws(0), minlength=len(sampler.parts))
    for part, n in zip(sampler.parts, counts.tolist()):
        left = len(part.rows) % sampler.size
        lines.append(f"{part.name}: {len(part.rows)} rows, {len(part.rows) // sampler.size} global batches per pass"
                     f" ({left} rows sit each pass out), {n} of the first epoch's {sampler.batches_per_epoch} steps")
    no_duplicates = sampler.no_duplicates
    what = ("no text twice in a global batch of %d rows" if isinstance(sampler, PooledSampler) else
            "every global batch of %d rows from one dataset" + (", no text twice in it" if no_duplicates else ""))
    logger.info("--multi_dataset_sampler %s%s: %s; %s", sampler.rule,
                " --batch_sampler no_duplicates" if no_duplicates else "", what % sampler.size, "; ".join(lines))


def train_sampler(dataset, args, infos=None) -> Sampler | None:
    """The sampler of ``dataset``'s training rows for this process (:func:`plan_sampling` for
    this process group, then :func:`build_sampler`): ms-swift's order for ``random`` and
    ``sequential`` (with ``--interleave_prob``: over the interleaved rows); a
    :class:`HomogeneousSampler` for ``proportional`` / ``round_robin`` / ``weighted`` or
    ``--batch_sampler no_duplicates``; None for a stream and for transformers' length-grouped
    strategies. ``infos``: the datasets' names and weights (``TrainingData.datasets``)."""
    rank, size = world()
    plan = plan_sampling(args, dataset, infos, rank, size)
    return None if plan is None else build_sampler(plan, dataset)


#: samplers that give each process its own share of every batch already
PROCESS_SHARE_SAMPLERS = (SwiftOrderSampler, MappedSampler, HomogeneousSampler)


def pass_through_shards(loader: DataLoader) -> DataLoader:
    """``loader`` (the Trainer's, as accelerate prepared it) with its batch-level sharding over
    the processes turned off where the sampler inside gives this process its own rows already
    (ms-swift's split of each epoch's order, or this process's share of each homogeneous global
    batch), so no process drops the others' batches."""
    shard = getattr(loader, "batch_sampler", None)
    if world()[1] > 1 and shard is not None and hasattr(shard, "num_processes"):
        inner = getattr(getattr(shard, "batch_sampler", None), "sampler", None)
        if isinstance(inner, PROCESS_SHARE_SAMPLERS):
            shard.num_processes, shard.process_index = 1, 0
    return loader


# ----------------------------------------------------------------------------- resuming

def sampler_state(sampler, global_step: int) -> dict | None:
    """What a checkpoint records of ``sampler``'s position after ``global_step`` steps (None:
    a sampler with no position to record). ``sampler``: one of this module's, or a stream with
    a ``state(global_step)`` of its own (:class:`~mmembed.training.stream_samplers.StreamBatches`)."""
    if callable(getattr(sampler, "state", None)):
        return sampler.state(global_step)
    if isinstance(sampler, SwiftOrderSampler):
        return {"sampler": "mixed", "rows": sampler.num_rows, "seed": sampler.seed, "global_step": global_step}
    return None


def resumed_epoch(sampler, loader_length: int, accumulation: int, checkpoint: str) -> None:
    """Set ``sampler`` to the epoch a run resumed from ``checkpoint`` goes on in. The Trainer
    computes that epoch from the checkpoint's step (``step // steps per epoch``) and sets it on
    the data loader, but under several processes the loader it skips the trained batches with
    (accelerate's ``SkipBatchSampler`` around its ``BatchSamplerShard``) does not pass the epoch
    on to the sampler, which would replay epoch 0's order from the skipped position."""
    state_path = os.path.join(checkpoint, "trainer_state.json")
    if not hasattr(sampler, "set_epoch") or not os.path.isfile(state_path):
        return
    with open(state_path, encoding="utf-8") as f:
        step = int(json.load(f).get("global_step", 0))
    per_epoch = max(loader_length // accumulation + int(loader_length % accumulation > 0), 1)  # as the Trainer counts
    sampler.set_epoch(step // per_epoch)


def check_resumed_state(sampler, checkpoint: str) -> None:
    """On resuming from ``checkpoint``: the position its ``sampler_state.json`` recorded must be
    the one ``sampler`` (built from this run's data and flags) reaches after the checkpoint's
    steps, or the resumed run would not train on the batches the interrupted one would have.
    A checkpoint without the file (written before mmembed recorded it) is resumed as before."""
    path = os.path.join(checkpoint, STATE_FILE)
    state_path = os.path.join(checkpoint, "trainer_state.json")
    if not os.path.isfile(path) or not os.path.isfile(state_path):
        return
    with open(path, encoding="utf-8") as f:
        recorded = json.load(f)
    with open(state_path, encoding="utf-8") as f:
        step = int(json.load(f).get("global_step", 0))
    now = sampler_state(sampler, step)
    if now is None or now == recorded:
        return
    differ = sorted(k for k in set(now) | set(recorded) if now.get(k) != recorded.get(k))
    if isinstance(sampler, SwiftOrderSampler) and recorded.get("sampler") == "mixed" and "datasets" not in recorded \
            and not recorded.get("interleave"):
        # ms-swift's plain order: resumed as ms-swift resumes, on the rows given now
        logger.warning("--resume_from_checkpoint %s: the training rows differ from the interrupted run's (%s); the "
                       "resumed epoch's order is not the one it would have had", checkpoint,
                       ", ".join(f"{k}: {recorded.get(k)} then, {now.get(k)} now" for k in differ))
        return
    raise UsageError(f"--resume_from_checkpoint {checkpoint}: its {STATE_FILE} records the sampler's position after "
                     f"step {step} as {json.dumps({k: recorded.get(k) for k in differ})}, but this run's data and "
                     f"flags give {json.dumps({k: now.get(k) for k in differ})}: the resumed run would not train on "
                     "the batches the interrupted one would have. Resume with the same --dataset, "
                     "--multi_dataset_sampler, --batch_sampler, batch sizes, process count and --data_seed, or pass "
                     "--ignore_data_skip true to start the epoch over with the new ones")
