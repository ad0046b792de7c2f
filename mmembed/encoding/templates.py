"""Templates: how one ``Item`` becomes the text a model sees, and how it is pooled.

A template is a declarative TOML file in ``templates/`` (shipped inside the wheel as the
``mmembed.template_files`` package data), found by its ``name`` or by one of its
``model_types`` (ms-swift's ``--model_type`` names). Fields:

- ``format``: the rendering of one item, with ``{content}`` for the text (media tags
  already replaced by the model's placeholders) and ``{system}`` where a system prompt goes.
- ``format_with_system``: optional; used instead of ``format`` when the item has a system
  prompt (or ``default_system`` is set) and the template puts it somewhere different.
- ``default_system``: the system prompt used when a row gives none.
- ``query_system`` / ``document_system``: the instruction of each side (``--query_system``,
  ``--document_system``), put where the system prompt goes, for an item of that side that
  has no system of its own; ``None``: the side takes ``default_system``. The query side is
  the anchor (``sentence1`` of a pair row), the document side its positives and negatives
  (``sentence2``). An item's own ``system`` (its row's, or its dataset's) always wins.
- ``add_special_tokens``: whether the tokenizer adds its own special tokens ([CLS]/[SEP]).
- ``pooling``: ``last`` | ``mean`` | ``cls`` | ``max`` | ``auto`` (read the model's
  sentence-transformers pooling config; ``default_pooling``, else mean, when there is none).
- ``padding_side``: the tokenizer's padding side used in training.
- ``[media]``: placeholder text per media kind (``image``, ``video``, ``audio``).
- ``tower``: the media tower a multimodal model runs (``vision`` or ``audio``); the model
  runs it on every forward, on a dummy input when a batch has no media.
- ``min_transformers``: the oldest transformers release that loads the family's checkpoints
  whole (checked when the template is used).
- ``[parts]``: the model's parts as prefixes of the module names of the model ``AutoModel``
  loads: ``vit`` (the vision or audio tower), ``aligner`` (the projector into the LLM,
  inside or beside the tower) and ``llm``. ms-swift's ``--freeze_vit``, ``--freeze_aligner``
  and ``--freeze_llm`` and LoRA's ``all-linear`` act on these.
- ``media_defaults``: the media budget the family's own loader sets when the user sets none
  (ms-swift 4.6's, e.g. Qwen3-VL-Embedding's ``image_max_tokens = 1800`` tokens per image,
  ``fps = 1``, ``fps_max_frames = 64``): each applies when its variable (``MAX_PIXELS``, ``FPS``,
  ``FPS_MAX_FRAMES``) is unset.
- ``trim``: strip the whitespace around the content and the system prompt before rendering
  (ms-swift's Qwen3.5 templates do, as the models' own chat template trims every turn).
- ``eos_tokens``: a count of trailing tokens read from the model folder, as UEmbed's
  ``sparse_info.json``: ``{file, field, token}``; when the folder's ``file`` gives ``field`` = N > 0
  (:meth:`Template.for_model`), the ``token`` that ends ``format`` (and ``format_with_system``)
  is written N times and ``last`` pooling takes the position before those N tokens
  (``pool_skip`` = N); absent, 0: the template as written.
- ``pool_skip``: positions ``last`` pooling steps back from the last real token (set by
  ``eos_tokens``; 0: the last token itself).
- ``architectures``: config.json ``architectures`` that pick this template before its
  ``model_type`` does (a family that shares a transformers model type with another).
- ``model_files``: files of the model folder carried into every checkpoint and export
  (ms-swift's ``additional_saved_files``; :mod:`mmembed.model.model_files`).
- ``saved_architectures``: the ``architectures`` a saved folder's ``config.json`` names (its
  ``auto_map`` dropped), as ms-swift saves WeMM-Embedding.
- ``adapter_prefix``: where the family's full class (the causal-LM or conditional-generation
  class ms-swift and PEFT users load) holds the ``AutoModel`` backbone, e.g. ``"model."``;
  LoRA adapters are written with the full class's module names. Empty: the bare model.

Reranker templates (``task = "reranker"``) score a (query, document) pair instead of
embedding one text; they are searched by ``model_types`` only when a reranker is asked for
(``get_template(..., task="reranker")``), so ``qwen3`` finds ``qwen3_emb`` for an embedding
run and ``qwen3_reranker`` for a reranker run. Their extra fields:

- ``task``: ``embedding`` (the default) or ``reranker``.
- ``pair_format``: the text of one pair, with ``{query}`` and ``{document}`` in either order
  (the media of the side written first come first) and ``{instruction}``; the result is the
  ``{content}`` of ``format`` (``format``'s ``{system}`` then takes ``default_system``, e.g.
  Qwen3-Reranker's "Judge whether ..."). A ``pair_format`` without ``{instruction}`` puts the
  pair's instruction, when it has one, where ``format_with_system`` puts a system prompt
  (jina-reranker-m0's ``{instruction}\n`` before the pair).
- ``text_pair``: true instead of ``pair_format``: the tokenizer's own text-pair encoding
  ``tokenizer(query, document)`` with the token type ids it gives (what sentence-transformers'
  ``CrossEncoder`` feeds the model); an instruction, when a row has one, goes before the
  query as ``format_with_system`` puts it.
- ``score_token_id``: a token id appended to every pair after tokenization, the position the
  score is read at (jina-reranker-m0's 100, which its model card appends); ``None``: none.
- ``default_instruction``: the instruction of a pair whose rows give none (``None``: none).
  A pair's instruction is the first present of: the document's own system, the query row's
  system, ``--query_system`` (or a dataset's), ``default_instruction``
  (:mod:`mmembed.tasks.reranker.inputs`).

A new model family is one such file. ``--template path/to/file.toml`` takes a user's own;
a checkpoint trained with it keeps the whole template in its ``mmembed.json``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import tomllib

from ..data.sample import Item
from ..files import read_json_once
from .swift_models import why_not

POOLINGS = ("last", "mean", "cls", "max")
MEDIA_TAGS = {"image": "<image>", "video": "<video>", "audio": "<audio>"}
TOWERS = {"image": "vision", "video": "vision", "audio": "audio"}  # the tower each media kind needs
PARTS = ("aligner", "vit", "llm")  # in the order names are matched: the aligner sits inside the tower
SIDES = ("query", "document")  # the two sides an item may be embedded as (the anchor is the query)
TASKS = ("embedding", "reranker")  # what a template is for (get_template searches one kind's templates)


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
    tower: str | None = None
    parts: dict[str, tuple[str, ...]] = field(default_factory=dict)
    min_transformers: str | None = None
    adapter_prefix: str = ""
    query_system: str | None = None
    document_system: str | None = None
    task: str = "embedding"
    pair_format: str | None = None
    text_pair: bool = False
    default_instruction: str | None = None
    score_token_id: int | None = None
    media_defaults: dict[str, Any] = field(default_factory=dict)
    trim: bool = False
    eos_tokens: dict[str, str] = field(default_factory=dict)
    pool_skip: int = 0
    architectures: tuple[str, ...] = ()
    model_files: tuple[str, ...] = ()
    saved_architectures: tuple[str, ...] = ()

    @property
    def reranker(self) -> bool:
        return self.task == "reranker"

    def check_installed(self) -> None:
        """Refuse a transformers release that cannot load this family's models as the template needs."""
        if self.min_transformers is None:
            return
        import transformers
        from packaging.version import Version

        if Version(transformers.__version__) < Version(self.min_transformers):
            raise ValueError(
                f"template '{self.name}' needs transformers >= {self.min_transformers} (installed: "
                f"{transformers.__version__}): older releases load this family's checkpoints without some of their "
                f"weights; pip install 'transformers>={self.min_transformers}'"
            )

    def module_part(self, name: str) -> str | None:
        """``aligner``, ``vit`` or ``llm`` for a module or parameter name of the model
        (``None`` for a text template, or a name in none of the parts)."""
        for part in PARTS:
            if any(name == p or name.startswith(p + ".") for p in self.parts.get(part, ())):
                return part
        return None

    def side_system(self, side: str | None) -> str | None:
        """The system prompt of an item of ``side`` (``query``, ``document`` or ``None``: no
        side) that has none of its own: the side's instruction, else ``default_system``."""
        if side is not None:
            if side not in SIDES:
                raise ValueError(f"unknown side {side!r}; expected one of {', '.join(SIDES)}")
            own = getattr(self, side + "_system")
            if own is not None:
                return own
        return self.default_system

    def with_side(self, item: Item, side: str | None) -> Item:
        """``item`` as an input of ``side``: given the side's instruction as its system when it
        has no system of its own (the item itself when nothing changes), so that
        ``render(with_side(item, side)) == render(item, side)``."""
        if item.system is not None or side is None:
            return item
        system = self.side_system(side)
        if system is None or system == self.default_system:
            return item
        return dataclasses.replace(item, system=system)

    def render(self, item: Item, side: str | None = None) -> str:
        """The exact string fed to the tokenizer for ``item``, embedded as ``side``
        (``query``, ``document``, or ``None``). The system prompt, first present of: the
        item's own (its row's, or its dataset's), the side's instruction
        (``query_system``/``document_system``), ``default_system`` (``--system``, else the
        template's)."""
        content = item.text.strip() if self.trim else item.text
        for kind, tag in MEDIA_TAGS.items():
            if tag in content:
                if kind not in self.media:
                    raise ValueError(f"template '{self.name}' has no placeholder for {kind} inputs ({tag})")
                content = content.replace(tag, self.media[kind])
        return self.format_text(content, item.system if item.system is not None else self.side_system(side))

    def format_text(self, content: str, system: str | None) -> str:
        """``content`` (its media tags already replaced by placeholders) in this template's
        format, with ``system`` as its system prompt (None or empty: none)."""
        if system and self.trim:
            system = system.strip()
        if system and self.format_with_system is not None:
            return self.format_with_system.format(system=system, content=content)
        if "{system}" in self.format:
            return self.format.format(system=system or "", content=content)
        return self.format.format(content=content)

    def for_model(self, model_dir: str | None) -> Template:
        """This template for the model in ``model_dir``: with ``eos_tokens``, its suffix token
        written N times and ``pool_skip`` = N, N read from the folder's file (see the module
        docstring); the template itself when there is nothing to apply."""
        if not self.eos_tokens or not model_dir:
            return self
        path = os.path.join(model_dir, self.eos_tokens["file"])
        if not os.path.isfile(path):
            return self
        key = self.eos_tokens["field"]
        try:
            raw = read_json_once(path).get(key, 0)
            count = int(raw if raw is not None else 0)
        except (ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}: '{key}' must be a whole number of tokens ({e})") from None
        if count < 0:
            raise ValueError(f"{path}: '{key}' must be 0 or more, got {count}")
        if count == 0:
            return self
        token = self.eos_tokens["token"]

        def repeat(fmt: str | None) -> str | None:
            return None if fmt is None else fmt[: -len(token)] + token * count

        return dataclasses.replace(self, format=repeat(self.format), format_with_system=repeat(self.format_with_system),
                                   pool_skip=count, eos_tokens={})

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
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"template '{name}': not valid TOML: {e}") from None
    raw.setdefault("name", name)
    return _from_fields(name, raw)


