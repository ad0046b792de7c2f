"""What a saved folder holds beside the weights: ``mmembed.json`` (template, pooling, base
model: what is needed to embed with it) and the sentence-transformers files."""

from __future__ import annotations

import json
import os
from typing import Any

MMEMBED_CONFIG = "mmembed.json"


def write_mmembed_config(output_dir: str, **fields: Any) -> None:
    """Write what is needed to embed with a saved folder (template, pooling, base model)."""
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, MMEMBED_CONFIG), "w", encoding="utf-8") as f:
        json.dump(fields, f, indent=2)


def read_mmembed_config(path: str) -> dict[str, Any] | None:
    cfg = os.path.join(path, MMEMBED_CONFIG)
    if not os.path.isfile(cfg):
        return None
    with open(cfg, encoding="utf-8") as f:
        return json.load(f)


def writes_sentence_transformers(config: dict[str, Any]) -> bool:
    """Whether a folder saved with these ``mmembed.json`` fields gets the sentence-transformers
    files: only when ``SentenceTransformer(folder).encode(texts)`` gives the embeddings that
    ``mmembed.Embedder`` gives. Training checkpoints and ``mmembed export`` both ask here.

    SentenceTransformer tokenizes each text as it is, with the tokenizer's own special
    tokens, then pools and L2-normalizes. So the folder must hold the whole model (not a
    LoRA adapter: export it first), the template must render a text as the text itself
    (``{content}``, no default system prompt) and let the tokenizer add its special
    tokens ([CLS] ... [SEP]), take no media, and the embeddings must be normalized.
    Templates that append a token (``<|endoftext|>``) or write a chat format the tokenizer
    does not add itself get no files; their folders load with ``mmembed.Embedder``.
    """
    from ..encoding.templates import template_from_config

    if config.get("tuner_type") != "full" or config.get("media") or not config.get("normalize", True):
        return False
    if not config.get("template"):
        return False
    template = template_from_config(config["template"])
    system = config.get("default_system", template.default_system)
    return template.add_special_tokens and template.format == "{content}" and not system and not template.media


def write_sentence_transformers_config(output_dir: str, dim: int, pooling: str, max_seq_length: int | None) -> None:
    """Files that let ``sentence_transformers.SentenceTransformer(output_dir)`` load the folder
    as Transformer -> Pooling -> Normalize, matching mmembed's own embeddings."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    os.makedirs(os.path.join(output_dir, "1_Pooling"), exist_ok=True)
    os.makedirs(os.path.join(output_dir, "2_Normalize"), exist_ok=True)
    with open(os.path.join(output_dir, "modules.json"), "w", encoding="utf-8") as f:
        json.dump(modules, f, indent=2)
    pool_cfg = {
        "word_embedding_dimension": dim,
        "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_max_tokens": pooling == "max",
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_lasttoken": pooling == "last",
    }
    with open(os.path.join(output_dir, "1_Pooling", "config.json"), "w", encoding="utf-8") as f:
        json.dump(pool_cfg, f, indent=2)
    with open(os.path.join(output_dir, "sentence_bert_config.json"), "w", encoding="utf-8") as f:
        json.dump({"max_seq_length": max_seq_length or 512, "do_lower_case": False}, f, indent=2)
