"""A saved folder's weights loaded into a backbone that exists already, in place.

:func:`load_backbone_weights` takes what a checkpoint or model folder holds (a PEFT adapter,
or full safetensors weights, sharded or not) and loads it into the bare backbone (what
``AutoModel`` builds) without building a model: resuming, ``--resume_only_model``,
``--load_best_model_at_end``. Weights are matched by name under transformers' own renaming
rules, so mmembed's checkpoints, ms-swift's (adapter or full class) and ZeRO-3-gathered
saves all load (a full class's head, which the backbone has not, is left out); any other
weight the model lacks, or a model weight the folder lacks, is an error naming them. Parameters ZeRO-3 has partitioned are gathered for the load.
"""

from __future__ import annotations

import glob
import logging
import os

import torch

from .adapters import is_adapter, read_adapter_weights, set_lora_weights


def load_backbone_weights(backbone: torch.nn.Module, folder: str) -> None:
    """Load a checkpoint's weights (PEFT adapter or full safetensors) into ``backbone`` in place.
    Parameters ZeRO-3 has partitioned (loaded under ``zero.Init``) are gathered for the load and
    partitioned again from rank 0's copy after it (every process reads the same files)."""
    partitioned = [p for p in backbone.parameters() if hasattr(p, "ds_id")]
    if not partitioned:
        _load_backbone_weights(backbone, folder)
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0):
        _load_backbone_weights(backbone, folder)


def _as_loaded(state: dict[str, torch.Tensor], model: torch.nn.Module, source: str) -> dict[str, torch.Tensor]:
    """Saved weights under the names ``from_pretrained`` maps them to on ``model`` (the bare
    backbone), with transformers' own rule (``rename_source_key``): the checkpoint names of
    some weights (BERT's ``LayerNorm.gamma`` / ``beta`` when ZeRO-3 gathers the model to save
    it, Qwen2-VL's saved layout) are renamed, and the full class's prefix is taken off
    (``model.embed_tokens.weight`` of a ``Qwen3ForCausalLM`` or
    ``Qwen2VLForConditionalGeneration`` folder, as an ms-swift full checkpoint saves it). The
    weights outside the backbone there (the head: ``lm_head``) are left out, as
    ``AutoModel.from_pretrained`` leaves them out."""
    names = model.state_dict()
    if all(k in names for k in state):
        return state
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    try:
        mapping = get_model_conversion_mapping(model)
    except Exception:  # not a transformers model: its names are taken as they are
        return state
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    prefix = getattr(model, "base_model_prefix", "") or None
    renamed = {key: key if key in names else rename_source_key(key, renamings, converters, prefix, names)[0]
               for key in state}
    # a folder of the full class (its backbone's weights under the prefix): what it holds
    # beyond the backbone is its head
    full_class = prefix is not None and any(k.startswith(prefix + ".") and r != k for k, r in renamed.items())
    head = sorted(k for k, r in renamed.items() if full_class and r not in names and not k.startswith(prefix + "."))
    if head:
        logging.getLogger("mmembed").info(
            "%s: the full model's head weights (%s) are left out: the embedding model has no head",
            source, ", ".join(head[:4]))
    return {renamed[k]: v for k, v in state.items() if k not in head}


def _load_backbone_weights(backbone: torch.nn.Module, folder: str) -> None:
    from safetensors.torch import load_file

    if is_adapter(folder):
        # mmembed's adapters and ms-swift's (keys of the full causal-LM class) alike
        set_lora_weights(backbone, read_adapter_weights(folder), folder)
        return
    files = sorted(glob.glob(os.path.join(folder, "model*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{folder}: no adapter_model.safetensors or model.safetensors to load")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    state = _as_loaded(state, backbone, folder)
    missing, unexpected = backbone.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not m.endswith("position_ids")]:
        raise ValueError(f"{folder}: weights do not match the model (missing {missing[:5]}, unexpected {unexpected[:5]})")
