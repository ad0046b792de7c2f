"""Read one data file and turn each row into a :class:`~mmembed.data.sample.Sample`.

Two layers, usable separately:

* :func:`iter_raw_rows` streams the rows of a ``.jsonl``, ``.json``, ``.csv``/``.tsv`` or
  ``.parquet`` file, each with the line it starts on, so that every later error can name
  ``file:line``.
* :func:`parse_row` detects the row form (ms-swift's query form or messages form), checks it
  against the data contract and binds media paths to media tags.

Row forms (detected per row)
----------------------------
**Query form** (ms-swift <= 3.8)::

    {"query": "<image>", "response": "A dog on grass", "images": ["dog.png"],
     "rejected_response": ["A cat"], "label": 1.0, "system": "..."}

``query`` is the anchor, ``response`` the positive, ``rejected_response`` (absent, a string
or a list of any length) the hard negatives. The paths in ``images`` bind to the ``<image>``
tags in order: first the tags in the query, then the response, then each rejected response;
likewise ``videos``/``<video>`` and ``audios``/``<audio>``. A ``system`` applies to every
member of the group, as in ms-swift (which copies the whole conversation for the anchor,
the positive and each negative).

Column aliases accepted in the query form (sentence-transformers and common names):

=====================  ==========================================================
canonical              aliases
=====================  ==========================================================
``query``              ``anchor``, ``sentence1``, ``question``, ``prompt``
``response``           ``positive``, ``sentence2``, ``answer``
``rejected_response``  ``negative``, ``negatives``, ``negative_1``, ``negative_2``, ...
``label``              ``score``
``system``             ``system_prompt``
``images``             ``image`` (also in the messages form; ``video``, ``audio`` alike)
=====================  ==========================================================

A row that names the same field twice (``query`` and ``anchor``) is an error.

**Messages form** (ms-swift >= 3.9)::

    {"messages": [{"role": "user", "content": "<image>a photo"}], "images": ["a.png"],
     "positive_messages": [[{"role": "user", "content": "a dog"}]],
     "negative_messages": [[{"role": "user", "content": "<image>"}], [...]],
     "negative_images": [["cat.png"], []], "label": 0.8}

Each group (``messages``, ``positive_messages[k]``, ``negative_messages[k]``) becomes one
item: its system message becomes ``Item.system``; the contents of its user and assistant
messages are joined with ``"\\n"`` in order (empty contents are left out). Media bind per
group: the n-th tag in the group takes the group's n-th path (``images`` for the anchor,
``positive_images[k]``, ``negative_images[k]``; videos and audios alike). Exactly one
positive group is required, as in ms-swift.

OpenAI-style content parts are accepted: ``{"type": "text", "text": ...}`` contributes its
text; ``{"type": "image", "image": PATH}``, ``{"type": "image_url", "image_url": {"url":
PATH}}`` (video/audio alike, plus ``{"type": "input_audio", "input_audio": {"data": B64,
"format": "wav"}}``) becomes a tag in place with its own path bound at that position. A
media part without a path (``{"type": "image"}``, the Hugging Face chat-template style) is a
placeholder like a literal ``<image>`` tag and takes the next path from the group's list.
Parts of one message are concatenated without separator.

A messages row without ``positive_messages`` whose last message is an assistant reply is
read as ms-swift 3.x's standard format (the query form after conversion): the assistant
reply is the positive, the messages before it are the anchor, ``rejected_response`` holds
the negatives, and ``images`` bind in order across all of them, like the query form.

Media paths
-----------
Relative paths resolve against ``base_dir`` (the data file's folder); ``~`` expands;
``file://`` URIs become paths. ``http(s)://`` URLs and ``data:`` URIs are kept as they are
(fetched later). Every local path must exist; local images must be readable by PIL (header
only) unless ``verify_images=False``. An inline image ``{"bytes": ..., "path": ...}`` (a
Hugging Face ``Image`` column read from parquet) becomes a ``data:`` URI.
"""

from __future__ import annotations

import base64
import csv
import functools
import json
import math
import os
import re
import stat
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlparse
from urllib.request import url2pathname

from .sample import MEDIA_KINDS, DataError, Item, Sample

__all__ = ["DATA_EXTENSIONS", "MediaFileError", "iter_raw_rows", "parse_row", "read_file"]

#: File extensions read by :func:`iter_raw_rows` (and picked from a folder by the loader).
DATA_EXTENSIONS = (".jsonl", ".json", ".csv", ".tsv", ".parquet")

_TAG_RE = re.compile(r"<(image|video|audio)>")
_UTF8_BOM = b"\xef\xbb\xbf"

