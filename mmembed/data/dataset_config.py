"""``--dataset_config FILE``: several training datasets, each with its own weight, task
instructions, loss settings and validation rows.

The file (YAML or JSON) is a list of datasets, or an object whose ``datasets`` key is one::

    datasets:
      - name: retrieval                 # letters, digits, '_' and '-'; unique
        path: [data/msmarco.jsonl, data/more/]   # a file or folder or hub dataset id, or a list of them
        sample: 2000                    # ms-swift's path#N over the dataset's rows (optional)
        rows: 1000000                   # --streaming: its size for the samplers (optional; else counted)
        weight: 2.0                     # the weighted sampler's share (default 1.0)
        query_system: "Given a web search query, retrieve relevant passages"
        document_system: null           # optional, like query_system
        infonce: {use_batch: false, hard_negatives: 3, temperature: 0.02}
        loss_kwargs: {}                 # over --loss_kwargs, key by key
        val: data/msmarco_dev.jsonl     # validation rows of this dataset (a file/folder or list)

Keys of ``infonce`` are the fields of :class:`~mmembed.losses.InfoNCEConfig` or the names of
the ``INFONCE_*`` variables (``temperature`` or ``INFONCE_TEMPERATURE``); a value is read as
the variable's text would be, over the variables of the run (the keys and values are the
loss's: :mod:`mmembed.losses.config` checks them; this module keeps the mapping as written). A
relative path is taken from the configuration file's folder, else from the working directory;
one found in neither that reads as a hub dataset id (``org/name[:subset][#N]``, ``hf::...``) is
kept as written, for :func:`mmembed.data.load_samples` to load from the hub. A
file that breaks these rules is one :class:`ConfigError` naming the file, the dataset and the
key; unknown keys are refused.

This module reads and checks the file only (no rows are read): :mod:`mmembed.training.data_assembly`
loads the rows, :func:`mmembed.training.model_assembly.make_loss` builds each dataset's loss.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .specs import looks_like_hub_id

__all__ = ["ConfigError", "DatasetEntry", "DatasetInfo", "read_dataset_config"]

KEYS = ("name", "path", "sample", "rows", "weight", "query_system", "document_system", "infonce", "loss_kwargs", "val")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")


class ConfigError(ValueError):
    """A ``--dataset_config`` file that cannot be used; the message names the file, the
    dataset and the key."""

    def __init__(self, file: str, dataset: str | None, key: str | None, reason: str):
        self.file, self.dataset, self.key, self.reason = file, dataset, key, reason
        where = f"--dataset_config {file}"
        if dataset is not None:
            where += f": dataset {dataset}"
        if key is not None:
            where += f", key '{key}'" if dataset is not None else f": key '{key}'"
        super().__init__(f"{where}: {reason}")

    def __reduce__(self):
        return (ConfigError, (self.file, self.dataset, self.key, self.reason))


@dataclass
class DatasetEntry:
    """One dataset of the configuration, as written (paths made absolute)."""

    name: str
    paths: list[str]
    sample: int | None = None
    # its number of training rows as declared for --streaming (the samplers that draw by size
    # read it rather than count the files' lines); None: not declared
    rows: int | None = None
    weight: float = 1.0
    query_system: str | None = None
    document_system: str | None = None
    # the ``infonce`` settings as written: {"temperature": 0.02, "INFONCE_USE_BATCH": false, ...}
    # (read by mmembed.losses.config.infonce_values when the dataset's loss is built)
    infonce: dict[str, Any] = field(default_factory=dict)
    loss_kwargs: dict[str, Any] = field(default_factory=dict)
    val: list[str] = field(default_factory=list)

    @property
    def has_loss_settings(self) -> bool:
        return bool(self.infonce or self.loss_kwargs)

    def specs(self) -> list[str]:
        """The ``--dataset`` specs of the training rows (``#N`` on a single path)."""
        if self.sample is not None and len(self.paths) == 1:
            return [f"{self.paths[0]}#{self.sample}"]
        return list(self.paths)


@dataclass
class DatasetInfo:
    """One training dataset as training sees it: its name, weight and number of rows (after
    the checks; a stream's: its size as declared or counted, None when not needed), its entry in
    the configuration (None for a plain ``--dataset`` run)."""

    name: str
    weight: float
    rows: int | None
    entry: DatasetEntry | None = None
    val_rows: int = 0


def _load_file(path: str) -> Any:
    if not os.path.isfile(path):
        raise ConfigError(path, None, None, "no such file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(path, None, None, f"cannot be read ({e})") from None
    if path.lower().endswith(".json"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(path, None, None, f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(path, None, None, f"not valid YAML ({problem}{at})") from None


def _paths(file: str, name: str, key: str, value: Any, base: str) -> list[str]:
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not values or not all(isinstance(v, str) and v.strip() for v in values):
        raise ConfigError(file, name, key, f"must be a file or folder, or a list of them, got {value!r}")
    def exists(p: str) -> bool:
        return os.path.exists(p) or os.path.exists(re.sub(r"#\d+$", "", p))

    out = []
    for v in values:
        v = os.path.expanduser(v.strip())
        tried = [v] if os.path.isabs(v) else [os.path.join(base, v), os.path.abspath(v)]
        found = next((p for p in tried if exists(p)), None)
        if found is None and looks_like_hub_id(re.sub(r"#\d+$", "", v)):
            out.append(v)
            continue
        if found is None:
            raise ConfigError(file, name, key, f"no such file or folder: {v!r} (a relative path is taken from the "
                                               f"configuration file's folder, {base}, then from the working directory), "
                                               "nor a hub dataset id (org/name[:subset])")
        out.append(os.path.normpath(found) if os.path.exists(found) else found)
    return out


def _system(file: str, name: str, key: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ConfigError(file, name, key, f"must be a string (the task instruction), got {value!r}")
    return value


def _infonce(file: str, name: str, value: Any, check: Callable[[Mapping[str, Any], str, str], Any] | None
             ) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(file, name, "infonce", f"must be a mapping of InfoNCE settings, got {value!r}")
    if check is not None:
        check(value, file, name)
    for key, raw in value.items():
        if raw is not None and not isinstance(raw, (bool, int, float, str)):
            raise ConfigError(file, name, f"infonce.{key}", f"must be a number, a boolean or null, got {raw!r}")
    return dict(value)


def read_dataset_config(path: str, check_infonce: Callable[[Mapping[str, Any], str, str], Any] | None = None
                        ) -> list[DatasetEntry]:
    """The datasets of a ``--dataset_config`` file, checked (the files and folders exist; no
    row is read).

    ``check_infonce(mapping, file, dataset)``: the check of each dataset's ``infonce`` keys,
    raising :class:`ConfigError` naming the key (training passes
    :func:`mmembed.losses.config.infonce_keys`: losses/ owns the keys); None: the mapping is
    kept as written, its keys checked when the dataset's loss is built.

    Raises:
        ConfigError: naming the file, the dataset (its name, or its position when it has no
            usable name) and the key.
    """
    file = os.path.abspath(os.path.expanduser(path))
    data = _load_file(file)
    base = os.path.dirname(file)
    if isinstance(data, dict):
        extra = sorted(set(data) - {"datasets"})
        if extra:
            raise ConfigError(file, None, extra[0], "unknown key; the file holds a list of datasets, or "
                                                    "{datasets: [...]}")
        data = data.get("datasets")
    if not isinstance(data, list) or not data:
        raise ConfigError(file, None, "datasets", "must be a non-empty list of datasets (each with name and path)")
    entries: list[DatasetEntry] = []
    seen: set[str] = set()
    for i, raw in enumerate(data):
        label = f"#{i + 1}"
        if not isinstance(raw, dict):
            raise ConfigError(file, label, None, f"must be a mapping (name, path, ...), got {raw!r}")
        name = raw.get("name")
        if isinstance(name, str) and name:
            label = name
        unknown = [k for k in raw if k not in KEYS]
        if unknown:
            raise ConfigError(file, label, str(unknown[0]), f"unknown key; known: {', '.join(KEYS)}")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ConfigError(file, label, "name", f"must be a name of letters, digits, '_' and '-' (it names the "
                                                   f"dataset's loss_<name> and eval_<name>_* numbers), got {name!r}")
        if name in seen:
            raise ConfigError(file, label, "name", "given to two datasets; names must be unique")
        seen.add(name)
        if "path" not in raw:
            raise ConfigError(file, label, "path", "missing: the dataset's file or folder (or a list of them)")
        paths = _paths(file, name, "path", raw["path"], base)
        sample = raw.get("sample")
        if sample is not None and (isinstance(sample, bool) or not isinstance(sample, int) or sample < 1):
            raise ConfigError(file, name, "sample", f"must be an integer >= 1 (rows to sample, ms-swift's #N), "
                                                    f"got {sample!r}")
        if sample is not None and any(re.search(r"#\d+$", p) for p in paths):
            raise ConfigError(file, name, "sample", "given with a path#N: give one of them")
        rows = raw.get("rows")
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise ConfigError(file, name, "rows", f"must be an integer >= 1 (the dataset's training rows, which "
                                                  f"--streaming's samplers draw by), got {rows!r}")
        weight = raw.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
            raise ConfigError(file, name, "weight", f"must be a number > 0, got {weight!r}")
        loss_kwargs = raw.get("loss_kwargs") or {}
        if not isinstance(loss_kwargs, dict):
            raise ConfigError(file, name, "loss_kwargs", f"must be a mapping of the loss's options, got {loss_kwargs!r}")
        val = _paths(file, name, "val", raw["val"], base) if raw.get("val") is not None else []
        entries.append(DatasetEntry(
            name=name, paths=paths, sample=sample, rows=rows, weight=float(weight),
            query_system=_system(file, name, "query_system", raw.get("query_system")),
            document_system=_system(file, name, "document_system", raw.get("document_system")),
            infonce=_infonce(file, name, raw.get("infonce"), check_infonce), loss_kwargs=dict(loss_kwargs), val=val,
        ))
    return entries