def _from_fields(where: str, raw: dict[str, Any]) -> Template:
    """A template from its fields (a TOML file's, or those kept in a checkpoint's mmembed.json), checked."""
    raw = dict(raw)
    unknown = set(raw) - set(Template.__dataclass_fields__)
    if unknown:
        raise ValueError(f"template '{where}': unknown fields {sorted(unknown)}")
    for key in ("name", "format"):
        if not isinstance(raw.get(key), str):
            raise ValueError(f"template '{where}': '{key}' must be a string")
    raw["model_types"] = tuple(raw.get("model_types", ()))
    pooling = raw.get("pooling", "auto")
    if pooling != "auto" and pooling not in POOLINGS:
        raise ValueError(f"template '{where}': pooling must be auto or one of {POOLINGS}, got {pooling!r}")
    media = raw.get("media", {})
    if set(media) - set(MEDIA_TAGS):
        raise ValueError(f"template '{where}': [media] keys must be among {sorted(MEDIA_TAGS)}, got {sorted(media)}")
    towers = {TOWERS[kind] for kind in media}
    if len(towers) > 1:
        raise ValueError(f"template '{where}': one template takes vision or audio media, not both")
    tower = raw.get("tower")
    if towers and tower not in towers:
        raise ValueError(f"template '{where}': its [media] need tower = \"{next(iter(towers))}\", got {tower!r}")
    if not towers and tower is not None:
        raise ValueError(f"template '{where}': tower = {tower!r} but no [media] placeholders")
    parts = raw.get("parts", {})
    if set(parts) - set(PARTS) or not all(isinstance(v, (list, tuple)) and all(isinstance(p, str) for p in v) for v in parts.values()):
        raise ValueError(f"template '{where}': [parts] maps {', '.join(PARTS)} to lists of module-name prefixes")
    if tower and not {"vit", "llm"} <= set(parts):
        raise ValueError(f"template '{where}': a template with a media tower names its [parts] vit and llm (aligner too if any)")
    raw["parts"] = {k: tuple(v) for k, v in parts.items()}
    defaults = raw.get("media_defaults", {})
    allowed = {"image_max_tokens": int, "fps": (int, float), "fps_max_frames": int}
    if not isinstance(defaults, dict) or set(defaults) - set(allowed) or not all(
            isinstance(v, allowed[k]) and not isinstance(v, bool) and v > 0 for k, v in defaults.items()):
        raise ValueError(f"template '{where}': [media_defaults] takes positive numbers for "
                         f"{', '.join(allowed)}, got {defaults!r}")
    if defaults and not media:
        raise ValueError(f"template '{where}': [media_defaults] without [media] placeholders")
    raw["media_defaults"] = dict(defaults)
    _check_suffix(where, raw)
    _check_task(where, raw)
    return Template(**raw)