# CSV cells of these columns are decoded when they hold JSON (see _csv_cell).
_GROUP_KEYS = ("messages", "conversations", "conversation", "positive_messages", "negative_messages")
_MEDIA_KEYS = (
    tuple(f"{prefix}{kind}s" for prefix in ("", "positive_", "negative_") for kind in MEDIA_KINDS) + MEDIA_KINDS
)
_TEACHER_KEYS = ("teacher_scores", "teacher_embeddings")
_LIST_KEYS = frozenset(("rejected_response", "negative", "negatives") + _GROUP_KEYS + _MEDIA_KEYS + _TEACHER_KEYS)
_NUMBER_KEYS = frozenset(("label", "score"))

_QUERY_ALIASES = {
    "query": ("query", "anchor", "sentence1", "question", "prompt"),
    "response": ("response", "positive", "sentence2", "answer"),
    "label": ("label", "score"),
    "system": ("system", "system_prompt"),
}
_NEGATIVE_KEYS = ("rejected_response", "negative", "negatives")
_NEGATIVE_N_RE = re.compile(r"negative_(\d+)")
_MESSAGES_KEYS = ("messages", "conversations", "conversation")
_NEW_FORM_KEYS = ("positive_messages", "negative_messages") + tuple(
    f"{prefix}_{kind}s" for prefix in ("positive", "negative") for kind in MEDIA_KINDS
)
_ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "bot": "assistant",
}


class MediaFileError(DataError):
    """A local media file that is missing or unreadable: unlike every other row error it
    depends on files outside the data file, so a cached verdict may go stale."""


# ----------------------------------------------------------------------------- file reading


def iter_raw_rows(path: str) -> Iterator[tuple[int, Any]]:
    """Stream the rows of one data file as ``(line, row)``, ``line`` 1-based.

    * ``.jsonl``: one JSON value per line; ``line`` is the line in the file; blank lines are
      skipped.
    * ``.json``: a JSON array (``line`` is where each element starts), or JSON Lines content,
      or whitespace-separated JSON objects (e.g. one pretty-printed object).
    * ``.csv`` / ``.tsv``: a header row, then one row per record; ``line`` is the line the
      record starts on. Empty cells are absent fields (except text columns, which stay
      ``""``); cells of list columns (``rejected_response``, ``images``, ``messages``, ...)
      that start with ``[`` are decoded as JSON; ``label``/``score`` cells become floats
      when they parse as numbers (otherwise :func:`parse_row` reports them).
    * ``.parquet``: ``line`` is the 1-based row number.

    Rows are usually dicts; a JSON value that is not an object is yielded as it is so that
    :func:`parse_row` can report it. Raises :class:`DataError` (naming file, line and the
    parse problem) at the first row that cannot be parsed at all.
    """
    for line, row in _iter_rows(path):
        if isinstance(row, DataError):
            raise row
        yield line, row


def _iter_rows(path: str, shard: int = 0, num_shards: int = 1) -> Iterator[tuple[int, Any]]:
    """Like :func:`iter_raw_rows` but yields a :class:`DataError` in place of a bad row, then
    goes on where the format allows it (JSONL, CSV); for a broken JSON document it stops.

    ``shard``/``num_shards`` split a ``.jsonl`` file into byte ranges aligned to line starts
    (other formats are read whole by shard 0 and yield nothing for the other shards).
    """
    ext = _extension(path)
    if ext not in DATA_EXTENSIONS:
        yield (
            0,
            DataError(
                path,
                0,
                None,
                f"unsupported file type {ext or '(none)'!r}; expected one of {', '.join(DATA_EXTENSIONS)}",
            ),
        )
        return
    if ext != ".jsonl" and shard != 0:
        return
    try:
        if ext == ".jsonl":
            yield from _iter_jsonl(path, shard, num_shards)
        elif ext == ".json":
            yield from _iter_json(path)
        elif ext == ".parquet":
            yield from _iter_parquet(path)
        else:
            yield from _iter_csv(path, "\t" if ext == ".tsv" else ",")
    except OSError as e:
        yield 0, DataError(path, 0, None, f"cannot read file: {e}")


def _extension(path: str) -> str:
    return os.path.splitext(path)[1].lower()


def _json_error(path: str, line: int, e: json.JSONDecodeError, what: str = "invalid JSON") -> DataError:
    return DataError(path, line, None, f"{what}: {e.msg} (column {e.colno})")


def _count_newlines(f, end: int) -> int:
    f.seek(0)
    count, left = 0, end
    while left > 0:
        chunk = f.read(min(left, 1 << 24))
        if not chunk:
            break
        count += chunk.count(b"\n")
        left -= len(chunk)
    return count


def _align_to_line(f, offset: int, size: int) -> int:
    """The first line start at or after ``offset`` (0 and ``size`` map to themselves)."""
    if offset <= 0:
        return 0
    if offset >= size:
        return size
    f.seek(offset - 1)
    f.readline()
    return f.tell()


