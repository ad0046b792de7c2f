"""One raw row -> one :class:`~mmembed.data.sample.Sample`: the two ms-swift row forms.

:func:`parse_row` detects the row form (ms-swift's query form or messages form), checks it
against the data contract and binds media paths to media tags (:mod:`mmembed.data.paths`).

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

Teacher fields (distillation): ``teacher_scores`` (one score per candidate, the positive's
first) and ``teacher_embeddings`` (one vector per member), checked against the row's
number of negatives.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

from .labels import LabelRule
from .messages import group_draft, require_str, role_of
from .paths import Draft, RowContext, bind_media
from .sample import MEDIA_KINDS, Item, Sample, json_type

__all__ = [
    "GROUP_FIELDS",
    "MESSAGES_FIELDS",
    "NEGATIVE_FIELDS",
    "NEGATIVE_N_RE",
    "QUERY_ALIASES",
    "TEACHER_FIELDS",
    "check_teacher_embeddings",
    "check_teacher_scores",
    "has_group_messages",
    "media_key",
    "parse_row",
]

#: The query form's fields and their aliases, canonical name first.
QUERY_ALIASES = {
    "query": ("query", "anchor", "sentence1", "question", "prompt"),
    "response": ("response", "positive", "sentence2", "answer"),
    "label": ("label", "score"),
    "system": ("system", "system_prompt"),
}
#: The query form's negatives as one list (or one string); or numbered ``negative_N`` fields.
NEGATIVE_FIELDS = ("rejected_response", "negative", "negatives")
NEGATIVE_N_RE = re.compile(r"negative_(\d+)")
#: The messages form's anchor group (aliases) ...
MESSAGES_FIELDS = ("messages", "conversations", "conversation")
#: ... and every field that holds a group of messages or a list of groups.
GROUP_FIELDS = MESSAGES_FIELDS + ("positive_messages", "negative_messages")
#: A distillation teacher's view of the group.
TEACHER_FIELDS = ("teacher_scores", "teacher_embeddings")

# fields that only the messages form (with positive_messages) has
_NEW_FORM_FIELDS = ("positive_messages", "negative_messages") + tuple(
    f"{prefix}_{kind}s" for prefix in ("positive", "negative") for kind in MEDIA_KINDS
)


def has_group_messages(raw: Any) -> bool:
    """Whether ``raw`` is a row of the messages form with ``positive_messages`` (ms-swift >=
    3.9: negatives are ``negative_messages`` groups with their own media lists), as opposed
    to the query form and ms-swift 3.x messages rows (negatives are strings whose tags bind
    in the shared media lists)."""
    return (isinstance(raw, dict) and any(raw.get(k) is not None for k in MESSAGES_FIELDS)
            and raw.get("positive_messages") is not None)


def media_key(raw: dict, kind: str) -> str:
    """The top-level key that holds a row's media of ``kind``: ``images`` or its alias
    ``image`` (videos/video, audios/audio), whichever the row gives (``images`` when none)."""
    return next((k for k in _media_keys(kind) if raw.get(k) is not None), kind + "s")


def _media_keys(kind: str) -> tuple[str, str]:
    return kind + "s", kind


def parse_row(
    raw: Any,
    source: str,
    line: int,
    base_dir: str,
    *,
    verify_images: bool = True,
    work_dir: str | None = None,
    root_image_dir: str | None = None,
    label_rule: LabelRule | None = None,
    media_kinds: frozenset[str] | None = None,
    several_positives: bool = False,
) -> Sample:
    """Normalize one raw row (query form or messages form, detected per row) into a Sample.

    ``source``/``line`` name the row in errors and are stored on the sample; a relative media
    path resolves against ``work_dir`` (default: the current directory) or ``base_dir``,
    whichever holds it (both, as different files: an error). The sample's media are absolute paths, or ``http(s)``
    / ``data:`` URIs unchanged. Raises :class:`DataError` naming file, line and field for
    every breach of the data contract: not an object, a missing or mistyped field, a tag
    count that differs from the path count, a missing or (with ``verify_images``)
    unreadable local media file, an unknown role, a member with empty text and no media.
    ``label_rule`` (a loss's :class:`~mmembed.data.labels.LabelRule`) checks the row's label
    against what the loss takes; ``media_kinds`` (the kinds the model takes, e.g.
    ``frozenset()`` for a text model) makes media of any other kind an error.
    ``several_positives`` (a reranker run: ms-swift's reranker takes every group of
    ``positive_messages``, drawing ``MAX_POSITIVE_SAMPLES`` of them) lets a messages-form row
    hold more than one positive group; an embedding run refuses that (one positive per row).
    """
    sample = _plain_text_row(raw, source, line)
    if sample is not None:  # most rows of large text data sets: the same Sample, without the general reader's walk
        if label_rule is not None and label_rule.problem(sample.label):
            return _parse_row(raw, source, line, base_dir, verify_images, work_dir, root_image_dir, label_rule,
                              media_kinds, several_positives)  # raises the general reader's error, naming the field
        return sample
    return _parse_row(raw, source, line, base_dir, verify_images, work_dir, root_image_dir, label_rule, media_kinds,
                      several_positives)


_PLAIN_KEYS = frozenset(("query", "response", "rejected_response", "label", "system"))


def _plain_text_row(raw: Any, source: str, line: int) -> Sample | None:
    """The Sample of a plain text row of the query form (``query``, ``response``, optional
    ``rejected_response`` as a string or a list of strings, ``label``, ``system``; no media
    fields, no ``<`` anywhere, no empty text), built directly; None for any other row, which
    the general reader reads (and reports, if it is bad). Gives exactly what the general
    reader gives for these rows (tests/data/test_scale.py compares them)."""
    if type(raw) is not dict or not raw.keys() <= _PLAIN_KEYS:
        return None
    query, response = raw.get("query"), raw.get("response")
    if type(query) is not str or type(response) is not str:
        return None
    negatives = raw.get("rejected_response")
    if negatives is None:
        negatives = []
    elif type(negatives) is str:
        negatives = [negatives]
    elif type(negatives) is not list:
        return None
    system = raw.get("system")
    if system is not None and (type(system) is not str or "<" in system):
        return None
    label = raw.get("label")
    if label is not None:
        if type(label) is not float and type(label) is not int or not math.isfinite(label):
            return None
        label = float(label)
    for text in (query, response, *negatives):
        if type(text) is not str or "<" in text or not text.strip():
            return None
    system = system or None
    return Sample(anchor=Item(query, system), positives=[Item(response, system)],
                  negatives=[Item(text, system) for text in negatives], label=label, source=source, line=line)


def _parse_row(raw, source, line, base_dir, verify_images, work_dir, root_image_dir, label_rule, media_kinds,
               several_positives=False) -> Sample:
    ctx = RowContext(source, line, os.path.abspath(base_dir), verify_images, work_dir, root_image_dir, media_kinds)
    if not isinstance(raw, dict):
        raise ctx.error(None, f"row is not a JSON object (got {json_type(raw)})")
    messages_key = _present_key(raw, MESSAGES_FIELDS, ctx, "messages")
    if messages_key is not None:
        sample = _parse_messages_row(raw, messages_key, ctx, several_positives)
    else:
        mixed = [k for k in _NEW_FORM_FIELDS if raw.get(k) is not None]
        if mixed:
            raise ctx.error(mixed[0], f"'{mixed[0]}' belongs to the messages form, but the row has no 'messages'")
        sample = _parse_query_row(raw, ctx)
    if raw.get("teacher_scores") is not None:
        sample.teacher_scores = check_teacher_scores(raw["teacher_scores"], len(sample.negatives), ctx.error, "teacher_scores")
    if raw.get("teacher_embeddings") is not None:
        sample.teacher_embeddings = check_teacher_embeddings(
            raw["teacher_embeddings"], len(sample.negatives), ctx.error, "teacher_embeddings")
    if label_rule is not None:
        problem = label_rule.problem(sample.label)
        if problem:
            raise ctx.error(_present_key(raw, QUERY_ALIASES["label"], ctx, "label") or "label", problem)
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
        got = f"{len(value)} vectors" if isinstance(value, list) else json_type(value)
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


# ----------------------------------------------------------------------------- fields


def _present_key(raw: dict, names: tuple[str, ...], ctx: RowContext, canonical: str) -> str | None:
    """The one key among ``names`` that is present and not null; two of them is an error."""
    present = [k for k in names if raw.get(k) is not None]
    if len(present) > 1:
        raise ctx.error(canonical, f"the row gives both '{present[0]}' and '{present[1]}'; keep one")
    return present[0] if present else None


def _parse_label(raw: dict, ctx: RowContext) -> float | None:
    key = _present_key(raw, QUERY_ALIASES["label"], ctx, "label")
    if key is None:
        return None
    value = raw[key]
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)):
        raise ctx.error(key, f"must be a number, got {json_type(value)} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ctx.error(key, f"must be a finite number, got {value}")
    return value


def _parse_system(raw: dict, ctx: RowContext) -> str | None:
    key = _present_key(raw, QUERY_ALIASES["system"], ctx, "system")
    if key is None:
        return None
    return require_str(raw[key], key, ctx) or None


def _text_list(value: Any, fieldname: str, ctx: RowContext) -> list[str]:
    """``rejected_response``: null -> [], a string -> [it], a list of strings -> itself."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise ctx.error(fieldname, f"must be a list of strings (or one string), got {json_type(value)}")
    for i, v in enumerate(value):
        require_str(v, f"{fieldname}[{i}]", ctx)
    return list(value)


def _negatives(raw: dict, ctx: RowContext) -> list[tuple[str, str]]:
    """The query form's negatives as ``(text, field name)``, in order."""
    numbered = sorted((int(m.group(1)), k) for k in raw if (m := NEGATIVE_N_RE.fullmatch(k)) and raw[k] is not None)
    key = _present_key(raw, NEGATIVE_FIELDS, ctx, "rejected_response")
    if key is not None and numbered:
        raise ctx.error("rejected_response", f"the row gives both '{key}' and '{numbered[0][1]}'; keep one")
    if numbered:
        return [(require_str(raw[k], k, ctx), k) for _, k in numbered]
    if key is None:
        return []
    return [(text, f"{key}[{i}]") for i, text in enumerate(_text_list(raw[key], key, ctx))]


def _media_list(raw: dict, kind: str, ctx: RowContext) -> tuple[list[Any], str]:
    """Top-level ``images``/``image`` (or videos/audios): a list of entries, and the key."""
    key = _present_key(raw, _media_keys(kind), ctx, kind + "s")
    if key is None:
        return [], kind + "s"
    return _as_media_entries(raw[key], key, ctx), key


def _as_media_entries(value: Any, fieldname: str, ctx: RowContext) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (str, dict)):
        return [value]
    if not isinstance(value, list):
        raise ctx.error(fieldname, f"must be a list of paths (or one path), got {json_type(value)}")
    return value