def _check_suffix(where: str, raw: dict[str, Any]) -> None:
    """``eos_tokens``, ``pool_skip``, ``trim`` and ``architectures``: their types, and a suffix the
    formats end with."""
    for key in ("architectures", "model_files", "saved_architectures"):
        raw[key] = tuple(raw.get(key, ()))
        if not all(isinstance(a, str) and a for a in raw[key]):
            raise ValueError(f"template '{where}': {key} must be a list of names")
    if not isinstance(raw.get("trim", False), bool):
        raise ValueError(f"template '{where}': trim must be true or false")
    skip = raw.get("pool_skip", 0)
    if not isinstance(skip, int) or isinstance(skip, bool) or skip < 0:
        raise ValueError(f"template '{where}': pool_skip must be 0 or more, got {skip!r}")
    if skip and raw.get("pooling") != "last":
        raise ValueError(f"template '{where}': pool_skip needs pooling = \"last\"")
    eos = raw.get("eos_tokens", {})
    if not eos:
        raw["eos_tokens"] = {}
        return
    if not isinstance(eos, dict) or set(eos) != {"file", "field", "token"} or not all(isinstance(v, str) and v for v in eos.values()):
        raise ValueError(f"template '{where}': eos_tokens takes the strings file, field and token, got {eos!r}")
    if raw.get("pooling") != "last":
        raise ValueError(f"template '{where}': eos_tokens needs pooling = \"last\"")
    for key in ("format", "format_with_system"):
        if raw.get(key) is not None and not raw[key].endswith(eos["token"]):
            raise ValueError(f"template '{where}': {key} must end with eos_tokens' token {eos['token']!r}")
    raw["eos_tokens"] = dict(eos)


