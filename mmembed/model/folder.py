"""Writing a saved folder (a training checkpoint or ``mmembed export``) beside its weights:
the files of :mod:`mmembed.model.io` (``mmembed.json``, the tokenizer's suffix, the
sentence-transformers files) and the model card of :mod:`mmembed.model.card`."""

from __future__ import annotations

from typing import Any

from .card import training_record, write_model_card
from .io import (
    base_model_folder,
    read_sentence_transformers_prompts,
    sentence_transformers_prompts,
    text_form,
    write_mmembed_config,
    write_sentence_transformers_config,
    write_tokenizer_suffix,
    writes_sentence_transformers,
)


def write_saved_folder(output_dir: str, config: dict[str, Any], dim: int, log_history: list[dict] | None = None,
                       final_path: str | None = None, global_step: int | None = None,
                       tokenizer: Any = None) -> dict[str, Any]:
    """Everything a saved folder (training checkpoint or ``mmembed export``) holds beside the
    weights and the tokenizer, from its ``mmembed.json`` fields: ``mmembed.json`` itself (with
    a summary of the training so far when ``log_history``, the Trainer's, is given), the
    saved tokenizer set to append the template's suffix, the sentence-transformers files
    (``writes_sentence_transformers``) and the model card (``README.md``, naming the folder
    ``final_path`` when it is written under a temporary name). ``tokenizer`` is the tokenizer
    (or processor) just saved there, which spares loading it back. Returns the fields written to
    ``mmembed.json``."""
    config = dict(config)
    if log_history is not None:
        config["training"] = training_record(config, log_history, global_step)
    form = text_form(config)
    tokenizer_ok = form is not None and write_tokenizer_suffix(
        output_dir, form, config.get("padding_side") or _template_padding_side(config),
        getattr(tokenizer, "tokenizer", tokenizer))  # a processor holds its tokenizer
    st = tokenizer_ok and writes_sentence_transformers(config)
    config.pop("sentence_transformers_prompts", None)  # an exported checkpoint's: written anew below
    if st:
        prompts, default_name = sentence_transformers_prompts(
            config, read_sentence_transformers_prompts(base_model_folder(config)))
        write_sentence_transformers_config(output_dir, dim, config["pooling"], config.get("max_length"),
                                           prompts=prompts, default_prompt_name=default_name,
                                           modules=config.get("sentence_transformers_modules"))
        config["sentence_transformers_prompts"] = prompts
    config["sentence_transformers"] = st
    write_mmembed_config(output_dir, **config)
    write_model_card(output_dir, config, form if tokenizer_ok else None, final_path)
    return config


def _template_padding_side(config: dict[str, Any]) -> str:
    from ..encoding.templates import template_from_config

    return template_from_config(config["template"]).padding_side
