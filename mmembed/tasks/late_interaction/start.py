"""What a late-interaction run starts from when ``--model`` is a late-interaction model already:
an mmembed checkpoint or export (``late_interaction_projection.safetensors`` and its
``mmembed.json`` settings), a sentence-transformers ``MultiVectorEncoder`` folder or a PyLate
ColBERT folder (the ``Dense`` module's weight; the query expansion of ``sentence_bert_config.json``
or PyLate's settings, the ``MultiVectorMask`` skiplist). Its projection is the run's starting
projection (not a new random one), and its settings are the defaults of the flags not given.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ...errors import UsageError
from ...files import read_json_once, read_once
from ...model.late_interaction import PROJECTION_FILE, PROJECTION_KEY, PUNCTUATION_SKIPLIST, load_projection
from ...model.st_modules import read_entries
from ...task import folder_json
from .settings import saved_settings

#: what mmembed's late-interaction model is, module by module, as sentence-transformers 6.2 writes it
_LAYOUT = "Transformer -> Dense (no bias, identity activation, token_embeddings) -> [MultiVectorMask] -> Normalize"
_IDENTITY = ("torch.nn.modules.linear.Identity", "torch.nn.Identity", None)


def check_multivector_folder(path: str, flag: str = "--model") -> None:
    """A sentence-transformers ``MultiVectorEncoder`` folder's modules, before any weight loads:
    each must be what mmembed's late-interaction model holds (:data:`_LAYOUT`; the mask's
    skiplist none or ColBERT's punctuation, on documents; no prompts), or the run is refused in
    one line naming the module, so that nothing of the folder is dropped silently."""
    st = _json(os.path.join(path, "config_sentence_transformers.json"))
    if st.get("model_type") != "MultiVectorEncoder":
        return
    entries = read_entries(path, flag) or []

    def refuse(entry: Any, why: str) -> UsageError:
        return UsageError(f"{flag} {path}: modules.json module {entry.name!r} ({entry.type}, folder "
                          f"{entry.path or '.'!r}) {why}; mmembed's late-interaction model is {_LAYOUT}")

    kinds = [e.kind for e in entries]
    if not entries or kinds[0] != "Transformer" or entries[0].path not in ("", "."):
        raise UsageError(f"{flag} {path}: modules.json must start with the Transformer stored in the folder itself; "
                         f"mmembed's late-interaction model is {_LAYOUT}")
    expected = ["Dense", "MultiVectorMask", "Normalize"]
    for entry in entries[1:]:
        if entry.kind not in expected:
            raise refuse(entry, "cannot be kept" if entry.kind not in ("Dense", "MultiVectorMask", "Normalize")
                         else "is a second one or out of order")
        expected = expected[expected.index(entry.kind) + 1:]
        config = _json(os.path.join(path, entry.path, "config.json"))
        if entry.kind == "Dense":
            if config.get("bias", True) or config.get("activation_function") not in _IDENTITY \
                    or config.get("module_input_name") != "token_embeddings":
                raise refuse(entry, f"has bias {config.get('bias', True)}, activation "
                                    f"{config.get('activation_function')} over {config.get('module_input_name')}")
        elif entry.kind == "MultiVectorMask":
            words = config.get("skiplist_words") or []
            if (words and set(words) != set(PUNCTUATION_SKIPLIST)) or config.get("keep_only_token_ids") \
                    or list(config.get("skiplist_tasks") or ["document"]) != ["document"]:
                raise refuse(entry, "masks other tokens than none or ColBERT's punctuation on documents")
    if "Normalize" in expected:
        raise UsageError(f"{flag} {path}: modules.json has no Normalize after the Dense; mmembed's late-interaction "
                         f"vectors are L2-normalised ({_LAYOUT}): add a Normalize")
    if "Dense" in expected:
        raise UsageError(f"{flag} {path}: modules.json has no Dense projection; mmembed's late-interaction model is "
                         f"{_LAYOUT}")
    prompts = {k: v for k, v in (st.get("prompts") or {}).items() if v}
    if prompts:
        raise UsageError(f"{flag} {path}: config_sentence_transformers.json's prompts {prompts} cannot be kept: mmembed's "
                         "late-interaction run puts no prompt before queries or documents; remove them")


def _dense_folder(path: str) -> str | None:
    try:
        modules = read_json_once(os.path.join(path, "modules.json"))
    except (OSError, ValueError):
        return None
    for entry in modules if isinstance(modules, list) else []:
        if isinstance(entry, dict) and str(entry.get("type", "")).endswith(("Dense", "Dense.Dense")):
            return os.path.join(path, entry.get("path", ""))
    return None


def _projection_file(path: str) -> str | None:
    """The file that holds a model folder's projection: mmembed's, else its ``Dense`` module's."""
    if os.path.isfile(os.path.join(path, PROJECTION_FILE)):
        return os.path.join(path, PROJECTION_FILE)
    dense = _dense_folder(path)
    for name in ("model.safetensors", "pytorch_model.bin") if dense is not None else ():
        if os.path.isfile(os.path.join(dense, name)):
            return os.path.join(dense, name)
    return None


