"""Read one data file and turn each row into a :class:`~mmembed.data.sample.Sample`.

:func:`read_file` reads and validates a whole file. The work is done in three layers,
usable separately:

* :mod:`mmembed.data.formats`: :func:`iter_raw_rows` streams the rows of a ``.jsonl``,
  ``.json``, ``.csv``/``.tsv`` or ``.parquet`` file, each with the line it starts on, so
  that every later error can name ``file:line``.
* :mod:`mmembed.data.rows`: :func:`parse_row` detects the row form (ms-swift's query form or
  messages form) and checks it against the data contract.
* :mod:`mmembed.data.paths`: binds media paths to media tags and resolves them (relative
  paths, ``file://``, ``data:`` URIs, URLs).
"""

from __future__ import annotations

import os

from .formats import DATA_EXTENSIONS, iter_raw_rows
from .labels import LabelRule
from .paths import MediaFileError
from .rows import parse_row
from .sample import Sample

__all__ = ["DATA_EXTENSIONS", "MediaFileError", "iter_raw_rows", "parse_row", "read_file"]


def read_file(path: str, *, verify_images: bool = True, label_rule: LabelRule | None = None,
              media_kinds: frozenset[str] | None = None, several_positives: bool = False) -> list[Sample]:
    """Read and validate a whole (small) file into a list of Samples.

    For validation or small files; use :func:`mmembed.data.load_samples` for training data,
    which streams to Arrow. Raises the first :class:`~mmembed.data.sample.DataError`.
    ``label_rule`` (a loss's ``label_rule``, e.g. ``build_loss("contrastive").label_rule``) and
    ``media_kinds`` check the rows against a loss and a model as training does;
    ``several_positives`` reads the rows as a reranker run does (several ``positive_messages``
    groups allowed).
    """
    base_dir = os.path.dirname(os.path.abspath(path))
    return [parse_row(raw, path, line, base_dir, verify_images=verify_images, label_rule=label_rule, media_kinds=media_kinds,
                      several_positives=several_positives)
            for line, raw in iter_raw_rows(path)]
