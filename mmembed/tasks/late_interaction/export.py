"""``mmembed export`` of a late-interaction checkpoint: the LoRA adapter merged into the
backbone (or the full weights copied), with the projection, ``mmembed.json`` and the card, so
mmembed loads the folder as it loads the checkpoint; and beside them the folder the users'
libraries load with the same token vectors:

- a text encoder trained with the ``mask`` or ``none`` query expansion: the same folder is a
  sentence-transformers ``MultiVectorEncoder`` (Transformer / ``1_Dense`` / ``2_MultiVectorMask``
  / ``3_Normalize``, ``config_sentence_transformers.json`` with ``model_type``
  ``MultiVectorEncoder``; :func:`~mmembed.model.multivector_io.write_multivector_folder`), and
  ``pylate/`` holds PyLate 1.6's layout of it (``pylate.models.ColBERT``), when PyLate can
  express it (the ``mask`` expansion, raw MaxSim);
- a Qwen2-VL / Qwen2.5-VL backbone: ``colqwen2/`` is a transformers ``ColQwen2ForRetrieval``
  folder (:func:`~mmembed.model.multivector_io.write_colqwen2_folder`).
"""

from __future__ import annotations

import os

from ...files import folder_replaced_when_done
from ...model.io import save_tokenizer, text_form
from ...model.multivector_io import save_projection, write_colqwen2_folder, write_multivector_folder
from ...tools.export import exported_config
from .folder import load_late_interaction, write_late_interaction_folder

COLQWEN2_TYPES = ("qwen2_vl", "qwen2_5_vl")


def export_late_interaction(checkpoint: str, output_dir: str) -> str:
    """Write the merged late-interaction model of ``checkpoint`` to ``output_dir`` (see the module)."""
    model, processing, template, info, settings = load_late_interaction(checkpoint, merge=True)
    cfg = exported_config(checkpoint, output_dir, max_length=info["max_length"])
    tokenizer = getattr(processing, "tokenizer", None) or processing
    form = text_form(cfg)
    multivector = (not template.media and settings.expansion in ("mask", "none") and form is not None
                   and not form.suffix and not form.prompt)
    written = []
    with folder_replaced_when_done(output_dir) as tmp:
        if multivector:  # the backbone at the root, as a MultiVectorEncoder folder holds it
            write_multivector_folder(tmp, model, tokenizer=tokenizer, skiplist=settings.skiplist,
                                     query_length=settings.query_length if settings.expansion == "mask" else None,
                                     document_length=info["max_length"], query_expansion=settings.query_expansion(),
                                     normalize_scores=settings.normalize_scores)
            written.append("sentence-transformers MultiVectorEncoder")
            if settings.expansion == "mask" and not settings.normalize_scores:
                write_multivector_folder(os.path.join(tmp, "pylate"), model, tokenizer=tokenizer,
                                         skiplist=settings.skiplist, query_length=settings.query_length,
                                         document_length=info["max_length"], query_expansion=settings.query_expansion(),
                                         flavor="pylate")
                written.append("PyLate ColBERT (pylate/)")
        else:
            model.backbone.save_pretrained(tmp, safe_serialization=True)
        save_tokenizer(tmp, processing)
        save_projection(tmp, model)
        if model.backbone.config.model_type in COLQWEN2_TYPES and template.media:
            write_colqwen2_folder(os.path.join(tmp, "colqwen2"), model, processing)
            written.append("transformers ColQwen2ForRetrieval (colqwen2/)")
        cfg["exported_formats"] = written
        write_late_interaction_folder(tmp, cfg, settings.dim, final_path=os.path.abspath(output_dir))
    return output_dir
