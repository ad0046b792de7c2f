"""Plain rows of a JSON Lines file read a block at a time by Arrow's JSON parser.

:func:`plain_samples` takes a block of a ``.jsonl`` file's lines (:func:`~mmembed.data.formats.jsonl_lines`),
parses them all at once with ``pyarrow.json`` and, for each *plain* row, writes the
``Sample.to_json()`` text that :func:`~mmembed.data.rows.parse_row` would give, without a
Python object per row. Every other row is None: the caller reads it with the general reader
(``json.loads`` and :func:`parse_row`), which reads it or reports its error (file, line,
field) as before. A block that Arrow's parser does not read as expected (invalid JSON or
UTF-8, a field whose type changes from row to row, two values on a line, a value nested deeply
...) is read wholly by the general reader.

Plain rows, in either of ms-swift's forms:

* the query form: ``query`` and ``response`` strings, ``rejected_response`` absent or a list of
  strings, ``label`` absent or a finite number (one the loss takes), ``system`` absent or a
  string;
* the messages form: ``messages``, ``positive_messages`` (one group; several for a reranker
  run) and ``negative_messages`` (absent or any number of groups) of messages whose ``role``
  is a role the reader knows and whose ``content`` is a string (several messages in a group, a
  system message among them, are read as the general reader reads them), ``label`` and
  ``system`` as above;

with no media: every media field (``images``, ``positive_images``, ...) absent or empty,
no media tag in any text, no member with empty text; no field the general reader reads
besides these (aliases such as ``anchor`` or ``conversations``, ``negative_N``, teacher
fields); other fields are ignored, as the general reader ignores them.
tests/data/test_columnar.py compares both readers row for row, bad rows included.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from .labels import LabelRule
from .messages import ROLE_ALIASES
from .paths import MEDIA_FIELDS, TAG_RE
from .rows import GROUP_FIELDS, NEGATIVE_FIELDS, NEGATIVE_N_RE, QUERY_ALIASES, TEACHER_FIELDS
from .sample import MEDIA_KINDS

__all__ = ["plain_samples"]

# json.dumps(..., ensure_ascii=False) writes a string with this function (Sample.to_json's texts)
_encode: Any = json.encoder.encode_basestring  # type: ignore[attr-defined]

#: deeper than this, a value of an ignored field sends its row to the general reader (whose
#: json.loads refuses values nested about a thousand deep)
_MAX_DEPTH = 32

_ITEM_TAIL = ', "images": [], "videos": [], "audios": []}'
_SAMPLE_TAIL = ', "teacher_scores": null, "teacher_embeddings": null, "dataset_id": 0}'

# the fields the plain rows are read from, typed
_READ = ("query", "response", "rejected_response", "label", "system", "messages", "positive_messages",
         "negative_messages")
# the fields the general reader reads besides those: a plain row has none of them (null), except
# the top-level media lists, which may be empty
_TOP_MEDIA = tuple(kind + "s" for kind in MEDIA_KINDS)
_GROUP_MEDIA = tuple(f"{prefix}_{kind}s" for prefix in ("positive", "negative") for kind in MEDIA_KINDS)
_OTHERS = frozenset(
    {*(name for names in QUERY_ALIASES.values() for name in names), *NEGATIVE_FIELDS, *GROUP_FIELDS, *MEDIA_FIELDS,
     *TEACHER_FIELDS} - set(_READ) - set(_TOP_MEDIA) - set(_GROUP_MEDIA))


def _schema():
    import pyarrow as pa

    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    return pa.schema([("query", pa.string()), ("response", pa.string()), ("rejected_response", pa.list_(pa.string())),
                      ("label", pa.float64()), ("system", pa.string()), ("messages", pa.list_(message)),
                      ("positive_messages", pa.list_(pa.list_(message))),
                      ("negative_messages", pa.list_(pa.list_(message)))])


def _depth(t) -> int:
    """How deep a value of Arrow type ``t`` nests (a scalar: 0)."""
    import pyarrow as pa

    if pa.types.is_struct(t):
        return 1 + max((_depth(t.field(i).type) for i in range(t.num_fields)), default=0)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return 1 + _depth(t.value_type)
    return 0


#: a line with more ``[`` and ``{`` than this has its depth measured (Arrow's parser crashes on
#: values nested some ten thousand deep, where json.loads raises an error the reader reports)
_MANY_OPENINGS = 256


def _nests_deeply(raw: bytes) -> bool:
    """Whether the JSON text ``raw`` may nest deeper than :data:`_MANY_OPENINGS` (brackets
    inside strings do not count)."""
    if raw.count(b"[") + raw.count(b"{") <= _MANY_OPENINGS:
        return False
    a = np.frombuffer(raw, dtype=np.uint8)
    index = np.arange(len(a))
    # a quote preceded by an odd run of backslashes is escaped
    last_other = np.maximum.accumulate(np.where(a != 0x5C, index, -1))
    run = np.concatenate([[0], index[:-1] - last_other[:-1]])
    quotes = (a == 0x22) & (run % 2 == 0)
    outside = np.cumsum(quotes) % 2 == 0  # (a closing quote counts as outside: it is no bracket)
    step = ((a == 0x5B) | (a == 0x7B)).astype(np.int64) - ((a == 0x5D) | (a == 0x7D))
    return int(np.cumsum(np.where(outside, step, 0)).max()) > _MANY_OPENINGS


def _read_table(lines: list[bytes]):
    """The block's rows as an Arrow table (one row per line), or None when Arrow's parser does
    not read them as ``json.loads`` reads each line (then the general reader reads them)."""
    import pyarrow as pa
    import pyarrow.json as paj

    data = b"\n".join(lines)
    try:
        data.decode("utf-8")  # Arrow's parser does not check the strings' UTF-8; json.loads' decoding does
    except UnicodeDecodeError:
        return None
    try:
        table = paj.read_json(
            pa.BufferReader(data),
            read_options=paj.ReadOptions(use_threads=False, block_size=max(len(data) + 1, 1 << 16)),
            parse_options=paj.ParseOptions(explicit_schema=_schema(), unexpected_field_behavior="infer"),
        )
    except (pa.ArrowException, ValueError):
        return None
    # a line holding two values (or a carriage return between them) would be two rows here
    return table if table.num_rows == len(lines) else None


def _valid(array) -> np.ndarray:
    """A boolean array: which entries of ``array`` are not null."""
    if array.null_count == 0:
        return np.ones(len(array), dtype=bool)
    return array.is_valid().to_numpy(zero_copy_only=False)


def _empty_or_null(array) -> np.ndarray:
    """Which entries are null or an empty list (a media list that binds nothing)."""
    import pyarrow as pa

    ok = ~_valid(array)
    if pa.types.is_list(array.type):
        ok |= np.diff(array.offsets.to_numpy()) == 0
    return ok


def _groups_media_ok(array, n_groups: np.ndarray) -> np.ndarray:
    """``positive_images`` (...) of the messages form: null, or one null or empty entry per group."""
    import pyarrow as pa

    ok = ~_valid(array)
    if pa.types.is_list(array.type):
        offsets = array.offsets.to_numpy().astype(np.int64)
        filled = np.concatenate([[0], np.cumsum(~_empty_or_null(array.values))])  # entries that hold something
        ok |= _valid(array) & (np.diff(offsets) == n_groups) & (filled[offsets[1:]] == filled[offsets[:-1]])
    return ok


def _label(x: float | None) -> str | None:
    """A label as ``json.dumps`` writes it; None for one the general reader must read: not
    finite (its error), or -0.0 (``-0`` is the integer 0 to json.loads, whose label is 0.0)."""
    if x is None:
        return "null"
    if not math.isfinite(x) or (x == 0 and math.copysign(1.0, x) < 0):
        return None
    return float.__repr__(x)


def _space_class() -> str:
    """An RE2 character class of the characters ``str.strip()`` removes (``str.isspace()``)."""
    return "".join(f"\\x{{{ord(c):04x}}}" for c in map(chr, range(0x3001)) if c.isspace())


_NOT_SPACE = f"[^{_space_class()}]"  # a text holding one is not empty to the general reader's strip()
_TO_ESCAPE = r'[\x00-\x1f"\\]'  # a text holding one is written with escapes by json.dumps


def _checked(texts, ok: np.ndarray | None = None):
    """``texts`` (Arrow strings) with null in place of each text a plain member cannot have:
    null already, a media tag in it, empty to ``str.strip()``, or not ``ok``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    keep = pc.and_(pc.match_substring_regex(texts, _NOT_SPACE),
                   pc.invert(pc.match_substring_regex(texts, TAG_RE.pattern))).fill_null(False)
    if ok is not None:
        keep = pc.and_(keep, pa.array(ok))
    return pc.if_else(keep, texts, pa.nulls(len(texts), pa.string()))