# ----------------------------------------------------------------------------- query form


def _parse_query_row(raw: dict, ctx: RowContext) -> Sample:
    qkey = _present_key(raw, QUERY_ALIASES["query"], ctx, "query")
    if qkey is None:
        fields = ", ".join(repr(k) for k in list(raw)[:8]) + (", ..." if len(raw) > 8 else "")
        raise ctx.error("query", "missing field 'query' (the anchor; or 'messages' for the messages form); "
                                 f"the row's fields are {fields or 'none'}")
    rkey = _present_key(raw, QUERY_ALIASES["response"], ctx, "response")
    if rkey is None:
        raise ctx.error("response", "missing field 'response' (the positive)")
    if isinstance(raw[rkey], list):
        raise ctx.error(rkey, "must be a string, got array (one positive per row; negatives go in 'rejected_response')")
    query = require_str(raw[qkey], qkey, ctx)
    response = require_str(raw[rkey], rkey, ctx)
    negatives = _negatives(raw, ctx)
    system = _parse_system(raw, ctx)
    label = _parse_label(raw, ctx)

    drafts = [Draft(qkey, query, system), Draft(rkey, response, system)]
    drafts += [Draft(fieldname, text, system) for text, fieldname in negatives]
    for d in drafts:
        d.add_literal_tags(d.text, d.fieldname)
    items = _bind_shared(raw, drafts, ctx)
    return Sample(
        anchor=items[0], positives=[items[1]], negatives=items[2:], label=label, source=ctx.source, line=ctx.line
    )


