"""The normalized form every row becomes, whatever file format or row form it came from.

A ``Sample`` is one training group: an anchor, its positive(s), its hard negatives (any
number, including none), an optional label (the score pair losses use) and, for
distillation, optional teacher scores or embeddings. Each member is
an ``Item``: the text as the user wrote it, with media tags (``<image>``, ``<video>``,
``<audio>``) left in place, the system prompt if the row gave one, and the media paths
bound to those tags, already resolved to absolute paths or data URIs.

Samples are stored in Arrow as JSON strings (``Sample.to_json``) so that rows of any shape
(variable negatives, media lists) share one column and are decoded only when a batch
needs them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

MEDIA_KINDS = ("image", "video", "audio")

#: ``(source, line, field)``: the row (and field) an item or media reference came from, for
#: error messages; the field is None (or ``""``) when no single field is at fault.
Origin = tuple[str, int, str | None]


@dataclass
class Item:
    """One text (with media tags) to embed."""

    text: str
    system: str | None = None
    images: list[str] = field(default_factory=list)
    videos: list[str] = field(default_factory=list)
    audios: list[str] = field(default_factory=list)

    def media(self, kind: str) -> list[str]:
        return getattr(self, kind + "s")

    @property
    def has_media(self) -> bool:
        return bool(self.images or self.videos or self.audios)


@dataclass
class Sample:
    """One group: anchor, positives, negatives, label; plus where it came from."""

    anchor: Item
    positives: list[Item] = field(default_factory=list)
    negatives: list[Item] = field(default_factory=list)
    label: float | None = None
    source: str = ""
    line: int = 0
    # a distillation teacher's view of this group, from the row or a .npy aligned with the
    # file's rows: one score per candidate (positive first, then the negatives in order),
    # one embedding per member (anchor, positive, negatives in order)
    teacher_scores: list[float] | None = None
    teacher_embeddings: list[list[float]] | None = None
    # the index of the training dataset the row came from (--dataset_config; 0 otherwise);
    # the dataset's ``dataset_id`` column sets it when a row is read from there
    dataset_id: int = 0

    def to_json(self) -> str:
        """The JSON text :meth:`from_json` reads (what the Arrow cache stores). Built from
        the attributes directly: ``dataclasses.asdict``'s deep copies doubled load times."""
        d = dict(vars(self))
        d["anchor"] = vars(self.anchor)
        d["positives"] = [vars(x) for x in self.positives]
        d["negatives"] = [vars(x) for x in self.negatives]
        return json.dumps(d, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> Sample:
        d = json.loads(text)
        return cls(
            anchor=Item(**d["anchor"]),
            positives=[Item(**x) for x in d["positives"]],
            negatives=[Item(**x) for x in d["negatives"]],
            label=d["label"],
            source=d.get("source", ""),
            line=d.get("line", 0),
            teacher_scores=d.get("teacher_scores"),
            teacher_embeddings=d.get("teacher_embeddings"),
            dataset_id=d.get("dataset_id", 0),
        )


class DataError(ValueError):
    """A row that breaks the data contract. The message names file, line and field."""

    def __init__(self, source: str, line: int, fieldname: str | None, message: str):
        self.source = source
        self.line = line
        self.field = fieldname
        self.reason = message
        where = f"{source}:{line}"
        if fieldname:
            where += f" field '{fieldname}'"
        super().__init__(f"{where}: {message}")

    def __reduce__(self):  # survive pickling across worker processes
        return (DataError, (self.source, self.line, self.field, self.reason))


def json_type(value: Any) -> str:
    """The JSON name of a value's type (``object``, ``array``, ``string``, ...), for messages."""
    if value is None:
        return "null"
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(
        type(value), type(value).__name__
    )