def _quoted(texts):
    """Each text as ``json.dumps(text, ensure_ascii=False)`` writes it; null stays null."""
    import pyarrow as pa
    import pyarrow.compute as pc

    quoted = pc.binary_join_element_wise('"', texts, '"', "")
    escaped = pc.match_substring_regex(texts, _TO_ESCAPE).fill_null(False)
    if pc.any(escaped).as_py():
        mask = escaped.to_numpy(zero_copy_only=False)
        values = [_encode(t) for t in texts.filter(escaped).to_pylist()]
        quoted = pc.replace_with_mask(quoted, pa.array(mask), pa.array(values, pa.string()))
    return quoted


def _items(texts, systems):
    """The members' ``Item`` JSON (text, system, no media); null where the text is null."""
    import pyarrow.compute as pc

    return pc.binary_join_element_wise('{"text": ', _quoted(texts), ', "system": ',
                                       _quoted(systems).fill_null("null"), _ITEM_TAIL, "")


def _lists(offsets: np.ndarray, items):
    """Each row's members (``offsets`` into ``items``) as the JSON list's inside (``a, b``);
    null for a row with a null member."""
    import pyarrow as pa
    import pyarrow.compute as pc

    return pc.binary_join(pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), items), ", ")


def _take(array, index: np.ndarray):
    import pyarrow as pa

    return array.take(pa.array(index, pa.int64()))


