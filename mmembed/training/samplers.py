"""The order in which training rows reach each process.

A sampler here is a small class over the dataset's row indices (``0 .. len - 1``) that
yields the rows of one process for one epoch; the trainer asks :func:`train_sampler` for
it and falls back to transformers' own samplers where it returns None.

- :class:`SwiftOrderSampler`: ms-swift's order, so that the same flags and data train on
  the same rows in the same steps as ``swift sft`` (tests/tools/test_swift_compat.py holds
  it against ms-swift's recorded orders, one and two processes).
- :class:`HomogeneousSampler`: ``--multi_dataset_sampler proportional | round_robin |
  weighted`` (every global batch from one dataset) and ``--batch_sampler no_duplicates`` (no
  text twice in a global batch); :class:`MappedSampler`: ms-swift's order over the rows
  ``--interleave_prob`` draws (:func:`interleaved_rows`).
- :func:`pass_through_shards`: such a sampler has split each epoch among the processes
  already, so accelerate's batch-level sharding of the data loader must hand every batch
  through unchanged.
- resuming: :func:`sampler_state` is what each checkpoint records of the position
  (``sampler_state.json``), :func:`check_resumed_state` holds a resumed run to it, and
  :func:`resumed_epoch` sets the resumed epoch where accelerate's skipping loader does not.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from ..errors import UsageError
from .distributed import world

logger = logging.getLogger("mmembed")


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


# ----------------------------------------------------------------------------- several datasets

#: ``--multi_dataset_sampler`` values: ``mixed`` is ms-swift's order (every dataset's rows
#: shuffled together); the others make every global batch come from one dataset
MULTI_DATASET_SAMPLERS = ("mixed", "proportional", "round_robin", "weighted")
#: ``--batch_sampler`` values
BATCH_SAMPLERS = ("default", "no_duplicates")
#: the file of a checkpoint that records the sampler's position
STATE_FILE = "sampler_state.json"


@dataclasses.dataclass
class Part:
    """One dataset's training rows: their indices in the training dataset, in its order."""

    name: str
    weight: float
    rows: np.ndarray


def dataset_parts(dataset, infos=None) -> list[Part]:
    """The datasets the training rows come from: ``dataset.dataset_ids`` (one index per row;
    absent: all rows are one dataset) named and weighted by ``infos`` (``TrainingData.datasets``:
    objects with ``name`` and ``weight``; absent: ``dataset N``, weight 1)."""
    n = len(dataset)
    ids = getattr(dataset, "dataset_ids", None)
    ids = np.zeros(n, dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64)
    if len(ids) != n:
        raise ValueError(f"dataset_ids has {len(ids)} entries for {n} training rows")
    infos = list(infos or [])
    count = max(int(ids.max()) + 1 if n else 1, len(infos))
    parts = []
    for d in range(count):
        info = infos[d] if d < len(infos) else None
        name = getattr(info, "name", None) or ("all rows" if count == 1 else f"dataset {d}")
        weight = float(getattr(info, "weight", 1.0) if getattr(info, "weight", None) is not None else 1.0)
        parts.append(Part(name, weight, np.flatnonzero(ids == d)))
    return parts


def row_keys(dataset) -> list[frozenset[int]]:
    """For ``--batch_sampler no_duplicates``: each row's texts, anchor, positives and negatives,
    each with its media (the system prompt aside), as 64-bit digests (the same on every process,
    unlike Python's ``hash``). Read from the Arrow column when there is one, without decoding
    the rows into Samples."""
    column = None
    inner = getattr(dataset, "dataset", None)
    if inner is not None and hasattr(inner, "column_names") and "sample" in inner.column_names:
        column = inner["sample"]

    def digest(item: dict) -> int:
        text = json.dumps([item.get("text"), item.get("images") or [], item.get("videos") or [],
                           item.get("audios") or []], ensure_ascii=False)
        return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")

    keys = []
    for i in range(len(dataset)):
        if column is not None:
            d = json.loads(column[i])
            items = [d["anchor"], *d["positives"], *d["negatives"]]
        else:
            s = dataset[i]
            items = [vars(x) for x in (s.anchor, *s.positives, *s.negatives)]
        keys.append(frozenset(digest(x) for x in items))
    return keys