def _iter_jsonl(path: str, shard: int = 0, num_shards: int = 1) -> Iterator[tuple[int, Any]]:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        start = _align_to_line(f, size * shard // num_shards, size)
        end = _align_to_line(f, size * (shard + 1) // num_shards, size)
        line = _count_newlines(f, start) + 1 if start else 1
        f.seek(start)
        pos = start
        while pos < end:
            raw = f.readline()
            if not raw:
                break
            pos += len(raw)
            n, line = line, line + 1
            if n == 1 and raw.startswith(_UTF8_BOM):
                raw = raw[len(_UTF8_BOM) :]
            raw = raw.strip()
            if not raw:
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield n, DataError(path, n, None, f"line is not valid UTF-8: {e.reason} at byte {e.start}")
                continue
            try:
                yield n, json.loads(text)
            except json.JSONDecodeError as e:
                yield n, _json_error(path, n, e)


class _LineCounter:
    """Maps increasing character offsets of ``text`` to 1-based line numbers."""

    def __init__(self, text: str):
        self.text, self.pos, self.line = text, 0, 1

    def __call__(self, pos: int) -> int:
        self.line += self.text.count("\n", self.pos, pos)
        self.pos = pos
        return self.line


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    return i


def _iter_json(path: str) -> Iterator[tuple[int, Any]]:
    with open(path, "rb") as f:
        data = f.read()
    if data.startswith(_UTF8_BOM):
        data = data[len(_UTF8_BOM) :]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        yield line, DataError(path, line, None, f"file is not valid UTF-8: {e.reason} at byte {e.start}")
        return
    del data
    i = _skip_ws(text, 0)
    if i == len(text):
        return
    if text[i] == "[":
        yield from _iter_json_array(path, text, i)
        return
    eol = text.find("\n", i)
    try:
        json.loads(text[i : eol if eol >= 0 else len(text)])
        jsonl = True
    except json.JSONDecodeError:
        jsonl = False
    if jsonl:
        del text
        # JSON Lines content in a .json file: read line by line so one bad line does not
        # hide the rest.
        yield from _iter_jsonl(path)
        return
    yield from _iter_json_values(path, text, i)


def _iter_json_array(path: str, text: str, i: int) -> Iterator[tuple[int, Any]]:
    decoder = json.JSONDecoder()
    line_at = _LineCounter(text)
    n = len(text)
    i = _skip_ws(text, i + 1)
    index = 0
    if i < n and text[i] == "]":
        i += 1
    else:
        while True:
            start = i
            try:
                value, end = decoder.raw_decode(text, i)
            except json.JSONDecodeError as e:
                yield (
                    line_at(e.pos),
                    _json_error(
                        path, line_at(e.pos), e, f"invalid JSON in array element {index} (rest of file not read)"
                    ),
                )
                return
            yield line_at(start), value
            index += 1
            i = _skip_ws(text, end)
            if i < n and text[i] == ",":
                i = _skip_ws(text, i + 1)
                continue
            if i < n and text[i] == "]":
                i += 1
                break
            line = line_at(min(i, n))
            yield (
                line,
                DataError(
                    path,
                    line,
                    None,
                    f"invalid JSON: expected ',' or ']' after array element {index - 1} (rest of file not read)",
                ),
            )
            return
    i = _skip_ws(text, i)
    if i < n:
        line = line_at(i)
        yield line, DataError(path, line, None, "invalid JSON: unexpected content after the closing ']'")


def _iter_json_values(path: str, text: str, i: int) -> Iterator[tuple[int, Any]]:
    decoder = json.JSONDecoder()
    line_at = _LineCounter(text)
    n = len(text)
    while i < n:
        try:
            value, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            yield line_at(e.pos), _json_error(path, line_at(e.pos), e, "invalid JSON (rest of file not read)")
            return
        yield line_at(i), value
        i = _skip_ws(text, end)


def _iter_csv(path: str, delimiter: str) -> Iterator[tuple[int, Any]]:
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f, delimiter=delimiter)
        try:
            header = next(reader, None)
            if header is None:
                return
            header = [h.strip() for h in header]
            done = reader.line_num
            for cells in reader:
                line, done = done + 1, reader.line_num
                if not cells:
                    continue
                if len(cells) > len(header):
                    yield (
                        line,
                        DataError(
                            path, line, None, f"row has {len(cells)} cells but the header has {len(header)} columns"
                        ),
                    )
                    continue
                row: dict[str, Any] = {}
                bad = None
                for key, value in zip(header, cells):
                    try:
                        cell = _csv_cell(key, value)
                    except ValueError as e:
                        bad = DataError(path, line, key, str(e))
                        break
                    if cell is not None:
                        row[key] = cell
                yield line, bad if bad is not None else row
        except csv.Error as e:
            line = reader.line_num
            yield line, DataError(path, line, None, f"invalid CSV (rest of file not read): {e}")
        except UnicodeDecodeError as e:
            yield (
                reader.line_num + 1,
                DataError(
                    path, reader.line_num + 1, None, f"file is not valid UTF-8 (rest of file not read): {e.reason}"
                ),
            )


def _csv_cell(key: str, value: str) -> Any:
    """Type one CSV cell: JSON for list columns, numbers for label columns, absent if empty."""
    s = value.strip()
    if key in _LIST_KEYS:
        if not s:
            return None
        # Negatives are free text, so only a full "[...]" is read as a list there.
        text_like = key in _NEGATIVE_KEYS
        if (text_like and s[0] == "[" and s[-1] == "]") or (not text_like and s[0] in "[{"):
            try:
                return json.loads(s)
            except json.JSONDecodeError as e:
                raise ValueError(f"cell looks like JSON but does not parse: {e.msg} (column {e.colno})") from None
        return value
    if key in _NUMBER_KEYS:
        if not s:
            return None
        try:
            return float(s)
        except ValueError:
            return value
    if not s and _NEGATIVE_N_RE.fullmatch(key):
        return None  # rows with fewer negatives leave trailing negative_N cells empty
    return value


def _iter_parquet(path: str) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    line = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            line += 1
            yield line, row


# ----------------------------------------------------------------------------- row parsing


@dataclass
class _Ctx:
    source: str
    line: int
    base_dir: str
    verify_images: bool

    def error(self, fieldname: str | None, message: str) -> DataError:
        return DataError(self.source, self.line, fieldname, message)


@dataclass
class _Slot:
    """One media tag in a member's text: ``value`` is its own path (a content part) or
    ``None`` (a literal tag or placeholder part, bound from the group's path list)."""

    value: Any
    fieldname: str


@dataclass
class _Draft:
    """A member before its media are bound."""

    fieldname: str
    text: str
    system: str | None = None
    slots: dict[str, list[_Slot]] = field(default_factory=lambda: {k: [] for k in MEDIA_KINDS})

    def add_literal_tags(self, text: str, fieldname: str) -> None:
        for m in _TAG_RE.finditer(text):
            self.slots[m.group(1)].append(_Slot(None, fieldname))


def parse_row(
    raw: Any,
    source: str,
    line: int,
    base_dir: str,
    *,
    verify_images: bool = True,
) -> Sample:
    """Normalize one raw row (query form or messages form, detected per row) into a Sample.

    ``source``/``line`` name the row in errors and are stored on the sample; relative media
    paths resolve against ``base_dir``. The sample's media are absolute paths, or ``http(s)``
    / ``data:`` URIs unchanged. Raises :class:`DataError` naming file, line and field for
    every breach of the data contract: not an object, a missing or mistyped field, a tag
    count that differs from the path count, a missing or (with ``verify_images``)
    unreadable local media file, an unknown role, a member with empty text and no media.
    """
    ctx = _Ctx(source, line, os.path.abspath(base_dir), verify_images)
    if not isinstance(raw, dict):
        raise ctx.error(None, f"row is not a JSON object (got {_type_name(raw)})")
    messages_key = _present_key(raw, _MESSAGES_KEYS, ctx, "messages")
    if messages_key is not None:
        sample = _parse_messages_row(raw, messages_key, ctx)
    else:
        mixed = [k for k in _NEW_FORM_KEYS if raw.get(k) is not None]
        if mixed:
            raise ctx.error(mixed[0], f"'{mixed[0]}' belongs to the messages form, but the row has no 'messages'")
        sample = _parse_query_row(raw, ctx)
    if raw.get("teacher_scores") is not None:
        sample.teacher_scores = check_teacher_scores(raw["teacher_scores"], len(sample.negatives), ctx.error, "teacher_scores")
    if raw.get("teacher_embeddings") is not None:
        sample.teacher_embeddings = check_teacher_embeddings(
            raw["teacher_embeddings"], len(sample.negatives), ctx.error, "teacher_embeddings")
    return sample


def check_teacher_scores(value: Any, n_negatives: int, error, fieldname: str) -> list[float]:
    """A group's teacher scores: ``1 + n_negatives`` finite numbers, the positive's first.
    ``error(fieldname, message)`` builds the exception to raise."""
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in value):
        raise error(fieldname, f"must be a list of numbers (the positive's score, then one per negative), got {value!r:.80}")
    if len(value) != 1 + n_negatives:
        raise error(fieldname, f"has {len(value)} scores but the row has 1 positive and {n_negatives} negatives "
                               f"(expected {1 + n_negatives}: the positive's score first)")
    bad = [i for i, v in enumerate(value) if not math.isfinite(v)]
    if bad:
        raise error(fieldname, f"score {bad[0]} is {value[bad[0]]}; every score must be finite")
    return [float(v) for v in value]


