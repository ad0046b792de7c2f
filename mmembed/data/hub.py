"""``--dataset ORG/NAME[:SUBSET][#N]``: a hub dataset loaded by its hub's own client, its rows
written once as JSONL for the reader.

The id is ms-swift's (:class:`~mmembed.data.specs.HubDataset`): ModelScope by default, Hugging
Face with ``--use_hf true`` or ``USE_HF=1`` (an ``hf::`` / ``ms::`` prefix decides for its
spec). Each split is loaded with ``datasets.load_dataset``: of the Hugging Face id, or of the
ModelScope dataset repository's files downloaded by modelscope's client (see
:func:`_load_split`; the clients download and cache; ``HF_HUB_OFFLINE=1`` reads their caches
only), then its rows
are mapped to mmembed's row forms (:mod:`mmembed.data.hub_columns`) and written to
``$MMEMBED_HUB_CACHE/<hub>/<org>/<name>/<subset>/<key>/<split>.jsonl`` (default
``$XDG_CACHE_HOME/mmembed/hub_datasets``, ``~/.cache/...``), one
line per row of the split (a row ms-swift's mapping drops is a blank line, which the reader
skips), with its embedded media as files beside it. The key hashes the id, subset, splits,
the loaded data's fingerprint (``datasets`` changes it when the hub's files change), the
mapping and ``--columns``, so a new revision or mapping is written anew and a second run
reads the files as they are.

From there the rows are the reader's like any JSONL file (:func:`~mmembed.data.load_samples`:
the up-front check, the Arrow cache, ``#N``, ``--strict``), except their name: each file is
read as ``hf::org/name[train]`` (``:subset`` when not ``default``), so an error reads
``hf::org/name[train]:3 field 'response': ...``, 3 being the row's number in the split
(``datasets``' index + 1).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

from ..environment import EnvironmentLike
from ..environment import read as read_environment
from ..errors import UsageError, one_line
from ..hub import INSTALL_MODELSCOPE, modelscope_endpoint, modelscope_not_found, offline_switched
from .hub_columns import SwiftDataset, SwiftSubset, positional_columns, swift_dataset, swift_renames
from .specs import HubDataset, SpecError

__all__ = ["HubFile", "DatasetHubOptions", "check_hub_client", "hub_files"]

logger = logging.getLogger("mmembed")

#: bump when the rows written for the same hub data change, so old files are not reused
_ROWS_VERSION = "mmembed-hub-rows-1"
_HUB_NAMES = {"hf": "Hugging Face", "ms": "ModelScope"}
_MEDIA_EXTENSIONS = {"image": ".png", "audio": ".wav", "video": ".mp4"}


@dataclass(frozen=True)
class DatasetHubOptions:
    """How hub dataset ids load: from Hugging Face (``use_hf``) or ModelScope, the token and
    ``download_mode`` passed to the client (ms-swift's ``--hub_token``, ``--download_mode``:
    ``reuse_dataset_if_exists`` or ``force_redownload``, which also writes the rows anew),
    ``datasets``' cache folder (None: its default), where the rows are written, and
    ``MAX_NEGATIVE_SAMPLES`` (TextCaps' reranker negatives); ``offline``: the offline switches
    (``HF_HUB_OFFLINE``, ``MMEMBED_OFFLINE``), under which a ModelScope dataset comes from
    modelscope's cache only."""

    use_hf: bool = False
    cache: str = field(default_factory=lambda: read_environment({}).hub.cache)
    token: str | None = None
    download_mode: str | None = None
    datasets_cache: str | None = None
    max_negative: int = 7
    offline: bool = False

    @classmethod
    def of(cls, use_hf: bool | None = None, environment: EnvironmentLike = None, **options: Any) -> DatasetHubOptions:
        """``--use_hf`` or ``USE_HF`` (either true: Hugging Face, as in ms-swift), the cache
        folder and ``MAX_NEGATIVE_SAMPLES`` from the environment, the rest as given."""
        env = read_environment(environment)
        return cls(use_hf=bool(use_hf) or env.hub.use_hf, cache=env.hub.cache,
                   max_negative=env.rerank_sampling.max_negative, offline=offline_switched(env), **options)

    def hub_of(self, dataset: HubDataset) -> str:
        """``"hf"`` or ``"ms"``: the spec's prefix, else ``use_hf``."""
        return dataset.hub or ("hf" if self.use_hf else "ms")


@dataclass(frozen=True)
class HubFile:
    """One split written as JSONL: its path and the name its rows are read under."""

    path: str
    name: str


def check_hub_client(dataset: HubDataset, options: DatasetHubOptions) -> None:
    """A UsageError, before anything loads, when ``dataset`` is a ModelScope id and the
    optional ``modelscope`` package is missing."""
    if options.hub_of(dataset) == "ms":
        _modelscope_download(dataset)


def hub_files(dataset: HubDataset, options: DatasetHubOptions, columns: dict[str, str] | None = None) -> list[HubFile]:
    """The JSONL files of ``dataset``'s subsets and splits (ms-swift's: each subset's splits in
    order, the subsets in the spec's order), written now unless the cache holds them.
    ``columns``: ``--columns``' renames, applied before the mapping (as ms-swift does).

    Raises:
        SpecError: the hub or the client could not give the split (naming the id, subset,
            split and the client's message), a subset mmembed does not read, or a mapping
            that finds its columns missing.
        UsageError: ``modelscope`` is missing for a ModelScope id.
    """
    hub = options.hub_of(dataset)
    entry, exact = swift_dataset(hub, dataset.repo_id)
    if entry is not None and not exact:
        logger.info("%s: read with the mapping of ms-swift's registered %s (the same dataset name, as ms-swift "
                    "matches it)", dataset, entry.name)
    subsets = _subsets(dataset, entry)
    # what datasets.load_dataset reads: the Hugging Face id, or the ModelScope repository's folder,
    # downloaded once for all its subsets and splits
    source = dataset.repo_id if hub == "hf" else _modelscope_folder(dataset, options)
    files = []
    for subset in subsets:
        files += _subset_files(dataset, hub, source, entry, subset, options, columns or {})
    return files


def _subsets(dataset: HubDataset, entry: SwiftDataset | None) -> list[SwiftSubset]:
    """ms-swift's choice of subsets (``DatasetLoader._select_subsets``): none named: the
    registered dataset's only subset or its ``default``; ``all``: every subset it registers."""
    names = list(dataset.subsets)
    if entry is None:
        names = ["default"] if not names or names == ["all"] else names
        return [SwiftSubset(name, name, ("train",)) for name in names]
    registered = [s.name for s in entry.subsets]
    if not names:
        if len(registered) > 1 and "default" not in registered:
            raise SpecError(f"dataset {dataset}: name a subset ({', '.join(registered)})")
        names = registered if len(registered) <= 1 else ["default"]
    elif names == ["all"] and "all" not in registered:
        names = registered
    subsets = [entry.subset(name) for name in names]
    refused = next((s for s in subsets if s.refused), None)
    if refused is not None:
        raise SpecError(f"dataset {dataset}: subset {refused.name!r} is {refused.refused}")
    return subsets


def _display(dataset: HubDataset, hub: str, subset: str, split: str) -> str:
    return f"{hub}::{dataset.repo_id}" + (f":{subset}" if subset != "default" else "") + f"[{split}]"


def _subset_files(dataset: HubDataset, hub: str, source: str, entry: SwiftDataset | None, subset: SwiftSubset,
                  options: DatasetHubOptions, columns: dict[str, str]) -> list[HubFile]:
    loaded = [(split, _load_split(dataset, hub, source, subset.hub_subset, split, options))
              for split in subset.splits or ("train",)]
    key = hashlib.sha256(json.dumps({
        "version": _ROWS_VERSION, "hub": hub, "id": dataset.repo_id, "subset": subset.name,
        "hub_subset": subset.hub_subset, "splits": [[s, getattr(ds, "_fingerprint", None)] for s, ds in loaded],
        "swift": entry.name if entry is not None else None, "columns": columns,
        "negatives": options.max_negative}, sort_keys=True).encode()).hexdigest()[:16]
    folder = os.path.join(options.cache, hub, *dataset.repo_id.split("/"), subset.name, key)
    names = {split: _display(dataset, hub, subset.name, split) for split, _ in loaded}
    files = [HubFile(os.path.join(folder, f"{split}.jsonl"), names[split]) for split, _ in loaded]
    complete = os.path.join(folder, ".complete")  # written last: the folder's rows are whole
    if os.path.isfile(complete) and options.download_mode != "force_redownload":
        return files
    os.makedirs(folder, exist_ok=True)
    if os.path.exists(complete):
        os.remove(complete)
    mapper = subset.mapper(options.max_negative) if subset.mapper is not None else None
    for (split, ds), file in zip(loaded, files):
        # media go to their place at once (the same bytes under the same name, whoever writes them);
        # each JSONL file is written aside and moved in whole
        fd, work = tempfile.mkstemp(prefix=f".{split}-", suffix=".tmp", dir=folder)
        os.close(fd)
        try:
            _write_split(ds, work, os.path.join(folder, "media", split), names[split], columns,
                         dict(subset.columns) if entry is not None else None, mapper)
            os.replace(work, file.path)
        finally:
            if os.path.exists(work):
                os.remove(work)
    with open(complete, "w", encoding="utf-8") as f:
        f.write(json.dumps({"id": dataset.repo_id, "hub": hub, "subset": subset.name, "splits": list(names)}) + "\n")
    logger.info("%s: %s rows written to %s", ", ".join(names.values()), ", ".join(str(len(ds)) for _, ds in loaded),
                folder)
    return files


# ----------------------------------------------------------------------------- the clients


def _load_split(dataset: HubDataset, hub: str, source: str, subset: str, split: str, options: DatasetHubOptions):
    """One split as a ``datasets.Dataset``, from the hub's client; a SpecError naming it.

    ``source`` is what ``datasets.load_dataset`` reads. Hugging Face: the id. ModelScope: the
    folder of the dataset repository's files, downloaded by modelscope's own client
    (:func:`_modelscope_folder`), read with the subset and split: what ``MsDataset.load`` does for a repository of data files (ModelScope's
    "general" datasets, which its builder hands to the same ``datasets`` loader with the same
    configs and split patterns), without MsDataset itself, which requires ``datasets<=4.8.4``
    (modelscope's ``datasets`` extra) and fails on ``datasets`` 5."""
    import datasets

    where = f"{_HUB_NAMES[hub]} dataset {dataset.repo_id} (subset {subset!r}, split {split!r})"
    try:
        token = {"token": options.token} if hub == "hf" else {}  # a local folder needs none
        ds = datasets.load_dataset(source, name=subset, split=split, download_mode=options.download_mode,
                                   cache_dir=options.datasets_cache, **token)
    except (UsageError, SpecError):
        raise
    except Exception as e:  # noqa: BLE001 (the clients raise many kinds; each is the user's data or network)
        text = " ".join(str(e).split())
        hint = "" if hub == "hf" or dataset.hub else \
            " (ModelScope is the default hub, as in ms-swift: --use_hf true or USE_HF=1 loads from Hugging Face)"
        raise SpecError(f"dataset {dataset}: {_not_local(dataset)}{where} could not be loaded: {type(e).__name__}: "
                        f"{text[:400]}{hint}") from None
    if not isinstance(ds, datasets.Dataset):
        raise SpecError(f"dataset {dataset}: {where} came as a {type(ds).__name__}, not a dataset of rows")
    return ds


def _modelscope_download(dataset: HubDataset):
    """modelscope's ``snapshot_download``; a UsageError when the package is missing."""
    try:
        from modelscope import snapshot_download
    except ImportError:
        raise UsageError(f"dataset {dataset}: {_not_local(dataset)}a ModelScope id (the default hub, as in ms-swift), "
                         f"and the optional modelscope package is not installed: {INSTALL_MODELSCOPE}") from None
    return snapshot_download


def _modelscope_folder(dataset: HubDataset, options: DatasetHubOptions) -> str:
    """The local folder of ModelScope dataset ``dataset`` (its default branch, ``master``, as
    ms-swift loads it): modelscope's ``snapshot_download`` (``repo_type="dataset"``, into
    ``MODELSCOPE_CACHE``) now or, offline, from the cache; a SpecError of one line
    for an id the hub does not have, an unreachable hub, or an empty cache offline."""
    download = _modelscope_download(dataset)
    named = f"dataset {dataset}: {_not_local(dataset)}"
    try:
        folder = download(dataset.repo_id, repo_type="dataset", revision="master", token=options.token,
                          local_files_only=options.offline)
    except Exception as e:  # noqa: BLE001 (modelscope's errors have no common base: reported in one line)
        what = one_line(e)[:300]
        if options.offline:
            raise SpecError(f"{named}ModelScope dataset {dataset.repo_id} is not in the ModelScope cache "
                            f"(MODELSCOPE_CACHE) and the offline switches (HF_HUB_OFFLINE / MMEMBED_OFFLINE) allow no "
                            f"download ({what}): load it once online") from None
        where = f"ModelScope ({modelscope_endpoint()})"
        if modelscope_not_found(e):
            raise SpecError(f"{named}{dataset.repo_id} is no dataset of {where}: check the id (ModelScope is the "
                            "default hub, as in ms-swift: --use_hf true or USE_HF=1 loads from Hugging Face); if it "
                            "is private, pass --hub_token or set MODELSCOPE_API_TOKEN") from None
        raise SpecError(f"{named}{where} could not give dataset {dataset.repo_id} ({type(e).__name__}: {what}): check "
                        "the network (MODELSCOPE_ENDPOINT for a mirror), or pass --use_hf true for Hugging Face's") \
            from None
    if not (os.path.isdir(folder) and os.listdir(folder)):
        raise SpecError(f"{named}ModelScope ({modelscope_endpoint()}) lists no files of dataset {dataset.repo_id}")
    return folder


def _not_local(dataset: HubDataset) -> str:
    """For an id without a prefix, which may be a local path mistyped: say it is not one."""
    return "" if dataset.hub else "not a local file or folder, so "


# ----------------------------------------------------------------------------- writing the rows


def _write_split(ds, path: str, media_dir: str, name: str, columns: dict[str, str],
                 swift_columns: dict[str, str] | None, mapper) -> None:
    """Write ``ds``'s rows to ``path``, one line per row (a dropped row: a blank line): media
    as files, ``columns`` renamed, then the registered mapping (``swift_columns`` and
    ``mapper``; None: the dataset's own columns, read by name or in sentence-transformers'
    column order)."""
    media = _media_columns(ds.features)
    names = list(ds.column_names)
    renames = {c: columns[c] for c in names if c in columns}
    names = [renames.get(c, c) for c in names]
    if swift_columns is not None:
        more = swift_renames(names, swift_columns)
        renames = {old: more.get(new, new) for old, new in {c: renames.get(c, c) for c in ds.column_names}.items()}
        final = [renames.get(c, c) for c in ds.column_names]
        missing = [c for c in (mapper.needs if mapper is not None else ()) if c not in final]
        if missing:
            raise SpecError(f"dataset {name}: ms-swift's mapping of this dataset reads the column(s) "
                            f"{', '.join(missing)}, which it does not have (its columns: {', '.join(ds.column_names)}); "
                            "--columns renames them")
    else:
        text = {c for c, f in ds.features.items() if _is_text(f)}
        order = positional_columns(names, {renames.get(c, c) for c in text})
        if order:
            logger.info("%s: columns %s read in sentence-transformers' order as %s", name, ", ".join(order),
                        ", ".join(order.values()))
            renames = {c: order.get(renames.get(c, c), renames.get(c, c)) for c in ds.column_names}
    if mapper is not None:
        mapper.prepare(lambda column: ds[_source_column(renames, column)])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        index = 0
        for table in ds.with_format("arrow").iter(batch_size=1000):
            for raw in table.to_pylist():
                row = {}
                for column, value in raw.items():
                    if column in media:
                        value = _media_value(value, media[column], media_dir, index, column)
                    row[renames.get(column, column)] = value
                if mapper is not None:
                    row = mapper(row)
                f.write("\n" if row is None else json.dumps(row, ensure_ascii=False, default=_plain) + "\n")
                index += 1


def _source_column(renames: dict[str, str], column: str) -> str:
    return next((old for old, new in renames.items() if new == column), column)


def _is_text(feature) -> bool:
    return getattr(feature, "dtype", None) in ("string", "large_string")


def _media_columns(features) -> dict[str, str]:
    """The columns holding images, audio or video (alone or in a list) -> their kind."""
    import datasets

    kinds = {datasets.Image: "image", datasets.Audio: "audio"}
    if hasattr(datasets, "Video"):
        kinds[datasets.Video] = "video"

    def kind(feature) -> str | None:
        for cls, name in kinds.items():
            if isinstance(feature, cls):
                return name
        inner = feature[0] if isinstance(feature, list) and feature else getattr(feature, "feature", None)
        return kind(inner) if inner is not None else None

    return {column: k for column, feature in features.items() if (k := kind(feature)) is not None}


def _media_value(value: Any, kind: str, folder: str, index: int, column: str) -> Any:
    """An undecoded medium (``{"bytes": ..., "path": ...}``, or a list of them) as a path: its
    bytes written to ``folder`` (named by the row and column), or its own path when it names a
    file here and has no bytes; the path as given otherwise (the reader reports it)."""
    if isinstance(value, list):
        return [_media_value(v, kind, folder, index, f"{column}-{k}") for k, v in enumerate(value)]
    if not isinstance(value, dict):
        return value
    data, path = value.get("bytes"), value.get("path")
    if not data:
        return path
    ext = os.path.splitext(path or "")[1].lower() or _sniff(data, kind)
    os.makedirs(folder, exist_ok=True)
    out = os.path.join(folder, f"{index}-{column}{ext}")
    with open(out, "wb") as f:
        f.write(data)
    return out


def _sniff(data: bytes, kind: str) -> str:
    if kind == "image":
        import io

        from PIL import Image

        try:
            with Image.open(io.BytesIO(data)) as image:
                return "." + (image.format or "png").lower().replace("jpeg", "jpg")
        except Exception:  # noqa: BLE001 (not an image: the reader reports the file)
            pass
    return _MEDIA_EXTENSIONS[kind]


def _plain(value: Any) -> Any:
    """JSON for what Arrow gives besides JSON's types: numbers and arrays of numpy, dates as
    text; raw bytes (a binary column the reader has no use for) as null."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "isoformat"):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray)):
        return None
    return str(value)
