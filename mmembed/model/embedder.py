"""Embedder: use a trained checkpoint, an exported folder or a base model without extra code.

    from mmembed import Embedder
    emb = Embedder.from_pretrained("output/checkpoint-60")
    vectors = emb.encode(["A man is playing a flute.", "Someone plays music."])  # [2, D], L2-normalized
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..data.sample import Item
from ..encoding import remote
from ..encoding.inputs import InputBuilder, tokenizer_of
from ..encoding.templates import SIDES, Template, get_template, template_from_config
from ..errors import UsageError
from .adapters import load_lora
from .embedding import EmbeddingModel, default_max_length, load_backbone, require_local_model
from .io import instructions_of, read_mmembed_config, read_sentence_transformers_prompts
from .quantization import Quantization
from .st_modules import SentenceTransformersModules, entries_of_records, modules_of_folder

if TYPE_CHECKING:
    from ..encoding.media import MediaSettings


def _base_model_of(path: str, cfg: dict[str, Any] | None) -> str:
    if cfg and cfg.get("base_model") and os.path.isdir(cfg["base_model"]):
        return cfg["base_model"]
    with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as f:
        base = json.load(f).get("base_model_name_or_path")
    swift_model = (read_swift_args(path) or {}).get("model")
    if (not base or not os.path.isdir(base)) and swift_model and os.path.isdir(swift_model):
        base = swift_model
    if not base or not os.path.isdir(base):
        raise FileNotFoundError(f"{path}: the adapter's base model {base!r} is not a local folder")
    return base


def read_swift_args(path: str) -> dict[str, Any] | None:
    """The ``args.json`` ms-swift writes into its output and checkpoint folders (None when absent)."""
    args = os.path.join(path, "args.json")
    if not os.path.isfile(args):
        return None
    with open(args, encoding="utf-8") as f:
        return json.load(f)


def _swift_template(path: str, base: str) -> Template | None:
    """The template of an ms-swift checkpoint: its ``--template`` or ``--model_type`` when mmembed
    has one of that name (None otherwise: the base model's type decides)."""
    swift = read_swift_args(path) or {}
    for name, model_type in ((swift.get("template"), None), (None, swift.get("model_type"))):
        if name or model_type:
            try:
                return get_template(name, model_type)
            except ValueError:
                continue
    return None


def load_embedding_model(path: str, torch_dtype: str | None = None, merge: bool = True, quantized: bool = False,
                         device: str | torch.device | None = None, head: Any = None
                         ) -> tuple[EmbeddingModel, Any, Template, dict]:
    """Load ``path`` (checkpoint, exported folder or base model) as an ``EmbeddingModel``.

    A QLoRA checkpoint (``mmembed.json``'s ``quantization``) loads its base in full precision
    and merges the adapter into the original weights, as ``mmembed export`` (and ms-swift's
    export) does; with ``quantized`` the base is quantized as it was trained (onto
    ``device``) and the adapter stays unmerged: the training model's embeddings, in its memory.

    Returns ``(model, processing, template, info)``: ``processing`` is the tokenizer, or the
    processor for a multimodal template; ``info`` holds the resolved ``pooling``,
    ``max_length``, ``base_model``, whether the folder was a LoRA adapter and the
    ``quantization`` it was trained with (None: none). ``head``: ``head(backbone, template,
    processing) -> model`` builds the model around the loaded backbone instead of a pooling
    ``EmbeddingModel`` (a late-interaction model's projection).
    """
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    require_local_model(path)
    cfg = read_mmembed_config(path) or {}
    if head is None and cfg.get("pooling") == "tokens":  # a vector per token: no single embedding to give
        raise UsageError(f"{path}: a late-interaction model (a vector per token, scored by MaxSim), not a "
                         "single-vector embedder: mmembed embed writes its token matrices, mmembed rerank / eval "
                         "--beir score with it (in Python: mmembed.task.get_task('late_interaction').load_scorer)")
    is_adapter = os.path.isfile(os.path.join(path, "adapter_config.json"))
    base = _base_model_of(path, cfg) if is_adapter else path
    if cfg.get("template"):
        template = template_from_config(cfg["template"])
    else:
        config = AutoConfig.from_pretrained(base)
        template = _swift_template(path, base) or get_template(config_model_type=config.model_type,
                                                               architectures=config.architectures or ())
        template = template.for_model(base)  # e.g. UEmbed's sparse_info.json
    template.check_installed()
    quant = Quantization.from_record(cfg.get("quantization")) if is_adapter else None
    if quantized and quant is None:
        raise ValueError(f"{path}: quantized=True loads a QLoRA checkpoint's base as it was trained; this folder was not "
                         "trained on a quantized base (its mmembed.json records no quantization)")
    if quantized:
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        backbone = load_backbone(base, torch_dtype, **quant.loading(template.parts, device))
        merge = False  # merging into quantized weights would round the update away
    else:
        backbone = load_backbone(base, torch_dtype)
    if is_adapter:
        backbone = load_lora(backbone, path)
        if merge:
            backbone = backbone.merge_and_unload()
    tok_dir = path if os.path.isfile(os.path.join(path, "tokenizer_config.json")) else base
    if cfg.get("default_system") is not None:
        template = dataclasses.replace(template, default_system=cfg["default_system"])
    instructions = instructions_of(cfg)
    for side in SIDES:  # --query_system / --document_system the folder was trained with
        if instructions[side] is not None:
            template = dataclasses.replace(template, **{side + "_system": instructions[side]})
    tokenizer = (AutoProcessor if template.media else AutoTokenizer).from_pretrained(tok_dir)
    pooling = cfg.get("pooling") or template.resolve_pooling(base)
    if cfg.get("max_length") or (read_swift_args(path) or {}).get("max_length"):
        max_length = int(cfg.get("max_length") or read_swift_args(path)["max_length"])
    else:
        max_length = default_max_length(base, tokenizer_of(tokenizer))
    if head is None:
        model = EmbeddingModel(backbone, pooling, normalize=cfg.get("normalize", True), tower=template.tower,
                               modules=_st_modules(path, base, cfg, pooling))
    else:
        model = head(backbone, template, tokenizer)
    if head is None:
        model.pool_skip = template.pool_skip  # UEmbed's num_eos_tokens (0: the last token)
    model.eval()
    # a text model's sentence-transformers prompts (its own, else its base model's: what an
    # export keeps): the prompt of a side the run gave no instruction (Qwen3-Embedding's query)
    prompts = {} if template.media else (read_sentence_transformers_prompts(path) or read_sentence_transformers_prompts(base))
    info = {"pooling": pooling, "max_length": max_length, "base_model": base, "is_adapter": is_adapter, "prompts": prompts,
            "quantization": quant.record() if quant else None}
    return model, tokenizer, template, info


def _st_modules(path: str, base: str, cfg: dict[str, Any], pooling: str) -> SentenceTransformersModules | None:
    """The sentence-transformers modules (Dense layers, ...) of a saved folder (its
    ``mmembed.json`` lists them; their folders are in ``path``) or of a base model's folder."""
    records = cfg.get("sentence_transformers_modules")
    if records:
        modules = SentenceTransformersModules(entries_of_records(records), path)
    else:
        entries = modules_of_folder(base)
        if not entries:
            return None
        modules = SentenceTransformersModules(entries, base)
    if modules.own_pooling is not None and cfg.get("pooling"):
        modules.use_pooling(pooling)
    return modules


def as_item(x: Any, source: str = "<input>", line: int = 0, base_dir: str | None = None) -> Item:
    """A string, an ``Item``, a row-like dict (``{"query"|"text": "<image>...", "images": [...],
    "system": ...}`` or ``{"messages": [...]}``) or a messages list (``[{"role": "user",
    "content": ...}]``, content parts included). Rows go through the training reader: media
    tags bind to paths the same way, relative paths resolve against ``base_dir`` (default:
    the working directory), and a broken input is a ``DataError`` naming ``source:line``."""
    if isinstance(x, Item):
        return x
    if isinstance(x, str):
        return Item(text=x)
    if isinstance(x, list):
        x = {"messages": x}
    if not isinstance(x, dict):
        raise TypeError(f"cannot embed an input of type {type(x).__name__}")
    from ..data.rows import parse_row
    from ..data.sample import DataError

    row = dict(x)
    if "messages" in row:
        if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in row["messages"] or []):
            # the reader wants a positive; only the first group (the input) is embedded
            row["messages"] = list(row["messages"]) + [{"role": "assistant", "content": "-"}]
    else:
        text = row.pop("text", None) if "query" not in row else row["query"]
        if not isinstance(text, str):
            raise DataError(source, line, "query", "an input row needs a 'query' or 'text' string, or 'messages'")
        row.update(query=text, response="-")
        row.pop("rejected_response", None)
    return parse_row(row, source=source, line=line, base_dir=base_dir or os.getcwd()).anchor