def check_teacher_embeddings(value: Any, n_negatives: int, error, fieldname: str) -> list[list[float]]:
    """A group's teacher embeddings: ``2 + n_negatives`` vectors of one width (anchor,
    positive, then the negatives), finite numbers."""
    n = 2 + n_negatives
    if not isinstance(value, list) or len(value) != n:
        got = f"{len(value)} vectors" if isinstance(value, list) else _type_name(value)
        raise error(fieldname, f"must hold {n} vectors (anchor, positive, then one per negative: the row has "
                               f"{n_negatives} negatives), got {got}")
    width = None
    for i, vec in enumerate(value):
        if not isinstance(vec, list) or not vec or any(
                isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) for v in vec):
            raise error(f"{fieldname}[{i}]", "must be a non-empty list of finite numbers")
        if width is None:
            width = len(vec)
        elif len(vec) != width:
            raise error(f"{fieldname}[{i}]", f"has {len(vec)} numbers but {fieldname}[0] has {width}; one width for all")
    return [[float(v) for v in vec] for vec in value]


def read_file(path: str, *, verify_images: bool = True) -> list[Sample]:
    """Read and validate a whole (small) file into a list of Samples.

    For validation or small files; use :func:`mmembed.data.load_samples` for training data,
    which streams to Arrow. Raises the first :class:`DataError`.
    """
    base_dir = os.path.dirname(os.path.abspath(path))
    return [parse_row(raw, path, line, base_dir, verify_images=verify_images) for line, raw in iter_raw_rows(path)]


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(
        type(value), type(value).__name__
    )


