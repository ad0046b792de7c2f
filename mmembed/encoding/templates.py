"""Templates: how one ``Item`` becomes the text a model sees, and how it is pooled.

A template is a declarative TOML file in ``templates/`` (shipped inside the wheel as the
``mmembed.template_files`` package data), found by its ``name`` or by one of its
``model_types`` (ms-swift's ``--model_type`` names). Fields:

- ``format``: the rendering of one item, with ``{content}`` for the text (media tags
  already replaced by the model's placeholders) and ``{system}`` where a system prompt goes.
- ``format_with_system``: optional; used instead of ``format`` when the item has a system
  prompt (or ``default_system`` is set) and the template puts it somewhere different.
- ``default_system``: the system prompt used when a row gives none.
- ``add_special_tokens``: whether the tokenizer adds its own special tokens ([CLS]/[SEP]).
- ``pooling``: ``last`` | ``mean`` | ``cls`` | ``max`` | ``auto`` (read the model's
  sentence-transformers pooling config; ``default_pooling``, else mean, when there is none).
- ``padding_side``: the tokenizer's padding side used in training.
- ``[media]``: placeholder text per media kind (``image``, ``video``, ``audio``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from importlib import resources

import tomllib

from ..data.sample import Item

POOLINGS = ("last", "mean", "cls", "max")
MEDIA_TAGS = {"image": "<image>", "video": "<video>", "audio": "<audio>"}


@dataclass(frozen=True)
class Template:
    name: str
    format: str
    description: str = ""
    model_types: tuple[str, ...] = ()
    format_with_system: str | None = None
    default_system: str | None = None
    add_special_tokens: bool = True
    pooling: str = "auto"
    default_pooling: str = "mean"
    padding_side: str = "right"
    media: dict[str, str] = field(default_factory=dict)

    def render(self, item: Item) -> str:
        """The exact string fed to the tokenizer for ``item``."""
        content = item.text
        for kind, tag in MEDIA_TAGS.items():
            if tag in content:
                if kind not in self.media:
                    raise ValueError(f"template '{self.name}' has no placeholder for {kind} inputs ({tag})")
                content = content.replace(tag, self.media[kind])
        system = item.system if item.system is not None else self.default_system
        if system and self.format_with_system is not None:
            return self.format_with_system.format(system=system, content=content)
        if "{system}" in self.format:
            return self.format.format(system=system or "", content=content)
        return self.format.format(content=content)

    def resolve_pooling(self, model_dir: str | None) -> str:
        """The pooling this template uses for the model in ``model_dir``."""
        if self.pooling != "auto":
            return self.pooling
        st = read_sentence_transformers_pooling(model_dir) if model_dir else None
        return st or self.default_pooling


def _template_files() -> dict[str, str]:
    root = resources.files("mmembed.template_files")
    return {p.name[: -len(".toml")]: p.read_text(encoding="utf-8") for p in root.iterdir() if p.name.endswith(".toml")}


def _parse(name: str, text: str) -> Template:
    raw = tomllib.loads(text)
    unknown = set(raw) - set(Template.__dataclass_fields__)
    if unknown:
        raise ValueError(f"template '{name}': unknown fields {sorted(unknown)}")
    raw["model_types"] = tuple(raw.get("model_types", ()))
    pooling = raw.get("pooling", "auto")
    if pooling != "auto" and pooling not in POOLINGS:
        raise ValueError(f"template '{name}': pooling must be auto or one of {POOLINGS}, got {pooling!r}")
    return Template(**raw)


def list_templates() -> list[str]:
    return sorted(_template_files())


def get_template(name: str | None = None, model_type: str | None = None, config_model_type: str | None = None) -> Template:
    """Find a template by name, else by ms-swift ``--model_type``, else by the model config's ``model_type``."""
    files = _template_files()
    templates = {n: _parse(n, t) for n, t in files.items()}
    if name:
        if name not in templates:
            raise ValueError(f"unknown template '{name}'; available: {', '.join(sorted(templates))}")
        return templates[name]
    for key in (model_type, config_model_type):
        if not key:
            continue
        for t in templates.values():
            if key in t.model_types or key == t.name:
                return t
        if key is model_type:
            raise ValueError(f"unknown --model_type '{model_type}'; known: {', '.join(sorted(m for t in templates.values() for m in t.model_types))}")
    raise ValueError(
        f"cannot pick a template for model type '{config_model_type}'; pass --template (one of {', '.join(sorted(templates))})"
    )


def read_sentence_transformers_pooling(model_dir: str) -> str | None:
    """Pooling named by a sentence-transformers folder (modules.json + Pooling config), if any."""
    modules = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules):
        return None
    with open(modules, encoding="utf-8") as f:
        entries = json.load(f)
    for entry in entries:
        if entry.get("type", "").endswith("Pooling"):
            cfg_path = os.path.join(model_dir, entry.get("path", ""), "config.json")
            if not os.path.isfile(cfg_path):
                return None
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
            if "pooling_mode" in cfg:  # newer sentence-transformers spell it as one string
                mode = cfg["pooling_mode"]
                return {"lasttoken": "last", "mean": "mean", "cls": "cls", "max": "max"}.get(mode)
            for key, mode in (
                ("pooling_mode_lasttoken", "last"),
                ("pooling_mode_cls_token", "cls"),
                ("pooling_mode_max_tokens", "max"),
                ("pooling_mode_mean_tokens", "mean"),
            ):
                if cfg.get(key):
                    return mode
    return None