class Embedder:
    """Encode inputs (text, and images, videos or audio for a multimodal model) into
    L2-normalized embeddings with a trained (or base) model.

    ``media``: how media are loaded (pixel and frame budgets, downloads), as a command builds
    them where it starts; None: the environment's (``MAX_PIXELS``, ``FPS``, ...,
    ``MMEMBED_OFFLINE``), parsed at the first input with media and kept."""

    def __init__(self, model: EmbeddingModel, tokenizer: Any, template: Template, max_length: int, device: str | None = None,
                 media: MediaSettings | None = None, prompts: dict[str, str] | None = None):
        self.model = model
        self.processing = tokenizer  # the tokenizer, or the processor of a multimodal model
        self.tokenizer = tokenizer_of(tokenizer)
        self.template = template
        self.max_length = max_length
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model.to(self.device)
        self.builder = InputBuilder(template, tokenizer, max_length, truncate=True, media=media)
        # sentence-transformers prompts for the sides the template gives no instruction; used
        # only where the template renders a text with no system as the text itself (+ suffix)
        marker = "\x00"
        plain = not template.media and template.render(Item(text=marker)).startswith(marker)
        self.prompts = {k: v for k, v in (prompts or {}).items() if k in SIDES and v} if plain else {}

    @classmethod
    def from_pretrained(cls, path: str, device: str | None = None, torch_dtype: str | None = None,
                        media: MediaSettings | None = None, quantized: bool = False) -> Embedder:
        """``path``: a checkpoint, an exported folder or a base model. A QLoRA checkpoint embeds
        with its adapter merged into the full-precision base (what ``mmembed export`` writes);
        ``quantized=True`` loads its base quantized as it was trained instead (less memory; the
        embeddings of the training model)."""
        model, tokenizer, template, info = load_embedding_model(path, torch_dtype, quantized=quantized, device=device)
        return cls(model, tokenizer, template, info["max_length"], device, media, info["prompts"])

    def as_input(self, x: Any, input_type: str | None = None) -> Item:
        """The ``Item`` an input becomes when embedded as ``input_type`` (``query``,
        ``document``, or ``None``: no side). An input without a system of its own takes the
        side's instruction the model was trained with (``--query_system`` /
        ``--document_system``, else ``--system`` or the template's); a text model whose side
        has none takes its sentence-transformers prompt of that side, if any (e.g. a base
        Qwen3-Embedding's ``query`` instruction, which an export keeps): what
        ``SentenceTransformer.encode_query`` / ``encode_document`` give."""
        item = as_item(x)
        if input_type is None:
            return item
        if input_type not in SIDES:
            raise ValueError(f"input_type must be one of {', '.join(SIDES)} (or None), got {input_type!r}")
        item = self.template.with_side(item, input_type)
        if item.system is None and self.template.side_system(input_type) is None and input_type in self.prompts:
            item = dataclasses.replace(item, text=self.prompts[input_type] + item.text)
        return item

    @torch.no_grad()
    def encode(self, inputs: str | Sequence[Any], batch_size: int = 32,
               origins: Sequence[tuple[str, int]] | None = None, input_type: str | None = None) -> np.ndarray:
        """Embed ``inputs`` (strings, ``Item``s, row dicts or messages lists); returns
        ``[n, D]`` float32, L2-normalized. Text longer than the model's limit is truncated;
        an input with media that is too long is an error. ``origins`` (file, line) or (file,
        line, field) per input name the inputs in errors (default: ``<input>`` and the
        input's index). ``input_type``: ``query`` or ``document`` embeds the inputs as that
        side, with its instruction (:meth:`as_input`); ``None``: as they are, with ``--system``."""
        if isinstance(inputs, (str, Item, dict)):
            inputs = [inputs]
        items = [self.as_input(x, input_type) for x in inputs]
        texts = [self.template.render(it) for it in items]
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))  # similar lengths share a batch
        out: list[np.ndarray | None] = [None] * len(texts)
        fetched = remote.tally()
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            where = [(*origins[i], "")[:3] if origins else ("<input>", i, "") for i in idx]
            enc = self.builder([items[i] for i in idx], where)
            enc = {k: v.to(self.device) for k, v in enc.items()}
            emb = self.model(**enc)["last_hidden_state"].float().cpu().numpy()
            for j, i in enumerate(idx):
                out[i] = emb[j]
        fetched = remote.tally() - fetched
        if fetched:  # URLs downloaded (each logged) or first found in the media cache by this call
            logging.getLogger("mmembed").info(fetched.summary(self.builder.media_settings().downloads.cache))
        if not out:
            return np.zeros((0, 0), dtype=np.float32)
        return np.stack(out).astype(np.float32)


def read_inputs(path: str) -> tuple[list[Any], list[tuple[str, int]]]:
    """Inputs for ``mmembed embed`` and where each came from (file, line): a .txt file (one
    text per line) or rows (.jsonl/.json/.csv/...) with ``query`` or ``text`` and media lists
    (paths relative to the file), or ``messages``."""
    if path.endswith(".txt"):
        with open(path, encoding="utf-8") as f:
            lines = [(n, line.rstrip("\n")) for n, line in enumerate(f, 1) if line.strip()]
        return [t for _, t in lines], [(path, n) for n, _ in lines]
    from ..data.formats import iter_raw_rows

    rows: list[Any] = []
    origins: list[tuple[str, int]] = []
    base = os.path.dirname(os.path.abspath(path))
    for line, raw in iter_raw_rows(path):
        rows.append(as_item(raw, source=path, line=line, base_dir=base))  # media bound and checked
        origins.append((path, line))
    return rows, origins