def _present_key(raw: dict, names: tuple[str, ...], ctx: _Ctx, canonical: str) -> str | None:
    """The one key among ``names`` that is present and not null; two of them is an error."""
    present = [k for k in names if raw.get(k) is not None]
    if len(present) > 1:
        raise ctx.error(canonical, f"the row gives both '{present[0]}' and '{present[1]}'; keep one")
    return present[0] if present else None


def _require_str(value: Any, fieldname: str, ctx: _Ctx) -> str:
    if not isinstance(value, str):
        raise ctx.error(fieldname, f"must be a string, got {_type_name(value)}")
    return value


def _parse_label(raw: dict, ctx: _Ctx) -> float | None:
    key = _present_key(raw, _QUERY_ALIASES["label"], ctx, "label")
    if key is None:
        return None
    value = raw[key]
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)):
        raise ctx.error(key, f"must be a number, got {_type_name(value)} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ctx.error(key, f"must be a finite number, got {value}")
    return value


def _parse_system(raw: dict, ctx: _Ctx) -> str | None:
    key = _present_key(raw, _QUERY_ALIASES["system"], ctx, "system")
    if key is None:
        return None
    return _require_str(raw[key], key, ctx) or None


def _text_list(value: Any, fieldname: str, ctx: _Ctx) -> list[str]:
    """``rejected_response``: null -> [], a string -> [it], a list of strings -> itself."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise ctx.error(fieldname, f"must be a list of strings (or one string), got {_type_name(value)}")
    for i, v in enumerate(value):
        _require_str(v, f"{fieldname}[{i}]", ctx)
    return list(value)


def _negatives(raw: dict, ctx: _Ctx) -> list[tuple[str, str]]:
    """The query form's negatives as ``(text, field name)``, in order."""
    numbered = sorted((int(m.group(1)), k) for k in raw if (m := _NEGATIVE_N_RE.fullmatch(k)) and raw[k] is not None)
    key = _present_key(raw, _NEGATIVE_KEYS, ctx, "rejected_response")
    if key is not None and numbered:
        raise ctx.error("rejected_response", f"the row gives both '{key}' and '{numbered[0][1]}'; keep one")
    if numbered:
        return [(_require_str(raw[k], k, ctx), k) for _, k in numbered]
    if key is None:
        return []
    return [(text, f"{key}[{i}]") for i, text in enumerate(_text_list(raw[key], key, ctx))]


def _media_list(raw: dict, kind: str, ctx: _Ctx) -> tuple[list[Any], str]:
    """Top-level ``images``/``image`` (or videos/audios): a list of entries, and the key."""
    key = _present_key(raw, (kind + "s", kind), ctx, kind + "s")
    if key is None:
        return [], kind + "s"
    return _as_media_entries(raw[key], key, ctx), key


def _as_media_entries(value: Any, fieldname: str, ctx: _Ctx) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (str, dict)):
        return [value]
    if not isinstance(value, list):
        raise ctx.error(fieldname, f"must be a list of paths (or one path), got {_type_name(value)}")
    return value


def _parse_query_row(raw: dict, ctx: _Ctx) -> Sample:
    qkey = _present_key(raw, _QUERY_ALIASES["query"], ctx, "query")
    if qkey is None:
        raise ctx.error("query", "missing field 'query' (the anchor; or 'messages' for the messages form)")
    rkey = _present_key(raw, _QUERY_ALIASES["response"], ctx, "response")
    if rkey is None:
        raise ctx.error("response", "missing field 'response' (the positive)")
    if isinstance(raw[rkey], list):
        raise ctx.error(rkey, "must be a string, got array (one positive per row; negatives go in 'rejected_response')")
    query = _require_str(raw[qkey], qkey, ctx)
    response = _require_str(raw[rkey], rkey, ctx)
    negatives = _negatives(raw, ctx)
    system = _parse_system(raw, ctx)
    label = _parse_label(raw, ctx)

    drafts = [_Draft(qkey, query, system), _Draft(rkey, response, system)]
    drafts += [_Draft(fieldname, text, system) for text, fieldname in negatives]
    for d in drafts:
        d.add_literal_tags(d.text, d.fieldname)
    items = _bind_shared(raw, drafts, ctx)
    return Sample(
        anchor=items[0], positives=[items[1]], negatives=items[2:], label=label, source=ctx.source, line=ctx.line
    )


