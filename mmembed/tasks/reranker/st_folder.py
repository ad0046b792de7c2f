"""A sentence-transformers ``CrossEncoder`` folder as a reranker's ``--model``, kept whole.

sentence-transformers 6.2 saves a ``CrossEncoder`` of a sequence classifier as the transformers
folder (``*ForSequenceClassification``, its one-label head) plus three files of its own:

- ``modules.json``: one ``Transformer`` (``sentence_bert_config.json``: ``transformer_task``
  ``sequence-classification``, ``module_output_name`` ``scores``); a causal LM's CrossEncoder
  adds a ``LogitScore`` (``text-generation``), and ``modules=`` may stack a Pooling and a Dense
  ``scores`` head over a feature-extraction Transformer;
- ``config_sentence_transformers.json``: ``model_type`` ``CrossEncoder``, ``activation_fn``
  (what ``predict`` applies to the logit: ``torch.nn.modules.activation.Sigmoid`` by default,
  ``Identity``, ``Tanh``...), ``prompts`` and ``default_prompt_name`` (``predict`` puts that
  prompt before every query), ``keep_in_fp32_modules``.

mmembed trains the classifier (its head is the transformers model's own) and keeps the rest:
:class:`CrossEncoderFolder` carries the three files into every checkpoint and export (the
query's prompt as the run rendered it), the default prompt is the run's query instruction
(``--query_system``) rendered exactly as ``predict`` writes it, and ``mmembed rerank`` /
``/v1/rerank`` report scores through the folder's ``activation_fn``. What mmembed cannot run
(a module after the Transformer, a Transformer that is not a sequence classifier, an
activation outside torch, a prompt the template cannot render verbatim) is refused in one line
before the weights load, naming it (:func:`read_cross_encoder`).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import UsageError
from ...files import read_json_once
from ...model.st_modules import MODULES_FILE, read_entries

__all__ = ["CrossEncoderFolder", "read_cross_encoder"]

ST_CONFIG = "config_sentence_transformers.json"
TRANSFORMER_CONFIG = "sentence_bert_config.json"
_CONTENT = "\x00"  # a stand-in for the query's text, to read what the template writes before it


def _json(path: str) -> dict[str, Any]:
    try:
        value = read_json_once(path) if os.path.isfile(path) else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class CrossEncoderFolder:
    """What a CrossEncoder folder says beside its transformers model.

    ``activation``: ``activation_fn``'s dotted path (under ``torch``); ``prompt``: the default
    prompt ``predict`` puts before each query (``None``: none); ``files``: the contents of
    ``modules.json``, ``sentence_bert_config.json`` and ``config_sentence_transformers.json``,
    written into every saved folder (:meth:`save`)."""

    activation: str
    prompt: str | None
    files: dict[str, Any]

    @property
    def instruction(self) -> str | None:
        """The default prompt as a query instruction of a template that writes ``{system} {content}``."""
        return None if self.prompt is None else self.prompt[:-1]

    def activate(self, raw: np.ndarray) -> np.ndarray:
        """``activation_fn`` of raw scores, as ``CrossEncoder.predict`` applies it (float32)."""
        import torch

        module, _, name = self.activation.rpartition(".")
        fn = getattr(importlib.import_module(module), name)()
        with torch.no_grad():
            return fn(torch.as_tensor(np.asarray(raw, dtype=np.float32))).numpy().astype(np.float32)

    def with_instruction(self, template: Any) -> CrossEncoderFolder:
        """The folder as a run with ``template`` saves it: the query side's instruction
        (``--query_system``, or the default prompt itself) becomes the default prompt, exactly
        the text the template writes before the query; a template that does not write the
        instruction as a plain prefix is a :class:`UsageError`."""
        instruction = template.query_system
        if instruction is None:
            return self
        rendered = template.format_text(_CONTENT, instruction)
        prefix, found, rest = rendered.partition(_CONTENT)
        if not found or rest != template.format_text(_CONTENT, None).partition(_CONTENT)[2]:
            raise UsageError(f"--query_system {instruction!r}: template {template.name} does not write it as a prefix of "
                             "the query, which a CrossEncoder's prompt is; leave it out")
        st = dict(self.files[ST_CONFIG])
        name = st.get("default_prompt_name") or "query"
        st["prompts"] = {**(st.get("prompts") or {}), name: prefix}
        st["default_prompt_name"] = name
        return dataclasses.replace(self, prompt=prefix, files={**self.files, ST_CONFIG: st})

    def save(self, folder: str) -> None:
        """Write the three files into ``folder`` (a model folder, not a LoRA adapter)."""
        for name, value in self.files.items():
            if value is None:
                continue
            with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
                json.dump(value, f, indent=2, ensure_ascii=False)


def read_cross_encoder(path: str, flag: str = "--model") -> CrossEncoderFolder | None:
    """``path``'s :class:`CrossEncoderFolder` (``None`` when it is no CrossEncoder folder:
    ``config_sentence_transformers.json`` does not say ``model_type`` ``CrossEncoder``).

    Raises:
        UsageError: naming what mmembed would otherwise drop: a module after the Transformer
            (a ``LogitScore``, a ``Dense`` scores head, ...), a Transformer that is not a
            ``sequence-classification`` one, an ``activation_fn`` outside ``torch`` (folder
            code, which mmembed never runs), a default prompt that does not end in one space."""
    st = _json(os.path.join(path, ST_CONFIG))
    if st.get("model_type") != "CrossEncoder":
        return None
    where = f"{flag} {path}"
    entries = read_entries(path, flag) or []
    for entry in entries[1:] or ():
        raise UsageError(f"{where}: {MODULES_FILE} module {entry.name!r} ({entry.type}, folder {entry.path or '.'!r}) "
                         "scores after the Transformer; mmembed's reranker (--task_type reranker) is the Transformer's "
                         "own one-label sequence-classification head: give a CrossEncoder of that Transformer alone")
    transformer = _json(os.path.join(path, TRANSFORMER_CONFIG))
    task = transformer.get("transformer_task", "sequence-classification")
    if entries and (entries[0].kind != "Transformer" or task != "sequence-classification"):
        raise UsageError(f"{where}: {MODULES_FILE} module {entries[0].name!r} ({entries[0].type}, transformer_task "
                         f"{task!r}) is not a sequence classifier; mmembed's reranker scores with the Transformer's "
                         "one-label sequence-classification head")
    config = _json(os.path.join(path, "config.json"))
    activation = st.get("activation_fn") or (config.get("sentence_transformers") or {}).get("activation_fn") \
        or "torch.nn.modules.activation.Sigmoid"
    if not str(activation).startswith("torch."):
        raise UsageError(f"{where}: {ST_CONFIG}'s activation_fn {activation!r} is code outside torch, which mmembed "
                         "never runs (CrossEncoder too ignores it without trust_remote_code); use a torch.nn activation")
    prompts = st.get("prompts") or {}
    name = st.get("default_prompt_name")
    prompt = prompts.get(name) if name else None
    if prompt is not None and (not prompt.endswith(" ") or prompt[:-1] != prompt[:-1].rstrip() or not prompt.strip()):
        raise UsageError(f"{where}: {ST_CONFIG}'s default prompt {name!r} ({prompt!r}) must be text ending in one "
                         "space: mmembed writes it as the query's instruction, '<instruction> <query>'")
    files = {MODULES_FILE: [e.record() for e in entries] if entries else None,
             TRANSFORMER_CONFIG: transformer or None, ST_CONFIG: st}
    return CrossEncoderFolder(str(activation), prompt or None, files)