def folder_projection(path: str) -> torch.Tensor | None:
    """The projection weight ``[dim, hidden]`` a model folder holds (mmembed's file, else the
    ``Dense`` module of a sentence-transformers / PyLate folder), or None. Read once per process
    while the file stays the same (the run's checks, its settings and its model each ask); each
    call gets its own copy."""
    file = _projection_file(path)
    weight = None if file is None else read_once(file, _read_projection, "projection")
    return None if weight is None else weight.clone()


def _read_projection(file: str) -> torch.Tensor | None:
    if os.path.basename(file) == PROJECTION_FILE:
        return load_projection(os.path.dirname(file))
    if file.endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(file)
    else:
        state = torch.load(file, map_location="cpu", weights_only=True)
    weight = state.get(PROJECTION_KEY)
    if weight is None or weight.ndim != 2 or any(k.endswith("bias") and v is not None for k, v in state.items()):
        return None  # not a bias-free linear projection: not what a late-interaction head is
    return weight


def folder_defaults(path: str) -> dict[str, Any]:
    """The ``--late_interaction_*`` values a model folder implies (only those it says)."""
    saved = saved_settings(_mmembed_json(path))
    if saved is not None:
        return {"late_interaction_query_expansion": saved.expansion,
                "late_interaction_query_length": saved.query_length,
                "late_interaction_attend_expansion": saved.attend_expansion if saved.expansion == "mask" else None,
                "late_interaction_skiplist": "punctuation" if saved.skiplist else "none",
                "late_interaction_normalize_scores": saved.normalize_scores}
    out: dict[str, Any] = {}
    st = _json(os.path.join(path, "config_sentence_transformers.json"))
    transformer = _json(os.path.join(path, "sentence_bert_config.json"))
    expansion = transformer.get("query_expansion") if isinstance(transformer, dict) else None
    if isinstance(expansion, dict) and expansion.get("strategy") == "fixed":
        out.update(late_interaction_query_expansion="mask", late_interaction_query_length=int(expansion["length"]),
                   late_interaction_attend_expansion=bool(expansion.get("attend", False)))
    elif st.get("model_type") == "ColBERT" and st.get("do_query_expansion") and st.get("query_length"):  # PyLate
        out.update(late_interaction_query_expansion="mask", late_interaction_query_length=int(st["query_length"]),
                   late_interaction_attend_expansion=bool(st.get("attend_to_expansion_tokens", False)))
    skiplist = st.get("skiplist_words") if st.get("model_type") == "ColBERT" else None
    if st.get("model_type") == "MultiVectorEncoder":
        skiplist = []  # no MultiVectorMask: every token scored
    for entry in _json(os.path.join(path, "modules.json")) or []:
        if isinstance(entry, dict) and str(entry.get("type", "")).endswith("MultiVectorMask"):
            skiplist = _json(os.path.join(path, entry.get("path", ""), "config.json")).get("skiplist_words")
    if skiplist is not None:
        out["late_interaction_skiplist"] = "punctuation" if skiplist else "none"
    if st.get("similarity_fn_name") == "meanmaxsim":
        out["late_interaction_normalize_scores"] = True
    return out


def _json(path: str) -> Any:
    value = folder_json(os.path.dirname(path), os.path.basename(path))
    return value if isinstance(value, (dict, list)) else {}


def _mmembed_json(path: str) -> dict[str, Any] | None:
    value = _json(os.path.join(path, "mmembed.json"))
    return value if isinstance(value, dict) and value else None