def _bind_shared(raw: dict, drafts: list[Draft], ctx: RowContext) -> list[Item]:
    """Bind the row's top-level media lists across ``drafts`` in order (query form)."""
    bound: dict[str, list[list[str]]] = {}
    for kind in MEDIA_KINDS:
        entries, key = _media_list(raw, kind, ctx)
        bound[kind] = bind_media(drafts, kind, entries, key, ctx)
    return [_finish(d, {k: bound[k][i] for k in MEDIA_KINDS}, ctx) for i, d in enumerate(drafts)]



def _finish(d: Draft, media: dict[str, list[str]], ctx: RowContext) -> Item:
    item = Item(text=d.text, system=d.system, images=media["image"], videos=media["video"], audios=media["audio"])
    if not item.text.strip() and not item.has_media:
        raise ctx.error(d.fieldname, "empty text and no media")
    return item


# ----------------------------------------------------------------------------- messages form


def _parse_messages_row(raw: dict, mkey: str, ctx: RowContext, several_positives: bool = False) -> Sample:
    for k in ("query", "response"):
        if raw.get(k) is not None:
            raise ctx.error(k, f"'{k}' belongs to the query form, but the row also has '{mkey}'; use one form")
    label = _parse_label(raw, ctx)
    top_system = _parse_system(raw, ctx)
    if not has_group_messages(raw):
        return _parse_legacy_messages_row(raw, mkey, top_system, label, ctx)
    for k in NEGATIVE_FIELDS:
        if raw.get(k) is not None:
            raise ctx.error(k, f"'{k}' belongs to the query form; with 'positive_messages' use 'negative_messages'")

    anchor = group_draft(raw[mkey], mkey, ctx)
    if top_system is not None:
        if anchor.system is not None:
            raise ctx.error("system", f"the row gives both 'system' and a system message in '{mkey}'; keep one")
        anchor.system = top_system
    items = [_finish(anchor, {k: bind_media([anchor], k, *_media_list(raw, k, ctx), ctx)[0] for k in MEDIA_KINDS}, ctx)]

    positives = _groups(raw, "positive", ctx)
    if several_positives and not positives:
        raise ctx.error("positive_messages", "must hold at least one positive group (one more [] than 'messages'), "
                                             "got 0")
    if not several_positives and len(positives) != 1:
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