class _Groups:
    """The groups of one messages column (``messages``: one per row; ``positive_messages`` /
    ``negative_messages``: a list of them per row) read into one member each: ``texts`` and
    ``systems`` (Arrow strings, a text null where the group gives no plain member: its error,
    media, ...), and ``rows``, each row's first group (``rows[i]:rows[i + 1]``)."""

    def __init__(self, array, nested: bool):
        import pyarrow as pa
        import pyarrow.compute as pc

        n = len(array)
        if nested:
            self.rows = array.offsets.to_numpy().astype(np.int64)
            groups = array.values
            group_valid = _valid(groups)
        else:
            self.rows = np.arange(n + 1, dtype=np.int64)
            groups, group_valid = array, np.ones(n, dtype=bool)
        starts = groups.offsets.to_numpy().astype(np.int64)
        messages = groups.values
        roles, contents = pc.struct_field(messages, "role"), pc.struct_field(messages, "content")  # (null message: null)
        counts = np.diff(starts)
        first = np.minimum(starts[:-1], max(len(messages) - 1, 0))
        # the usual group: one user message whose text is plain
        usual = group_valid & (counts == 1)
        if len(messages):
            usual &= pc.equal(roles, "user").fill_null(False).to_numpy(zero_copy_only=False)[first]
            texts = _checked(_take(contents, first), usual)
        else:
            texts = pa.nulls(len(counts), pa.string())
        systems = pa.nulls(len(counts), pa.string())
        other = np.flatnonzero(group_valid & ~usual & (counts > 0))
        if len(other):  # the rest walked as the general reader walks them
            walked = self._walk(other, starts, roles.to_pylist(), contents.to_pylist(),
                                pc.match_substring_regex(contents, TAG_RE.pattern).fill_null(True).to_pylist())
            mask = np.zeros(len(counts), dtype=bool)
            mask[other] = True
            texts = pc.replace_with_mask(texts, pa.array(mask), pa.array([t for t, _ in walked], pa.string()))
            systems = pc.replace_with_mask(systems, pa.array(mask), pa.array([s for _, s in walked], pa.string()))
        self.texts, self.systems = texts, systems

    @staticmethod
    def _walk(groups: np.ndarray, starts: np.ndarray, roles: list, contents: list, tagged: list) -> list:
        """``(text, system)`` of each group as :func:`~mmembed.data.messages.group_draft` reads
        it, or ``(None, None)`` when it gives no plain member."""
        out = []
        for g in groups.tolist():
            texts, systems, spoken, plain = [], [], False, True
            for m in range(starts[g], starts[g + 1]):
                role, content = roles[m], contents[m]
                role = ROLE_ALIASES.get(role.lower()) if isinstance(role, str) else None
                if role is None or content is None or tagged[m]:
                    plain = False
                    break
                if role == "system":
                    if content:
                        systems.append(content)
                    continue
                spoken = True
                if content:
                    texts.append(content)
            text = "\n".join(texts)
            plain = plain and spoken and bool(text.strip())
            out.append((text, "\n".join(systems) or None) if plain else (None, None))
        return out


