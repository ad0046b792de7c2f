"""A distillation teacher's signals taken from the data instead of a teacher model.

Two signals, each from a row field or from a ``.npy`` file aligned with a data file's rows
(row ``k`` of the array belongs to the ``k``-th row of the file: JSONL blank lines do not
count, a bad row skipped with ``strict=False`` still does):

- **scores**: one per candidate of the group, the positive's first, then one per negative
  in the row's order (``distill_kl`` with ``use_batch=False``). Row field
  ``teacher_scores``; file ``[rows, W]`` float, ``W >= 1 +`` the most negatives of a row,
  the slots past a row's candidates NaN.
- **embeddings**: one per member, anchor, positive, then the negatives (``distill_cosine``,
  ``distill_mse``, ``distill_marginal``, and ``distill_kl``). Row field
  ``teacher_embeddings``; file ``[rows, I, D]``, ``I >= 2 +`` the most negatives, the
  members past a row's own all NaN.

The NaN padding is checked, so an array that is off by a row is caught by the first row
whose negatives count differs rather than trained on. Arrays are memory-mapped: only the
rows of a batch are read.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .rows import check_teacher_embeddings, check_teacher_scores
from .sample import DataError, Sample

#: Sample attribute (also the row field's name) -> what its ``.npy`` holds per row
SIGNALS = {"teacher_scores": "scores", "teacher_embeddings": "embeddings"}


@dataclass
class TeacherFiles:
    """``.npy`` teacher signals keyed by the absolute path of the data file they align with."""

    scores: dict[str, str] = field(default_factory=dict)
    embeddings: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        self._arrays: dict[str, np.ndarray] = {}

    def __bool__(self) -> bool:
        return bool(self.scores or self.embeddings)

    def __getstate__(self):  # workers reopen the memory maps instead of receiving copies
        return {"scores": self.scores, "embeddings": self.embeddings}

    def __setstate__(self, state):
        self.scores, self.embeddings = state["scores"], state["embeddings"]
        self._arrays = {}

    @classmethod
    def open(
        cls,
        data_files: list[list[str]],
        records: dict[str, int],
        scores_files: Iterable[str] | None = None,
        embeddings_files: Iterable[str] | None = None,
    ) -> TeacherFiles:
        """Pair each ``--dataset`` spec's file with its ``.npy`` (same order) and check shapes.

        Args:
            data_files: The files of each dataset spec, in ``--dataset`` order.
            records: Rows read per data file (bad rows included).
            scores_files, embeddings_files: One ``.npy`` per dataset spec, or None.

        Raises:
            ValueError: a count, a shape or a dtype that does not fit (named).
        """
        out = cls()
        for kind, files, ndim in (("scores", scores_files, 2), ("embeddings", embeddings_files, 3)):
            files = list(files or [])
            if not files:
                continue
            flag = f"--teacher_{kind}_file"
            if len(files) != len(data_files):
                raise ValueError(f"{flag}: {len(files)} file(s) for {len(data_files)} --dataset spec(s); "
                                 "give one .npy per dataset, in the same order")
            for npy, spec_files in zip(files, data_files):
                if len(spec_files) != 1:
                    raise ValueError(f"{flag} {npy}: its dataset is a folder of {len(spec_files)} files; "
                                     "a .npy aligns with the rows of one file, so pass the files one by one")
                data = spec_files[0]
                npy = os.path.abspath(npy)
                if not os.path.isfile(npy):
                    raise FileNotFoundError(f"{flag}: {npy} does not exist")
                arr = np.load(npy, mmap_mode="r")
                if arr.ndim != ndim or not np.issubdtype(arr.dtype, np.floating):
                    want = "[rows, 1 + negatives]" if kind == "scores" else "[rows, 2 + negatives, width]"
                    raise ValueError(f"{flag} {npy}: expected a float array {want}, got {arr.dtype} {tuple(arr.shape)}")
                if arr.shape[0] != records.get(data, 0):
                    raise ValueError(f"{flag} {npy}: {arr.shape[0]} rows, but {data} has {records.get(data, 0)}; "
                                     "row k of the array belongs to row k of the file")
                getattr(out, kind)[data] = npy
        return out

    def _array(self, npy: str) -> np.ndarray:
        if npy not in self._arrays:
            self._arrays[npy] = np.load(npy, mmap_mode="r")
        return self._arrays[npy]

    def check_rows(self, dataset: Any) -> None:
        """Check every row of ``dataset`` (Arrow samples, as ``load_samples`` returns them)
        whose file has an array: its slice fits the row (:meth:`attach`'s checks). For rows
        that are not read before training (the eval rows), so that a misaligned array fails
        at start, not at the first evaluation; rows of files without an array (a
        ``--val_dataset``) are not decoded.

        Raises:
            DataError: the first row whose slice does not fit (named as :meth:`attach` does).
        """
        files = set(self.scores) | set(self.embeddings)
        if not files:
            return
        for batch in dataset.select_columns(["sample", "source", "row"]).iter(batch_size=1000):
            for sample, source, row in zip(batch["sample"], batch["source"], batch["row"]):
                if source in files:
                    self.attach(Sample.from_json(sample), int(row))

    def attach(self, sample: Sample, row: int) -> Sample:
        """Fill ``sample``'s teacher signals from the arrays of its file (row ``row``).

        Raises:
            DataError: the row's slice does not fit its group (names the file, line and
                the array's row), or the row gives the same signal itself.
        """
        k = len(sample.negatives)
        for attr, kind in SIGNALS.items():
            npy = getattr(self, kind).get(sample.source)
            if npy is None:
                continue
            where = f"{os.path.basename(npy)}[{row}]"
            if getattr(sample, attr) is not None:
                raise DataError(sample.source, sample.line, attr,
                                f"the row has '{attr}' and {npy} gives them too; keep one source")
            values = np.asarray(self._array(npy)[row], dtype=np.float64)
            n = (1 if kind == "scores" else 2) + k
            own, pad = values[:n], values[n:]
            filled = ~np.isnan(own) if kind == "scores" else ~np.isnan(own).all(axis=-1)
            if own.shape[0] < n or not filled.all():
                raise DataError(sample.source, sample.line, where,
                                f"holds {int(filled.sum())} {kind} but the row has {k} negatives, so it needs {n}; "
                                "is the array aligned with the file's rows?")
            if not np.isnan(pad).all():
                raise DataError(sample.source, sample.line, where,
                                f"has values past the row's {n} entries (it has {k} negatives); pad with NaN. "
                                "Is the array aligned with the file's rows?")

            def error(fieldname, message):
                return DataError(sample.source, sample.line, fieldname, message)

            check = check_teacher_scores if kind == "scores" else check_teacher_embeddings
            setattr(sample, attr, check(own.tolist(), k, error, where))
        return sample


def teacher_signal(samples: Iterable[Sample], accepted: Iterable[str], loss_type: str, what: str
                   ) -> tuple[str, int | None]:
    """Which teacher signal the training rows give: every row must carry it.

    Args:
        accepted: The signals the loss takes (its ``side.teacher``): ``"embeddings"``
            and/or ``"scores"``.
        loss_type: The loss's name, for messages.

    Returns:
        ``(attribute, width)``: ``"teacher_scores"`` or ``"teacher_embeddings"``, and the
        embeddings' width (None for scores).

    Raises:
        DataError: the first row that lacks the signal, or embeddings of another width.
    """
    scores_ok = "scores" in set(accepted)
    first: dict[str, Any] = {}
    missing: dict[str, Sample] = {}
    width, width_row = None, None
    for s in samples:
        for attr in SIGNALS:
            value = getattr(s, attr)
            if value is None:
                missing.setdefault(attr, s)
            else:
                first.setdefault(attr, s)
        if s.teacher_embeddings is not None:
            w = len(s.teacher_embeddings[0])
            if width is None:
                width, width_row = w, s
            elif w != width:
                raise DataError(s.source, s.line, "teacher_embeddings",
                                f"width {w}, but {width_row.source}:{width_row.line} has {width}; one teacher, one width")
    if scores_ok and "teacher_scores" in first and "teacher_scores" not in missing:
        return "teacher_scores", None
    if "teacher_embeddings" in first and "teacher_embeddings" not in missing:
        return "teacher_embeddings", width
    need = "teacher_scores or teacher_embeddings" if scores_ok else "teacher_embeddings"
    lacking = missing.get("teacher_embeddings") or missing.get("teacher_scores")
    hint = ""
    if not scores_ok and "teacher_scores" in first and "teacher_scores" not in missing:
        hint = (" (the rows have teacher_scores, which score only each row's own candidates: "
                "distill_kl uses them with use_batch false, e.g. --loss_kwargs '{\"use_batch\": false}')")
    if lacking is None:
        raise ValueError(f"{what}: no rows")
    raise DataError(lacking.source, lacking.line, need.split(" or ")[0],
                    f"--loss_type {loss_type} without --teacher_model takes the teacher from the data, so every "
                    f"{what} row needs {need} (a row field, or --teacher_scores_file / --teacher_embeddings_file)"
                    + hint)
