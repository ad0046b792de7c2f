"""Media references in rows: binding paths to media tags and resolving them.

Every ``<image>``, ``<video>`` and ``<audio>`` tag in a member's text takes one path. A
literal tag (or a placeholder content part) takes the next entry of the row's path list for
that kind, in order; a content part that carries its own path keeps it. :func:`bind_media`
pairs tags and paths and checks that their counts agree; :func:`resolve_media` turns each
entry into the reference an :class:`~mmembed.data.sample.Item` stores.

Media paths
-----------
A relative path is tried against the working directory (as ms-swift resolves it) and
against ``base_dir`` (the data file's folder): the one that exists is taken; both existing
as different files is an error naming both, and neither is an error naming both tried
paths. ``~`` expands; ``file://`` URIs become paths. ``http(s)://`` URLs and ``data:`` URIs are kept as they are
(fetched later). Every local path must exist and, unless ``verify_images=False``, its header
must be readable: an image by PIL, a video by PyAV (a container with a video stream), an
audio file by libsndfile or PyAV (with an audio stream). Only the header is read: a file
that opens but cannot be decoded is found when it is decoded (by ``mmembed sft``'s length
check, or when its batch is built), an error naming the row too. An inline image ``{"bytes": ..., "path": ...}`` (a Hugging Face ``Image`` column
read from parquet) becomes a ``data:`` URI.

A model that takes only some media kinds (``media_kinds``; a text model: none) makes a row
with another kind an error naming the field, when the row is read.
"""

from __future__ import annotations

import base64
import functools
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlparse
from urllib.request import url2pathname

from ..environment import read as read_environment
from .sample import MEDIA_KINDS, DataError, json_type

__all__ = [
    "MEDIA_FIELDS",
    "SCHEME_RE",
    "TAG_RE",
    "Draft",
    "MediaFileError",
    "RowContext",
    "Slot",
    "bind_media",
    "resolve_media",
]

#: A media tag in a member's text; group 1 is the kind.
TAG_RE = re.compile(r"<(image|video|audio)>")

#: The scheme of a URI (``file``, ``http``, ``data``, ...) as group 1; a plain path has none.
SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")

#: Row fields that hold media paths: ``images``/``videos``/``audios`` (and their singular
#: aliases ``image``/``video``/``audio``), and the messages form's per-group
#: ``positive_images``, ``negative_images``, ... lists.
MEDIA_FIELDS = (
    tuple(f"{prefix}{kind}s" for prefix in ("", "positive_", "negative_") for kind in MEDIA_KINDS) + MEDIA_KINDS
)
#: The keys of a media entry given as an object (``{"path": ...}``, ``{"url": ...}``) that hold
#: its path or URL, in the order :func:`resolve_media` looks; ``{"bytes": ...}`` holds the data.
ENTRY_PATH_KEYS = ("path", "url")


class MediaFileError(DataError):
    """A local media file that is missing or unreadable: unlike every other row error it
    depends on files outside the data file, so a cached verdict may go stale."""


# ----------------------------------------------------------------------------- binding


@dataclass
class RowContext:
    """The row being read: where it is (for errors) and how its media paths resolve."""

    source: str
    line: int
    base_dir: str
    verify_images: bool  # read each local media file's header (images, videos, audio)
    work_dir: str | None = None  # the working directory relative paths are also tried against (None: the current one)
    # ms-swift's ROOT_IMAGE_DIR, relative paths' third place ("": none; None: the environment's)
    root_image_dir: str | None = None
    media_kinds: frozenset[str] | None = None  # the media kinds the model takes (None: any)

    def error(self, fieldname: str | None, message: str) -> DataError:
        return DataError(self.source, self.line, fieldname, message)


@dataclass
class Slot:
    """One media tag in a member's text: ``value`` is its own path (a content part) or
    ``None`` (a literal tag or placeholder part, bound from the group's path list)."""

    value: Any
    fieldname: str


@dataclass
class Draft:
    """A member before its media are bound."""

    fieldname: str
    text: str
    system: str | None = None
    slots: dict[str, list[Slot]] = field(default_factory=lambda: {k: [] for k in MEDIA_KINDS})

    def add_literal_tags(self, text: str, fieldname: str) -> None:
        for m in TAG_RE.finditer(text):
            self.slots[m.group(1)].append(Slot(None, fieldname))


def bind_media(drafts: list[Draft], kind: str, entries: list[Any], key: str, ctx: RowContext) -> list[list[str]]:
    """Give each unbound tag of ``drafts`` (in order) the next entry of ``entries``.

    Returns the resolved media per draft, in tag order. The number of unbound tags must equal
    ``len(entries)``.
    """
    if not entries and not any(d.slots[kind] for d in drafts):
        return [[] for _ in drafts]  # the common text-only case
    if ctx.media_kinds is not None and kind not in ctx.media_kinds:
        own = [s.fieldname for d in drafts for s in d.slots[kind] if s.value is not None]
        takes = ", ".join(k for k in MEDIA_KINDS if k in ctx.media_kinds) or "text only"
        raise ctx.error(
            key if entries or not own else own[0],
            f"the row has {kind} input, but the model takes {takes}; use a model (and template) that "
            f"takes {kind} input, or remove the row",
        )
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
                paths.append(resolve_media(entries[j], kind, f"{key}[{j}]", ctx))
                j += 1
            else:
                paths.append(resolve_media(slot.value, kind, slot.fieldname, ctx))
        out.append(paths)
    return out