def duplicate_free_batches(order, keys, size: int) -> list[list[int]]:
    """The rows of ``order`` cut into whole batches of ``size`` rows in which no text (with its
    media) appears twice, as anchor, positive or negative (``keys``: each row's texts). A row
    that would repeat a text of the batch being filled waits and is the first offered to the
    next batch; the rows left when no whole batch can be filled sit out (they are returned by
    nothing: the caller's next pass is a new permutation)."""
    batches: list[list[int]] = []
    waiting: list[int] = []
    pointer, n = 0, len(order)
    while True:
        batch, seen, still = [], set(), []
        for i in waiting:
            if len(batch) < size and not (keys[i] & seen):
                batch.append(i)
                seen |= keys[i]
            else:
                still.append(i)
        while len(batch) < size and pointer < n:
            i = int(order[pointer])
            pointer += 1
            if keys[i] & seen:
                still.append(i)
            else:
                batch.append(i)
                seen |= keys[i]
        if len(batch) < size:
            return batches
        batches.append(batch)
        waiting = still


class BatchStream:
    """One dataset's endless sequence of global batches: pass ``p`` is a permutation of its rows
    (seeded with ``(seed, index, p)``; in order without shuffling) cut into whole batches of
    ``size`` rows (with ``keys``: duplicate-free ones, :func:`duplicate_free_batches`); the rows
    that do not fill a whole batch sit that pass out and are drawn afresh in the next."""

    def __init__(self, rows: np.ndarray, size: int, seed: int, index: int, shuffle: bool = True, keys=None):
        self.rows, self.size, self.seed, self.index, self.shuffle, self.keys = rows, size, seed, index, shuffle, keys
        self._passes: dict[int, list[list[int]]] = {}  # the last pass read, cached
        self._lengths: list[int] = []  # batches of each pass computed so far

    def _pass(self, p: int) -> list[list[int]]:
        if p not in self._passes:
            order = self.rows
            if self.shuffle:
                order = self.rows[np.random.default_rng([self.seed, self.index, p]).permutation(len(self.rows))]
            if self.keys is None:
                k = len(order) // self.size
                batches = order[:k * self.size].reshape(k, self.size).tolist()
            else:
                batches = duplicate_free_batches(order, self.keys, self.size)
            self._passes = {p: batches}
            if not batches:
                raise ValueError("cannot fill one batch")
        return self._passes[p]

    def _length(self, p: int) -> int:
        if self.keys is None:
            return len(self.rows) // self.size
        while len(self._lengths) <= p:
            self._lengths.append(len(self._pass(len(self._lengths))))
        return self._lengths[p]

    def locate(self, position: int) -> tuple[int, int]:
        """``(pass, batch in that pass)`` of the stream's ``position``-th batch."""
        if self.keys is None:
            k = self._length(0)
            return divmod(position, k)
        p = 0
        while position >= self._length(p):
            position -= self._length(p)
            p += 1
        return p, position

    def batch(self, position: int) -> list[int]:
        p, j = self.locate(position)
        return self._pass(p)[j]


