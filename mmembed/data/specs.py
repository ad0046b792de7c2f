"""What a ``--dataset`` spec names and how its rows are drawn: ``path``, ``path#N``, a folder
of data files, a hub dataset id (:func:`parse_spec`, :func:`data_files`, :class:`HubDataset`;
:class:`SpecError` for a path that is not there), ms-swift's ``#N`` sampling (:func:`sample_indices`, with or without
repetition) and its validation split (:func:`sample_and_split` per spec,
:func:`split_dataset` for ``--split_dataset_ratio``), each seeded as ms-swift seeds them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np

from .formats import DATA_EXTENSIONS
from .sample import DataError


class SpecError(ValueError):
    """A ``--dataset`` spec that names no readable local file or folder, or a hub dataset that
    cannot be loaded."""


# ----------------------------------------------------------------------------- specs

_HUB_PREFIX_RE = re.compile(r"^(hf|ms)::", re.IGNORECASE)
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w./-]+)?$")
_PREFIXED_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w./-]+)?$")


@dataclass(frozen=True)
class HubDataset:
    """A spec that names a hub dataset, in ms-swift's syntax ``[hf::|ms::]ORG/NAME[:SUBSET[/SUBSET...]]``
    (its ``#N`` is returned beside it by :func:`parse_spec`). ``hub``: ``"hf"`` or ``"ms"`` from
    the prefix, None when the run's ``--use_hf`` / ``USE_HF`` decides (ModelScope by default, as
    in ms-swift). :mod:`mmembed.data.hub` loads it."""

    repo_id: str
    subsets: tuple[str, ...] = ()
    hub: str | None = None

    def __str__(self) -> str:
        prefix = f"{self.hub}::" if self.hub else ""
        return prefix + self.repo_id + (":" + "/".join(self.subsets) if self.subsets else "")


def parse_spec(spec: str) -> tuple[str | HubDataset, int | None]:
    """Split a dataset spec into ``(absolute path, N or None)``, or ``(HubDataset, N or None)``.

    Accepted: ``path``, ``path#N`` (N > 0: sample N rows, see :func:`load_samples`), a folder
    (every data file under it), and a hub dataset id as ms-swift writes it (``org/name``,
    ``org/name:subset``, ``org/name:a/b``, ``hf::org/name``, ``ms::org/name``, each with an
    optional ``#N``). A path that exists as written wins over the ``#N`` reading, and a local
    path wins over a hub id. Nothing is downloaded here. A spec that names nothing on disk
    and does not look like a hub id raises :class:`SpecError`.
    """
    spec = spec.strip()
    if not spec:
        raise SpecError("empty dataset spec (check --dataset for an empty string)")
    if os.path.exists(os.path.expanduser(spec)):
        return os.path.abspath(os.path.expanduser(spec)), None
    path, n = spec, None
    m = re.fullmatch(r"(.*)#(\d+)", spec)
    if m:
        path, n = m.group(1), int(m.group(2))
        if n <= 0:
            raise SpecError(f"dataset spec {spec!r}: the sample count after '#' must be positive")
    local = os.path.expanduser(path)
    if os.path.exists(local):
        return os.path.abspath(local), n
    prefix = _HUB_PREFIX_RE.match(path)
    if prefix:  # ms-swift: hf::data.jsonl is the local file (the prefix names a hub for ids only)
        rest = os.path.expanduser(path[prefix.end():])
        if os.path.exists(rest):
            return os.path.abspath(rest), n
    if looks_like_hub_id(path):
        return hub_dataset(path), n
    raise SpecError(f"dataset file or folder not found: {path!r} (from spec {spec!r})")


def hub_dataset(text: str) -> HubDataset:
    """``[hf::|ms::]ORG/NAME[:SUBSET[/SUBSET...]]`` (no ``#N``) as a :class:`HubDataset`."""
    hub = None
    prefix = _HUB_PREFIX_RE.match(text)
    if prefix:
        hub, text = prefix.group(1).lower(), text[prefix.end():]
    repo_id, _, subsets = text.partition(":")
    return HubDataset(repo_id.strip(), tuple(s.strip() for s in subsets.split("/") if s.strip()), hub)


def looks_like_hub_id(path: str) -> bool:
    """Whether ``path`` (not found on disk) reads as a hub dataset id: ``org/name`` with an
    optional ``:subset``, and after an ``hf::``/``ms::`` prefix also ``name``; not ``./x``,
    ``/x``, ``~/x`` or a name with a data file's extension."""
    rest = _HUB_PREFIX_RE.sub("", path)
    if rest.startswith(("/", ".", "~")) or _has_data_extension(rest.split(":")[0]):
        return False
    if rest != path:  # with a prefix an id without an organisation is one too (hf::imdb)
        return bool(_PREFIXED_ID_RE.match(rest))
    return bool(_HUB_ID_RE.match(rest))


def _has_data_extension(path: str) -> bool:
    return os.path.splitext(path)[1].lower() in DATA_EXTENSIONS


def data_files(path: str) -> list[str]:
    """A file -> [it]; a folder -> its data files (recursively, hidden entries skipped, sorted)."""
    if os.path.isfile(path):
        if not _has_data_extension(path):
            raise SpecError(f"unsupported data file {path!r}: expected one of {', '.join(DATA_EXTENSIONS)}")
        return [path]
    found = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [os.path.join(root, f) for f in files if not f.startswith(".") and _has_data_extension(f)]
    if not found:
        raise SpecError(f"folder {path!r} holds no data files ({', '.join(DATA_EXTENSIONS)})")
    return sorted(found, key=lambda p: os.path.relpath(p, path))


def sample_indices(size: int, n: int, rng: np.random.RandomState, shuffle: bool = True) -> np.ndarray:
    """Row indices for ``#n`` over ``size`` rows, as ms-swift picks them.

    ``n <= size``: ``n`` distinct rows in random order (the first ``n`` of a permutation), or
    the first ``n`` rows without ``shuffle``. ``n > size``: every row ``n // size`` times in
    order, then ``n % size`` more chosen the same way. ``n == size`` draws nothing.
    """
    if size == 0:
        raise ValueError(f"cannot sample {n} rows from an empty dataset")
    repeats, rest = divmod(n, size)
    idx = np.tile(np.arange(size), repeats)
    if rest:
        idx = np.concatenate([idx, rng.permutation(size)[:rest] if shuffle else np.arange(rest)])
    return idx


def draw_seed(rng: np.random.RandomState) -> int:
    """A seed drawn from the shared state, as ms-swift seeds each split and shuffle."""
    return int(rng.randint(0, np.iinfo(np.int32).max))


def sample_and_split(ds, n: int | None, ratio: float, shuffle: bool, rng: np.random.RandomState, path: str = ""):
    """One spec's ``(train, val)`` in ms-swift's order of draws: with a ratio, the validation
    rows are split off the whole file first (``max(int(min(rows, N) * ratio), 1)`` of them),
    then the ``N - val`` training rows are sampled from the rest."""
    n = len(ds) if n is None else n
    if ratio == 0:
        return ds.select(sample_indices(len(ds), n, rng, shuffle)), None
    if ratio == 1:
        if n > len(ds):
            raise SpecError(f"a validation spec cannot sample {n} rows from {len(ds)}")
        return None, ds.select(sample_indices(len(ds), n, rng, shuffle))
    n_val = max(int(min(len(ds), n) * ratio), 1)
    if n - n_val <= 0 or n_val >= len(ds):
        raise DataError(path, 0, None, f"{len(ds)} usable row(s): splitting off {n_val} for validation "
                                       f"(split ratio {ratio}) leaves no training rows")
    parts = ds.train_test_split(test_size=n_val, shuffle=shuffle, seed=draw_seed(rng))
    train = parts["train"]
    return train.select(sample_indices(len(train), n - n_val, rng, shuffle)), parts["test"]


def split_dataset(ds, ratio: float, seed: int):
    """Split off a validation set like ms-swift's ``--split_dataset_ratio``.

    ``ratio == 0`` -> ``(ds, None)``. ``0 < ratio < 1`` -> ``(train, val)`` with
    ``max(int(len(ds) * ratio), 1)`` validation rows chosen at random with ``seed``.
    """
    if not 0 <= ratio < 1:
        raise ValueError(f"split_dataset_ratio must be in [0, 1), got {ratio}")
    if ratio == 0:
        return ds, None
    n_val = max(int(len(ds) * ratio), 1)
    if n_val >= len(ds):
        raise ValueError(f"cannot split {len(ds)} row(s) with ratio {ratio}: no training rows would remain")
    parts = ds.train_test_split(test_size=n_val, shuffle=True, seed=seed)
    return parts["train"], parts["test"]
