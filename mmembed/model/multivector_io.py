"""Saved forms of a late-interaction model (:mod:`mmembed.model.late_interaction`).

- :func:`write_multivector_folder`: a folder sentence-transformers 6.2 loads as a
  ``MultiVectorEncoder`` as it is (``flavor="sentence-transformers"``: Transformer /
  ``1_Dense`` / ``2_MultiVectorMask`` / ``3_Normalize``), or the PyLate 1.6 layout
  (``flavor="pylate"``: ``model_type: "ColBERT"``, Transformer / ``1_Dense``, the ColBERT settings
  at the top of ``config_sentence_transformers.json``), which ``pylate.models.ColBERT`` loads.
- :func:`write_colqwen2_folder`: a Qwen2-VL / Qwen2.5-VL late-interaction model as a transformers
  ``ColQwen2ForRetrieval`` folder (with a ``ColQwen2Processor``).
- mmembed's own checkpoints: :func:`save_projection` / :func:`load_projection` (the projection
  in ``late_interaction_projection.safetensors``, key ``linear.weight``) and
  :func:`late_interaction_config` / :func:`read_late_interaction_config` (the settings that go into
  ``mmembed.json`` under :data:`LATE_INTERACTION_KEY`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .late_interaction import (
    PROJECTION_FILE,
    PROJECTION_KEY,
    PUNCTUATION_SKIPLIST,
    LateInteractionModel,
    _weight_of,
    load_projection,
    query_expansion_config,
    save_projection,
)

__all__ = ["LATE_INTERACTION_KEY", "PROJECTION_FILE", "PROJECTION_KEY", "late_interaction_config", "load_projection",
           "projection_from_weight", "read_late_interaction_config", "save_projection", "weight_digest",
           "write_colqwen2_folder", "write_multivector_folder"]

#: the key of mmembed.json that holds :func:`late_interaction_config`
LATE_INTERACTION_KEY = "late_interaction"
# the files of a transformers model folder that a multi-vector folder keeps (weights, config, tokenizer)
_MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "merges.txt",
                "special_tokens_map.json", "added_tokens.json", "sentencepiece.bpe.model", "spiece.model",
                "tokenizer.model", "chat_template.jinja", "chat_template.json", "generation_config.json")


# --- mmembed's own checkpoints ---------------------------------------------------------------

def projection_from_weight(weight: torch.Tensor) -> nn.Linear:
    """An ``nn.Linear(hidden, dim, bias=False)`` holding ``weight`` ``[dim, hidden]`` (to pass as
    :class:`LateInteractionModel`'s ``projection``)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
    return linear


def late_interaction_config(dim: int, *, skiplist: Sequence[str] = PUNCTUATION_SKIPLIST,
                            query_length: int | None = None, document_length: int | None = None,
                            query_expansion: dict[str, Any] | None = None, normalize_scores: bool = False,
                            query_prefix: str = "", document_prefix: str = "") -> dict[str, Any]:
    """The late-interaction settings of a checkpoint, for ``mmembed.json[LATE_INTERACTION_KEY]``:
    ``dim``; ``skiplist`` (words dropped from documents); ``query_length`` /
    ``document_length`` (token caps, ``None``: the model's max length); ``query_expansion``
    (sentence-transformers' dict, :func:`~mmembed.model.late_interaction.query_expansion_config`,
    or ``None``); ``normalize_scores`` (MaxSim divided by the query's token count: colpali's
    ``normalize_scores``, sentence-transformers' ``meanmaxsim``); the query / document prefixes."""
    if query_expansion is not None:
        query_expansion = query_expansion_config(**query_expansion)
    config = {"dim": int(dim), "skiplist": list(skiplist), "query_length": query_length,
              "document_length": document_length, "query_expansion": query_expansion,
              "normalize_scores": bool(normalize_scores), "query_prefix": query_prefix,
              "document_prefix": document_prefix, "projection_file": PROJECTION_FILE}
    return read_late_interaction_config({LATE_INTERACTION_KEY: config})


def read_late_interaction_config(mmembed_config: dict[str, Any]) -> dict[str, Any]:
    """The validated ``late_interaction`` entry of an ``mmembed.json`` (a ``ValueError`` naming the
    field when one is wrong or missing)."""
    config = mmembed_config.get(LATE_INTERACTION_KEY)
    if not isinstance(config, dict):
        raise ValueError(f"mmembed.json has no {LATE_INTERACTION_KEY!r} object")
    out = dict(config)
    if not isinstance(out.get("dim"), int) or out["dim"] < 1:
        raise ValueError(f"{LATE_INTERACTION_KEY}.dim must be a positive int, got {out.get('dim')!r}")
    for key in ("query_length", "document_length"):
        value = out.get(key)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{LATE_INTERACTION_KEY}.{key} must be a positive int or null, got {value!r}")
    if not isinstance(out.get("skiplist", []), list) or not all(isinstance(w, str) for w in out.get("skiplist", [])):
        raise ValueError(f"{LATE_INTERACTION_KEY}.skiplist must be a list of strings")
    out.setdefault("skiplist", [])
    if out.get("query_expansion") is not None:
        out["query_expansion"] = query_expansion_config(**out["query_expansion"])
    out["normalize_scores"] = bool(out.get("normalize_scores", False))
    out.setdefault("query_prefix", "")
    out.setdefault("document_prefix", "")
    out.setdefault("projection_file", PROJECTION_FILE)
    return out


def weight_digest(weight: torch.Tensor) -> str:
    """sha256 of a weight's float32 bytes (to check two projections are the same)."""
    return hashlib.sha256(weight.detach().cpu().float().contiguous().numpy().tobytes()).hexdigest()


# --- sentence-transformers / PyLate folders --------------------------------------------------

def _write_json(path: str, value: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
        f.write("\n")


def _is_peft(model: nn.Module) -> bool:
    return callable(getattr(model, "get_base_model", None)) and hasattr(model, "peft_config")


def _write_backbone(output_dir: str, backbone: str | nn.Module, tokenizer: Any) -> None:
    """The transformers model (weights, config, tokenizer) at the root of ``output_dir``."""
    if isinstance(backbone, str):
        if not os.path.isfile(os.path.join(backbone, "config.json")):
            raise FileNotFoundError(f"{backbone}: no config.json (a transformers model folder)")
        weights = [f for f in os.listdir(backbone) if f.startswith("model") and (f.endswith(".safetensors")
                                                                                or f == "model.safetensors.index.json")]
        if not weights:
            raise FileNotFoundError(f"{backbone}: no model*.safetensors")
        for name in [*_MODEL_FILES, *weights]:
            if os.path.isfile(os.path.join(backbone, name)):
                shutil.copyfile(os.path.join(backbone, name), os.path.join(output_dir, name))
        if tokenizer is None:
            return
    else:
        if _is_peft(backbone):
            raise ValueError("the backbone is a PEFT (LoRA) model: merge it first (merge_and_unload(), or "
                             "mmembed export --merge_lora true) and write the merged model")
        backbone.save_pretrained(output_dir, safe_serialization=True)
        if tokenizer is None:
            raise ValueError("a backbone passed as a model needs its tokenizer")
    tokenizer.save_pretrained(output_dir)


def write_multivector_folder(output_dir: str, backbone: str | nn.Module | LateInteractionModel,
                             projection: nn.Module | torch.Tensor | None = None, *, tokenizer: Any = None,
                             query_prefix: str = "", document_prefix: str = "",
                             skiplist: Sequence[str] = PUNCTUATION_SKIPLIST, query_length: int | None = None,
                             document_length: int | None = None,
                             query_expansion: dict[str, Any] | None = None, normalize_scores: bool = False,
                             flavor: str = "sentence-transformers") -> str:
    """Write a late-interaction text model as a sentence-transformers / PyLate folder.

    Args:
        output_dir: the folder to write (created).
        backbone: the transformers model's folder (its config, safetensors weights and tokenizer
            files are copied), or the model itself (saved with ``save_pretrained``; a PEFT model
            must be merged first), or a :class:`LateInteractionModel` (its backbone and projection).
        projection: the projection (``nn.Linear`` or weight ``[dim, hidden]``); taken from
            ``backbone`` when that is a :class:`LateInteractionModel`.
        tokenizer: the tokenizer, needed when ``backbone`` is a model (saved beside it); with a
            folder, replaces the folder's tokenizer files when given.
        query_prefix, document_prefix: sentence-transformers flavour: the ``prompts`` (text put
            before the query / document). PyLate flavour: PyLate's prefixes, which PyLate inserts
            as one token after the first token (``[CLS]``), adding them to the vocabulary when
            missing: leave them empty unless the tokenizer holds them as tokens.
        skiplist: the words dropped from documents (ColBERT: ``string.punctuation``).
        query_length, document_length: token caps of queries / documents.
        query_expansion: sentence-transformers' ``query_expansion`` dict (``{"strategy": "fixed",
            "attend": False, "length": 32}`` is classic ColBERT), or ``None``. The PyLate flavour
            knows only the ``fixed`` strategy, with ``length == query_length``.
        normalize_scores: MaxSim divided by the query's length (``similarity_fn_name``
            ``meanmaxsim``; sentence-transformers flavour only).
        flavor: ``sentence-transformers`` (a ``MultiVectorEncoder`` folder) or ``pylate``.

    Returns:
        ``output_dir``.
    """
    if flavor not in ("sentence-transformers", "pylate"):
        raise ValueError(f"flavor must be sentence-transformers or pylate, got {flavor!r}")
    if isinstance(backbone, LateInteractionModel):
        projection = backbone.projection if projection is None else projection
        backbone = backbone.backbone
    if projection is None:
        raise ValueError("the projection is missing: pass projection=, or a LateInteractionModel")
    weight = _weight_of(projection)
    if query_expansion is not None:
        query_expansion = query_expansion_config(**query_expansion)
    dim, hidden = weight.shape
    os.makedirs(output_dir, exist_ok=True)
    _write_backbone(output_dir, backbone, tokenizer)
    from safetensors.torch import save_file

    os.makedirs(os.path.join(output_dir, "1_Dense"), exist_ok=True)
    save_file({PROJECTION_KEY: weight}, os.path.join(output_dir, "1_Dense", "model.safetensors"),
              metadata={"format": "pt"})
    if flavor == "pylate":
        _write_pylate(output_dir, dim, hidden, query_prefix, document_prefix, list(skiplist), query_length,
                      document_length, query_expansion, normalize_scores)
        return output_dir
    transformer: dict[str, Any] = {
        "transformer_task": "feature-extraction",
        "modality_config": {"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
        "module_output_name": "token_embeddings",
    }
    if query_length is not None:
        transformer["query_length"] = query_length
    if document_length is not None:
        transformer["document_length"] = document_length
    if query_expansion is not None:
        transformer["query_expansion"] = query_expansion
    _write_json(os.path.join(output_dir, "sentence_bert_config.json"), transformer)
    _write_json(os.path.join(output_dir, "1_Dense", "config.json"), {
        "in_features": hidden, "out_features": dim, "bias": False,
        "activation_function": "torch.nn.modules.linear.Identity",
        "module_input_name": "token_embeddings", "module_output_name": "token_embeddings"})
    os.makedirs(os.path.join(output_dir, "2_MultiVectorMask"), exist_ok=True)
    _write_json(os.path.join(output_dir, "2_MultiVectorMask", "config.json"),
                {"skiplist_words": list(skiplist), "skiplist_tasks": ["document"], "keep_only_token_ids": None})
    os.makedirs(os.path.join(output_dir, "3_Normalize"), exist_ok=True)
    _write_json(os.path.join(output_dir, "3_Normalize", "config.json"),
                {"module_input_name": "token_embeddings", "module_output_name": "token_embeddings"})
    _write_json(os.path.join(output_dir, "modules.json"), [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "sentence_transformers.base.modules.dense.Dense"},
        {"idx": 2, "name": "2", "path": "2_MultiVectorMask",
         "type": "sentence_transformers.multi_vector_encoder.modules.multi_vector_mask.MultiVectorMask"},
        {"idx": 3, "name": "3", "path": "3_Normalize", "type": "sentence_transformers.base.modules.normalize.Normalize"},
    ])
    _write_json(os.path.join(output_dir, "config_sentence_transformers.json"), {
        "model_type": "MultiVectorEncoder",
        "prompts": {"query": query_prefix, "document": document_prefix},
        "default_prompt_name": None,
        "similarity_fn_name": "meanmaxsim" if normalize_scores else "maxsim",
    })
    return output_dir


def _write_pylate(output_dir: str, dim: int, hidden: int, query_prefix: str, document_prefix: str,
                  skiplist: list[str], query_length: int | None, document_length: int | None,
                  query_expansion: dict[str, Any] | None, normalize_scores: bool) -> None:
    if normalize_scores:
        raise ValueError("PyLate scores with plain MaxSim: normalize_scores is not expressible in its folder")
    if query_expansion is not None:
        if query_expansion["strategy"] != "fixed" or query_expansion["token"] is not None:
            raise ValueError("PyLate expands queries with the fixed strategy and the mask (else eos) token only")
        if query_length is not None and query_length != query_expansion["length"]:
            raise ValueError(f"PyLate pads queries to query_length: query_length {query_length} must equal the "
                             f"expansion length {query_expansion['length']}")
        query_length = query_expansion["length"]
    _write_json(os.path.join(output_dir, "sentence_bert_config.json"),
                {"max_seq_length": document_length or query_length or 512, "do_lower_case": False})
    _write_json(os.path.join(output_dir, "1_Dense", "config.json"), {
        "in_features": hidden, "out_features": dim, "bias": False,
        "activation_function": "torch.nn.modules.linear.Identity", "use_residual": False})
    _write_json(os.path.join(output_dir, "modules.json"), [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"},
    ])
    _write_json(os.path.join(output_dir, "config_sentence_transformers.json"), {
        "model_type": "ColBERT",
        "prompts": {},
        "default_prompt_name": None,
        "similarity_fn_name": "MaxSim",
        "query_prefix": query_prefix,
        "document_prefix": document_prefix,
        "query_length": query_length,
        "document_length": document_length,
        "attend_to_expansion_tokens": bool(query_expansion and query_expansion["attend"]),
        "skiplist_words": skiplist,
        "do_query_expansion": query_expansion is not None,
    })


# --- transformers ColQwen2ForRetrieval -------------------------------------------------------

def write_colqwen2_folder(output_dir: str, model: LateInteractionModel, processor: Any, *,
                          query_prefix: str | None = None, visual_prompt_prefix: str | None = None) -> str:
    """Write a Qwen2-VL / Qwen2.5-VL :class:`LateInteractionModel` as a transformers
    ``ColQwen2ForRetrieval`` folder (``ColQwen2Config`` with the backbone's config as
    ``vlm_config`` and ``embedding_dim``; weights ``vlm.*`` and ``embedding_proj_layer.*``) with a
    ``ColQwen2Processor`` made of ``processor``'s tokenizer and image processor.

    ColQwen2's ``embedding_proj_layer`` has a bias: it is written as zeros. What
    ``ColQwen2ForRetrieval`` does differently from :class:`LateInteractionModel` (so its vectors
    are the same only on the same token inputs and positions):

    - it keeps every attended token (``embeddings * attention_mask``): no skiplist and no
      separately scored expansion positions;
    - ``ColQwen2Processor`` renders a query as ``query_prefix + text + pad_token * 10 + "\\n"``
      (the pad tokens are the query augmentation, attended) and an image document as
      ``visual_prompt_prefix`` (``<|im_start|>user\\n<|vision_start|><|image_pad|><|vision_end|>``
      ``Describe the image.<|im_end|><|endoftext|>``), not mmembed's templates;
    - it calls the language model with ``inputs_embeds`` and no ``image_grid_thw``, so unless the
      caller passes ``position_ids``, image tokens get sequential (1-D) rather than Qwen2-VL's
      multimodal (M-RoPE) positions; pass the positions of ``get_rope_index`` for the vectors
      the backbone was trained with.

    A PEFT (LoRA) backbone must be merged first.
    """
    from safetensors.torch import save_file
    from transformers import ColQwen2Config, ColQwen2Processor

    backbone = model.backbone
    if _is_peft(backbone):
        raise ValueError("the backbone is a PEFT (LoRA) model: merge it first (merge_and_unload()) and write the "
                         "merged model")
    config = backbone.config
    if config.model_type not in ("qwen2_vl", "qwen2_5_vl"):
        raise ValueError(f"ColQwen2ForRetrieval holds a Qwen2-VL or Qwen2.5-VL model, not {config.model_type!r}")
    state = backbone.state_dict()
    if any(k.startswith("model.") for k in state):  # a *ForConditionalGeneration: its base model, no lm_head
        state = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
    tensors = {f"vlm.{k}": v.detach().cpu().contiguous() for k, v in state.items()}
    weight = _weight_of(model.projection)
    dtype = next(iter(tensors.values())).dtype
    tensors["embedding_proj_layer.weight"] = weight.to(dtype)
    tensors["embedding_proj_layer.bias"] = torch.zeros(weight.shape[0], dtype=dtype)
    os.makedirs(output_dir, exist_ok=True)
    col_config = ColQwen2Config(vlm_config=config.to_dict(), embedding_dim=int(weight.shape[0]))
    col_config.architectures = ["ColQwen2ForRetrieval"]
    col_config.save_pretrained(output_dir)
    save_file(tensors, os.path.join(output_dir, "model.safetensors"), metadata={"format": "pt"})
    ColQwen2Processor(image_processor=processor.image_processor, tokenizer=processor.tokenizer,
                      query_prefix=query_prefix, visual_prompt_prefix=visual_prompt_prefix).save_pretrained(output_dir)
    return output_dir
