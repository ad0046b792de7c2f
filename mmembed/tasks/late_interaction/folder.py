"""A late-interaction model's saved folder: what a checkpoint holds beside the backbone's
weights (or LoRA adapter) and the tokenizer, and loading it back.

A checkpoint holds ``late_interaction_projection.safetensors`` (the projection, written by the
model's ``save_head``), ``mmembed.json`` (the template, the ``late_interaction`` settings, how it
was trained) and a model card. :func:`load_late_interaction` loads a checkpoint (a LoRA adapter
merged into its base unless ``merge=False``) or an exported folder as a
:class:`~mmembed.model.late_interaction.LateInteractionModel`.
"""

from __future__ import annotations

import os
from typing import Any

from ...errors import UsageError
from ...model.card import training_record
from ...model.embedder import load_embedding_model
from ...model.io import read_mmembed_config, write_mmembed_config
from ...model.late_interaction import LateInteractionModel, skiplist_token_ids
from ...model.multivector_io import load_projection, projection_from_weight
from .settings import LateInteractionSettings, saved_settings


def write_late_interaction_folder(output_dir: str, config: dict[str, Any], dim: int,
                                  log_history: list[dict] | None = None, final_path: str | None = None,
                                  global_step: int | None = None, tokenizer: Any = None) -> dict[str, Any]:
    """``mmembed.json`` (with the training so far, from ``log_history``) and the model card
    of a saved late-interaction folder (the task's :meth:`~mmembed.task.Task.folder_writer`)."""
    config = dict(config)
    if log_history is not None:
        config["training"] = training_record(config, log_history, global_step)
    config["sentence_transformers"] = False  # `mmembed export` writes the MultiVectorEncoder folder
    write_mmembed_config(output_dir, **config)
    write_card(output_dir, config, final_path)
    return config


def write_card(output_dir: str, config: dict[str, Any], final_path: str | None = None) -> None:
    """``README.md``: what the folder is and how to use it."""
    settings = LateInteractionSettings.from_record(config)
    path = final_path or output_dir
    expansion = {"mask": f"padded to {settings.query_length} tokens with `{settings.expansion_token}` (ColBERT)",
                 "augment": f"{settings.query_length} `{settings.expansion_token}` tokens appended (ColQwen)",
                 "none": "as written"}[settings.expansion]
    training = config.get("training") or {}
    lines = [
        "---", "library_name: mmembed", "tags:", "- late-interaction", "- colbert", "- multi-vector", "---", "",
        f"# {os.path.basename(os.path.abspath(path))}", "",
        f"A late-interaction (multi-vector) model trained by mmembed from `{config.get('base_model', '?')}` "
        f"(`--task_type late_interaction`, `--loss_type {config.get('loss_type')}`, `--tuner_type "
        f"{config.get('tuner_type')}`): one {settings.dim}-d L2-normalised vector per token, a query scored "
        "against a document by MaxSim (the sum over the query's tokens of the best dot product with the "
        "document's tokens" + (", divided by the query's number of tokens)." if settings.normalize_scores else ")."),
        "",
        f"- queries: {expansion}",
        f"- documents: {'punctuation left out' if settings.skiplist else 'every token kept'}",
    ]
    if training:
        lines.append(f"- trained {training.get('global_step', '?')} steps" + (
            f", last training loss {training['train_loss']:.4g}" if isinstance(training.get("train_loss"), float) else ""))
    lines += ["", "## Use", "", "```bash",
              f"mmembed rerank --model {path} --query 'a question' --documents docs.txt",
              f"mmembed export --adapters {path}   # a MultiVectorEncoder / ColQwen2ForRetrieval folder",
              "```", ""]
    with open(os.path.join(output_dir, "README.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


def late_interaction_head(settings: LateInteractionSettings, projection_folder: str | None = None):
    """``head(backbone, template, processing)`` for
    :func:`~mmembed.model.embedder.load_embedding_model`: the backbone with the saved projection."""

    def head(backbone, template, processing) -> LateInteractionModel:
        projection = projection_from_weight(load_projection(projection_folder)) if projection_folder else None
        tokenizer = getattr(processing, "tokenizer", None) or processing
        return LateInteractionModel(backbone, settings.dim, skiplist_ids=skiplist_token_ids(tokenizer, settings.skiplist),
                                    tower=template.tower, projection=projection, length_chunks=1)

    return head


def load_late_interaction(path: str, torch_dtype: str | None = None, merge: bool = True
                          ) -> tuple[LateInteractionModel, Any, Any, dict[str, Any], LateInteractionSettings]:
    """A saved late-interaction folder (checkpoint or export) as ``(model, processing, template,
    info, settings)``; ``info`` as :func:`~mmembed.model.embedder.load_embedding_model` gives it."""
    cfg = read_mmembed_config(path) or {}
    settings = saved_settings(cfg)
    if settings is None:
        raise UsageError(f"{path}: not a late-interaction model (its mmembed.json has no late_interaction settings)")
    model, processing, template, info = load_embedding_model(path, torch_dtype, merge=merge,
                                                             head=late_interaction_head(settings, path))
    return model.eval(), processing, template, info, settings
