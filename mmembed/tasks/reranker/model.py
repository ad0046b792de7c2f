"""A reranker: one score per (query, document) pair, ``forward(**inputs) -> {"scores": [N] float32}``.

Two kinds, as ms-swift's ``--task_type`` names them:

- ``reranker`` (kind ``classifier``): ``AutoModelForSequenceClassification`` with one label
  (BERT, ModernBERT, GTE rerankers); the score is its logit. jina-reranker-m0's folders
  (``JinaVLForRanking``) load as :class:`~mmembed.tasks.reranker.jina.JinaRerankerM0`, Qwen2-VL
  with its score MLP: the score is ``score(h) - 2.65`` at the pair's last token. A folder
  without such a head (a base model, e.g. all-MiniLM-L6-v2) gets a new, randomly initialized
  one, as a classifier trained from a base model must. Saved, the folder loads in transformers
  as ``AutoModelForSequenceClassification`` and in sentence-transformers as ``CrossEncoder``
  (whose ``predict`` applies a sigmoid to the score unless given
  ``activation_fn=Identity()``).
- ``generative_reranker`` (kind ``generative``): a causal language model (Qwen3-Reranker,
  or a vision-language model such as Qwen3-VL-Reranker, loaded with its media towers); the
  score is ``logit(yes) - logit(no)`` at each row's last real token, where ``yes`` / ``no``
  are ``GENERATIVE_RERANKER_POSITIVE_TOKEN`` / ``GENERATIVE_RERANKER_NEGATIVE_TOKEN``
  (defaults ``yes`` / ``no``), each one vocabulary entry of the tokenizer. Only the two
  LM-head rows of those tokens are used: the language model's last hidden state at the last
  position whose attention mask is 1 (left or right padding alike) times those two rows, in
  float32; the logits over the whole vocabulary are never computed. Saved, the folder loads
  as the causal LM it was (``AutoModelForCausalLM``; ``AutoModelForImageTextToText`` for a
  vision-language model).

These raw scores are what the losses train. To users (``mmembed rerank``, ``POST /v1/rerank``,
:class:`~mmembed.tasks.reranker.scorer.Reranker`) a score is reported as ``sigmoid(score)`` unless
raw scores are asked for: ``CrossEncoder.predict``'s default for a classifier, and for a
generative reranker ``softmax([logit(no), logit(yes)])[1]``, Qwen3-Reranker's own score.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...environment import read
from ...errors import UsageError
from ...model.embedding import BackboneCheckpointing, refuse_custom_code, require_local_model
from ...model.packing import is_causal, packed_forward
from ...model.varlen_attention import transformers_name, use_for_towers

__all__ = ["RERANK_TASKS", "RerankerModel", "load_reranker", "token_id"]

logger = logging.getLogger("mmembed")

#: ``--task_type`` -> :attr:`RerankerModel.kind`
RERANK_TASKS = {"reranker": "classifier", "generative_reranker": "generative"}
POSITIVE_TOKEN_VAR = "GENERATIVE_RERANKER_POSITIVE_TOKEN"
NEGATIVE_TOKEN_VAR = "GENERATIVE_RERANKER_NEGATIVE_TOKEN"
DEFAULT_TOKENS = ("yes", "no")

# the collator's bookkeeping, never a model input
_NOT_INPUTS = ("labels", "group_ids", "media_counts")


def last_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's last position whose mask is 1: the final column under left padding, the one
    before the first pad under right padding."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (attention_mask.long() * positions).argmax(1)


class RerankerModel(BackboneCheckpointing, nn.Module):
    """A reranker around a transformers model (or a PEFT model around one).

    Args:
        backbone: ``classifier``: a sequence-classification model with one label;
            ``generative``: a causal LM (or a vision-language ``...ForConditionalGeneration``).
        kind: ``classifier`` or ``generative``.
        token_ids: ``generative``: the vocabulary ids of the positive and negative token.
        tokens: ``generative``: those tokens, as text (for messages and the saved record).

    ``forward(**inputs)`` takes what the tokenizer / processor gives (``input_ids``,
    ``attention_mask``, ``token_type_ids``, ``pixel_values``, ``image_grid_thw``, ...) and
    returns ``{"scores": [N] float32}``; ``labels`` / ``group_ids`` / ``media_counts`` are
    ignored. ``backbone`` is what PEFT, freezing and gradient checkpointing act on.
    """

    def __init__(self, backbone: nn.Module, kind: str, token_ids: tuple[int, int] | None = None,
                 tokens: tuple[str, str] | None = None, padding_free: bool = False):
        super().__init__()
        if kind not in ("classifier", "generative"):
            raise ValueError(f"reranker kind must be classifier or generative, got {kind!r}")
        if kind == "generative" and (token_ids is None or len(token_ids) != 2):
            raise ValueError("a generative reranker needs token_ids: the positive and negative token's ids")
        self.backbone = backbone
        self.kind = kind
        self.token_ids = tuple(int(i) for i in token_ids) if token_ids is not None else None
        self.tokens = tuple(tokens) if tokens is not None else None
        self.padding_free = padding_free
        # a sentence-transformers CrossEncoder folder's own files and settings (.st_folder), kept in every saved folder
        self.cross_encoder: Any = None

    def packable(self) -> str | None:
        """Why this reranker's batches cannot be packed (``--padding_free``), or None when they
        can: a generative reranker (each row's last token), or a classifier whose head scores the
        last token of a causal model (``score``: Qwen, Llama, ... sequence classifiers); an
        encoder's classifier pools inside the encoder (BERT's pooler), over the padded row."""
        if self.kind == "generative":
            return None
        transformer = self._transformer()
        if getattr(transformer, "logit_bias", None) is not None:
            return f"{type(transformer).__name__} is scored from padded rows only"
        if getattr(transformer, "score", None) is None or not is_causal(transformer.base_model):
            return f"{type(transformer).__name__} pools each row inside the model (no last-token score head)"
        return None

    @property
    def config(self):
        return self.backbone.config

    def _transformer(self) -> nn.Module:
        get = getattr(self.backbone, "get_base_model", None)  # a PEFT model wraps the transformer
        return get() if callable(get) else self.backbone

    def save_head(self, folder: str, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Nothing of weights beside the backbone: a classifier's head is the backbone's own
        module (saved with it, or with a LoRA adapter as PEFT's ``modules_to_save``); a generative
        one's is the LM head. A model folder (not an adapter) trained from a CrossEncoder folder
        gets its sentence-transformers files (:class:`~mmembed.tasks.reranker.st_folder.CrossEncoderFolder`)."""
        if self.cross_encoder is not None and not os.path.isfile(os.path.join(folder, "adapter_config.json")):
            self.cross_encoder.save(folder)

    def load_head(self, folder: str) -> None:
        """Nothing to load beside the backbone (see :meth:`save_head`)."""

    def forward(self, **inputs: Any) -> dict[str, torch.Tensor]:
        for key in _NOT_INPUTS:
            inputs.pop(key, None)
        if self.padding_free:
            return {"scores": self._packed_scores(inputs)}
        if self.kind == "classifier":
            logits = self.backbone(**inputs, return_dict=True).logits
            return {"scores": logits.reshape(logits.shape[0], -1)[:, 0].float()}
        attention_mask = inputs.get("attention_mask")
        if attention_mask is None:
            raise ValueError("a generative reranker needs the attention_mask, to find each row's last real token")
        # the language model without its head (LoRA layers sit inside it): hidden states only
        out = self._transformer().base_model(**inputs, return_dict=True)
        hidden = out.last_hidden_state
        last = hidden[torch.arange(hidden.shape[0], device=hidden.device), last_positions(attention_mask).to(hidden.device)]
        return {"scores": self.pair_logits(last)}

    def _packed_scores(self, inputs: dict[str, Any]) -> torch.Tensor:
        """The batch's pairs packed into one sequence (:func:`~mmembed.model.packing.packed_forward`),
        each scored at its last token: the same scores as the padded batch."""
        input_ids, attention_mask = inputs.pop("input_ids"), inputs.pop("attention_mask")
        transformer = self._transformer()
        base = transformer.base_model  # the language model without its head (LoRA layers sit inside it)
        hidden, packed = packed_forward(base, base, input_ids, attention_mask, inputs)
        last = hidden[packed.cu_seqlens[1 : packed.rows + 1].long() - 1]
        if self.kind == "generative":
            return self.pair_logits(last)
        logits = transformer.score(last)
        return logits.reshape(logits.shape[0], -1)[:, 0].float()

    def pair_logits(self, last: torch.Tensor) -> torch.Tensor:
        """``logit(positive) - logit(negative)`` of last hidden states ``[N, D]``, in float32:
        two rows of the LM head. Under DeepSpeed ZeRO-3 the head's weight is a partition
        outside its own forward, so the head module is called (on the N rows only)."""
        head = self._transformer().get_output_embeddings()
        ids = list(self.token_ids)
        if hasattr(head.weight, "ds_id"):
            logits = head(last)[:, ids].float()
        else:
            bias = head.bias[ids].float() if getattr(head, "bias", None) is not None else None
            logits = F.linear(last.float(), head.weight[ids].float(), bias)
        cap = getattr(self._transformer().config.get_text_config(), "final_logit_softcapping", None)
        if cap:  # Gemma 2 / 3 squash their logits so
            logits = torch.tanh(logits / cap) * cap
        return logits[:, 0] - logits[:, 1]

    def save_pretrained(self, save_directory: str, **kwargs: Any) -> None:
        """The backbone's folder (``kwargs`` as ``PreTrainedModel.save_pretrained`` takes them):
        a sequence-classification model (CrossEncoder-loadable) or the causal LM; a PEFT
        backbone saves its adapter."""
        self.backbone.save_pretrained(save_directory, **kwargs)


