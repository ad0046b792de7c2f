"""Raw rows from data files: ``.jsonl``, ``.json``, ``.csv``/``.tsv`` and ``.parquet``.

:func:`iter_raw_rows` streams the rows of one file, each with the line it starts on, so
that every later error can name ``file:line``. Rows come out as the file holds them (dicts,
usually); :func:`~mmembed.data.rows.parse_row` turns them into samples. CSV cells are typed
by column (JSON lists for list columns, numbers for ``label``/``score``): the columns are
the row fields of :mod:`mmembed.data.rows` and :mod:`mmembed.data.paths`.
"""

from __future__ import annotations

import csv
import json
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

from .paths import MEDIA_FIELDS
from .rows import GROUP_FIELDS, MESSAGES_FIELDS, NEGATIVE_FIELDS, NEGATIVE_N_RE, QUERY_ALIASES, TEACHER_FIELDS
from .sample import DataError

__all__ = ["DATA_EXTENSIONS", "decode_jsonl_line", "iter_raw_rows", "iter_rows_or_errors", "jsonl_lines"]

#: File extensions read by :func:`iter_raw_rows` (and picked from a folder by the loader).
DATA_EXTENSIONS = (".jsonl", ".json", ".csv", ".tsv", ".parquet")

_UTF8_BOM = b"\xef\xbb\xbf"

# CSV cells of these columns are decoded when they hold JSON (see _csv_cell) ...
_LIST_FIELDS = frozenset(NEGATIVE_FIELDS + GROUP_FIELDS + MEDIA_FIELDS + TEACHER_FIELDS)
# ... and of these read as numbers.
_NUMBER_FIELDS = frozenset(QUERY_ALIASES["label"])
# every row has one of these (its anchor)
_ANCHOR_FIELDS = frozenset(QUERY_ALIASES["query"] + MESSAGES_FIELDS)


def iter_raw_rows(path: str) -> Iterator[tuple[int, Any]]:
    """Stream the rows of one data file as ``(line, row)``, ``line`` 1-based.

    * ``.jsonl``: one JSON value per line; ``line`` is the line in the file; blank lines are
      skipped.
    * ``.json``: a JSON array (``line`` is where each element starts), or JSON Lines content,
      or whitespace-separated JSON objects (e.g. one pretty-printed object).
    * ``.csv`` / ``.tsv``: a header row, then one row per record; ``line`` is the line the
      record starts on. Quoting is read strictly: a quote left open (which would swallow
      the rest of the file into one cell) or text after a closing quote is an error naming
      the line (the rest of the file is not read). Empty cells are absent fields (except
      text columns, which stay ``""``); cells of list columns (``rejected_response``,
      ``images``, ``messages``, ...) that start with ``[`` (or ``{``, except negatives)
      must be JSON and are decoded; ``label``/``score`` cells become floats when they
      parse as numbers (otherwise :func:`~mmembed.data.rows.parse_row` reports them).
      Bytes that are not UTF-8 make their row an error; the next rows are read.
    * ``.parquet``: ``line`` is the 1-based row number.

    Rows are usually dicts; a JSON value that is not an object is yielded as it is so that
    :func:`~mmembed.data.rows.parse_row` can report it. JSON nested deeper than Python's
    parser goes is a row error like any other invalid JSON. Raises :class:`DataError`
    (naming file, line and the parse problem) at the first row that cannot be parsed at all.
    """
    for line, row in iter_rows_or_errors(path):
        if isinstance(row, DataError):
            raise row
        yield line, row


def iter_rows_or_errors(path: str, shard: int = 0, num_shards: int = 1) -> Iterator[tuple[int, Any]]:
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
    hint = ""
    if e.msg == "Extra data" and e.doc[e.pos : e.pos + 1] == ",":
        hint = "; JSON Lines rows are not separated by commas: remove the ',' after the row"
    return DataError(path, line, None, f"{what}: {e.msg} (column {e.colno}){hint}")


_TOO_DEEP = "invalid JSON: nested too deeply for the parser (a row holds strings, numbers and lists of them)"


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


#: the bytes read from a .jsonl file at a time (its lines are then split off in memory)
_JSONL_CHUNK = 1 << 22


def jsonl_lines(path: str, shard: int = 0, num_shards: int = 1) -> Iterator[list[tuple[int, bytes]]]:
    """The non-blank lines of a ``.jsonl`` file's byte range ``shard`` of ``num_shards``
    (aligned to line starts) as lists of ``(line, bytes)``: ``line`` 1-based, the bytes
    stripped of surrounding whitespace (and of a UTF-8 BOM on the file's first line), not yet
    decoded. The file is read a few MiB at a time (one list per read), each line as ``readline``
    would give it (lines end at ``\\n``)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        start = _align_to_line(f, size * shard // num_shards, size)
        end = _align_to_line(f, size * (shard + 1) // num_shards, size)
        line = _count_newlines(f, start) + 1 if start else 1
        f.seek(start)
        left, tail = end - start, b""
        while left > 0 or tail:
            data = f.read(min(left, _JSONL_CHUNK)) if left > 0 else b""
            left = left - len(data) if data else 0
            parts = (tail + data).split(b"\n")
            tail = parts.pop() if data else b""  # the last line of the range ends at its end
            out = []
            for raw in parts:
                n, line = line, line + 1
                if n == 1 and raw.startswith(_UTF8_BOM):
                    raw = raw[len(_UTF8_BOM) :]
                raw = raw.strip()
                if raw:
                    out.append((n, raw))
            if out:
                yield out


def decode_jsonl_line(path: str, n: int, raw: bytes) -> Any:
    """One line of a ``.jsonl`` file (from :func:`jsonl_lines`) as the JSON value it holds, or
    the :class:`DataError` naming line ``n``'s problem (not UTF-8, invalid JSON, nested too deeply)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return DataError(path, n, None, f"line is not valid UTF-8: {e.reason} at byte {e.start}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return _json_error(path, n, e)
    except RecursionError:
        return DataError(path, n, None, _TOO_DEEP)


