"""What a saved folder holds beside the weights: ``mmembed.json`` (template, pooling, base
model: what is needed to embed with it) and the sentence-transformers files."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from ..files import read_json_once

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


# sentence-transformers 6 pools "lasttoken"; mmembed says "last"
ST_POOLING = {"last": "lasttoken", "mean": "mean", "cls": "cls", "max": "max"}
_CONTENT = "\x00mmembed:content\x00"
_SYSTEM = "\x00mmembed:system\x00"


@dataclass(frozen=True)
class TextForm:
    """How a text template's rendering splits around the input text, so that a tokenizer call
    on ``prompt + text`` gives the template's token ids:

    ``render(text, system) == prompt(system) + text + suffix``

    - ``prompt``: what goes before the text with the folder's default system prompt (or none):
      sentence-transformers' default prompt.
    - ``prompt_format``: the prefix for any other system prompt, with ``{system}`` where it goes
      (``None``: the template takes no system prompt).
    - ``suffix``: what the template appends after the text (``<|endoftext|>`` for gte-Qwen2 and
      Qwen3-Embedding). The saved tokenizer appends it itself (its post-processor), so
      ``tokenizer(prompt + text)`` ends with it, as it ends with [SEP] for BERT.
    - ``add_special_tokens``: the template lets the tokenizer add its own special tokens
      ([CLS] ... [SEP]); then ``suffix`` is empty and the tokenizer is saved as it is.
    """

    prompt: str
    prompt_format: str | None
    suffix: str
    add_special_tokens: bool


def text_form(config: dict[str, Any]) -> TextForm | None:
    """The ``TextForm`` of a folder saved with these ``mmembed.json`` fields, or ``None`` when
    its embeddings cannot be reproduced as ``tokenizer(prompt + text)`` -> model -> pooling ->
    L2 normalization: a template with media placeholders, unnormalized embeddings, a template
    whose end depends on the system prompt, or one that appends text after the input and also
    wants the tokenizer's own special tokens."""
    from ..data.sample import Item
    from ..encoding.templates import template_from_config

    if config.get("media") or not config.get("normalize", True) or not config.get("template"):
        return None
    template = template_from_config(config["template"])
    if template.media:
        return None

    def split(system: str) -> tuple[str, str]:
        prefix, _, suffix = template.render(Item(text=_CONTENT, system=system)).partition(_CONTENT)
        return prefix, suffix

    default = config.get("default_system", template.default_system) or ""
    prompt, suffix = split(default)
    plain_prefix, plain_suffix = split("")
    sys_prefix, sys_suffix = split(_SYSTEM)
    if {plain_suffix, sys_suffix} != {suffix} or _SYSTEM in suffix:
        return None  # the text's end would depend on the prompt: not a prompt prepended to the text
    prompt_format = None
    if _SYSTEM in sys_prefix:
        prompt_format = sys_prefix.replace("{", "{{").replace("}", "}}").replace(_SYSTEM, "{system}")
    if template.add_special_tokens and suffix:
        return None
    return TextForm(prompt=prompt, prompt_format=prompt_format, suffix=suffix, add_special_tokens=template.add_special_tokens)


def writes_sentence_transformers(config: dict[str, Any]) -> bool:
    """Whether a folder saved with these ``mmembed.json`` fields gets the sentence-transformers
    files: only when ``SentenceTransformer(folder).encode(texts)`` gives the embeddings that
    ``mmembed.Embedder`` gives. Training checkpoints and ``mmembed export`` both ask here.

    The folder must hold the whole model (a LoRA adapter is exported first) and a text
    template (``text_form``): sentence-transformers prepends the default system prompt as its
    default prompt, and the saved tokenizer appends what the template appends after the text.
    """
    return config.get("tuner_type") == "full" and text_form(config) is not None


def suffix_ids(tokenizer: Any, suffix: str) -> list[int] | None:
    """The token ids the tokenizer gives ``suffix`` when it follows any text, or ``None`` when
    they depend on the text before it. Added (special) tokens are split off before the rest is
    tokenized, so a suffix that starts with one tokenizes the same after any text."""
    if not suffix:
        return []
    added = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)
    if not any(suffix.startswith(tok) for tok in added):
        return None
    ids = tokenizer(suffix, add_special_tokens=False)["input_ids"]
    for text in ("a", "Hello world.", " x\n"):  # the split holds on real text too
        whole = tokenizer(text + suffix, add_special_tokens=False)["input_ids"]
        if whole != tokenizer(text, add_special_tokens=False)["input_ids"] + ids:
            return None
    return ids


