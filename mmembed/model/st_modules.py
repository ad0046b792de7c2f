"""A sentence-transformers folder's modules after its Transformer, kept whole.

A folder that ``sentence_transformers.SentenceTransformer`` loads lists its pipeline in
``modules.json``: a ``Transformer`` (the backbone mmembed loads itself), then modules over its
token states (``WeightedLayerPooling``, ``WordWeights``, a token-level ``Dense``...), a
``Pooling``, and modules over the pooled vector (``Dense``, ``LayerNorm``, ``Dropout``,
``Normalize``). EmbeddingGemma is Transformer -> mean Pooling -> Dense 768->3072 -> Dense
3072->768 -> Normalize; ms-swift loads such a folder through ``SentenceTransformer`` and runs
the whole pipeline in its training forward (its ``SentenceTransformersLoader``).

:class:`SentenceTransformersModules` holds those modules as sentence-transformers' own classes
(loaded, run and saved by its code), so that training, checkpoints, ``mmembed export`` and
``mmembed embed`` keep every layer. :func:`check_modules` refuses, before any weight loads, a
module mmembed cannot run (named with its ``modules.json`` entry).

The plain pipeline mmembed writes itself (Transformer -> Pooling -> Normalize, one pooling mode
mmembed pools with) needs none of this: :func:`modules_of_folder` returns ``None`` for it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import UsageError
from ..files import read_json_once

MODULES_FILE = "modules.json"
# where a module runs: over the token states (before the Pooling), the Pooling, over the pooled vector
TOKEN, POOLING, SENTENCE = "token", "pooling", "sentence"
# sentence-transformers 6.2's modules of a dense embedder, by class name; a Dense / Normalize runs over the token
# states when its module_input_name says so (a token-level projection before the Pooling)
RUNS_ON = {"Pooling": POOLING, "WeightedLayerPooling": TOKEN, "WordWeights": TOKEN, "Dense": None,
           "LayerNorm": SENTENCE, "Dropout": SENTENCE, "Normalize": None}
# mmembed's pooling names for sentence-transformers' single pooling modes
POOLING_NAMES = {"mean": "mean", "cls": "cls", "max": "max", "lasttoken": "last"}
ST_POOLING_MODES = {v: k for k, v in POOLING_NAMES.items()}


@dataclass(frozen=True)
class ModuleEntry:
    """One entry of ``modules.json``: its position, name, folder (relative) and class name."""

    idx: int
    name: str
    path: str
    kind: str  # the class name: Transformer, Pooling, Dense, ...
    type: str  # as written: sentence_transformers.models.Dense, sentence_transformers.base.modules.dense.Dense, ...

    def record(self) -> dict[str, Any]:
        return {"idx": self.idx, "name": self.name, "path": self.path, "type": self.type}


def read_entries(folder: str, flag: str = "--model") -> list[ModuleEntry] | None:
    """The entries of ``folder``'s ``modules.json`` (``None`` when it has none); a file that is
    not a list of ``{idx, name, path, type}`` is a :class:`~mmembed.errors.UsageError` naming it."""
    path = os.path.join(folder, MODULES_FILE)
    if not os.path.isfile(path):
        return None
    try:
        raw = read_json_once(path)
    except ValueError as e:
        raise UsageError(f"{flag} {folder}: {path} is not JSON ({e})") from None
    if not isinstance(raw, list):
        raise UsageError(f"{flag} {folder}: {path} must hold a list of modules")
    entries = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict) or not isinstance(entry.get("type"), str):
            raise UsageError(f"{flag} {folder}: {path} entry {i} has no 'type'")
        entries.append(ModuleEntry(int(entry.get("idx", i)), str(entry.get("name", i)), str(entry.get("path", "")),
                                   entry["type"].rsplit(".", 1)[-1], entry["type"]))
    return entries


def _config(folder: str, entry: ModuleEntry) -> dict[str, Any]:
    path = os.path.join(folder, entry.path, "config.json")
    return read_json_once(path) if os.path.isfile(path) else {}


def _runs_on(folder: str, entry: ModuleEntry, after_pooling: bool) -> str:
    place = RUNS_ON[entry.kind]
    if place is not None:
        return place
    if entry.kind == "Dense":
        return TOKEN if _config(folder, entry).get("module_input_name") == "token_embeddings" else SENTENCE
    return SENTENCE if after_pooling else TOKEN  # Normalize


def check_modules(folder: str, flag: str = "--model") -> list[ModuleEntry] | None:
    """``folder``'s modules, checked before any weight loads: a Transformer first, stored in the
    folder itself (the backbone mmembed loads), then only modules of :data:`RUNS_ON` from
    sentence-transformers, one Pooling, nothing over the pooled vector before it. Anything else
    (a module in the folder's own code, a Router / Asym, a CNN or LSTM, a second Transformer, a
    StaticEmbedding) is a :class:`~mmembed.errors.UsageError` naming the module."""
    entries = read_entries(folder, flag)
    if not entries:
        return entries

    def refuse(entry: ModuleEntry, why: str) -> UsageError:
        return UsageError(f"{flag} {folder}: modules.json module {entry.name!r} ({entry.type}, folder "
                          f"{entry.path or '.'!r}) {why}; mmembed runs Transformer, then "
                          f"{', '.join(sorted(RUNS_ON))} (sentence-transformers' modules of a dense embedder)")

    first = entries[0]
    if first.kind != "Transformer" or first.path not in ("", "."):
        raise refuse(first, "comes first; mmembed needs the Transformer first, stored in the folder itself")
    pooled = False
    for entry in entries[1:]:
        if not entry.type.startswith("sentence_transformers."):
            raise refuse(entry, "is code of the folder's own, which mmembed never runs")
        if entry.kind not in RUNS_ON:
            raise refuse(entry, "cannot be trained or run by mmembed")
        place = _runs_on(folder, entry, pooled)
        if entry.kind == "Pooling":
            if pooled:
                raise refuse(entry, "is a second Pooling")
            pooled = True
        elif place == TOKEN and pooled:
            raise refuse(entry, "reads token states after the Pooling")
        elif place == SENTENCE and not pooled:
            raise refuse(entry, "reads the pooled vector before the Pooling")
    if not pooled:
        raise UsageError(f"{flag} {folder}: modules.json has no Pooling module; a single-vector embedder pools "
                         "its token states (a multi-vector folder trains with --task_type late_interaction)")
    return entries


def _module_class(kind: str):
    from sentence_transformers.sentence_transformer import modules

    return getattr(modules, kind)


def _is_plain(folder: str, entries: list[ModuleEntry]) -> bool:
    """Transformer -> Pooling (one mode mmembed pools with, the prompt included) [-> Normalize]:
    what mmembed's own pooling and L2 normalization already are."""
    kinds = [e.kind for e in entries]
    if kinds not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
        return False
    if len(entries) == 3 and _config(folder, entries[2]).get("module_input_name", "sentence_embedding") != "sentence_embedding":
        return False
    return pooling_of(_config(folder, entries[1])) is not None