# ----------------------------------------------------------------------------- resolution

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


def resolve_media(value: Any, kind: str, fieldname: str, ctx: RowContext) -> str:
    """A media entry -> an absolute existing path, or an http(s)/data URI unchanged."""
    if isinstance(value, dict):
        data = value.get("bytes")
        if data is not None:
            if not isinstance(data, (bytes, bytearray)):
                raise ctx.error(fieldname, f"'bytes' must be binary data, got {json_type(data)}")
            return _bytes_to_data_uri(bytes(data))
        value = next((value[k] for k in ENTRY_PATH_KEYS if k in value), None)
    if not isinstance(value, str):
        raise ctx.error(fieldname, f"a {kind} must be a path or URL string, got {json_type(value)}")
    value = value.strip()
    if not value:
        raise ctx.error(fieldname, f"empty {kind} path")
    m = SCHEME_RE.match(value)
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
    if os.path.isabs(path):
        path = os.path.normpath(path)
        try:
            st = os.stat(path)
        except OSError:
            raise MediaFileError(ctx.source, ctx.line, fieldname, f"{kind} file not found: {path}") from None
    else:
        path, st = _relative(path, kind, fieldname, ctx)
    if not stat.S_ISREG(st.st_mode):
        raise MediaFileError(ctx.source, ctx.line, fieldname, f"{kind} path is not a file: {path}")
    if ctx.verify_images:
        problem = _UNREADABLE[kind](path, st.st_mtime_ns)
        if problem:
            raise MediaFileError(ctx.source, ctx.line, fieldname, f"unreadable {kind} {path}: {problem}")
    return path


ROOT_IMAGE_DIR = "ROOT_IMAGE_DIR"


def _relative(path: str, kind: str, fieldname: str, ctx: RowContext) -> tuple[str, os.stat_result]:
    """A relative media path, as ms-swift resolves it (its ``_check_path``: against the working
    directory, then, when the ``ROOT_IMAGE_DIR`` environment variable is set, against that
    folder) and as a data file travels with its media (against its folder): the candidate that
    exists. Two that exist as different files: an error naming both."""
    work_dir = ctx.work_dir or os.getcwd()
    root = ctx.root_image_dir if ctx.root_image_dir is not None else read_environment().data.root_image_dir
    places = [(work_dir, "working directory")]
    if root:
        places.append((os.path.expanduser(root), f"{ROOT_IMAGE_DIR}={root}"))
    places.append((ctx.base_dir, "the data file's folder"))
    candidates: dict[str, str] = {}
    for folder, label in places:
        candidates.setdefault(os.path.normpath(os.path.join(os.path.abspath(folder), path)), label)
    found = []
    for cand, label in candidates.items():
        try:
            found.append((cand, os.stat(cand), label))
        except OSError:
            pass
    if not found:
        tried = " and ".join(candidates)
        raise MediaFileError(ctx.source, ctx.line, fieldname, f"{kind} file not found: {path!r} (tried {tried})")
    distinct = [found[0]] + [f for f in found[1:] if not os.path.samefile(found[0][0], f[0])]
    if len(distinct) > 1:
        named = " and ".join(f"{cand} ({label})" for cand, _, label in distinct)
        raise MediaFileError(
            ctx.source, ctx.line, fieldname,
            f"{kind} path {path!r} is ambiguous: {named} exist and are different files; write the path absolute or "
            "relative to one of them only",
        )
    return found[0][0], found[0][1]


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


def _stream_problem(path: str, kind: str) -> str | None:
    """Why PyAV cannot open ``path`` as a container with a ``kind`` stream (header only), or None."""
    import av

    try:
        with av.open(path) as container:
            if not getattr(container.streams, kind):
                return f"no {kind} stream in the file"
    except Exception as e:  # PyAV raises its own error types (InvalidDataError, ...)
        return f"{type(e).__name__}: {e}"
    return None


@functools.lru_cache(maxsize=65536)
def _unreadable_video(path: str, mtime_ns: int) -> str | None:
    """Why a video file cannot be opened (PyAV, header only), or None. Cached per path+mtime."""
    return _stream_problem(path, "video")


@functools.lru_cache(maxsize=65536)
def _unreadable_audio(path: str, mtime_ns: int) -> str | None:
    """Why an audio file cannot be opened by libsndfile nor PyAV (header only), or None."""
    import soundfile

    try:
        soundfile.info(path)
        return None
    except Exception:  # not a format libsndfile knows: the loader falls back to PyAV too
        return _stream_problem(path, "audio")


_UNREADABLE = {"image": _unreadable_image, "video": _unreadable_video, "audio": _unreadable_audio}
