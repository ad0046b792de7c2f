"""Dataset specs (``--dataset``) and Arrow storage of the parsed samples.

``load_samples(["train.jsonl#1000", "more_data/"])`` reads every file through
:func:`~mmembed.data.rows.parse_row` inside a ``datasets`` builder that writes tables of
:data:`~mmembed.data.arrow_rows._TABLE_ROWS` rows (``num_proc`` processes parse byte ranges of a ``.jsonl`` file), so
rows go straight to a memory-mapped Arrow file in the ``datasets`` cache and are never held as a
Python list. Each Arrow row holds one sample as JSON (``Sample.to_json``) plus its
``source``, ``line`` and ``row`` (its index among its file's rows, which a teacher ``.npy``
is aligned with); :class:`EmbeddingDataset` decodes them one at a time.

Bad rows are recorded in the Arrow file itself (an ``error`` column, dropped before the
dataset is returned), so that they survive worker processes and cache hits alike: with
``strict=True`` the first one is raised as the :class:`DataError` it is, with
``strict=False`` they are skipped and listed in :attr:`LoadResult.skipped` and in a warning.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch.utils.data

from ..environment import read as read_environment
from .arrow_rows import _build
from .hub import DatasetHubOptions, hub_files
from .labels import LabelRule
from .paths import MediaFileError
from .sample import DataError, Sample
from .specs import HubDataset, SpecError, data_files, draw_seed, parse_spec, sample_and_split

__all__ = ["EmbeddingDataset", "LoadResult", "load_samples", "spec_files"]

logger = logging.getLogger(__name__)

# Bump when the reader's output for the same file changes, so old caches are not reused.
_CACHE_VERSION = "mmembed-samples-5"
_REPORT_LIMIT = 50
#: the least a process parses of a .jsonl file (about 10k rows of the usual text shape)
_MIN_SHARD_BYTES = 4 << 20


# ----------------------------------------------------------------------------- loading


@dataclass
class LoadResult:
    """What :func:`load_samples` returns: the dataset and the rows it skipped (strict=False)."""

    dataset: Any  # datasets.Dataset with columns sample (JSON), source, line, remote, row
    skipped: list[DataError] = field(default_factory=list)
    rows_read: int = 0
    records: dict[str, int] = field(default_factory=dict)  # rows read per file (bad ones included)
    files: list[list[str]] = field(default_factory=list)  # the data files of each spec, in order
    val: Any = None  # the rows split off for validation (split_ratio > 0)
    parsed: bool = False  # whether any file was parsed now (False: every file came from the Arrow cache)
    seconds: float = 0.0  # the time the files took to parse (or to open from the cache)

    def report(self, limit: int = _REPORT_LIMIT) -> str:
        """A human-readable list of skipped rows (``file:line field: reason``); "" if none."""
        if not self.skipped:
            return ""
        lines = [f"skipped {len(self.skipped)} bad row(s) of {self.rows_read} read (strict=False):"]
        lines += [f"  {e}" for e in self.skipped[:limit]]
        rest: dict[str, list[int]] = {}
        for e in self.skipped[limit:]:
            rest.setdefault(e.source, []).append(e.line)
        for source, numbers in rest.items():
            shown = ", ".join(map(str, numbers[:200])) + (", ..." if len(numbers) > 200 else "")
            lines.append(f"  ... {len(numbers)} more in {source}, lines {shown} (reasons in LoadResult.skipped)")
        return "\n".join(lines)


def release_mapped(files: set[str] | frozenset[str]) -> None:
    """Let go of the pages of ``files`` (Arrow cache files) this process has memory-mapped and
    read: ``madvise(MADV_DONTNEED)`` on its maps of them, so that a pass over the whole cache
    does not leave every page counted in its resident set. The pages stay in the kernel's page
    cache, and a later read of them maps them again. Linux only (elsewhere: nothing)."""
    import ctypes
    import mmap

    if not files or not hasattr(mmap, "MADV_DONTNEED") or not os.path.exists("/proc/self/maps"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].rstrip("\n") in files:
                start, end = (int(x, 16) for x in parts[0].split("-"))
                libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_DONTNEED)


def _errors(ds) -> list[tuple[int, DataError]]:
    """The error rows of a freshly built dataset as ``(row index, DataError)``, in order."""
    import pyarrow.compute as pc

    column = ds.data.column("error")
    if column.null_count == len(column):
        return []
    bad = np.flatnonzero(pc.is_valid(column).to_numpy(zero_copy_only=False))
    errors = []
    for i, row in zip(bad, ds.select(bad)):
        info = json.loads(row["error"])
        cls = MediaFileError if info.get("media") else DataError
        errors.append((int(i), cls(row["source"], row["line"], info["field"], info["reason"])))
    return errors


def _from_cache(ds, started: float) -> bool:
    files = [f["filename"] for f in getattr(ds, "cache_files", [])]
    return bool(files) and all(os.path.getmtime(f) < started for f in files if os.path.exists(f))


def _load_files(
    files: list[str], *, strict: bool, verify_images: bool, cache_dir: str | None, num_proc: int, force: bool,
    columns: dict[str, str] | None = None, label_rule: LabelRule | None = None, media_kinds: frozenset[str] | None = None,
    reuse: bool = False, several_positives: bool = False, sources: dict[str, str] | None = None,
):
    """Arrow dataset of the files' good rows (with their ``row`` in their file), the bad rows
    as DataErrors, the rows read per file, and whether the files were parsed now (False: the
    cache). ``reuse``: take the cache as it is (another process of the run has just written it).
    ``sources``: a hub dataset's files -> the names their rows are read under."""
    shards = []
    for path in files:
        st = os.stat(path)
        # byte ranges of a .jsonl file for several processes, each worth starting (a pool costs ~0.5 s)
        n = min(num_proc, max(1, st.st_size // _MIN_SHARD_BYTES)) if path.lower().endswith(".jsonl") else 1
        shards += [(path, st.st_mtime_ns, st.st_size, i, n) for i in range(n)]
    gen_kwargs = {"shards": shards, "strict": strict, "verify_images": verify_images, "version": _CACHE_VERSION,
                  "work_dir": os.getcwd(), "root_image_dir": read_environment().data.root_image_dir, "columns": columns,
                  "label_rule": label_rule.as_dict() if label_rule else None,
                  "media_kinds": tuple(sorted(media_kinds)) if media_kinds is not None else None,
                  "several_positives": several_positives}
    if sources:
        gen_kwargs["sources"] = sources
    started = time.time()
    ds = _build(gen_kwargs, cache_dir, num_proc, force and not reuse)
    parsed = not _from_cache(ds, started)
    errors = _errors(ds)
    if not force and not reuse and not parsed and any(isinstance(e, MediaFileError) for _, e in errors):
        # The cache is keyed by the data files only; media may have been added or fixed since.
        ds = _build(gen_kwargs, cache_dir, num_proc, force=True)
        errors, parsed = _errors(ds), True
    if strict and errors:
        raise errors[0][1]
    ds, records = _with_row_numbers(ds)
    if not errors:
        return ds.remove_columns("error"), [], records, parsed
    good = np.setdiff1d(np.arange(len(ds)), [i for i, _ in errors], assume_unique=True)
    return ds.select(good).remove_columns("error"), [e for _, e in errors], records, parsed


def _with_row_numbers(ds):
    """Add ``row``, each row's index among its file's rows (what a ``.npy`` aligned with the
    file is indexed by), and count the rows of each file. Rows arrive file by file, in order."""
    import pyarrow.compute as pc

    column = ds.data.column("source")
    n = len(column)
    if n == 0:
        return ds.add_column("row", np.zeros(0, dtype=np.int64)), {}
    # where the file changes, found in Arrow (no Python string per row)
    changes = pc.not_equal(column.slice(1), column.slice(0, n - 1)).to_numpy(zero_copy_only=False)
    starts = np.concatenate([[0], np.flatnonzero(changes) + 1])
    source = {int(i): column[int(i)].as_py() for i in starts}
    sizes = np.diff(np.concatenate([starts, [n]]))
    row = np.arange(n) - np.repeat(starts, sizes)
    records: dict[str, int] = {}
    for start, size in zip(starts, sizes):
        records[source[start]] = records.get(source[start], 0) + int(size)
    return ds.add_column("row", row.astype(np.int64)), records


def load_samples(
    specs: list[str] | str,
    *,
    strict: bool = True,
    seed: int = 42,
    cache_dir: str | None = None,
    num_proc: int = 1,
    load_from_cache_file: bool = True,
    verify_images: bool = True,
    split_ratio: float = 0.0,
    shuffle: bool = False,
    columns: dict[str, str] | None = None,
    label_rule: LabelRule | None = None,
    media_kinds: frozenset[str] | None = None,
    reuse: bool = False,
    several_positives: bool = False,
    hub: DatasetHubOptions | None = None,
) -> LoadResult:
    """Read dataset specs into one Arrow-backed ``datasets.Dataset`` of samples.

    Columns: ``sample`` (``Sample.to_json()``), ``source`` (absolute file path), ``line``,
    ``remote`` (whether the sample names a URL), ``row`` (the index among the file's rows, bad
    rows included).
    Rows come in ms-swift's order for the same seed (its ``--data_seed``), with one
    ``numpy.random.RandomState(seed)`` drawn from spec by spec: each spec (see
    :func:`parse_spec`) first gives up ``split_ratio`` of its rows to the validation set
    (``LoadResult.val``), then ``#N`` samples N of the rest (after bad rows are dropped):
    without replacement when N <= rows; beyond, each row ``N // rows`` times plus ``N % rows``
    distinct rows. The specs are concatenated and, with ``shuffle`` (ms-swift's
    ``--dataset_shuffle``), the training and validation sets are shuffled. Without
    ``shuffle`` nothing is random: the split takes each file's last rows and ``#N`` its first.
    ``split_ratio=1`` reads validation specs (all rows go to ``val``).

    ``strict=True``: the first bad row raises its :class:`DataError`. ``strict=False``: bad
    rows are skipped, listed in ``LoadResult.skipped`` and logged as a warning (never
    silently). A spec that gives no usable row (an empty file, only blank lines, or every
    row bad with ``strict=False``) is a :class:`DataError` naming it. ``label_rule`` (the
    loss's :class:`~mmembed.data.labels.LabelRule`) and ``media_kinds`` (the media kinds
    the model takes) make a row whose label or media the training cannot use a bad row
    too. The Arrow cache (``cache_dir`` or the ``datasets`` default) is keyed by every
    file's path, size and mtime and by the options, so an edited file is read again; a cache
    that recorded a missing or unreadable media file is read again too (the media may have
    been fixed since); ``load_from_cache_file=False`` always re-reads. ``num_proc > 1`` reads
    files (and byte ranges of ``.jsonl`` files) in parallel processes, keeping row order.
    ``verify_images=False`` skips reading each local media file's header (PIL for images,
    PyAV for videos and audio; existence is still checked). ``columns`` renames row fields
    before they are read (``--columns``, ms-swift's mapping: ``{"text1": "query", "text2":
    "response"}``). ``reuse=True`` takes what the Arrow cache holds as it is, whatever
    ``load_from_cache_file`` says (the other processes of a run do, once its main process
    has read the files; see :func:`mmembed.training.data_assembly.read_once`).
    ``several_positives`` (a reranker run) lets a messages-form row hold several
    ``positive_messages`` groups (:func:`~mmembed.data.rows.parse_row`).

    A hub dataset id (``org/name[:subset][#N]``, :func:`parse_spec`) is loaded as ``hub`` says
    (None: ``USE_HF`` decides, ModelScope by default) and read from the JSONL files
    :func:`mmembed.data.hub.hub_files` writes (``columns`` applied there), its rows named
    ``hf::org/name[split]:ROW`` (the row's number in the split).
    """
    import datasets

    if isinstance(specs, str):
        specs = [specs]
    if not specs:
        raise SpecError("no dataset specs given")
    parsed = [parse_spec(s) for s in specs]
    resolved = [spec_files(target, hub, columns) for target, _ in parsed]
    file_lists = [[sources.get(f, f) for f in files] for files, sources in resolved]
    if not 0 <= split_ratio <= 1:
        raise ValueError(f"split_dataset_ratio must be in [0, 1], got {split_ratio}")
    rng = np.random.RandomState(seed)
    parts, vals, skipped, records = [], [], [], {}
    started, parsed_any = time.perf_counter(), False
    for (path, n), (files, sources) in zip(parsed, resolved):
        draw_seed(rng)  # ms-swift draws a seed per spec before reading it (for its decision-task augmentation)
        ds, bad, read, parsed_now = _load_files(
            files,
            strict=strict,
            verify_images=verify_images,
            cache_dir=cache_dir,
            num_proc=max(1, int(num_proc or 1)),
            force=not load_from_cache_file,
            columns=None if sources else columns,  # (a hub dataset's rows were renamed when written)
            label_rule=label_rule,
            media_kinds=media_kinds,
            reuse=reuse,
            several_positives=several_positives,
            sources=sources,
        )
        parsed_any = parsed_any or parsed_now
        skipped += bad
        records.update(read)
        if len(ds) == 0:
            raise _no_rows(str(path), bad, skipped, sum(records.values()))
        if n is not None and n > len(ds):
            logger.warning("%s#%d: more than its %d rows, so rows repeat", path, n, len(ds))
        train, val = sample_and_split(ds, n, split_ratio, shuffle, rng, str(path))
        if train is not None:
            parts.append(train)
        if val is not None:
            vals.append(val)

    def concat(sets):
        return sets[0] if len(sets) == 1 else datasets.concatenate_datasets(sets)

    dataset = concat(parts) if parts else None
    val_set = concat(vals) if vals else None
    if shuffle:
        if dataset is not None:
            dataset = dataset.shuffle(seed=draw_seed(rng))
        if val_set is not None:
            val_set = val_set.shuffle(seed=draw_seed(rng))
    result = LoadResult(dataset=dataset if dataset is not None else val_set, skipped=skipped,
                        rows_read=sum(records.values()), records=records, files=file_lists,
                        val=val_set if dataset is not None else None, parsed=parsed_any,
                        seconds=time.perf_counter() - started)
    if skipped:
        logger.warning("%s", result.report())
    return result


def spec_files(target: str | HubDataset, hub: DatasetHubOptions | None = None, columns: dict[str, str] | None = None
               ) -> tuple[list[str], dict[str, str]]:
    """A parsed spec's data files, and for a hub dataset the name each is read under (its
    splits written as JSONL now, unless cached: :func:`mmembed.data.hub.hub_files`)."""
    if isinstance(target, HubDataset):
        written = hub_files(target, hub if hub is not None else DatasetHubOptions.of(), columns)
        return [f.path for f in written], {f.path: f.name for f in written}
    return data_files(target), {}


def _no_rows(path: str, bad: list[DataError], skipped: list[DataError], rows_read: int) -> DataError:
    """The error for a spec that gives no usable row (``bad``: its skipped rows); the rows
    skipped so far (``skipped``, of ``rows_read``) are logged first."""
    if skipped:
        logger.warning("%s", LoadResult(dataset=None, skipped=skipped, rows_read=rows_read).report())
    if not bad:
        what = "a folder of data files that hold" if os.path.isdir(path) else \
            "the file holds" if os.path.exists(path) else "the hub dataset holds"
        return DataError(path, 0, None, f"no usable rows: {what} no rows (empty, or only blank lines)")
    return DataError(path, 0, None, f"no usable rows, {len(bad)} skipped (strict=False; listed above); "
                                    f"the first: {bad[0]}")


# ----------------------------------------------------------------------------- split / torch


#: the Arrow column holding each row's dataset index (``--dataset_config``)
DATASET_ID = "dataset_id"


class EmbeddingDataset(torch.utils.data.Dataset):
    """A torch Dataset over the Arrow samples; ``ds[i]`` decodes row ``i`` into a Sample,
    with its teacher signals from ``teacher`` (``.npy`` files aligned with the data files)
    and its dataset index (:attr:`dataset_ids`).

    Each sample it gives knows where it came from (``sample.drawn_from``: this dataset and
    the index), so that a row whose media fail to load when its batch is built can be
    replaced by another row of the same dataset (:meth:`replacement`, with ``--strict false`).
    """

    def __init__(self, dataset: Any, teacher: Any = None):
        if isinstance(dataset, LoadResult):
            dataset = dataset.dataset
        self.dataset = dataset
        self.teacher = teacher if teacher else None

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def dataset_ids(self) -> np.ndarray:
        """Each row's dataset index (int64, in row order): the ``dataset_id`` column written
        for ``--dataset_config`` (an index into ``TrainingData.datasets``), all zeros without it."""
        names = getattr(self.dataset, "column_names", None) or []
        if DATASET_ID not in names:
            return np.zeros(len(self), dtype=np.int64)
        column = self.dataset.select_columns([DATASET_ID]).with_format("numpy")[DATASET_ID]
        return np.asarray(column, dtype=np.int64)

    def __getitem__(self, index: int) -> Sample:
        row = self.dataset[int(index)]
        sample = Sample.from_json(row["sample"])
        if DATASET_ID in row:
            sample.dataset_id = int(row[DATASET_ID])
        if self.teacher is not None:
            self.teacher.attach(sample, int(row["row"]))
        sample.drawn_from = (self, int(index))  # not a field: not compared, not stored
        return sample

    def replacement(self, index: int, attempt: int) -> Sample:
        """The row that stands in for row ``index`` (``attempt`` 0, 1, ... when the ones before
        are unusable too): a row drawn from this dataset by a generator seeded with ``index``
        and ``attempt`` only, so the same bad row has the same stand-in in every epoch, run,
        process and data-loader worker; with several datasets (``--dataset_config``), a row of
        the same dataset."""
        rng = np.random.default_rng([int(index), int(attempt), 0x6D6D])
        ids = self.dataset_ids
        if ids.any():  # --dataset_config: a row of the same dataset (a batch may have to be one dataset's)
            same = np.flatnonzero(ids == ids[int(index)])
            return self[int(same[rng.integers(len(same))])]
        return self[int(rng.integers(len(self)))]
