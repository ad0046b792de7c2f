"""Backbone + pooling + L2 normalization -> ``{"last_hidden_state": [N, D]}``.

``EmbeddingModel`` wraps any transformers encoder or decoder (or a PEFT model around one).
It returns ms-swift's output layout: ``last_hidden_state`` holds one L2-normalized
embedding per input row, which is what every loss in ``mmembed.losses`` consumes.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..encoding.templates import POOLINGS
from ..errors import UsageError
from ..files import read_json_once
from .packing import PACKED_MULTIPLE, bucket_width, is_causal, packed_forward, pool_packed
from .st_modules import SentenceTransformersModules
from .varlen_attention import transformers_name, use_for_towers

# per-token inputs that can be cut to a chunk's width; anything else (pixels, grids) keeps
# the batch in one call
TOKEN_INPUTS = {"token_type_ids"}


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: str, skip: int = 0) -> torch.Tensor:
    """Pool token states ``[N, L, D]`` into ``[N, D]``.

    ``last`` takes the last position whose mask is 1, which is right under left padding
    (the final column) and right padding (the column before the first pad) alike; with
    ``skip`` = k, the position k before it (UEmbed's ``num_eos_tokens``: the state before
    its k trailing ``<|endoftext|>``, ms-swift's pooling hook).
    """
    mask = attention_mask.to(hidden.dtype).unsqueeze(-1)
    if mode == "mean":
        return (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "max":
        return hidden.masked_fill(mask == 0, torch.finfo(hidden.dtype).min).max(1).values
    if mode == "last":
        positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
        last = (attention_mask.long() * positions).argmax(1) - skip
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    raise ValueError(f"pooling must be one of {POOLINGS}, got {mode!r}")


class BackboneCheckpointing:
    """Activation (gradient) checkpointing switched on a wrapper's ``backbone``: the Trainer calls
    these on its model, transformers >= 5.23 by the ``activation_*`` names, older 5.x by the
    ``gradient_*`` names; the backbone has one spelling or both. A subclass overrides the
    ``activation_*`` methods; the ``gradient_*`` names follow."""

    backbone: nn.Module

    def _backbone_method(self, new: str, old: str):
        return getattr(self.backbone, new, None) or getattr(self.backbone, old)

    def activation_checkpointing_enable(self, *args: Any, **kwargs: Any) -> None:
        self._backbone_method("activation_checkpointing_enable", "gradient_checkpointing_enable")(*args, **kwargs)

    def activation_checkpointing_disable(self) -> None:
        self._backbone_method("activation_checkpointing_disable", "gradient_checkpointing_disable")()

    @property
    def is_activation_checkpointing(self) -> bool:
        for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
            value = getattr(self.backbone, name, None)
            if value is not None:
                return bool(value)
        return False

    def gradient_checkpointing_enable(self, *args: Any, **kwargs: Any) -> None:
        self.activation_checkpointing_enable(*args, **kwargs)

    def gradient_checkpointing_disable(self) -> None:
        self.activation_checkpointing_disable()

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.is_activation_checkpointing


class EmbeddingModel(BackboneCheckpointing, nn.Module):
    """An embedding model: ``forward(**batch) -> {"last_hidden_state": [N, D]}``.

    Args:
        backbone: a transformers model (or PEFT model) whose output has ``last_hidden_state``.
        pooling: one of ``last``, ``mean``, ``cls``, ``max``.
        normalize: L2-normalize the pooled vectors (every shipped template does).
        tower: the media tower the model runs on every forward (the template's ``tower``:
            ``vision``, ``audio`` or ``None`` for a text model).
        length_chunks: embed a text-only batch in up to this many chunks of rows sorted by
            length, each padded only to its own longest row (1: one padded call). Rows do not
            interact inside the encoder, so the embeddings and gradients are the same; the
            padding, often most of a batch of short texts, is not computed.
        padding_free: embed a text-only batch packed into one sequence of its real tokens
            (:mod:`mmembed.model.packing`): no padding computed at all, the same embeddings
            and gradients. Worth it with FlashAttention or FlexAttention; with SDPA / eager
            the packed attention is a dense mask (correct, not faster).
        bucket: widen padded text batches (and length chunks, and packed sequences) to a
            bounded set of widths (:func:`~mmembed.model.packing.bucket_width`), so that a run
            meets a few shapes rather than one per longest row.
        modules: a sentence-transformers folder's modules after its Transformer
            (:class:`~mmembed.model.st_modules.SentenceTransformersModules`: Dense layers,
            LayerNorm, token weights...), run after (or, for token modules, instead of) the pooling.
    """

    #: ``last`` pooling's step back from the last real token (a template's ``pool_skip``)
    pool_skip: int = 0

    def __init__(self, backbone: nn.Module, pooling: str, normalize: bool = True, length_chunks: int = 4,
                 tower: str | None = None, padding_free: bool = False, bucket: bool = False,
                 modules: SentenceTransformersModules | None = None):
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        if tower not in (None, "vision", "audio"):
            raise ValueError(f"tower must be vision, audio or None, got {tower!r}")
        self.tower = tower
        if length_chunks < 1:
            raise ValueError(f"length_chunks must be >= 1, got {length_chunks}")
        self.backbone = backbone
        self.pooling = pooling
        self.normalize = normalize
        self.length_chunks = length_chunks
        self.padding_free = padding_free and not (modules is not None and modules.needs_tokens)
        self.bucket = bucket
        self.st_modules = modules

    @property
    def config(self):
        return self.backbone.config

    def save_head(self, folder: str, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Write what the model holds beside its backbone into a saved ``folder``: a
        sentence-transformers folder's modules (Dense, ...), each in its own sub-folder
        (a late-interaction model: its projection). ``state_dict``: the whole model's, when the
        trainer gathered it (DeepSpeed), keyed as ``named_parameters``."""
        if self.st_modules is not None:
            self.st_modules.save(folder, state_dict, prefix="st_modules.")

    def load_head(self, folder: str) -> None:
        """Load back what :meth:`save_head` wrote into ``folder`` (resuming, the best checkpoint)."""
        if self.st_modules is not None:
            self.st_modules.load(folder)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **inputs: Any) -> dict[str, torch.Tensor]:
        inputs.pop("media_counts", None)  # bookkeeping of the collator (which media belong to which row)
        inputs, zero = self._run_media_towers(inputs)
        text_only = set(inputs) <= TOKEN_INPUTS
        if self.padding_free and (text_only or self.tower == "vision"):  # one call: ZeRO-3's gathers stay in step
            emb = self._embed_packed(input_ids, attention_mask, inputs)
        elif text_only and not self._zero3():  # text only: rows can be regrouped and padding cut
            chunks = max(1, min(self.length_chunks, input_ids.shape[0] // 8))  # at least 8 rows a chunk
            emb = self._embed_by_length(input_ids, attention_mask, inputs, chunks)
        else:
            emb = self._embed(input_ids, attention_mask, inputs)
        if zero is not None:
            emb = emb + zero.to(emb.dtype)
        if self.st_modules is not None:
            emb = self.st_modules.over_pooled(emb)
        if self.normalize:
            emb = F.normalize(emb.float(), dim=-1)
        return {"last_hidden_state": emb}

    # Under ZeRO-3 every process must call the same modules the same number of times (each
    # call gathers the module's partitioned weights from all processes), and under DDP a
    # trainable tower that one process skips leaves its gradients unreduced. So a forward
    # always runs each media tower exactly once: on all of the batch's images and videos
    # together, or, when the batch has none, on a minimal dummy input whose output enters
    # the embeddings multiplied by zero (values and gradients unchanged). Text batches are
    # not split into length chunks under ZeRO-3 for the same reason.
    def _zero3(self) -> bool:
        if not hasattr(self, "_is_zero3"):
            self._is_zero3 = any(hasattr(p, "ds_id") for p in self.backbone.parameters())
        return self._is_zero3

    def _base(self) -> nn.Module:
        get = getattr(self.backbone, "get_base_model", None)  # a PEFT model wraps the transformer
        return get() if callable(get) else self.backbone

    def _run_media_towers(self, inputs: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor | None]:
        if self.tower == "vision":
            return self._vision_once(inputs)
        if self.tower == "audio" and inputs.get("input_features") is None:
            return inputs, self._dummy_audio()
        return inputs, None

    def _vision_once(self, inputs: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor | None]:
        base = self._base()
        inputs = dict(inputs)
        images, videos = inputs.pop("pixel_values", None), inputs.pop("pixel_values_videos", None)
        if images is None and videos is None:
            pixels, grid = self._dummy_image(base)
            out = base.get_image_features(pixels, grid, return_dict=True)
            return inputs, _zero_sum(out)
        pixels = torch.cat([x for x in (images, videos) if x is not None])
        grid = torch.cat([g for x, g in ((images, inputs.get("image_grid_thw")), (videos, inputs.get("video_grid_thw"))) if x is not None])
        out = base.get_image_features(pixels, grid, return_dict=True)  # one call; split per image / video below
        n_images = 0 if images is None else len(inputs["image_grid_thw"])
        encoded = {}
        if images is not None:
            encoded["image"] = _take(out, 0, n_images)
        if videos is not None:
            encoded["video"] = _take(out, n_images, None)
        inputs["mm_encoder_outputs"] = encoded
        return inputs, None

    def _dummy_image(self, base: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """The smallest input the vision tower takes: one merge window of patches."""
        vc = base.config.vision_config
        merge = int(getattr(vc, "spatial_merge_size", 2))
        channels = int(getattr(vc, "in_channels", getattr(vc, "in_chans", 3)))
        dim = channels * int(getattr(vc, "temporal_patch_size", 2)) * int(vc.patch_size) ** 2
        param = next(base.visual.parameters())
        grid = torch.tensor([[1, merge, merge]], device=param.device)
        return torch.zeros(merge * merge, dim, device=param.device, dtype=param.dtype), grid

    def _dummy_audio(self) -> torch.Tensor:
        base = self._base()
        ac = base.config.audio_config
        param = next(base.audio_tower.parameters())
        features = torch.zeros(1, int(ac.num_mel_bins), 2 * int(ac.max_source_positions), device=param.device, dtype=param.dtype)
        hidden = base.audio_tower(features).last_hidden_state
        return base.multi_modal_projector(hidden).sum() * 0.0

    def _embed(self, input_ids, attention_mask, inputs) -> torch.Tensor:
        if self.st_modules is not None and self.st_modules.hidden_states:
            inputs = {**inputs, "output_hidden_states": True}
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, return_dict=True, **inputs)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        if self.st_modules is not None and self.st_modules.needs_tokens:  # sentence-transformers' token modules and pooling
            return self.st_modules.pool_tokens(hidden, attention_mask, input_ids, getattr(out, "hidden_states", None))
        return pool(hidden, attention_mask, self.pooling, self.pool_skip)

    def _embed_packed(self, input_ids, attention_mask, inputs) -> torch.Tensor:
        """The batch's real tokens as one sequence, each row attending to itself only (a media
        batch: its image features and grids as they are, the rotary positions per row)."""
        base = self._base()
        if not hasattr(self, "_is_causal"):
            self._is_causal = is_causal(base)
        hidden, packed = packed_forward(self.backbone, base, input_ids, attention_mask, inputs,
                                        multiple_of=PACKED_MULTIPLE if self.bucket else 1, causal=self._is_causal)
        return pool_packed(hidden, packed, self.pooling, self.pool_skip)

    def _embed_by_length(self, input_ids, attention_mask, inputs, chunks: int) -> torch.Tensor:
        """Rows sorted by length, in ``chunks`` calls, each cut to its own longest row (or
        that row's bucket). With ``length_chunks`` 1 (the GPU default) the batch is taken as
        collated (padded to its longest row or bucket already): no cut, so no wait for the
        lengths on the host before the forward."""
        if self.length_chunks == 1:
            return self._embed(input_ids, attention_mask, inputs)
        lengths = attention_mask.sum(1)
        left_padded = bool((attention_mask[:, -1] == 1).all()) and not bool((attention_mask[:, 0] == 1).all())

        def call(rows):
            width = int(lengths[rows].max())
            if self.bucket:
                width = min(bucket_width(width), input_ids.shape[1])
            cols = slice(input_ids.shape[1] - width, None) if left_padded else slice(0, width)
            sub = {k: v[rows][:, cols] for k, v in inputs.items()}
            return self._embed(input_ids[rows][:, cols], attention_mask[rows][:, cols], sub)

        if chunks == 1:
            return call(slice(None))
        order = torch.argsort(lengths, stable=True)
        emb = torch.cat([call(idx) for idx in order.chunk(chunks)])
        return emb[torch.argsort(order)]  # back to the batch's row order

    def activation_checkpointing_enable(self, *args: Any, **kwargs: Any) -> None:
        """The backbone's (BackboneCheckpointing), then no checkpointing of frozen towers."""
        super().activation_checkpointing_enable(*args, **kwargs)
        self._untrack_frozen_towers()

    def _untrack_frozen_towers(self) -> None:
        """Enabling checkpointing makes the output of every sub-model's input embeddings require
        grad (transformers' ``enable_input_require_grads``), the vision or audio tower's patch
        embedding included. For a tower with no trainable parameter (``--freeze_vit`` and
        ``--freeze_aligner``, ms-swift's defaults) that records, recomputes and back-propagates
        the whole tower for nothing: its output gets no gradient either way. Those hooks are
        removed; the language model's stays."""
        from transformers import PreTrainedModel

        base = self._base()
        hooks = getattr(base, "_require_grads_hooks", None) or []
        if not hooks:
            return
        for sub in base.modules():
            if sub is base or not isinstance(sub, PreTrainedModel) or any(p.requires_grad for p in sub.parameters()):
                continue
            try:
                embeddings = sub.get_input_embeddings()
            except (NotImplementedError, AttributeError):
                continue
            registered = getattr(embeddings, "_forward_hooks", {})
            for hook in [h for h in hooks if h.id in registered]:
                hook.remove()
                hooks.remove(hook)



def _take(out: Any, start: int, stop: int | None) -> Any:
    """Images ``start:stop`` of a vision tower output split per image (pooled features and,
    for Qwen3-VL, the deepstack features)."""
    part = copy.copy(out)
    part.pooler_output = tuple(out.pooler_output[start:stop])
    if getattr(out, "deepstack_features", None) is not None:
        part.deepstack_features = [tuple(f[start:stop]) for f in out.deepstack_features]
    return part


def _zero_sum(out: Any) -> torch.Tensor:
    """0 x every tensor a tower produced: ties the dummy call into the graph at no cost."""
    tensors = list(out.pooler_output)
    for f in getattr(out, "deepstack_features", None) or []:
        tensors.extend(f)
    return sum(t.float().sum() for t in tensors) * 0.0


def frozen_parts(freeze_vit: bool, freeze_aligner: bool, freeze_llm: bool) -> set[str]:
    return {p for p, f in (("vit", freeze_vit), ("aligner", freeze_aligner), ("llm", freeze_llm)) if f}


def hidden_size(config) -> int:
    """The embedding width: the language model's hidden size (multimodal configs nest it)."""
    return int(config.get_text_config().hidden_size)


def require_local_model(path: str) -> None:
    """The loaders take local folders: a hub id is resolved to one before (the commands do it
    where they start; from Python, :func:`mmembed.hub.resolve_model`), so say so before
    anything loads."""
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"--model {path!r} is not a local folder; pass a folder, or resolve a hub id to one first "
            "(mmembed.hub.resolve_model)"
        )


#: ``--torch_dtype`` values (``auto``: the dtype the checkpoint was saved in)
TORCH_DTYPES = ("float32", "bfloat16", "float16", "auto")


def check_torch_dtype(value: str | None, flag: str = "--torch_dtype") -> None:
    """A :class:`~mmembed.errors.UsageError` naming ``flag`` unless ``value`` is unset or one
    of :data:`TORCH_DTYPES`: a typo would otherwise surface as a missing ``torch`` attribute
    once the model loads."""
    if value is not None and value not in TORCH_DTYPES:
        raise UsageError(f"{flag} must be one of {', '.join(TORCH_DTYPES)}, got {value!r}")


def check_model_folder(path: str, flag: str = "--model", adapter: bool = True) -> None:
    """A :class:`~mmembed.errors.UsageError` naming ``flag`` unless ``path`` is a local folder
    that holds a model: its ``config.json``, or (with ``adapter``) a LoRA checkpoint's
    ``adapter_config.json``.
    Checked before anything loads, so the message names the flag rather than what
    transformers could not open."""
    if not os.path.isdir(path):  # hub ids are resolved to folders before (mmembed.hub.resolve_model)
        raise UsageError(f"{flag} {path!r} is not a local folder")
    if os.path.isfile(os.path.join(path, "config.json")):
        refuse_custom_code(path, flag)
        return
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        if adapter:
            return
        raise UsageError(f"{flag} {path!r} holds a LoRA adapter, not a model; pass its base model as {flag} and the "
                         "adapter as --adapters")
    raise UsageError(f"{flag} {path!r} holds no config.json" + (" or adapter_config.json" if adapter else "")
                     + "; pass the folder of a transformers model or an mmembed checkpoint")


def refuse_custom_code(path: str, flag: str = "--model") -> None:
    """mmembed never runs a model folder's own code (no ``trust_remote_code``): a
    :class:`~mmembed.errors.UsageError` naming ``flag``, the folder and its ``config.json``'s
    ``auto_map`` when loading it would need that code, i.e. its ``model_type`` is not one
    transformers implements. When transformers does implement it (gte-Qwen2's folders carry an
    ``auto_map`` beside ``model_type: qwen2``), its own classes load the weights and the folder's
    ``.py`` files are not run; a warning says so, as they may differ from transformers' classes."""
    _refuse_custom_tokenizer(path, flag)
    try:
        config = read_json_once(os.path.join(path, "config.json"))
    except (OSError, ValueError):
        return  # no or unreadable config: transformers' own error, later
    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    if not auto_map:
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = config.get("model_type")
    names = ", ".join(sorted({str(v) for v in auto_map.values()})) if isinstance(auto_map, dict) else str(auto_map)
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        _warn_once(os.path.abspath(path), "%s: config.json's auto_map (%s) is ignored: transformers' own %r classes "
                   "load this model; mmembed never runs a model folder's own code", path, names, model_type)
        return
    raise UsageError(f"{flag} {path!r}: its config.json has auto_map ({names}), custom code in the model folder, for "
                     f"model_type {model_type!r}, which transformers does not implement; mmembed never runs a model "
                     "folder's own code (no trust_remote_code): use a model whose model_type transformers implements")


_warned_custom_code: set[str] = set()


def _warn_once(key: str, message: str, *args) -> None:
    """A warning about a folder's own code, logged once per process for ``key``."""
    if key not in _warned_custom_code:
        _warned_custom_code.add(key)
        logging.getLogger("mmembed").warning(message, *args)


def _refuse_custom_tokenizer(path: str, flag: str) -> None:
    """The same rule for ``tokenizer_config.json``'s ``auto_map`` (a tokenizer in the folder's
    own code): refused when its ``tokenizer_class`` is not one transformers implements, else
    transformers' class loads it and a warning says the folder's code is not run."""
    try:
        config = read_json_once(os.path.join(path, "tokenizer_config.json"))
    except (OSError, ValueError):
        return
    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    if not auto_map:
        return
    import transformers

    values = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
    names = ", ".join(sorted({str(x) for v in values for x in (v if isinstance(v, list) else [v]) if x}))
    cls = config.get("tokenizer_class")
    known = isinstance(cls, str) and any(hasattr(transformers, c) for c in (cls, cls + "Fast", cls.removesuffix("Fast")))
    if known:
        _warn_once(os.path.abspath(path) + ":tokenizer", "%s: tokenizer_config.json's auto_map (%s) is ignored: "
                   "transformers' own %s loads this tokenizer; mmembed never runs a model folder's own code",
                   path, names, cls)
        return
    raise UsageError(f"{flag} {path!r}: its tokenizer_config.json has auto_map ({names}), custom tokenizer code in the "
                     f"model folder, for tokenizer_class {cls!r}, which transformers does not implement; mmembed never "
                     "runs a model folder's own code (no trust_remote_code): use a tokenizer transformers implements")


def load_backbone(path: str, torch_dtype: str | None = None, attn_impl: str | None = None,
                  quantization_config: Any = None, device_map: Any = None) -> nn.Module:
    """Load the base transformer (no head) from a local folder, as ``AutoModel`` does;
    ``quantization_config`` (a ``BitsAndBytesConfig``: QLoRA) quantizes it as it loads, onto
    ``device_map``."""
    from transformers import AutoModel

    require_local_model(path)
    refuse_custom_code(path)  # the base model of an adapter is loaded here without passing check_model_folder
    kwargs: dict[str, Any] = {"trust_remote_code": False}
    if torch_dtype and torch_dtype != "auto":
        kwargs["dtype"] = getattr(torch, torch_dtype)
    elif torch_dtype is None:
        kwargs["dtype"] = torch.float32
    if attn_impl:
        kwargs["attn_implementation"] = transformers_name(attn_impl)
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    if device_map is not None:
        kwargs["device_map"] = device_map
    # Embedding needs the base model only: the head weights a checkpoint may carry (lm_head
    # of GME / Qwen-VL / Qwen2-Audio checkpoints) are left out on purpose. transformers' load
    # report would list them as unexpected; it is silenced, and any other missing or
    # unexpected weight is reported here instead.
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        # the config as read once (model_config), not read from the folder again
        model, info = AutoModel.from_pretrained(path, config=model_config(path), output_loading_info=True, **kwargs)
    finally:
        hf_logging.set_verbosity(level)
    # A BERT-style pooler (dense + tanh over [CLS]) is part of the base model a checkpoint and
    # an export must keep whole, though no embedding pooling reads it: it is loaded, frozen
    # (no gradient ever reaches it, and DDP refuses parameters that get none) and saved as it was.
    pooler = getattr(model, "pooler", None)
    if isinstance(pooler, nn.Module):
        pooler.requires_grad_(False)
    unexpected = [k for k in info.get("unexpected_keys", []) if not _is_head_weight(k)]
    for what, keys in (("missing (randomly initialized)", info.get("missing_keys", [])), ("unexpected (ignored)", unexpected)):
        if keys:
            logging.getLogger("mmembed").warning("%s: %d weights %s: %s", path, len(keys), what, ", ".join(sorted(keys)[:10]))
    use_for_towers(model)  # --attn_impl varlen: a vision tower's pictures in one call per layer
    return model


def _is_head_weight(name: str) -> bool:
    parts = name.split(".")
    return "lm_head" in parts or "pooler" in parts


def model_config(model_dir: str):
    """The transformers config of the model folder ``model_dir`` (``AutoConfig``), built from its
    ``config.json`` as read once per process (:func:`~mmembed.files.read_json_once`); each call
    gets its own object."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    raw = read_json_once(os.path.join(model_dir, "config.json"))
    if not isinstance(raw, dict) or raw.get("model_type") not in CONFIG_MAPPING:  # transformers' own reading and message
        return AutoConfig.from_pretrained(model_dir)
    config = CONFIG_MAPPING[raw["model_type"]].from_dict(raw)
    config._name_or_path = model_dir  # as from_pretrained names it
    return config


def default_max_length(model_dir: str, tokenizer) -> int:
    """The model's own limit: sentence-transformers' max_seq_length, else the tokenizer's
    and the position table's, whichever is smaller."""
    st = os.path.join(model_dir, "sentence_bert_config.json")
    if os.path.isfile(st):
        value = read_json_once(st).get("max_seq_length")
        if value:
            return int(value)
    limits = [getattr(model_config(model_dir), "max_position_embeddings", None), tokenizer.model_max_length]
    limits = [int(x) for x in limits if x and x < 10**7]
    return min(limits) if limits else 512