def token_id(tokenizer: Any, token: str, variable: str, vocab_rows: int | None = None) -> int:
    """``token``'s id (``tokenizer.convert_tokens_to_ids``), or a UsageError naming
    ``variable`` when it is not one vocabulary entry (or has no row in an LM head of
    ``vocab_rows`` rows)."""
    tid = tokenizer.convert_tokens_to_ids(token) if token else None
    unk = getattr(tokenizer, "unk_token_id", None)
    if not isinstance(tid, int) or (tid == unk and token != getattr(tokenizer, "unk_token", None)):
        raise UsageError(f"{variable}={token!r} is not one token of the tokenizer (tokenizer.convert_tokens_to_ids "
                         f"does not find it as a vocabulary entry); use a single token, e.g. {DEFAULT_TOKENS[0]!r} / "
                         f"{DEFAULT_TOKENS[1]!r}, as the tokenizer spells it")
    if vocab_rows is not None and not 0 <= tid < vocab_rows:
        raise UsageError(f"{variable}={token!r} is token {tid}, but the model's LM head has {vocab_rows} rows")
    return tid


def load_reranker(path: str, task_type: str, torch_dtype: str | torch.dtype | None = None,
                  positive_token: str | None = None, negative_token: str | None = None,
                  tokenizer: Any = None, attn_impl: str | None = None,
                  head_from_adapter: bool = False) -> RerankerModel:
    """Load the reranker at ``path`` (a local folder) for ``task_type``.

    Args:
        path: the model folder.
        task_type: ``reranker`` (a sequence classifier, one label) or ``generative_reranker``
            (a causal LM, or a vision-language model).
        torch_dtype: ``float32`` (None), ``bfloat16``, ``float16``, ``auto`` or a torch dtype.
        positive_token, negative_token: ``generative_reranker``: the tokens whose logits give
            the score; None: ``GENERATIVE_RERANKER_POSITIVE_TOKEN`` /
            ``GENERATIVE_RERANKER_NEGATIVE_TOKEN`` (read through :mod:`mmembed.environment`),
            else ``yes`` / ``no``.
        tokenizer: the tokenizer (or processor) that converts them; None: the folder's.
        attn_impl: ``--attn_impl`` (sdpa, eager, flash_attn, ...); None: transformers' default.
        head_from_adapter: the base of a LoRA reranker checkpoint, whose adapter brings the
            trained head (no word about a new head starting from random weights).

    Raises:
        UsageError: an unknown ``task_type``, a folder that is not local or needs its own code,
            or a token that is not one vocabulary entry (naming its variable).
    """
    from transformers import AutoConfig

    if task_type not in RERANK_TASKS:
        raise UsageError(f"--task_type {task_type!r} is not a reranker task; use {' or '.join(RERANK_TASKS)}")
    require_local_model(path)
    refuse_custom_code(path)
    kwargs: dict[str, Any] = {"trust_remote_code": False, "output_loading_info": True}
    if isinstance(torch_dtype, torch.dtype):
        kwargs["dtype"] = torch_dtype
    elif torch_dtype is None:
        kwargs["dtype"] = torch.float32
    elif torch_dtype != "auto":
        kwargs["dtype"] = getattr(torch, torch_dtype)
    if attn_impl:
        kwargs["attn_implementation"] = transformers_name(attn_impl)
    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    if RERANK_TASKS[task_type] == "classifier":
        return _load_classifier(path, config, kwargs, tokenizer, head_from_adapter)
    return _load_generative(path, config, kwargs, tokenizer, positive_token, negative_token)