def _bind_shared(raw: dict, drafts: list[_Draft], ctx: _Ctx) -> list[Item]:
    """Bind the row's top-level media lists across ``drafts`` in order (query form)."""
    bound: dict[str, list[list[str]]] = {}
    for kind in MEDIA_KINDS:
        entries, key = _media_list(raw, kind, ctx)
        bound[kind] = _bind(drafts, kind, entries, key, ctx)
    return [_finish(d, {k: bound[k][i] for k in MEDIA_KINDS}, ctx) for i, d in enumerate(drafts)]


def _bind(drafts: list[_Draft], kind: str, entries: list[Any], key: str, ctx: _Ctx) -> list[list[str]]:
    """Give each unbound tag of ``drafts`` (in order) the next entry of ``entries``.

    Returns the resolved media per draft, in tag order. The number of unbound tags must equal
    ``len(entries)``.
    """
    if not entries and not any(d.slots[kind] for d in drafts):
        return [[] for _ in drafts]  # the common text-only case
    needed = [sum(s.value is None for s in d.slots[kind]) for d in drafts]
    if sum(needed) != len(entries):
        where = ", ".join(f"{d.fieldname}: {n}" for d, n in zip(drafts, needed) if n) or "none in the text"
        raise ctx.error(
            key,
            f"{sum(needed)} <{kind}> tag(s) ({where}) but {len(entries)} path(s) in '{key}'; "
            f"each <{kind}> tag takes one path, in order",
        )
    out: list[list[str]] = []
    j = 0
    for d in drafts:
        paths = []
        for slot in d.slots[kind]:
            if slot.value is None:
                paths.append(_resolve_media(entries[j], kind, f"{key}[{j}]", ctx))
                j += 1
            else:
                paths.append(_resolve_media(slot.value, kind, slot.fieldname, ctx))
        out.append(paths)
    return out


def _finish(d: _Draft, media: dict[str, list[str]], ctx: _Ctx) -> Item:
    item = Item(text=d.text, system=d.system, images=media["image"], videos=media["video"], audios=media["audio"])
    if not item.text.strip() and not item.has_media:
        raise ctx.error(d.fieldname, "empty text and no media")
    return item


# ----------------------------------------------------------------------------- messages form


def _parse_messages_row(raw: dict, mkey: str, ctx: _Ctx) -> Sample:
    for k in ("query", "response"):
        if raw.get(k) is not None:
            raise ctx.error(k, f"'{k}' belongs to the query form, but the row also has '{mkey}'; use one form")
    label = _parse_label(raw, ctx)
    top_system = _parse_system(raw, ctx)
    if raw.get("positive_messages") is None:
        return _parse_legacy_messages_row(raw, mkey, top_system, label, ctx)
    for k in _NEGATIVE_KEYS:
        if raw.get(k) is not None:
            raise ctx.error(k, f"'{k}' belongs to the query form; with 'positive_messages' use 'negative_messages'")

    anchor = _group_draft(raw[mkey], mkey, ctx)
    if top_system is not None:
        if anchor.system is not None:
            raise ctx.error("system", f"the row gives both 'system' and a system message in '{mkey}'; keep one")
        anchor.system = top_system
    items = [_finish(anchor, {k: _bind([anchor], k, *_media_list(raw, k, ctx), ctx)[0] for k in MEDIA_KINDS}, ctx)]

    positives = _groups(raw, "positive", ctx)
    if len(positives) != 1:
        raise ctx.error(
            "positive_messages",
            f"must hold exactly one positive group (one more [] than 'messages'), got {len(positives)}",
        )
    negatives = _groups(raw, "negative", ctx)
    return Sample(
        anchor=items[0],
        positives=positives,
        negatives=negatives,
        label=label,
        source=ctx.source,
        line=ctx.line,
    )


