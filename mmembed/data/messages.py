"""The messages of ms-swift's messages form, read into drafts: each message's role (with the
ShareGPT aliases), its content as text with media tags in place (OpenAI-style content parts
``{"type": "image", "image": ...}`` become tags, their media bound in order), and a system
message's text. :mod:`mmembed.data.rows` reads the rows around them; each error names the
file, line and field.
"""

from __future__ import annotations

from typing import Any

from .paths import TAG_RE, Draft, RowContext, Slot
from .sample import json_type

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "bot": "assistant",
}


def require_str(value: Any, fieldname: str, ctx: RowContext) -> str:
    if not isinstance(value, str):
        raise ctx.error(fieldname, f"must be a string, got {json_type(value)}")
    return value


def role_of(message: dict, fieldname: str, ctx: RowContext) -> str:
    role = message.get("role", message.get("from"))
    if role is None:
        raise ctx.error(f"{fieldname}.role", "missing 'role' (system, user or assistant)")
    if not isinstance(role, str) or role.lower() not in ROLE_ALIASES:
        raise ctx.error(f"{fieldname}.role", f"unknown role {role!r}; expected 'system', 'user' or 'assistant'")
    return ROLE_ALIASES[role.lower()]


def group_draft(messages: Any, fieldname: str, ctx: RowContext, offset: int = 0) -> Draft:
    """One group of messages -> one member: system message(s) to ``system``, user and
    assistant contents joined with newlines, media tags and content parts as slots."""
    if not isinstance(messages, list):
        raise ctx.error(fieldname, f"must be a list of messages, got {json_type(messages)}")
    if not messages:
        raise ctx.error(fieldname, "is an empty list of messages")
    draft = Draft(fieldname, "")
    systems: list[str] = []
    texts: list[str] = []
    roles: set[str] = set()  # the user / assistant roles seen
    for i, message in enumerate(messages, start=offset):
        mfield = f"{fieldname}[{i}]"
        if not isinstance(message, dict):
            raise ctx.error(mfield, f"a message must be an object with 'role' and 'content', got {json_type(message)}")
        role = role_of(message, mfield, ctx)
        content = message.get("content", message.get("value"))
        cfield = f"{mfield}.content"
        if role == "system":
            text = system_content(content, cfield, ctx)
            if text:
                systems.append(text)
            continue
        text = _content_text(content, cfield, draft, ctx)
        roles.add(role)
        if text:
            texts.append(text)
    if not roles:
        raise ctx.error(fieldname, "holds only system messages; it needs a user (or assistant) message, the text to embed")
    draft.text = "\n".join(texts)
    draft.system = "\n".join(systems) or None
    return draft


def system_content(content: Any, fieldname: str, ctx: RowContext) -> str:
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ctx.error(f"{fieldname}[{i}]", "a system message may hold only text parts")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise ctx.error(fieldname, f"must be a string or a list of content parts, got {json_type(content)}")
    if TAG_RE.search(content):
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
#: The keys of a media content part that may hold its path or URL (``_part_media`` reads them).
PART_MEDIA_KEYS = tuple(k for k, kind in _PART_KINDS.items() if kind != "text" and k != "input_audio") + ("url", "path")


def _content_text(content: Any, fieldname: str, draft: Draft, ctx: RowContext) -> str:
    """The text of one user/assistant content, adding its media slots to ``draft``."""
    if isinstance(content, str):
        draft.add_literal_tags(content, fieldname)
        return content
    if not isinstance(content, list):
        raise ctx.error(fieldname, f"must be a string or a list of content parts, got {json_type(content)}")
    pieces = []
    for i, part in enumerate(content):
        pfield = f"{fieldname}[{i}]"
        if isinstance(part, str):
            part = {"type": "text", "text": part}
        if not isinstance(part, dict):
            raise ctx.error(pfield, f"a content part must be an object with 'type', got {json_type(part)}")
        ptype = part.get("type")
        kind = _PART_KINDS.get(ptype) if isinstance(ptype, str) else None
        if kind is None:
            raise ctx.error(
                f"{pfield}.type", f"unknown content part type {ptype!r}; expected text, image, video or audio"
            )
        if kind == "text":
            text = require_str(part.get("text"), f"{pfield}.text", ctx)
            draft.add_literal_tags(text, pfield)
            pieces.append(text)
            continue
        draft.slots[kind].append(Slot(_part_media(part, ptype, kind, pfield, ctx), pfield))
        pieces.append(f"<{kind}>")
    return "".join(pieces)


def _part_media(part: dict, ptype: str, kind: str, fieldname: str, ctx: RowContext) -> Any:
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