def plain_samples(path: str, block: list[tuple[int, bytes]], *, label_rule: LabelRule | None = None,
                  several_positives: bool = False):
    """For each ``(line, bytes)`` of ``block`` (non-blank lines of ``path``, stripped), the
    ``Sample.to_json()`` text of the plain row it holds (see the module's description), or null
    for a row the general reader must read: an Arrow string array. ``label_rule`` and
    ``several_positives`` are :func:`~mmembed.data.rows.parse_row`'s."""
    import pyarrow as pa
    import pyarrow.compute as pc

    # lines the general reader takes without Arrow's parser: nested deeply, or holding a teacher's
    # signals (large arrays that would be parsed twice)
    deep = [i for i, (_, raw) in enumerate(block) if b'"teacher_' in raw or _nests_deeply(raw)]
    if deep:  # those lines to the general reader, the others read here
        shallow = np.setdiff1d(np.arange(len(block)), deep)
        got = plain_samples(path, [block[i] for i in shallow], label_rule=label_rule,
                            several_positives=several_positives) if len(shallow) else pa.nulls(0, pa.string())
        mask = np.zeros(len(block), dtype=bool)
        mask[shallow] = True
        return pc.replace_with_mask(pa.nulls(len(block), pa.string()), pa.array(mask), got)
    n = len(block)
    nothing = pa.nulls(n, pa.string())
    table = _read_table([raw for _, raw in block]) if n else None
    if table is None:
        return nothing
    names = set(table.column_names)
    ok = np.ones(n, dtype=bool)
    for name in table.column_names:
        column = table.column(name).combine_chunks()
        if name in _READ:
            if _depth(column.type) > _MAX_DEPTH:  # a message with an extra field nested too deeply
                ok &= ~_valid(column)
        elif name in _TOP_MEDIA:
            ok &= _empty_or_null(column)
        elif name in _GROUP_MEDIA:
            continue  # below, against the groups
        elif name in _OTHERS or NEGATIVE_N_RE.fullmatch(name) or _depth(column.type) > _MAX_DEPTH:
            ok &= ~_valid(column)  # a field the general reader reads, or a value nested too deeply for it
    column = {name: table.column(name).combine_chunks() for name in _READ}
    has = {name: _valid(column[name]) for name in _READ}
    query_form = ~has["messages"] & has["query"] & has["response"] & ~has["positive_messages"]
    query_form &= ~has["negative_messages"]
    grouped = has["messages"] & has["positive_messages"] & ~has["query"] & ~has["response"]
    grouped &= ~has["rejected_response"]
    for name in _GROUP_MEDIA:  # the messages form's lists per group hold nothing; the query form has none
        if name in names:
            media = table.column(name).combine_chunks()
            side = column[name.split("_")[0] + "_messages"]
            ok &= np.where(query_form, ~_valid(media), _groups_media_ok(media, np.diff(side.offsets.to_numpy())))
    ok &= query_form | grouped

    # the label: absent, or a finite number the loss takes
    labels = column["label"].to_pylist()
    label_texts = pa.array([_label(x) for x in labels], pa.string())
    if label_rule is not None:
        ok &= [label_rule.problem(x) is None for x in labels]
    if not ok.any():
        return nothing

    systems = column["system"]
    row_systems = pc.if_else(pc.equal(systems, ""), pa.nulls(n, pa.string()), systems)  # "" is no system
    out = nothing
    if (ok & query_form).any():
        negatives = column["rejected_response"]
        offsets = negatives.offsets.to_numpy().astype(np.int64)
        owners = np.repeat(np.arange(n), np.diff(offsets))  # the row of each negative
        anchor = _items(_checked(column["query"], ok & query_form), row_systems)
        positives = _items(_checked(column["response"]), row_systems)
        negative_items = _items(_checked(negatives.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))),
                                _take(row_systems, owners))
        samples = _samples(anchor, _lists(np.arange(n + 1), positives), _lists(offsets - offsets[0], negative_items),
                           label_texts, path, block)
        out = pc.if_else(pa.array(query_form), samples, out)
    if (ok & grouped).any():
        anchor = _Groups(column["messages"], nested=False)
        positive = _Groups(column["positive_messages"], nested=True)
        negative = _Groups(column["negative_messages"], nested=True)
        n_positive = np.diff(positive.rows)
        ok &= (n_positive >= 1) if several_positives else (n_positive == 1)
        # a system message of the anchor group and the row's system: the general reader's error
        top = _valid(row_systems)
        ok &= ~(top & _valid(anchor.systems))
        anchor_texts = pc.if_else(pa.array(ok & grouped), anchor.texts, pa.nulls(n, pa.string()))
        anchor_items = _items(anchor_texts, pc.if_else(pa.array(top), row_systems, anchor.systems))
        samples = _samples(anchor_items, _lists(positive.rows, _items(positive.texts, positive.systems)),
                           _lists(negative.rows, _items(negative.texts, negative.systems)), label_texts, path, block)
        out = pc.if_else(pa.array(grouped), samples, out)
    return out


def _samples(anchor, positives, negatives, labels, path: str, block: list[tuple[int, bytes]]):
    """Each row's ``Sample.to_json()`` text from its members' JSON; null where one is null."""
    import pyarrow as pa
    import pyarrow.compute as pc

    lines = pc.cast(pa.array([line for line, _ in block], pa.int64()), pa.string())
    return pc.binary_join_element_wise('{"anchor": ', anchor, ', "positives": [', positives, '], "negatives": [',
                                       negatives, '], "label": ', labels, ', "source": ' + _encode(path) + ', "line": ',
                                       lines, _SAMPLE_TAIL, "")
