"""What a family's saved folders carry beside the weights, as ms-swift 4.6 saves them.

- A template's ``model_files`` (ms-swift's ``additional_saved_files``): files of the model folder
  copied into every checkpoint and export, e.g. UEmbed's ``sparse_info.json`` (its
  ``num_eos_tokens``, read again when the folder is loaded) and ``sparse_weights.pt``.
- A template's ``saved_architectures``: the ``architectures`` written into a saved folder's
  ``config.json`` in place of the loaded model's, with no ``auto_map`` (WeMM-Embedding: its folder
  names its own ``WeMMEmbedding`` class; the saved folder is Qwen3.5, whose classes transformers
  has, and holds none of the original folder's code for an ``auto_map`` to point at).
"""

from __future__ import annotations

import json
import os
import shutil

from ..encoding.templates import Template


def carry_model_files(template: Template, sources: list[str | None], folder: str) -> list[str]:
    """Copy each of ``template.model_files`` from the first of ``sources`` (folders: the model
    trained from, a checkpoint) that holds it into ``folder``, and rewrite ``folder``'s
    ``config.json`` for ``template.saved_architectures``. Returns the names copied."""
    copied = []
    for name in template.model_files:
        for source in sources:
            path = os.path.join(source, name) if source else None
            if path and os.path.isfile(path) and os.path.abspath(source) != os.path.abspath(folder):
                shutil.copyfile(path, os.path.join(folder, name))
                copied.append(name)
                break
    config = os.path.join(folder, "config.json")
    if template.saved_architectures and os.path.isfile(config):
        with open(config, encoding="utf-8") as f:
            raw = json.load(f)
        raw["architectures"] = list(template.saved_architectures)
        raw.pop("auto_map", None)
        with open(config, "w", encoding="utf-8") as f:
            json.dump(raw, f, indent=2, ensure_ascii=False)
    return copied