class HomogeneousSampler(Sampler):
    """The training rows of one process when every global batch (all processes, all
    gradient-cache chunks, all accumulation micro-batches of one optimizer step: ``size =
    per_device_batch x world x accumulation`` rows) comes from one dataset.

    Each dataset is a :class:`BatchStream` of global batches; an epoch is a sequence of
    draws of a dataset, each taking that dataset's next global batch:

    - ``proportional``: each dataset ``floor(rows / size)`` times, in an order shuffled with
      ``(seed, epoch)``: one pass over every dataset, datasets drawn by their size;
    - ``round_robin``: the datasets in turn, as many rounds as the smallest has global batches;
      the larger ones go on where they stopped in the next epoch;
    - ``weighted``: as many draws as ``proportional`` makes, each drawing a dataset with
      probability ``weight / sum of weights`` (seeded with ``(seed, epoch)``); a dataset whose
      pass is used up starts a new one (a new permutation).

    A dataset's position (global batches drawn from it) carries over epochs. The global batch
    is split with process ``r``'s micro-batch ``k`` being rows ``(k * world + r) * B`` to
    ``+ B`` of it, so this sampler yields ``accumulation x B`` rows per optimizer step, the
    data loader cuts them into the process's micro-batches, and accelerate must not shard them
    again (:func:`pass_through_shards`). ``mixed`` with ``no_duplicates`` is this with one
    dataset of all rows (``rule="mixed"``). Everything follows from the seed and the epoch,
    so the Trainer's skipping of the batches trained before a resume lands exactly where the
    interrupted run stopped; :meth:`state` is the position a checkpoint records.
    """

    def __init__(self, parts: list[Part], rule: str, per_device_batch: int, accumulation: int, seed: int,
                 rank: int = 0, world: int = 1, shuffle: bool = True, keys=None):
        self.parts, self.rule, self.seed, self.rank, self.world = parts, rule, seed, rank, world
        self.per_device_batch, self.accumulation = per_device_batch, accumulation
        self.size = per_device_batch * world * accumulation
        self.epoch = 0
        for part in parts:
            if len(part.rows) < self.size and rule == "mixed":
                raise UsageError(f"--batch_sampler no_duplicates takes whole global batches: {len(part.rows)} training "
                                 f"row(s) are fewer than one global batch of {self.size} rows "
                                 f"(--per_device_train_batch_size {per_device_batch} x {world} process(es) x "
                                 f"--gradient_accumulation_steps {accumulation})")
            if len(part.rows) < self.size:
                raise UsageError(
                    f"dataset {part.name!r} has {len(part.rows)} training row(s), fewer than one global batch of "
                    f"{self.size} rows (--per_device_train_batch_size {per_device_batch} x {world} process(es) x "
                    f"--gradient_accumulation_steps {accumulation}); with --multi_dataset_sampler {rule} every "
                    "global batch comes from one dataset: give it more rows, lower the batch size, or leave it out")
        if rule == "weighted":
            weights = np.array([p.weight for p in parts], dtype=np.float64)
            if (weights < 0).any() or not np.isfinite(weights).all() or weights.sum() <= 0:
                raise UsageError(f"--multi_dataset_sampler weighted needs weights >= 0 with a positive sum, got "
                                 f"{', '.join(f'{p.name}={p.weight}' for p in parts)}")
            self.probabilities = weights / weights.sum()
        self.streams = [BatchStream(p.rows, self.size, seed, d, shuffle, keys) for d, p in enumerate(parts)]
        self.nominal = [len(p.rows) // self.size for p in parts]  # global batches per pass without no_duplicates
        self._draws: dict[int, np.ndarray] = {}

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def batches_per_epoch(self) -> int:
        if self.rule == "round_robin":
            return min(self.nominal) * len(self.parts)
        return sum(self.nominal)

    def __len__(self) -> int:
        return self.batches_per_epoch * self.accumulation * self.per_device_batch

    def draws(self, epoch: int) -> np.ndarray:
        """The dataset of each global batch of ``epoch``, in order."""
        if epoch not in self._draws:
            d = len(self.parts)
            rng = np.random.default_rng([self.seed, epoch, 1 + MULTI_DATASET_SAMPLERS.index(self.rule)])
            if self.rule == "round_robin":
                draws = np.tile(np.arange(d), min(self.nominal))
            elif self.rule == "weighted":
                draws = rng.choice(d, size=self.batches_per_epoch, p=self.probabilities)
            else:  # proportional, or mixed with no_duplicates (one dataset)
                draws = rng.permutation(np.repeat(np.arange(d), self.nominal))
            self._draws[epoch] = draws
        return self._draws[epoch]

    def positions(self, epoch: int, batches: int = 0) -> list[int]:
        """Global batches drawn from each dataset before batch ``batches`` of ``epoch``."""
        d = len(self.parts)
        if self.rule == "weighted":
            counts = np.zeros(d, dtype=np.int64)
            for e in range(epoch):
                counts += np.bincount(self.draws(e), minlength=d)
        elif self.rule == "round_robin":
            counts = np.full(d, epoch * min(self.nominal), dtype=np.int64)
        else:
            counts = np.array(self.nominal, dtype=np.int64) * epoch
        counts += np.bincount(self.draws(epoch)[:batches], minlength=d)
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
        return {"sampler": self.rule, "no_duplicates": self.streams[0].keys is not None, "seed": self.seed,
                "global_batch_size": self.size, "global_step": global_step, "epoch": epoch,
                "batch_in_epoch": batches, "batches_per_epoch": self.batches_per_epoch, "datasets": datasets}


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


def check_sampling(args, dataset, infos=None) -> None:
    """The sampler flags against the data, before the model loads (:func:`train_sampler`
    builds the sampler again when training starts): the datasets' sizes against one global
    batch, ``--interleave_prob``'s length against the datasets."""
    if dataset is None or not hasattr(dataset, "__len__"):
        return
    train_sampler(dataset, args, infos, check_only=True)


def _log_plan(sampler) -> None:
    """The start-up line of a :class:`HomogeneousSampler`: per dataset, its rows, global batches
    per pass, the rows sitting each pass out and its steps in the first epoch."""
    if world()[0] != 0:
        return
    if isinstance(sampler, HomogeneousSampler):
        lines = []
        counts = np.bincount(sampler.draws(0), minlength=len(sampler.parts))
        for part, n in zip(sampler.parts, counts.tolist()):
            left = len(part.rows) % sampler.size
            lines.append(f"{part.name}: {len(part.rows)} rows, {len(part.rows) // sampler.size} global batches per pass"
                         f" ({left} rows sit each pass out), {n} of the first epoch's {sampler.batches_per_epoch} steps")
        no_duplicates = sampler.streams[0].keys is not None
        what = ("no text twice in a global batch of %d rows" if sampler.rule == "mixed" else
                "every global batch of %d rows from one dataset" + (", no text twice in it" if no_duplicates else ""))
        logger.info("--multi_dataset_sampler %s%s: %s; %s", sampler.rule,
                    " --batch_sampler no_duplicates" if no_duplicates else "", what % sampler.size, "; ".join(lines))


def train_sampler(dataset, args, infos=None, check_only: bool = False) -> Sampler | None:
    """The sampler of ``dataset``'s training rows for this process under the training
    arguments ``args`` (``train_sampling_strategy``, ``train_dataloader_shuffle``,
    ``data_seed`` / ``seed``, and mmembed's ``multi_dataset_sampler``, ``batch_sampler``,
    ``interleave_prob``, ``stopping_strategy``): ms-swift's order for ``random`` and
    ``sequential`` (with ``--interleave_prob``: over the interleaved rows); a
    :class:`HomogeneousSampler` for ``proportional`` / ``round_robin`` / ``weighted`` or
    ``--batch_sampler no_duplicates``; None for a dataset without a length (a stream) and for
    transformers' length-grouped strategies, which the Trainer's own sampler serves.
    ``infos``: the datasets' names and weights (``TrainingData.datasets``)."""
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
    shuffle = strategy == "random" and getattr(args, "train_dataloader_shuffle", True)
    seed = args.data_seed if args.data_seed is not None else args.seed
    rank, size = world()
    if check_only:
        size = max(size, int(getattr(args, "world_size", 1) or 1))
    parts = dataset_parts(dataset, infos) if (rule != "mixed" or no_duplicates or interleave) else None
    rows = None
    if interleave:
        if len(interleave) != len(parts):
            raise UsageError(f"--interleave_prob gives {len(interleave)} probabilities for {len(parts)} dataset(s) "
                             f"({', '.join(p.name for p in parts)}): give one per dataset")
        empty = [p.name for p in parts if not len(p.rows)]
        if empty:
            raise UsageError(f"--interleave_prob: dataset(s) {', '.join(empty)} have no training rows")
        stopping = str(getattr(args, "stopping_strategy", None) or "first_exhausted")
        rows = interleaved_rows(parts, interleave, seed, stopping)
        if not check_only and rank == 0:
            total = float(sum(interleave))
            logger.info("--interleave_prob %s: datasets drawn row by row with probabilities %s (normalised to sum 1), "
                        "--stopping_strategy %s: %d training rows", " ".join(str(x) for x in interleave),
                        ", ".join(f"{p.name} {x / total:.4g}" for p, x in zip(parts, interleave)), stopping, len(rows))
    if rule != "mixed" or no_duplicates:
        accumulation = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
        batch = int(args.per_device_train_batch_size)
        keys = None
        if no_duplicates and not check_only:  # the start-up check counts rows only
            keys = row_keys(dataset)
        if rule == "mixed":  # no_duplicates over every row (or the interleaved ones): one dataset
            parts = [Part("all rows", 1.0, rows if rows is not None else np.arange(len(dataset)))]
        elif len(parts) == 1 and not check_only and rank == 0:
            logger.warning("--multi_dataset_sampler %s: the training rows are one dataset, so every global batch "
                           "is from it whatever the rule (several datasets: --dataset_config)", rule)
        sampler = HomogeneousSampler(parts, rule, batch, accumulation, seed, rank, size, shuffle, keys)
        if sampler.batches_per_epoch == 0:
            raise UsageError(f"{len(dataset)} training rows make no global batch of {sampler.size} rows")
        if not check_only:
            _log_plan(sampler)
        return sampler
    if rows is not None:
        return MappedSampler(SwiftOrderSampler(len(rows), shuffle, seed, rank, size), rows)
    return SwiftOrderSampler(len(dataset), shuffle, seed, rank, size)


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
    a sampler with no position to record)."""
    if isinstance(sampler, (HomogeneousSampler, MappedSampler)):
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
