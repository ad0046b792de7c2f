"""``mmembed export`` of a reranker checkpoint: the folder transformers loads it with
(``AutoModelForSequenceClassification`` for a classifier, which ``sentence_transformers.CrossEncoder``
loads too; the causal LM / image-text-to-text model for a generative one), with the tokenizer
or processor, ``mmembed.json`` and the reranker card."""

from __future__ import annotations

import os

from ...encoding.templates import template_config
from ...files import folder_replaced_when_done
from ...model.io import save_tokenizer
from ...tools.export import exported_config


def export_reranker(checkpoint: str, output_dir: str) -> str:
    """:func:`export_checkpoint` of a reranker checkpoint (a LoRA adapter merged into its base,
    or a full checkpoint copied without its training state)."""
    import json

    from .card import write_reranker_card
    from .scorer import load_reranker_folder

    model, processing, template, info = load_reranker_folder(checkpoint, merge=True)
    with folder_replaced_when_done(output_dir) as tmp:
        model.backbone.save_pretrained(tmp, safe_serialization=True)
        model.save_head(tmp)  # a CrossEncoder folder's sentence-transformers files
        save_tokenizer(tmp, processing)
        cfg = exported_config(
            checkpoint, output_dir,
            task_type=info["task_type"],
            template=template_config(template),
            default_system=template.default_system,
            max_length=info["max_length"],
            tokens=info["tokens"],
            token_ids=list(model.token_ids) if model.kind == "generative" else None,
        )
        with open(os.path.join(tmp, "mmembed.json"), "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2, ensure_ascii=False)
        write_reranker_card(tmp, cfg, final_path=os.path.abspath(output_dir))
    return output_dir