def _check_task(where: str, raw: dict[str, Any]) -> None:
    """The reranker fields: only on a reranker template, which has exactly one way to join a pair."""
    task = raw.get("task", "embedding")
    if task not in TASKS:
        raise ValueError(f"template '{where}': task must be one of {', '.join(TASKS)}, got {task!r}")
    pair_format, text_pair = raw.get("pair_format"), raw.get("text_pair", False)
    if task != "reranker":
        extra = [k for k in ("pair_format", "text_pair", "default_instruction", "score_token_id")
                 if raw.get(k) not in (None, False)]
        if extra:
            raise ValueError(f"template '{where}': {', '.join(extra)} belong to a reranker template (task = \"reranker\")")
        return
    if not isinstance(text_pair, bool):
        raise ValueError(f"template '{where}': text_pair must be true or false")
    if (pair_format is None) == (not text_pair):
        raise ValueError(f"template '{where}': a reranker template has either a pair_format or text_pair = true "
                         "(the tokenizer's text-pair encoding), exactly one")
    if text_pair and raw.get("media"):
        raise ValueError(f"template '{where}': text_pair = true takes no [media] (a processor encodes one text per input)")
    if pair_format is not None:
        if not isinstance(pair_format, str):
            raise ValueError(f"template '{where}': pair_format must be a string")
        try:
            pair_format.format(instruction="", query="", document="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"template '{where}': pair_format may name only {{instruction}}, {{query}} and "
                             f"{{document}}: {e!r}") from None
        if "{query}" not in pair_format or "{document}" not in pair_format:
            raise ValueError(f"template '{where}': pair_format needs {{query}} and {{document}}")
    token = raw.get("score_token_id")
    if token is not None and (isinstance(token, bool) or not isinstance(token, int) or token < 0):
        raise ValueError(f"template '{where}': score_token_id must be a token id (an integer >= 0), got {token!r}")


def list_templates() -> list[str]:
    return sorted(_template_files())


def is_template_file(name: str) -> bool:
    return name.endswith(".toml") or os.sep in name or "/" in name