def _load_classifier(path: str, config: Any, kwargs: dict[str, Any], tokenizer: Any,
                     head_from_adapter: bool = False) -> RerankerModel:
    from transformers import AutoModelForSequenceClassification

    from .jina import is_jina_reranker, load_jina_reranker
    from .st_folder import read_cross_encoder

    if is_jina_reranker(getattr(config, "architectures", None)):  # its own score head, no folder code run
        model, info = _quietly(load_jina_reranker, path, **kwargs)
        _report(path, info.get("missing_keys", []), info.get("unexpected_keys", []))
        use_for_towers(model)
        return RerankerModel(model, "classifier")
    model, info = _quietly(AutoModelForSequenceClassification.from_pretrained, path, num_labels=1, **kwargs)
    cross_encoder = read_cross_encoder(path)  # its modules checked by the run before the weights loaded
    missing = list(info.get("missing_keys", []))
    head = [k for k in missing if k.split(".")[0] in ("classifier", "score") or k.startswith("pooler.")]
    if head and not head_from_adapter:
        logger.warning("%s: no sequence-classification head with one label: a new one (%s) starts from random weights, "
                       "as expected when a reranker is trained from a model without one", path, ", ".join(sorted(head)))
    _report(path, [k for k in missing if k not in head], info.get("unexpected_keys", []))
    if getattr(model.config, "pad_token_id", None) is None and not model.config.is_encoder_decoder:
        # a decoder's classifier scores the last non-pad token, found by the pad id
        tok = tokenizer if tokenizer is not None else _tokenizer(path)
        tok = getattr(tok, "tokenizer", tok)
        if getattr(tok, "pad_token_id", None) is not None:
            model.config.pad_token_id = tok.pad_token_id
    reranker = RerankerModel(model, "classifier")
    reranker.cross_encoder = cross_encoder
    return reranker


