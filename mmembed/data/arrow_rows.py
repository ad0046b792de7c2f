"""The Arrow build of :mod:`mmembed.data.dataset`'s samples: a ``datasets`` builder whose
generator reads the data files' rows (each parsed by :func:`~mmembed.data.rows.parse_row`, or
a block at a time by Arrow's JSON parser for plain ``.jsonl`` rows) and writes tables of
:data:`_TABLE_ROWS` rows, a bad row as an ``error`` row; ``num_proc`` processes parse byte
ranges of a file. :func:`_build` builds (or opens from the ``datasets`` cache) the table of
one set of files."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import inspect
import json
import os
from typing import Any

from .columnar import plain_samples
from .formats import decode_jsonl_line, iter_rows_or_errors, jsonl_lines
from .labels import LabelRule
from .paths import MediaFileError
from .rows import parse_row
from .sample import DataError, Sample


def _features():
    import datasets

    return datasets.Features(
        {
            "sample": datasets.Value("string"),
            "source": datasets.Value("string"),
            "line": datasets.Value("int64"),
            "error": datasets.Value("string"),
            "remote": datasets.Value("bool"),  # a media reference names a URL (the remote media phase reads only these)
        }
    )


def _generate(shards: list[tuple], strict: bool, verify_images: bool, version: str, work_dir: str,
              columns: dict[str, str] | None = None, label_rule: dict | None = None,
              media_kinds: tuple[str, ...] | None = None, root_image_dir: str = "", several_positives: bool = False,
              sources: dict[str, str] | None = None):
    """Arrow rows for the given file shards, one at a time (a stream's rows); a bad row becomes
    an ``error`` row.

    ``version`` only feeds the cache fingerprint; ``work_dir`` is where relative media paths
    are tried besides the data file's folder, and ``root_image_dir`` (ms-swift's
    ``ROOT_IMAGE_DIR``, "" when unset) too (so both key the cache); ``columns`` renames
    row fields (old -> new) before a row is read; ``label_rule`` (a :class:`LabelRule` as a
    dict), ``media_kinds`` and ``several_positives`` are :func:`parse_row`'s. ``sources``: the
    name a file's rows are read under when it is not its path (a hub dataset's split,
    :mod:`mmembed.data.hub`). With ``strict`` a shard stops at its first bad row (the caller
    raises it).
    """
    del version
    read = _RowReader(work_dir, columns, label_rule, media_kinds, root_image_dir, several_positives, verify_images)
    for path, _mtime_ns, _size, shard, num_shards in shards:
        source = (sources or {}).get(path, path)
        for line, raw in iter_rows_or_errors(path, shard, num_shards):
            row = read(path, line, raw, source)
            yield row
            if strict and row["error"] is not None:
                return


class _RowReader:
    """One raw row (or the DataError of a line that holds none) -> its Arrow row (the
    sample's JSON, or an ``error`` row), as :func:`_generate` describes."""

    def __init__(self, work_dir: str, columns: dict[str, str] | None, label_rule: dict | None,
                 media_kinds: tuple[str, ...] | None, root_image_dir: str, several_positives: bool, verify_images: bool):
        self.work_dir, self.columns, self.root_image_dir = work_dir, columns, root_image_dir
        self.rule = LabelRule.from_dict(label_rule) if label_rule else None
        self.kinds = frozenset(media_kinds) if media_kinds is not None else None
        self.several_positives, self.verify_images = several_positives, verify_images

    def __call__(self, path: str, line: int, raw: Any, source: str | None = None) -> dict:
        """``source``: the name the file's rows are read under, when not its path (a hub
        dataset's split); media paths are still found beside the file."""
        source = source or path
        if isinstance(raw, DataError):
            err = DataError(source, raw.line, raw.field, raw.reason) if raw.source == path != source else raw
        else:
            if self.columns and isinstance(raw, dict):
                raw = {self.columns.get(k, k): v for k, v in raw.items()}
            try:
                sample = parse_row(raw, source, line, os.path.dirname(path), verify_images=self.verify_images,
                                   work_dir=self.work_dir, root_image_dir=self.root_image_dir, label_rule=self.rule,
                                   media_kinds=self.kinds, several_positives=self.several_positives)
            except DataError as e:
                err = e
            except RecursionError:  # raised inside datasets' generator it would become its own error
                err = DataError(source, line, None, "row nested too deeply to read")
            else:
                return {"sample": sample.to_json(), "source": source, "line": line, "error": None,
                        "remote": _names_a_url(sample)}
        return {
            "sample": None,
            "remote": False,
            "source": err.source,
            "line": err.line,
            "error": json.dumps({"field": err.field, "reason": err.reason, "media": isinstance(err, MediaFileError)},
                                ensure_ascii=False),
        }


_COLUMNS = ("sample", "source", "line", "error", "remote")


def _generate_blocks(shards: list[tuple], strict: bool, verify_images: bool, version: str, work_dir: str,
                     columns: dict[str, str] | None = None, label_rule: dict | None = None,
                     media_kinds: tuple[str, ...] | None = None, root_image_dir: str = "",
                     several_positives: bool = False, sources: dict[str, str] | None = None):
    """:func:`_generate`'s rows, the same, in order, as blocks of columns (``{column: values}``
    of up to :data:`_TABLE_ROWS` rows). The plain rows of a ``.jsonl`` file are read a block at a
    time by Arrow's JSON parser (:func:`~mmembed.data.columnar.plain_samples`; not with ``columns``),
    the others as :func:`_generate` reads them."""
    read = _RowReader(work_dir, columns, label_rule, media_kinds, root_image_dir, several_positives, verify_images)
    for path, _mtime_ns, _size, shard, num_shards in shards:
        source = (sources or {}).get(path, path)  # (a hub dataset's split: the name its rows are read under)
        arrow = not columns and os.path.splitext(path)[1].lower() == ".jsonl"
        if arrow:  # (line, bytes) of the non-blank lines
            batches = (rows[i:i + _TABLE_ROWS] for rows in jsonl_lines(path, shard, num_shards)
                       for i in range(0, len(rows), _TABLE_ROWS))
        else:  # (line, row or DataError)
            batches = _batched(iter_rows_or_errors(path, shard, num_shards))
        for rows in batches:
            plain = None
            if arrow:  # the plain rows read by Arrow's parser, the others as _generate reads them
                plain = plain_samples(source, rows, label_rule=read.rule, several_positives=several_positives)
                if plain.null_count == 0:
                    n = len(rows)
                    yield {"sample": plain, "source": [source] * n, "line": [line for line, _ in rows],
                           "error": [None] * n, "remote": [False] * n}
                    continue
                plain = plain.to_pylist()
            block: dict[str, list] = {k: [] for k in _COLUMNS}
            for i, (line, raw) in enumerate(rows):
                if plain is not None and plain[i] is not None:
                    row = {"sample": plain[i], "source": source, "line": line, "error": None, "remote": False}
                else:
                    row = read(path, line, decode_jsonl_line(path, line, raw) if arrow else raw, source)
                for k in _COLUMNS:
                    block[k].append(row[k])
                if strict and row["error"] is not None:
                    yield block
                    return
            yield block


def _batched(rows):
    """``rows`` in lists of :data:`_TABLE_ROWS`."""
    batch = []
    for row in rows:
        batch.append(row)
        if len(batch) >= _TABLE_ROWS:
            yield batch
            batch = []
    if batch:
        yield batch


def _names_a_url(sample: Sample) -> bool:
    """Whether a media reference of ``sample`` holds ``://`` (the rows the remote media phase
    decodes: a superset of those naming a URL; a text that mentions one is not media)."""
    return any("://" in r for it in (sample.anchor, *sample.positives, *sample.negatives)
               for refs in (it.images, it.videos, it.audios) for ref in refs
               for r in (ref if isinstance(ref, (list, tuple)) else [ref]) if isinstance(r, str))


#: rows per Arrow table the parse writes (one table per batch, not one encoded example per row)
_TABLE_ROWS = 2048


def _rows_builder_class():
    """A ``datasets`` builder that writes :func:`_generate`'s rows as Arrow tables of
    :data:`_TABLE_ROWS` rows (:func:`_generate_blocks`): ``datasets``' own ``Generator`` builder encodes every row as
    one example (a quarter of the parse's time); the cache, the sharding of ``shards``
    over ``num_proc`` processes and the progress bar are ``datasets``' as before."""
    import datasets
    import pyarrow as pa
    try:
        from datasets.builder import Key  # newer datasets read a table's shard from its key
    except ImportError:  # older ones (3.x) do not read the key
        def Key(shard: int, index: int) -> tuple[int, int]:  # noqa: N802 (stands in for the class)
            return shard, index
    from datasets.packaged_modules.generator.generator import GeneratorConfig
    from datasets.utils.sharding import _number_of_shards_in_gen_kwargs, _split_gen_kwargs

    class MmembedRows(datasets.ArrowBasedBuilder):
        BUILDER_CONFIG_CLASS = GeneratorConfig

        def _info(self):
            info = datasets.DatasetInfo(features=self.config.features)
            expected = _expected_rows(self.config.gen_kwargs["shards"])
            if expected:  # the progress bar's total (hence its ETA); the split's real size replaces it
                info.splits = datasets.SplitDict()
                info.splits.add(datasets.SplitInfo(name=str(self.config.split), num_examples=expected))
            return info

        def _split_generators(self, dl_manager):
            return [datasets.SplitGenerator(name=self.config.split, gen_kwargs=self.config.gen_kwargs)]

        def _generate_tables(self, **gen_kwargs):
            schema = self.config.features.arrow_schema
            num_shards = _number_of_shards_in_gen_kwargs(gen_kwargs)
            for shard_idx, shard_kwargs in enumerate(_split_gen_kwargs(gen_kwargs, max_num_jobs=num_shards)):
                for table_idx, columns in enumerate(_generate_blocks(**shard_kwargs)):
                    yield Key(shard_idx, table_idx), pa.Table.from_pydict(columns, schema=schema)

    return MmembedRows


def _expected_rows(shards: list[tuple]) -> int:
    """About how many rows the shards hold, for the parse's progress bar: the lines of the
    ``.jsonl`` files (a blank line is counted but yields no row) and the rows of the
    ``.parquet`` files; 0 (no total) when a file of another format is among them."""
    total = 0
    for path, _mtime, size, shard, _n in shards:
        if shard:
            continue
        ext = os.path.splitext(path)[1].lower()
        if ext == ".parquet":
            import pyarrow.parquet as pq

            total += pq.ParquetFile(path).metadata.num_rows
        elif ext == ".jsonl":
            with open(path, "rb") as f:
                total += _count_lines(f, size)
        else:
            return 0
    return total


def _count_lines(f, size: int) -> int:
    count, last = 0, b"\n"
    while chunk := f.read(1 << 24):
        count += chunk.count(b"\n")
        last = chunk[-1:]
    return count + (last != b"\n" and size > 0)


@contextlib.contextmanager
def shared_heap(forking: bool = True):
    """While ``forking`` (a pool of forked processes is about to start), the Python objects
    made so far are kept out of the garbage collector's reach (``gc.freeze``): a forked child
    then shares the parent's heap pages (torch, transformers and the rest imported) instead of
    copying each page its collections would write to; its own objects are collected as usual."""
    if not forking:
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _build(gen_kwargs: dict, cache_dir: str | None, num_proc: int, force: bool):
    import datasets

    fingerprint = hashlib.sha256(json.dumps(gen_kwargs, sort_keys=True).encode()).hexdigest()[:32]
    num_proc = min(num_proc, len(gen_kwargs["shards"]))  # one process per shard at most (datasets warns otherwise)
    named = {}
    if "config_id" in inspect.signature(datasets.DatasetBuilder.__init__).parameters:
        named["config_id"] = "mmembed-rows-fingerprint=" + fingerprint
    # (datasets 3.x takes no config_id: it names the cache by hashing these arguments, gen_kwargs
    # with every file's path, size and modification time among them)
    builder = _rows_builder_class()(cache_dir=cache_dir, features=_features(), generator=_generate,
                                    gen_kwargs=gen_kwargs, **named)
    try:
        # no_checks: the split's size recorded before the parse is an estimate (the bar's total)
        with shared_heap(num_proc > 1):
            builder.download_and_prepare(download_mode="force_redownload" if force else None,
                                         verification_mode="no_checks", num_proc=num_proc if num_proc > 1 else None)
        ds = builder.as_dataset(split=builder.config.split)
    except ValueError as e:
        if "corresponds to no data" not in str(e):
            raise
        # The files hold no rows at all; datasets cannot build a split from nothing.
        return datasets.Dataset.from_dict({k: [] for k in _features()}, features=_features())
    ds._fingerprint = fingerprint
    return ds