def _iter_jsonl(path: str, shard: int = 0, num_shards: int = 1) -> Iterator[tuple[int, Any]]:
    for lines in jsonl_lines(path, shard, num_shards):
        for n, raw in lines:
            yield n, decode_jsonl_line(path, n, raw)


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
    except (json.JSONDecodeError, RecursionError):
        jsonl = False
    if jsonl:
        del text
        # JSON Lines content in a .json file: read line by line so one bad line does not
        # hide the rest.
        rows = _iter_jsonl(path)
    else:
        rows = _iter_json_values(path, text, i)
    first = next(rows, None)
    if first is None:
        return
    second = next(rows, None)
    if second is None and _holds_rows(first[1]):
        keys = ", ".join(repr(k) for k in list(first[1])[:5]) + (", ..." if len(first[1]) > 5 else "")
        yield first[0], DataError(
            path, first[0], None,
            f"the file is one JSON object (keys {keys}) holding rows, not a list of rows: a .json data file "
            "is an array [{...}, {...}] or one row per line",
        )
        return
    yield first
    if second is not None:
        yield second
        yield from rows


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
            except RecursionError:
                yield line_at(start), DataError(path, line_at(start), None, f"{_TOO_DEEP} (rest of file not read)")
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
        except RecursionError:
            yield line_at(i), DataError(path, line_at(i), None, f"{_TOO_DEEP} (rest of file not read)")
            return
        yield line_at(i), value
        i = _skip_ws(text, end)


def _holds_rows(value: Any) -> bool:
    """A JSON object that is not a row but a container of rows (``{"train": [{...}, ...]}``,
    ``{"0": {...}, "1": {...}}``): it has no field a row must start from, and its values are
    objects or lists of objects."""
    if not isinstance(value, dict) or not value or set(value) & _ANCHOR_FIELDS:
        return False
    return all(isinstance(v, dict) or (isinstance(v, list) and v and isinstance(v[0], dict)) for v in value.values())


def _iter_csv(path: str, delimiter: str) -> Iterator[tuple[int, Any]]:
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    # surrogateescape: a byte that is not UTF-8 becomes a lone surrogate, found per row below
    with open(path, newline="", encoding="utf-8-sig", errors="surrogateescape") as f:
        reader = csv.reader(f, delimiter=delimiter, strict=True)
        done = 0  # the last line of the records read so far
        try:
            header = next(reader, None)
            if header is None:
                return
            bad = _not_utf8(path, 1, header)
            if bad is not None:
                yield 1, DataError(path, 1, None, f"header {bad.reason} (rest of file not read)")
                return
            header = [h.strip() for h in header]
            done = reader.line_num
            for cells in reader:
                line, done = done + 1, reader.line_num
                if not cells:
                    continue
                bad = _not_utf8(path, line, cells, header)
                if bad is not None:
                    yield line, bad
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
            if "unexpected end of data" in str(e):
                # a quote left open: the record would run to the end of the file
                line = done + 1
                yield line, DataError(path, line, None, "unclosed quote: a quoted cell of this row runs to the end "
                                                        "of the file (rest of file not read)")
            else:
                at = reader.line_num
                hint = " (a quote inside a quoted cell is written twice: \"\")" if "expected after" in str(e) else ""
                yield at, DataError(path, at, None, f"invalid CSV (rest of file not read): {e}{hint}")


def _not_utf8(path: str, line: int, cells: list[str], header: list[str] | None = None) -> DataError | None:
    """The error for a row holding bytes that are not UTF-8 (lone surrogates here), or None."""
    for i, cell in enumerate(cells):
        m = _SURROGATE_RE.search(cell)
        if m:
            byte = ord(m.group()) - 0xDC00
            key = header[i] if header is not None and i < len(header) else None
            return DataError(path, line, key, f"is not valid UTF-8 (byte 0x{byte:02x}); save the file as UTF-8")
    return None


_SURROGATE_RE = re.compile("[\udc80-\udcff]")


def _csv_cell(key: str, value: str) -> Any:
    """Type one CSV cell: JSON for list columns, numbers for label columns, absent if empty."""
    s = value.strip()
    if key in _LIST_FIELDS:
        if not s:
            return None
        # A cell starting with "[" is a JSON list; negatives are free text otherwise (one
        # negative), other list columns also take a JSON object ("{...}").
        if s[0] == "[" or (s[0] == "{" and key not in NEGATIVE_FIELDS):
            try:
                return json.loads(s)
            except json.JSONDecodeError as e:
                hint = ""
                if "'" in s and '"' not in s:
                    hint = "; JSON strings take double quotes: [\"a\", \"b\"]"
                elif key in NEGATIVE_FIELDS:
                    hint = "; a cell starting with '[' is read as a JSON list (a negative that starts with '[' goes inside one)"
                raise ValueError(f"cell starts with '{s[0]}' but is not valid JSON: {e.msg} (column {e.colno}){hint}") from None
            except RecursionError:
                raise ValueError("cell is JSON nested too deeply for the parser") from None
        return value
    if key in _NUMBER_FIELDS:
        if not s:
            return None
        try:
            return float(s)
        except ValueError:
            return value
    if not s and NEGATIVE_N_RE.fullmatch(key):
        return None  # rows with fewer negatives leave trailing negative_N cells empty
    return value


def _iter_parquet(path: str) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    line = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            line += 1
            yield line, row
