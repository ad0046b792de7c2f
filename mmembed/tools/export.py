"""``mmembed export``: a checkpoint -> a standalone folder (LoRA merged into the base).

The folder loads with ``transformers.AutoModel`` and, when sentence-transformers can embed
it as mmembed does (``writes_sentence_transformers``: text encoders whose template is the
text itself), with ``sentence_transformers.SentenceTransformer`` (modules.json, Pooling,
Normalize), giving the same embeddings as ``mmembed.Embedder`` on the checkpoint.

The checkpoint's task (:func:`mmembed.task.task_of_folder`) writes the folder. A reranker
checkpoint (``mmembed.json``'s ``task_type`` ``reranker`` / ``generative_reranker``) exports as the model transformers loads it with: ``AutoModelForSequenceClassification`` (a
classifier, its trained head merged in; ``sentence_transformers.CrossEncoder`` loads it too,
so it gets none of the embedding files: no modules.json or Pooling) or the causal LM /
image-text-to-text model (generative), with the tokenizer or processor, ``mmembed.json`` and
the reranker card (:mod:`mmembed.tasks.reranker.export`).
"""

from __future__ import annotations

import os
from typing import Any

from ..encoding.templates import template_config
from ..files import folder_replaced_when_done
from ..model.embedder import load_embedding_model
from ..model.embedding import hidden_size
from ..model.folder import write_saved_folder
from ..model.io import read_mmembed_config, save_tokenizer
from ..model.model_files import carry_model_files
from ..task import task_of_folder


def export_checkpoint(checkpoint: str, output_dir: str | None = None, merge_lora: bool = True) -> str:
    """Write the merged model of ``checkpoint`` to ``output_dir`` (default ``CHECKPOINT-merged``).

    The folder is written under a temporary name and renamed when complete, so a killed or
    failed export (full disk, read-only folder: :class:`~mmembed.files.WriteError`) never
    leaves a folder that looks whole.
    """
    if not merge_lora:
        raise ValueError("mmembed export writes a merged folder; pass --merge_lora true (a checkpoint already is the adapter)")
    checkpoint = checkpoint.rstrip("/")
    output_dir = output_dir or checkpoint + "-merged"
    if os.path.exists(output_dir):
        raise FileExistsError(f"{output_dir} already exists; remove it or pass another --output_dir")
    return task_of_folder(checkpoint).export(checkpoint, output_dir)


def exported_config(checkpoint: str, output_dir: str, **fields: Any) -> dict[str, Any]:
    """The ``mmembed.json`` of ``checkpoint``'s export to ``output_dir``: the checkpoint's own,
    with the model it was trained from kept (``trained_from``), the export as the base model of
    full weights (``base_model``, ``tuner_type``), where it came from (``exported_from``), and
    ``fields`` (what each task's export records anew)."""
    cfg = dict(read_mmembed_config(checkpoint) or {})
    cfg.setdefault("trained_from", cfg.get("base_model"))
    cfg.update(fields, base_model=os.path.abspath(output_dir), tuner_type="full",
               exported_from=os.path.abspath(checkpoint))
    return cfg


def export_embedding(checkpoint: str, output_dir: str) -> str:
    """:func:`export_checkpoint` of an embedding model's checkpoint (the embedding task's export)."""
    model, tokenizer, template, info = load_embedding_model(checkpoint, merge=True)
    with folder_replaced_when_done(output_dir) as tmp:
        model.backbone.save_pretrained(tmp, safe_serialization=True)
        model.save_head(tmp)  # a sentence-transformers folder's modules (Dense layers, ...)
        save_tokenizer(tmp, tokenizer)
        cfg = exported_config(checkpoint, output_dir, template=template_config(template),
                              default_system=template.default_system, pooling=info["pooling"],
                              max_length=info["max_length"])
        # QLoRA: the adapter was merged into the original full-precision weights (as ms-swift's
        # export does); the folder loads unquantized, and says how its adapter was trained
        if cfg.get("quantization"):
            cfg["trained_with_quantization"] = cfg.pop("quantization")
        write_saved_folder(tmp, cfg, hidden_size(model.backbone.config), final_path=os.path.abspath(output_dir),
                           tokenizer=tokenizer)
        carry_model_files(template, [checkpoint, info["base_model"]], tmp)  # UEmbed's sparse_info.json, ...
    return output_dir