def _groups(raw: dict, prefix: str, ctx: _Ctx) -> list[Item]:
    """``positive_messages``/``negative_messages`` with their per-group media lists."""
    key = f"{prefix}_messages"
    groups = raw.get(key)
    if groups is None:
        return []
    if not isinstance(groups, list):
        raise ctx.error(key, f"must be a list of message lists, got {_type_name(groups)}")
    if groups and isinstance(groups[0], dict):
        raise ctx.error(key, "must be a list of message lists (one more [] than 'messages'), got a list of messages")
    drafts = [_group_draft(g, f"{key}[{i}]", ctx) for i, g in enumerate(groups)]
    media: dict[str, list[list[Any]]] = {}
    for kind in MEDIA_KINDS:
        mkey = f"{prefix}_{kind}s"
        value = raw.get(mkey)
        if value is None:
            media[kind] = [[] for _ in drafts]
            continue
        if not isinstance(value, list):
            raise ctx.error(mkey, f"must be a list with one list of paths per group, got {_type_name(value)}")
        if len(value) != len(drafts):
            raise ctx.error(
                mkey, f"has {len(value)} entries but '{key}' has {len(drafts)} groups; they pair up by position"
            )
        media[kind] = [_as_media_entries(v, f"{mkey}[{i}]", ctx) for i, v in enumerate(value)]
    items = []
    for i, d in enumerate(drafts):
        bound = {kind: _bind([d], kind, media[kind][i], f"{prefix}_{kind}s[{i}]", ctx)[0] for kind in MEDIA_KINDS}
        items.append(_finish(d, bound, ctx))
    return items


def _parse_legacy_messages_row(raw: dict, mkey: str, top_system: str | None, label: float | None, ctx: _Ctx) -> Sample:
    """ms-swift 3.x standard format: the last assistant message is the positive."""
    messages = raw[mkey]
    if not isinstance(messages, list) or not messages:
        _group_draft(messages, mkey, ctx)  # raises the type / emptiness error
    last = messages[-1]
    role = _role_of(last, f"{mkey}[{len(messages) - 1}]", ctx) if isinstance(last, dict) else None
    if role != "assistant" or len(messages) < 2:
        raise ctx.error(
            "positive_messages",
            "missing 'positive_messages' (the positive group; the last message is not an assistant reply "
            "that could serve as the positive, as in ms-swift 3.x)",
        )
    if raw.get("negative_messages") is not None:
        raise ctx.error("negative_messages", "'negative_messages' needs 'positive_messages'")
    anchor = _group_draft(messages[:-1], mkey, ctx)
    positive = _group_draft([last], mkey, ctx, offset=len(messages) - 1)
    positive.fieldname = f"{mkey}[{len(messages) - 1}]"
    system = anchor.system
    if top_system is not None:
        if system is not None:
            raise ctx.error("system", f"the row gives both 'system' and a system message in '{mkey}'; keep one")
        system = top_system
    anchor.system = positive.system = system
    drafts = [anchor, positive]
    for text, fieldname in _negatives(raw, ctx):
        d = _Draft(fieldname, text, system)
        d.add_literal_tags(text, fieldname)
        drafts.append(d)
    items = _bind_shared(raw, drafts, ctx)
    return Sample(
        anchor=items[0], positives=[items[1]], negatives=items[2:], label=label, source=ctx.source, line=ctx.line
    )


def _role_of(message: dict, fieldname: str, ctx: _Ctx) -> str:
    role = message.get("role", message.get("from"))
    if role is None:
        raise ctx.error(f"{fieldname}.role", "missing 'role' (system, user or assistant)")
    if not isinstance(role, str) or role.lower() not in _ROLE_ALIASES:
        raise ctx.error(f"{fieldname}.role", f"unknown role {role!r}; expected 'system', 'user' or 'assistant'")
    return _ROLE_ALIASES[role.lower()]


def _group_draft(messages: Any, fieldname: str, ctx: _Ctx, offset: int = 0) -> _Draft:
    """One group of messages -> one member: system message(s) to ``system``, user and
    assistant contents joined with newlines, media tags and content parts as slots."""
    if not isinstance(messages, list):
        raise ctx.error(fieldname, f"must be a list of messages, got {_type_name(messages)}")
    if not messages:
        raise ctx.error(fieldname, "is an empty list of messages")
    draft = _Draft(fieldname, "")
    systems: list[str] = []
    texts: list[str] = []
    for i, message in enumerate(messages, start=offset):
        mfield = f"{fieldname}[{i}]"
        if not isinstance(message, dict):
            raise ctx.error(mfield, f"a message must be an object with 'role' and 'content', got {_type_name(message)}")
        role = _role_of(message, mfield, ctx)
        content = message.get("content", message.get("value"))
        cfield = f"{mfield}.content"
        if role == "system":
            text = _system_content(content, cfield, ctx)
            if text:
                systems.append(text)
            continue
        text = _content_text(content, cfield, draft, ctx)
        if text:
            texts.append(text)
    draft.text = "\n".join(texts)
    draft.system = "\n".join(systems) or None
    return draft


def _system_content(content: Any, fieldname: str, ctx: _Ctx) -> str:
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ctx.error(f"{fieldname}[{i}]", "a system message may hold only text parts")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise ctx.error(fieldname, f"must be a string or a list of content parts, got {_type_name(content)}")
    if _TAG_RE.search(content):
        raise ctx.error(fieldname, "media tags are not allowed in a system message")
    return content


_PART_KINDS = {
    "text": "text",
    "image": "image",
    "image_url": "image",
    "video": "video",
    "video_url": "video",
    "audio": "audio",
    "audio_url": "audio",
    "input_audio": "audio",
}


