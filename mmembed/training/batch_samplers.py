"""One dataset's global batches: the batch sampler of each dataset that the samplers of
:mod:`mmembed.training.samplers` draw from (as sentence-transformers wraps a batch sampler per
dataset in its multi-dataset samplers).

- :class:`Part`, :func:`dataset_parts`: the datasets the training rows come from.
- :class:`DatasetBatches`: the interface, one dataset's endless sequence of global batches in
  passes (:meth:`~DatasetBatches.batch` at a position, :meth:`~DatasetBatches.locate` a
  position's pass, :meth:`~DatasetBatches.batches_per_pass`); ``--batch_sampler`` picks the kind
  (:class:`BatchSamplerKind`): :class:`PlainBatches` (``default``) or :class:`NoDuplicatesBatches`
  (``no_duplicates``: no text twice in a batch, :func:`duplicate_free_batches` over the rows'
  texts, :func:`row_keys`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from enum import Enum

import numpy as np


class BatchSamplerKind(str, Enum):
    """``--batch_sampler``: how one dataset's rows are cut into global batches."""

    DEFAULT = "default"  # whole batches of a permutation (PlainBatches)
    NO_DUPLICATES = "no_duplicates"  # no text (with its media) twice in a batch (NoDuplicatesBatches)

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass
class Part:
    """One dataset's training rows: their indices in the training dataset, in its order."""

    name: str
    weight: float
    rows: np.ndarray


def dataset_parts(dataset, infos=None) -> list[Part]:
    """The datasets the training rows come from: ``dataset.dataset_ids`` (one index per row;
    absent: all rows are one dataset) named and weighted by ``infos`` (``TrainingData.datasets``:
    objects with ``name`` and ``weight``; absent: ``dataset N``, weight 1). Reads the dataset's
    length and ``dataset_ids`` only, never a row."""
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


class DatasetBatches:
    """One dataset's endless sequence of global batches of ``size`` rows: pass ``p`` is a
    permutation of its ``rows`` (seeded with ``(seed, index, p)``, ``index`` being the dataset's;
    in order without shuffling) cut into whole batches by :meth:`cut`; the rows that do not fill
    a whole batch sit that pass out and are drawn afresh in the next. Position ``n`` is the
    ``n``-th batch over all passes."""

    no_duplicates = False

    def __init__(self, rows: np.ndarray, size: int, seed: int, index: int, shuffle: bool = True):
        self.rows, self.size, self.seed, self.index, self.shuffle = rows, size, seed, index, shuffle
        self._passes: dict[int, list[list[int]]] = {}  # the last pass read, cached

    def order(self, p: int) -> np.ndarray:
        """Pass ``p``'s permutation of the rows."""
        if not self.shuffle:
            return self.rows
        return self.rows[np.random.default_rng([self.seed, self.index, p]).permutation(len(self.rows))]

    def cut(self, order: np.ndarray) -> list[list[int]]:
        """A pass's permutation cut into its whole batches."""
        raise NotImplementedError

    def pass_batches(self, p: int) -> list[list[int]]:
        """Pass ``p``'s batches; ValueError when the rows fill none."""
        if p not in self._passes:
            batches = self.cut(self.order(p))
            self._passes = {p: batches}
            if not batches:
                raise ValueError("cannot fill one batch")
        return self._passes[p]

    def batches_per_pass(self, p: int) -> int:
        raise NotImplementedError

    def locate(self, position: int) -> tuple[int, int]:
        """``(pass, batch in that pass)`` of the ``position``-th batch."""
        p = 0
        while position >= self.batches_per_pass(p):
            position -= self.batches_per_pass(p)
            p += 1
        return p, position

    def batch(self, position: int) -> list[int]:
        """The rows of the ``position``-th batch."""
        p, j = self.locate(position)
        return self.pass_batches(p)[j]


class PlainBatches(DatasetBatches):
    """``--batch_sampler default``: each pass the permutation's first ``rows // size`` batches
    of consecutive rows; every pass has as many."""

    def cut(self, order: np.ndarray) -> list[list[int]]:
        k = len(order) // self.size
        return order[:k * self.size].reshape(k, self.size).tolist()

    def batches_per_pass(self, p: int) -> int:
        return len(self.rows) // self.size

    def locate(self, position: int) -> tuple[int, int]:
        return divmod(position, self.batches_per_pass(0))


class NoDuplicatesBatches(DatasetBatches):
    """``--batch_sampler no_duplicates``: each pass the permutation cut by
    :func:`duplicate_free_batches` over the rows' texts (``keys``, :func:`row_keys`, indexed by
    row), so a pass may have fewer batches than ``rows // size`` and each pass has its own count."""

    no_duplicates = True

    def __init__(self, rows: np.ndarray, size: int, seed: int, index: int, shuffle: bool = True, keys=None):
        super().__init__(rows, size, seed, index, shuffle)
        self.keys = keys
        self._lengths: list[int] = []  # batches of each pass computed so far

    def cut(self, order: np.ndarray) -> list[list[int]]:
        return duplicate_free_batches(order, self.keys, self.size)

    def batches_per_pass(self, p: int) -> int:
        while len(self._lengths) <= p:
            self._lengths.append(len(self.pass_batches(len(self._lengths))))
        return self._lengths[p]


def dataset_batches(rows: np.ndarray, size: int, seed: int, index: int, shuffle: bool = True,
                    keys=None) -> DatasetBatches:
    """Dataset ``index``'s batch sampler: duplicate-free with the rows' texts ``keys``, plain without."""
    if keys is None:
        return PlainBatches(rows, size, seed, index, shuffle)
    return NoDuplicatesBatches(rows, size, seed, index, shuffle, keys)