def write_tokenizer_suffix(output_dir: str, form: TextForm, padding_side: str, tokenizer: Any = None) -> bool:
    """Make the saved tokenizer (``tokenizer.json``) append ``form.suffix`` itself when it adds
    special tokens, and pad on the template's side (``tokenizer_config.json``). mmembed renders
    the suffix into the text and tokenizes without special tokens, so its own embeddings of the
    folder do not change; ``tokenizer(prompt + text)`` (transformers, sentence-transformers)
    now gives the template's ids. ``tokenizer`` is the one just saved there (loaded from the
    folder when not given). Returns whether the tokenizer could be written so."""
    tok_json = os.path.join(output_dir, "tokenizer.json")
    tok_cfg = os.path.join(output_dir, "tokenizer_config.json")
    if not (os.path.isfile(tok_json) and os.path.isfile(tok_cfg)):
        return False
    if not form.add_special_tokens:
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(output_dir)
        ids = suffix_ids(tokenizer, form.suffix)
        if ids is None:
            return False
        _write_post_processor(tok_json, ids, tokenizer.convert_ids_to_tokens(ids))
    with open(tok_cfg, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["padding_side"] = padding_side
    for key in ("add_bos_token", "add_eos_token"):  # these would make transformers rebuild the post-processor
        cfg.pop(key, None)
    with open(tok_cfg, "w", encoding="utf-8") as f:
        json.dump(cfg, f, ensure_ascii=False, indent=2)
    return True


def _write_post_processor(tok_json: str, ids: list[int], tokens: list[str]) -> None:
    """Set ``tok_json``'s post-processor to append the template's suffix (``ids``) after each sequence.

    Read and written by the tokenizers library itself (a Qwen ``tokenizer.json`` is 11-19 MB:
    Python's indenting JSON encoder took over a second per checkpoint)."""
    from tokenizers import Tokenizer, processors

    backend = Tokenizer.from_file(tok_json)
    name = "suffix"  # the special token's name in the template (the suffix itself may hold ':' or spaces)
    after = [f"{name}:0"] if ids else []
    single, pair = ["$A:0", *after], ["$A:0", *after, "$B:1", *([f"{name}:1"] if ids else [])]
    special = [{"id": name, "ids": ids, "tokens": tokens}] if ids else []
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
    backend.save(tok_json)


def write_added_tokens_decoder(output_dir: str, tokenizer: Any) -> None:
    """Record the saved tokenizer's added tokens in its ``tokenizer_config.json``
    (``added_tokens_decoder``), as the hub's Qwen folders and transformers 4 have them.
    transformers 5 saves them in ``tokenizer.json`` only, and its loader then parses that
    whole file a second time to find them (a Qwen ``tokenizer.json`` is 11-19 MB: ~0.7 s of
    every load). ``tokenizer``: the tokenizer (or processor) just saved there; a folder that
    has the field, or no ``tokenizer.json``, is left as it is."""
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    tok_cfg = os.path.join(output_dir, "tokenizer_config.json")
    added = getattr(tok, "added_tokens_decoder", None)
    if not added or not (os.path.isfile(tok_cfg) and os.path.isfile(os.path.join(output_dir, "tokenizer.json"))):
        return
    with open(tok_cfg, encoding="utf-8") as f:
        cfg = json.load(f)
    if "added_tokens_decoder" in cfg:
        return
    cfg["added_tokens_decoder"] = {str(i): token.__getstate__() for i, token in sorted(added.items())}
    with open(tok_cfg, "w", encoding="utf-8") as f:
        json.dump(cfg, f, ensure_ascii=False, indent=2)


def save_tokenizer(output_dir: str, processing: Any) -> None:
    """``processing`` (a tokenizer or processor) saved into ``output_dir`` with its added
    tokens listed in ``tokenizer_config.json`` (:func:`write_added_tokens_decoder`): how
    every saved folder (checkpoints, exports) gets its tokenizer."""
    processing.save_pretrained(output_dir)
    write_added_tokens_decoder(output_dir, processing)


ST_CONFIG = "config_sentence_transformers.json"


def read_sentence_transformers_prompts(folder: str | None) -> dict[str, str]:
    """The named prompts of a sentence-transformers folder (``config_sentence_transformers.json``;
    e.g. Qwen3-Embedding's ``query`` instruction): ``{}`` when it has none."""
    path = os.path.join(folder, ST_CONFIG) if folder else ""
    if not path or not os.path.isfile(path):
        return {}
    try:
        prompts = read_json_once(path).get("prompts") or {}
    except (OSError, ValueError, AttributeError):
        return {}
    return {k: v for k, v in prompts.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(prompts, dict) else {}


def instructions_of(config: dict[str, Any]) -> dict[str, Any]:
    """The ``instructions`` a folder's ``mmembed.json`` records: ``{"query": str|None,
    "document": str|None, "datasets": {name: {"query": ..., "document": ...}}}`` (``--query_system``,
    ``--document_system``, and each dataset's), with what is missing as ``None`` / ``{}``."""
    raw = config.get("instructions") or {}
    datasets = raw.get("datasets") or {}
    return {"query": raw.get("query"), "document": raw.get("document"),
            "datasets": {str(name): {"query": (d or {}).get("query"), "document": (d or {}).get("document")}
                         for name, d in datasets.items()}}


def configured_template(config: dict[str, Any]):
    """The template a folder's ``mmembed.json`` fields name, with the system prompt
    (``default_system``) and the side instructions (``instructions``) it was trained with."""
    import dataclasses

    from ..encoding.templates import template_from_config

    template = template_from_config(config["template"])
    if "default_system" in config:
        template = dataclasses.replace(template, default_system=config["default_system"])
    instructions = instructions_of(config)
    for side in ("query", "document"):
        if instructions[side] is not None:
            template = dataclasses.replace(template, **{side + "_system": instructions[side]})
    return template


def base_model_folder(config: dict[str, Any]) -> str | None:
    """The model a run started from (an export's ``trained_from``, else ``base_model``)."""
    return config.get("trained_from") or config.get("base_model")


def sentence_transformers_prompts(config: dict[str, Any], base_prompts: dict[str, str]) -> tuple[dict[str, str], str | None]:
    """The ``prompts`` and ``default_prompt_name`` of a text folder saved with these
    ``mmembed.json`` fields, each prompt what the template renders before the text:

    - ``query`` / ``document``: the side's instruction (``--query_system`` /
      ``--document_system``, else ``--system`` or the template's). A side with none keeps the
      base model's prompt of that name (e.g. Qwen3-Embedding's ``query`` instruction), else
      gets the plain prefix (``""``);
    - ``<dataset>_query`` / ``<dataset>_document``: each dataset's own instructions;
    - ``default``: only where both sides and the text embedded without a side agree on a
      non-empty prompt; then it is ``default_prompt_name``.

    Every other prompt of the base model (``base_prompts``) is kept."""
    from ..data.sample import Item
    from ..encoding.templates import SIDES

    template = configured_template(config)

    def prefix(item: Item, side: str | None = None) -> str:
        return template.render(item, side).partition(_CONTENT)[0]

    prompts = dict(base_prompts)
    for side in SIDES:
        if template.side_system(side) is not None or side not in base_prompts:
            prompts[side] = prefix(Item(text=_CONTENT), side)
    for name, own in instructions_of(config)["datasets"].items():
        for side in SIDES:
            if own[side] is not None:
                prompts[f"{name}_{side}"] = prefix(Item(text=_CONTENT, system=own[side]))
    plain = prefix(Item(text=_CONTENT))
    if prompts["query"] == prompts["document"] == plain and plain:
        prompts["default"] = plain
        return prompts, "default"
    return prompts, None


def write_sentence_transformers_config(output_dir: str, dim: int, pooling: str, max_seq_length: int | None,
                                       prompt: str = "", prompts: dict[str, str] | None = None,
                                       default_prompt_name: str | None = None,
                                       modules: list[dict[str, Any]] | None = None) -> None:
    """Files that let ``sentence_transformers.SentenceTransformer(output_dir)`` load the folder
    as Transformer (text only) -> Pooling -> Normalize, with ``prompts`` (named prompts:
    ``query`` and ``document`` for ``encode_query`` / ``encode_document``) and
    ``default_prompt_name``; or, without ``prompts``, ``prompt`` as its default prompt.
    ``modules``: the ``modules.json`` entries of a pipeline of the model's own (a
    sentence-transformers folder's Dense layers, ...), whose module folders the model wrote
    (:meth:`~mmembed.model.embedding.EmbeddingModel.save_head`), in place of Pooling -> Normalize."""
    if modules is not None:
        _write_json(os.path.join(output_dir, "modules.json"), modules)
        _write_transformer_config(output_dir, max_seq_length)
        _write_st_config(output_dir, prompt, prompts, default_prompt_name)
        return
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    os.makedirs(os.path.join(output_dir, "1_Pooling"), exist_ok=True)
    os.makedirs(os.path.join(output_dir, "2_Normalize"), exist_ok=True)
    _write_json(os.path.join(output_dir, "modules.json"), modules)
    # the pooling_mode_* flags are what sentence-transformers < 6 reads; 6 reads them too
    pool_cfg = {
        "word_embedding_dimension": dim,
        "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_max_tokens": pooling == "max",
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": pooling == "last",
        "include_prompt": True,
    }
    _write_json(os.path.join(output_dir, "1_Pooling", "config.json"), pool_cfg)
    _write_transformer_config(output_dir, max_seq_length)
    _write_st_config(output_dir, prompt, prompts, default_prompt_name)


def _write_transformer_config(output_dir: str, max_seq_length: int | None) -> None:
    # text only: a tokenizer with a chat template would otherwise be fed chat messages
    _write_json(os.path.join(output_dir, "sentence_bert_config.json"), {
        "max_seq_length": max_seq_length or 512,
        "do_lower_case": False,
        "transformer_task": "feature-extraction",
        "modality_config": {"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
        "module_output_name": "token_embeddings",
    })


def _write_st_config(output_dir: str, prompt: str, prompts: dict[str, str] | None,
                     default_prompt_name: str | None) -> None:
    if prompts is None:
        prompts = {"default": prompt} if prompt else {}
        default_prompt_name = "default" if prompt else None
    _write_json(os.path.join(output_dir, ST_CONFIG), {
        "model_type": "SentenceTransformer",
        "prompts": prompts,
        "default_prompt_name": default_prompt_name,
        "similarity_fn_name": "cosine",
    })


def _write_json(path: str, value: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
