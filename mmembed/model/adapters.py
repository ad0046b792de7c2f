"""LoRA adapters in the layout ms-swift and PEFT use, read and written.

mmembed trains the bare backbone (what ``AutoModel`` loads: ``Qwen3Model``,
``Qwen2VLModel``). ms-swift trains the same weights inside the model family's full class
(``Qwen3ForCausalLM``, ``Qwen2VLForConditionalGeneration``), which holds the backbone as
``.model``, so its adapter keys read ``base_model.model.model.layers.0...`` where the
backbone's own would read ``base_model.model.layers.0...``; its ``target_modules`` may be a
regular expression over the full class's module names.

- Reading (:func:`load_lora`): the adapter's keys name its modules; they are matched against
  the backbone as they are, or with the one leading component the full class adds
  (``model.``) removed. The LoRA layers go on exactly those modules and every weight of the
  file is loaded; an adapter whose modules are not in the model is an error naming them,
  never a silent no-op.
- Writing (:func:`write_lora_layout`): a checkpoint's adapter gets the keys of the full class
  when the template says the family is loaded that way (``adapter_prefix = "model"``), so
  ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), checkpoint)`` and
  ``swift export --adapters checkpoint`` load it with effect.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch
from torch import nn

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# the weight names PEFT saves per LoRA layer (adapter name removed), after the module's name
_LORA_KEY = re.compile(r"^base_model\.model\.(.+)\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)"
                       r"(\.weight|\.bias)?$")


class AdapterMismatchError(ValueError):
    """An adapter whose weights name modules the model does not have."""


def is_adapter(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG))


def read_adapter_weights(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights = os.path.join(path, ADAPTER_WEIGHTS)
    if os.path.isfile(weights):
        return load_file(weights)
    legacy = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(legacy):
        return torch.load(legacy, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{path}: {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}")


def adapter_modules(state: dict[str, torch.Tensor]) -> list[str]:
    """The names of the modules an adapter's weights belong to (``model.layers.0.mlp.up_proj``)."""
    names = set()
    for key in state:
        m = _LORA_KEY.match(key)
        if m:
            names.add(m.group(1))
    return sorted(names)


def module_prefix(model: nn.Module, modules: list[str], source: str) -> str:
    """The leading part of ``modules`` that ``model`` lacks: ``""`` when the adapter was made
    for this very class, ``"model."`` when it was made for the full class around it (as
    ms-swift does). Raises ``AdapterMismatchError`` when neither reading names modules of
    ``model``."""
    if not modules:
        raise AdapterMismatchError(f"{source}: the adapter holds no LoRA weights")
    have = {name for name, _ in model.named_modules()}
    if all(m in have for m in modules):
        return ""
    first = {m.split(".", 1)[0] for m in modules}
    if len(first) == 1:
        prefix = first.pop() + "."
        if all("." in m and m[len(prefix):] in have for m in modules):
            return prefix
    missing = [m for m in modules if m not in have][:4]
    raise AdapterMismatchError(
        f"{source}: the adapter's weights belong to modules this {type(model).__name__} does not have "
        f"(e.g. {', '.join(missing)}); it was made for another model. Pass the adapter's own base model "
        "(adapter_config.json's base_model_name_or_path)."
    )


def load_lora(backbone: nn.Module, path: str, is_trainable: bool = False) -> nn.Module:
    """``backbone`` with the LoRA adapter in ``path`` (mmembed's, ms-swift's or any PEFT
    adapter of the same weights) as a ``PeftModel``; every weight of the file is loaded."""
    from peft import LoraConfig, get_peft_model

    state = read_adapter_weights(path)
    modules = adapter_modules(state)
    prefix = module_prefix(backbone, modules, path)
    config = LoraConfig.from_pretrained(path)
    # the modules the weights name, exactly: a regex written for the full class would match nothing here
    config.target_modules = sorted(m[len(prefix):] for m in modules)
    config.exclude_modules = None
    config.layers_to_transform = config.layers_pattern = None
    config.task_type = None
    config.inference_mode = not is_trainable
    model = get_peft_model(backbone, config)
    set_lora_weights(model, state, path)
    if not is_trainable:
        model.eval()
    return model


def set_lora_weights(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load an adapter's weights (either layout) into the PEFT ``model``; every LoRA weight of
    the model and every weight of the file must be used."""
    from peft import set_peft_model_state_dict

    base = model.get_base_model()
    prefix = module_prefix(base, adapter_modules(state), source)
    if prefix:
        state = {PEFT_PREFIX + k[len(PEFT_PREFIX) + len(prefix):] if k.startswith(PEFT_PREFIX + prefix) else k: v
                 for k, v in state.items()}
    result = set_peft_model_state_dict(model, state)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    missing = [k for k in getattr(result, "missing_keys", []) or [] if "lora_" in k]
    if unexpected or missing:
        raise AdapterMismatchError(f"{source}: adapter weights do not fit the model (unexpected {unexpected[:4]}, "
                                   f"missing {missing[:4]})")


def full_class_mapping(base: str | None) -> dict[str, str] | None:
    """PEFT's ``auto_mapping`` for the family's full class (``Qwen3ForCausalLM``,
    ``Qwen2VLForConditionalGeneration``: transformers' image-text-to-text class of the base's
    ``model_type``, else its causal-LM class), the class ms-swift loads and names there; what
    ``AutoPeftModel.from_pretrained`` builds under an adapter without a task type. None when the
    base folder or such a class cannot be found."""
    import importlib

    from transformers.models.auto import modeling_auto

    path = os.path.join(base or "", "config.json")
    if not base or not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        model_type = json.load(f).get("model_type")
    name = (modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type)
            or modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type))
    if not name:
        return None
    module = f"transformers.models.{model_type}.modeling_{model_type}"
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    return {"base_model_class": cls.__name__, "parent_library": cls.__module__}


def write_lora_layout(folder: str, prefix: str) -> None:
    """Rewrite the adapter PEFT saved in ``folder`` (keys of the bare backbone) with the keys
    of the full class that holds the backbone under ``prefix`` (``"model."``): the layout
    ms-swift saves and loads. ``target_modules`` given as names match in both classes (PEFT
    matches a name as a suffix); a regex or the backbone's own names anchored at the start
    would not, so those are written with the prefix."""
    from safetensors.torch import load_file, save_file

    if not prefix:
        return
    weights = os.path.join(folder, ADAPTER_WEIGHTS)
    state = load_file(weights)
    out = {}
    for key, value in state.items():
        if key.startswith(PEFT_PREFIX) and not key.startswith(PEFT_PREFIX + prefix):
            key = PEFT_PREFIX + prefix + key[len(PEFT_PREFIX):]
        out[key] = value.contiguous()
    save_file(out, weights, metadata={"format": "pt"})
    cfg_path = os.path.join(folder, ADAPTER_CONFIG)
    with open(cfg_path, encoding="utf-8") as f:
        cfg: dict[str, Any] = json.load(f)
    if isinstance(cfg.get("target_modules"), str):  # a regex over the backbone's names
        cfg["target_modules"] = sorted(m[len(PEFT_PREFIX):] for m in adapter_modules(out))
    # ms-swift writes no task type: PeftModel.from_pretrained then wraps whatever class it is given,
    # and PEFT's AutoPeftModel builds the class named in auto_mapping (the full one, as ms-swift's)
    cfg["task_type"] = None
    cfg["auto_mapping"] = full_class_mapping(cfg.get("base_model_name_or_path"))
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