def read_template_file(path: str) -> Template:
    """A user's own template (``--template path.toml``)."""
    if not os.path.isfile(path):
        raise ValueError(f"--template {path!r}: no such file")
    with open(path, encoding="utf-8") as f:
        return _parse(os.path.basename(path)[: -len(".toml")] if path.endswith(".toml") else os.path.basename(path), f.read())


def builtin_templates() -> dict[str, Template]:
    return {n: _parse(n, t) for n, t in _template_files().items()}


def template_config(template: Template) -> str | dict[str, Any]:
    """How ``mmembed.json`` names ``template``: a shipped template by its name, any other
    (a user's file, or a shipped name with other fields) by all its fields, so the folder
    loads without the file. ``default_system``, ``padding_side`` and the side instructions
    (``--system``, ``--padding_side``, ``--query_system``, ``--document_system``) are kept
    beside it in ``mmembed.json`` and do not count."""
    shipped = builtin_templates().get(template.name)
    if shipped is not None and dataclasses.replace(
        template, default_system=shipped.default_system, padding_side=shipped.padding_side,
        query_system=shipped.query_system, document_system=shipped.document_system,
    ) == shipped:
        return template.name
    fields = dataclasses.asdict(template)
    fields["model_types"] = list(fields["model_types"])
    for key in ("architectures", "model_files", "saved_architectures"):
        fields[key] = list(fields[key])
    fields["parts"] = {k: list(v) for k, v in fields["parts"].items()}
    return fields


def template_from_config(value: str | dict[str, Any]) -> Template:
    """The template ``mmembed.json`` names (see ``template_config``)."""
    if isinstance(value, dict):
        return _from_fields(str(value.get("name", "mmembed.json")), value)
    return get_template(value)


def get_template(name: str | None = None, model_type: str | None = None, config_model_type: str | None = None,
                 task: str | None = None, architectures: list[str] | tuple[str, ...] = ()) -> Template:
    """Find a template by name or TOML file path, else by ms-swift ``--model_type``, else by
    one of the model config's ``architectures`` a template names, else by its ``model_type``. ``task`` (what the template is for, one of :data:`TASKS`:
    ``embedding`` or ``reranker``, a task's :attr:`~mmembed.task.Task.template_task`; None:
    embedding) picks which templates the model types are searched among; a template named
    outright must be of that kind when one is given."""
    if task is not None and task not in TASKS:
        raise ValueError(f"unknown template task {task!r}; expected one of {', '.join(TASKS)}")
    wanted = task or "embedding"
    if name and is_template_file(name):
        return _of_task(read_template_file(name), task)
    templates = builtin_templates()
    if name:
        if name not in templates:
            raise ValueError(f"unknown template '{name}' (--template); available: {', '.join(sorted(templates))}, "
                             "or a .toml file of your own")
        return _of_task(templates[name], task)
    others = [t for t in templates.values() if t.task != wanted]
    templates = {n: t for n, t in templates.items() if t.task == wanted}
    if not model_type:
        for t in templates.values():
            if set(t.architectures) & set(architectures or ()):
                return t
    for key in (model_type, config_model_type):
        if not key:
            continue
        for t in templates.values():
            if key in t.model_types or key == t.name:
                return t
        if key is model_type:
            known = sorted(m for t in templates.values() for m in t.model_types)
            other = next((t for t in others if model_type in t.model_types or model_type == t.name), None)
            hint = f"; '{model_type}' is a model type of {_a(other.task)} template ({other.name})" if other else ""
            if why_not(model_type):
                hint += f"; ms-swift's '{model_type}' is not trained here: {why_not(model_type)}"
            raise ValueError(f"unknown --model_type '{model_type}' for {_a(wanted)} model{hint}; known: "
                             f"{', '.join(known)} (or pass --template)")
    raise ValueError(
        f"cannot pick a template for model type '{config_model_type}'; pass --template (one of {', '.join(sorted(templates))})"
    )


def _of_task(template: Template, task: str | None) -> Template:
    if task is not None and template.task != task:
        raise ValueError(f"template '{template.name}' is {_a(template.task)} template; this --task_type needs "
                         f"{_a(task)} template")
    return template


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def read_sentence_transformers_pooling(model_dir: str) -> str | None:
    """Pooling named by a sentence-transformers folder (modules.json + Pooling config), if any."""
    modules = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules):
        return None
    entries = read_json_once(modules)
    for entry in entries:
        if entry.get("type", "").endswith("Pooling"):
            cfg_path = os.path.join(model_dir, entry.get("path", ""), "config.json")
            if not os.path.isfile(cfg_path):
                return None
            cfg = read_json_once(cfg_path)
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
