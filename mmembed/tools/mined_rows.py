"""The rows ``mmembed mine`` writes: each input row as it was, with the mined negatives added
in its own form (``rejected_response`` and the media lists of the query form, or
``negative_messages`` groups with their media), media paths rebased to the output file's
folder, and the file written whole or not at all.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..data.messages import PART_MEDIA_KEYS
from ..data.paths import ENTRY_PATH_KEYS, MEDIA_FIELDS, SCHEME_RE
from ..data.rows import GROUP_FIELDS, NEGATIVE_FIELDS, NEGATIVE_N_RE, media_key
from ..data.sample import MEDIA_KINDS, Item, Sample
from ..files import replaced_when_done


def rebase_media(row: Any, src: str, dst: str) -> Any:
    """A copy of ``row`` whose relative local media paths (resolved against ``src``, as the
    reader does) are rewritten relative to ``dst``: the output file may live elsewhere.
    Absolute paths, ``~`` paths and URIs are left as they are."""

    def path(value: Any) -> Any:
        if isinstance(value, str):
            v = value.strip()
            if v and not (SCHEME_RE.match(v) or os.path.isabs(v) or v.startswith("~")):
                return os.path.relpath(os.path.join(src, v), dst)
            return value
        if isinstance(value, dict):  # {"path": ...} / {"url": ...}; inline bytes have no path
            return {k: path(v) if k in ENTRY_PATH_KEYS else v for k, v in value.items()}
        if isinstance(value, list):
            return [path(v) for v in value]
        return value

    def part(p: Any) -> Any:
        if not (isinstance(p, dict) and p.get("type") not in (None, "text", "input_audio")):
            return p
        return {k: path(v) if k in PART_MEDIA_KEYS else v for k, v in p.items()}

    def messages(msgs: Any) -> Any:
        if not isinstance(msgs, list):
            return msgs
        out = []
        for m in msgs:
            if isinstance(m, list):  # positive_messages / negative_messages: groups
                out.append(messages(m))
            elif isinstance(m, dict) and isinstance(m.get("content"), list):
                out.append(dict(m, content=[part(p) for p in m["content"]]))
            else:
                out.append(m)
        return out

    if not isinstance(row, dict):
        return row
    new = {}
    for key, value in row.items():
        if key in MEDIA_FIELDS:
            new[key] = path(value)
        elif key in GROUP_FIELDS:
            new[key] = messages(value)
        else:
            new[key] = value
    return new


def _out_media(path: str, media_root: str | None) -> str:
    if media_root is None or not os.path.isabs(path):  # URLs and data: URIs stay as they are
        return path
    return os.path.relpath(path, media_root)


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def with_rejected_responses(raw: dict, new: list[Item], overwrite: bool, media_root: str | None) -> dict:
    """Query form (and ms-swift 3.x messages rows): negatives are strings whose media tags
    bind last in the row's shared ``images``/``videos``/``audios`` lists."""
    row = dict(raw)
    numbered = sorted((int(m.group(1)), k) for k in row if (m := NEGATIVE_N_RE.fullmatch(k)))
    list_key = None if numbered else next((k for k in NEGATIVE_FIELDS if row.get(k) is not None), "rejected_response")
    if numbered:
        existing = [row[k] for _, k in numbered if row[k] is not None]
    else:
        existing = _as_list(row.get(list_key))
    if overwrite:
        for kind in MEDIA_KINDS:  # the existing negatives' paths are the tail of each list
            used = sum(text.count(f"<{kind}>") for text in existing)
            if used:
                key = media_key(row, kind)
                paths = _as_list(row[key])
                row[key] = paths[: len(paths) - used]
        for _, k in numbered:
            del row[k]
        existing = []
    for kind in MEDIA_KINDS:
        added = [_out_media(p, media_root) for item in new for p in item.media(kind)]
        if added:
            key = media_key(row, kind)
            row[key] = _as_list(row.get(key)) + added
    texts = [item.text for item in new]
    if numbered:  # negative_1, negative_2, ...: go on counting
        last = 0 if overwrite else numbered[-1][0]
        for j, text in enumerate(texts, start=last + 1):
            row[f"negative_{j}"] = text
    else:
        row[list_key] = existing + texts
    return row


def with_negative_groups(raw: dict, sample: Sample, new: list[Item], overwrite: bool, media_root: str | None) -> dict:
    """Messages form: one ``negative_messages`` group per negative, media lists aligned."""
    row = dict(raw)
    groups = [] if overwrite else list(row.get("negative_messages") or [])
    system = sample.positives[0].system
    added_groups = []
    for item in new:
        group = [{"role": "system", "content": system}] if system else []
        group.append({"role": "user", "content": item.text})
        added_groups.append(group)
    for kind in MEDIA_KINDS:
        key = f"negative_{kind}s"
        old = [] if overwrite else list(row.get(key) or [])
        added = [[_out_media(p, media_root) for p in item.media(kind)] for item in new]
        if old or any(added):
            old += [[] for _ in range(len(groups) - len(old))]  # absent list: the groups had none
            row[key] = old + added
        else:
            row.pop(key, None)
    row["negative_messages"] = groups + added_groups
    return row


def check_output_path(output: str) -> None:
    """``ValueError`` unless ``output`` is a ``.jsonl``/``.json`` file in an existing folder."""
    if not output.endswith((".jsonl", ".json")):
        raise ValueError(f"--output {output!r}: mining writes .jsonl (JSON Lines) or .json (a JSON array)")
    if not os.path.isdir(os.path.dirname(os.path.abspath(output))):
        raise ValueError(f"--output {output!r}: the folder does not exist")


def write_rows(rows: list[Any], output: str) -> None:
    check_output_path(output)
    with replaced_when_done(output, "w", encoding="utf-8") as f:
        if output.endswith(".jsonl"):
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        else:
            f.write("[\n")
            f.write(",\n".join(json.dumps(row, ensure_ascii=False) for row in rows))
            f.write("\n]\n")