def pooling_of(config: dict[str, Any]) -> str | None:
    """mmembed's name of a Pooling config's mode (``None``: several modes, the weighted or
    sqrt-length means, or the prompt left out of the pool: sentence-transformers pools then)."""
    if config.get("include_prompt", True) is False:
        return None
    mode = config.get("pooling_mode")
    if mode is None:
        flags = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
        on = [m for key, m in flags.items() if config.get(key)]
        mode = on[0] if len(on) == 1 else on
    if isinstance(mode, list):
        mode = mode[0] if len(mode) == 1 else None
    return POOLING_NAMES.get(mode) if isinstance(mode, str) else None


def modules_of_folder(folder: str, flag: str = "--model") -> list[ModuleEntry] | None:
    """``folder``'s checked modules when mmembed must keep them (:class:`SentenceTransformersModules`),
    ``None`` when it has no ``modules.json`` or only the plain pipeline mmembed pools as itself."""
    entries = check_modules(folder, flag)
    if not entries or _is_plain(folder, entries):
        return None
    return entries


class SentenceTransformersModules(nn.Module):
    """The modules after a sentence-transformers folder's Transformer, as its own classes.

    ``tokens`` run over the token states, ``pool`` is the Pooling, ``sentence`` run over the
    pooled vector; :meth:`pool_tokens` runs the first two as sentence-transformers does,
    :meth:`over_pooled` the last. A Normalize is appended when the folder has none: mmembed's
    embeddings are L2-normalized (its losses and scores are cosines), and the saved folder says so.
    """

    def __init__(self, entries: list[ModuleEntry], folder: str):
        super().__init__()
        self.source = folder
        self.entries = list(entries)
        modules, places = [], []
        pooled = False
        for entry in self.entries[1:]:
            modules.append(_module_class(entry.kind).load(folder, subfolder=entry.path))
            place = _runs_on(folder, entry, pooled)
            pooled = pooled or place == POOLING
            places.append(place)
        if len(self.entries) < len(with_normalize(entries)):
            self.entries = with_normalize(entries)
            modules.append(_module_class("Normalize")())
            places.append(SENTENCE)
        self.stages = nn.ModuleList(modules)
        self.places = places
        pool_at = places.index(POOLING)
        self.pool_config = _config(folder, self.entries[pool_at + 1])
        # mmembed pools itself (every batch layout: length chunks, packed rows) unless a token
        # module or an unusual Pooling asks for sentence-transformers' pooling over padded rows
        self.own_pooling = pooling_of(self.pool_config) if pool_at == 0 else None
        self.hidden_states = any(e.kind == "WeightedLayerPooling" for e in self.entries)

    def use_pooling(self, mode: str) -> None:
        """Pool with mmembed's ``mode`` (``--pooling``) in place of the folder's Pooling; the
        saved folder's Pooling says so."""
        if self.needs_tokens:
            raise UsageError(f"--pooling {mode}: the model's sentence-transformers modules pool the token states "
                             "themselves (token modules, or a Pooling of several or weighted modes); leave --pooling out")
        if mode == self.own_pooling:
            return
        pooling_cls = _module_class("Pooling")
        at = self.places.index(POOLING)
        dim = self.pool_config.get("embedding_dimension", self.pool_config.get("word_embedding_dimension"))
        self.stages[at] = pooling_cls(int(dim), pooling_mode=ST_POOLING_MODES[mode])
        self.pool_config = {**self.stages[at].get_config_dict()}
        self.own_pooling = mode

    @property
    def needs_tokens(self) -> bool:
        """Whether the token states go through sentence-transformers' modules (then the rows
        are embedded padded, not packed)."""
        return self.own_pooling is None

    @property
    def dimension(self) -> int | None:
        """The width of the vectors the pipeline gives (the last Dense's output), if it changes."""
        dense = [m for m, p in zip(self.stages, self.places) if p == SENTENCE and hasattr(m, "out_features")]
        return int(dense[-1].out_features) if dense else None

    def modules_named(self, names: list[str]) -> tuple[list[str], list[str]]:
        """The ``--modules_to_save`` names that name a module of this pipeline (its modules.json
        ``name`` or folder, e.g. ``2`` / ``2_Dense``, or a module inside it as ms-swift's
        SentenceTransformer names it, ``2.linear``, ``linear``), and the rest (for PEFT)."""
        mine, rest = [], []
        for name in names:
            (mine if self._match(name) else rest).append(name)
        return mine, rest

    def _match(self, name: str) -> list[nn.Module]:
        found = []
        for entry, module in zip(self.entries[1:], self.stages):
            if name in (entry.name, entry.path):
                found.append(module)
                continue
            for sub, child in module.named_modules():
                if sub and (name == f"{entry.name}.{sub}" or name == sub or sub.endswith("." + name)):
                    found.append(child)
        return found

    def set_trainable(self, train_all: bool, names: list[str] = ()) -> list[str]:
        """Full training trains every module; under LoRA they stay frozen but for the ones
        ``names`` picks (:meth:`modules_named`). Returns what is trained, for the log."""
        self.requires_grad_(train_all)
        if train_all:
            return [e.path for e, m in zip(self.entries[1:], self.stages) if any(True for _ in m.parameters())]
        for name in names:
            for module in self._match(name):
                module.requires_grad_(True)
        return list(names)

    def pool_tokens(self, token_embeddings: torch.Tensor, attention_mask: torch.Tensor, input_ids: torch.Tensor,
                    hidden_states: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """Token states ``[N, L, H]`` (padded rows) -> the pooled vectors ``[N, D]``, through the
        token modules and the Pooling as sentence-transformers runs them."""
        features: dict[str, Any] = {"token_embeddings": token_embeddings, "attention_mask": attention_mask,
                                    "input_ids": input_ids}
        if hidden_states is not None:
            features["all_layer_embeddings"] = hidden_states
        for module, place in zip(self.stages, self.places):
            if place == SENTENCE:
                break
            features = module(features)
        return features["sentence_embedding"]

    def over_pooled(self, pooled: torch.Tensor) -> torch.Tensor:
        """The pooled vectors ``[N, H]`` through the modules after the Pooling (Dense, LayerNorm,
        Dropout, Normalize), in the modules' own dtype."""
        param = next(self.parameters(), None)
        features: dict[str, Any] = {"sentence_embedding": pooled if param is None else pooled.to(param.dtype)}
        for module, place in zip(self.stages, self.places):
            if place == SENTENCE:
                features = module(features)
        return features["sentence_embedding"]

    def save(self, folder: str, state_dict: dict[str, torch.Tensor] | None = None, prefix: str = "") -> None:
        """Each module into its folder under ``folder`` as sentence-transformers saves it;
        ``state_dict`` (the whole model's, gathered by DeepSpeed, keys under ``prefix``) gives
        the weights when given."""
        for i, (entry, module) in enumerate(zip(self.entries[1:], self.stages)):
            own = {k[len(f"{prefix}stages.{i}."):]: v for k, v in (state_dict or {}).items()
                   if k.startswith(f"{prefix}stages.{i}.")}
            if own:  # a fresh copy holds the gathered weights (under ZeRO-3 the module's own are partitioned)
                module = self._fresh(i, entry)
                module.load_state_dict({k: v.detach().cpu() for k, v in own.items()})
            path = os.path.join(folder, entry.path)
            os.makedirs(path, exist_ok=True)
            module.save(path)

    def _fresh(self, i: int, entry: ModuleEntry) -> nn.Module:
        if os.path.isdir(os.path.join(self.source, entry.path)) and entry.path:
            return type(self.stages[i]).load(self.source, subfolder=entry.path)
        return type(self.stages[i])()

    def load(self, folder: str) -> None:
        """Load back the weights :meth:`save` wrote into ``folder``."""
        for entry, module in zip(self.entries[1:], self.stages):
            loaded = type(module).load(folder, subfolder=entry.path)
            module.load_state_dict(loaded.state_dict())

    def records(self) -> list[dict[str, Any]]:
        """``modules.json``'s entries of the whole pipeline (the Transformer in the folder itself)."""
        return [e.record() for e in self.entries]


def with_normalize(entries: list[ModuleEntry]) -> list[ModuleEntry]:
    """``entries`` ending with a Normalize (one appended when the folder has none)."""
    last = entries[-1]
    if last.kind == "Normalize":
        return list(entries)
    idx = last.idx + 1
    return [*entries, ModuleEntry(idx, str(idx), f"{idx}_Normalize", "Normalize", "sentence_transformers.models.Normalize")]


def write_modules_file(folder: str, records: list[dict[str, Any]]) -> None:
    with open(os.path.join(folder, MODULES_FILE), "w", encoding="utf-8") as f:
        json.dump(records, f, indent=2)


def entries_of_records(records: list[dict[str, Any]]) -> list[ModuleEntry]:
    return [ModuleEntry(int(r["idx"]), str(r["name"]), str(r["path"]), r["type"].rsplit(".", 1)[-1], r["type"])
            for r in records]