def _groups(raw: dict, prefix: str, ctx: RowContext) -> list[Item]:
    """``positive_messages``/``negative_messages`` with their per-group media lists."""
    key = f"{prefix}_messages"
    groups = raw.get(key)
    if groups is None:
        return []
    if not isinstance(groups, list):
        raise ctx.error(key, f"must be a list of message lists, got {json_type(groups)}")
    if groups and isinstance(groups[0], dict):
        raise ctx.error(key, "must be a list of message lists (one more [] than 'messages'), got a list of messages")
    drafts = [group_draft(g, f"{key}[{i}]", ctx) for i, g in enumerate(groups)]
    media: dict[str, list[list[Any]]] = {}
    for kind in MEDIA_KINDS:
        mkey = f"{prefix}_{kind}s"
        value = raw.get(mkey)
        if value is None:
            media[kind] = [[] for _ in drafts]
            continue
        if not isinstance(value, list):
            raise ctx.error(mkey, f"must be a list with one list of paths per group, got {json_type(value)}")
        if len(value) != len(drafts):
            raise ctx.error(
                mkey, f"has {len(value)} entries but '{key}' has {len(drafts)} groups; they pair up by position"
            )
        media[kind] = [_as_media_entries(v, f"{mkey}[{i}]", ctx) for i, v in enumerate(value)]
    items = []
    for i, d in enumerate(drafts):
        bound = {kind: bind_media([d], kind, media[kind][i], f"{prefix}_{kind}s[{i}]", ctx)[0] for kind in MEDIA_KINDS}
        items.append(_finish(d, bound, ctx))
    return items


def _parse_legacy_messages_row(
    raw: dict, mkey: str, top_system: str | None, label: float | None, ctx: RowContext
) -> Sample:
    """ms-swift 3.x standard format: the last assistant message is the positive."""
    messages = raw[mkey]
    if not isinstance(messages, list) or not messages:
        group_draft(messages, mkey, ctx)  # raises the type / emptiness error
    last = messages[-1]
    role = role_of(last, f"{mkey}[{len(messages) - 1}]", ctx) if isinstance(last, dict) else None
    if role != "assistant" or len(messages) < 2:
        raise ctx.error(
            "positive_messages",
            "missing 'positive_messages' (the positive group; the last message is not an assistant reply "
            "that could serve as the positive, as in ms-swift 3.x)",
        )
    if raw.get("negative_messages") is not None:
        raise ctx.error("negative_messages", "'negative_messages' needs 'positive_messages'")
    anchor = group_draft(messages[:-1], mkey, ctx)
    positive = group_draft([last], mkey, ctx, offset=len(messages) - 1)
    positive.fieldname = f"{mkey}[{len(messages) - 1}]"
    system = anchor.system
    if top_system is not None:
        if system is not None:
            raise ctx.error("system", f"the row gives both 'system' and a system message in '{mkey}'; keep one")
        system = top_system
    anchor.system = positive.system = system
    drafts = [anchor, positive]
    for text, fieldname in _negatives(raw, ctx):
        d = Draft(fieldname, text, system)
        d.add_literal_tags(text, fieldname)
        drafts.append(d)
    items = _bind_shared(raw, drafts, ctx)
    return Sample(
        anchor=items[0], positives=[items[1]], negatives=items[2:], label=label, source=ctx.source, line=ctx.line
    )