def _load_generative(path: str, config: Any, kwargs: dict[str, Any], tokenizer: Any,
                     positive_token: str | None, negative_token: str | None) -> RerankerModel:
    import transformers

    vision = getattr(config, "vision_config", None) is not None
    auto = transformers.AutoModelForImageTextToText if vision else transformers.AutoModelForCausalLM
    model, info = _quietly(auto.from_pretrained, path, **kwargs)
    _report(path, info.get("missing_keys", []), info.get("unexpected_keys", []))
    use_for_towers(model)  # --attn_impl varlen: a vision tower's pictures in one call per layer
    variables = read().reranker
    tokens = (positive_token if positive_token is not None else variables.get(POSITIVE_TOKEN_VAR) or DEFAULT_TOKENS[0],
              negative_token if negative_token is not None else variables.get(NEGATIVE_TOKEN_VAR) or DEFAULT_TOKENS[1])
    tok = tokenizer if tokenizer is not None else _tokenizer(path)
    tok = getattr(tok, "tokenizer", tok)  # a processor holds its tokenizer
    weight = model.get_output_embeddings().weight
    rows = getattr(weight, "ds_shape", weight.shape)[0]  # under ZeRO-3 the local tensor is a partition (0 rows)
    ids = (token_id(tok, tokens[0], POSITIVE_TOKEN_VAR, rows), token_id(tok, tokens[1], NEGATIVE_TOKEN_VAR, rows))
    if ids[0] == ids[1]:
        raise UsageError(f"{POSITIVE_TOKEN_VAR}={tokens[0]!r} and {NEGATIVE_TOKEN_VAR}={tokens[1]!r} are one token "
                         f"(id {ids[0]}): every score would be 0; use two different tokens")
    return RerankerModel(model, "generative", ids, tokens)


def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=False)


def _quietly(load, path: str, **kwargs: Any):
    """``load(path, **kwargs)`` with transformers' own load report silenced: :func:`_report`
    reports the weights that matter instead."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return load(path, **kwargs)
    finally:
        hf_logging.set_verbosity(level)


def _report(path: str, missing: list[str], unexpected: list[str]) -> None:
    for what, keys in (("missing (randomly initialized)", missing), ("unexpected (ignored)", unexpected)):
        if keys:
            logger.warning("%s: %d weights %s: %s", os.path.basename(os.path.normpath(path)) or path, len(keys), what,
                           ", ".join(sorted(keys)[:10]))