def _content_text(content: Any, fieldname: str, draft: _Draft, ctx: _Ctx) -> str:
    """The text of one user/assistant content, adding its media slots to ``draft``."""
    if isinstance(content, str):
        draft.add_literal_tags(content, fieldname)
        return content
    if not isinstance(content, list):
        raise ctx.error(fieldname, f"must be a string or a list of content parts, got {_type_name(content)}")
    pieces = []
    for i, part in enumerate(content):
        pfield = f"{fieldname}[{i}]"
        if isinstance(part, str):
            part = {"type": "text", "text": part}
        if not isinstance(part, dict):
            raise ctx.error(pfield, f"a content part must be an object with 'type', got {_type_name(part)}")
        ptype = part.get("type")
        kind = _PART_KINDS.get(ptype) if isinstance(ptype, str) else None
        if kind is None:
            raise ctx.error(
                f"{pfield}.type", f"unknown content part type {ptype!r}; expected text, image, video or audio"
            )
        if kind == "text":
            text = _require_str(part.get("text"), f"{pfield}.text", ctx)
            draft.add_literal_tags(text, pfield)
            pieces.append(text)
            continue
        draft.slots[kind].append(_Slot(_part_media(part, ptype, kind, pfield, ctx), pfield))
        pieces.append(f"<{kind}>")
    return "".join(pieces)


def _part_media(part: dict, ptype: str, kind: str, fieldname: str, ctx: _Ctx) -> Any:
    """The path/URL a media content part carries, or None for a placeholder part."""
    if ptype == "input_audio":
        data = part.get("input_audio")
        if not (isinstance(data, dict) and isinstance(data.get("data"), str)):
            raise ctx.error(f"{fieldname}.input_audio", "must be an object with base64 'data' and 'format'")
        fmt = data.get("format") or "wav"
        return f"data:audio/{fmt};base64,{data['data']}"
    for key in (ptype, kind, f"{kind}_url", "url", "path"):
        value = part.get(key)
        if isinstance(value, dict):
            value = value.get("url", value.get("path"))
        if value is not None:
            return value
    return None


# ----------------------------------------------------------------------------- media paths

_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")
_MIME = {b"\x89PNG": "image/png", b"\xff\xd8\xff": "image/jpeg", b"GIF8": "image/gif", b"BM": "image/bmp"}


def _bytes_to_data_uri(data: bytes) -> str:
    mime = "application/octet-stream"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        mime = "image/webp"
    else:
        for magic, m in _MIME.items():
            if data.startswith(magic):
                mime = m
                break
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def _resolve_media(value: Any, kind: str, fieldname: str, ctx: _Ctx) -> str:
    """A media entry -> an absolute existing path, or an http(s)/data URI unchanged."""
    if isinstance(value, dict):
        data = value.get("bytes")
        if data is not None:
            if not isinstance(data, (bytes, bytearray)):
                raise ctx.error(fieldname, f"'bytes' must be binary data, got {_type_name(data)}")
            return _bytes_to_data_uri(bytes(data))
        value = value.get("path", value.get("url"))
    if not isinstance(value, str):
        raise ctx.error(fieldname, f"a {kind} must be a path or URL string, got {_type_name(value)}")
    value = value.strip()
    if not value:
        raise ctx.error(fieldname, f"empty {kind} path")
    m = _SCHEME_RE.match(value)
    if m:
        scheme = m.group(1).lower()
        if scheme in ("http", "https", "data"):
            return value
        if scheme != "file":
            raise ctx.error(
                fieldname,
                f"unsupported URI scheme {scheme!r} in {value!r}; use a local path, file://, http(s):// or data:",
            )
        parsed = urlparse(value)
        if parsed.netloc not in ("", "localhost"):
            raise ctx.error(fieldname, f"file URI with a remote host is not supported: {value!r}")
        path = url2pathname(unquote(parsed.path))
    else:
        path = value
    path = os.path.expanduser(path)
    if not os.path.isabs(path):
        path = os.path.join(ctx.base_dir, path)
    path = os.path.normpath(path)
    try:
        st = os.stat(path)
    except OSError:
        raise MediaFileError(
            ctx.source, ctx.line, fieldname, f"{kind} file not found: {value!r} (resolved to {path})"
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise MediaFileError(ctx.source, ctx.line, fieldname, f"{kind} path is not a file: {path}")
    if kind == "image" and ctx.verify_images:
        problem = _unreadable_image(path, st.st_mtime_ns)
        if problem:
            raise MediaFileError(ctx.source, ctx.line, fieldname, f"unreadable image {path}: {problem}")
    return path


@functools.lru_cache(maxsize=65536)
def _unreadable_image(path: str, mtime_ns: int) -> str | None:
    """Why PIL cannot identify the image (header only), or None. Cached per path+mtime."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.size  # noqa: B018 - touching the header is the check
    except Exception as e:  # PIL raises many kinds; any of them means unusable
        return f"{type(e).__name__}: {e}"
    return None
