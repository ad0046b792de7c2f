"""jina-reranker-m0 (``--model_type jina_reranker_m0``) over transformers' Qwen2-VL classes.

jina-reranker-m0's hub folder is a Qwen2-VL checkpoint with a score head and model code of its
own (``config.json``: ``architectures: ["JinaVLForRanking"]``, ``auto_map`` to its
``modeling.py``). mmembed never runs that code; what it does is small enough to state here:

- the backbone is Qwen2-VL (vision tower, merger, language model); there is no LM head;
- ``score = Sequential(Linear(H, H), ReLU, Linear(H, 1))``, weights ``score.0.*`` / ``score.2.*``;
- a pair's raw score is ``score(h)`` of the language model's final (normed) hidden state ``h``
  at the pair's last token, the score token (id 100) its model card appends; the model card
  reports ``sigmoid(raw - 2.65)`` (``LOGIT_BIAS``), and ms-swift 4.6's ``JinaRerankerM0Loader``
  trains ``raw - 2.65`` as the logit of its reranker losses.

:class:`JinaRerankerM0` is that model as a transformers ``PreTrainedModel``: its ``forward``
returns ``logits = score(h) - LOGIT_BIAS`` (``[N, 1]``) with ``h`` at each row's last position
whose ``attention_mask`` is 1 (left or right padding alike), the sequence-classification
output :class:`~mmembed.tasks.reranker.model.RerankerModel` and PEFT's ``SEQ_CLS`` task
expect (``score`` is then trained and saved whole beside a LoRA adapter). It loads the hub's
key names (``model.*`` for the language model, ``visual.*``) and transformers 5's
(``model.language_model.*``, ``model.visual.*``), and saves the latter under the hub's
``architectures`` and ``auto_map``, so a saved folder loads where the original does (its own
code under transformers 5, vLLM's ``JinaVLForSequenceClassification``, mmembed).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn
from transformers import Qwen2VLConfig
from transformers.modeling_outputs import SequenceClassifierOutputWithPast
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel, Qwen2VLPreTrainedModel

__all__ = ["ARCHITECTURE", "LOGIT_BIAS", "JinaRerankerM0", "is_jina_reranker", "load_jina_reranker"]

#: config.json's ``architectures`` entry of jina-reranker-m0's folders
ARCHITECTURE = "JinaVLForRanking"
#: subtracted from the raw score: the model card's ``sigmoid(raw - 2.65)``, ms-swift's ``logit_bias``
LOGIT_BIAS = 2.65
# the hub checkpoint's names (transformers 4's Qwen2-VL) -> transformers 5's
_HUB_KEYS = {r"^visual\.": "model.visual.", r"^model\.(?!language_model\.|visual\.)": "model.language_model."}


def is_jina_reranker(architectures: Any) -> bool:
    """Whether a config's ``architectures`` name jina-reranker-m0's class."""
    return isinstance(architectures, (list, tuple)) and ARCHITECTURE in architectures


def _last_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (attention_mask.long() * positions).argmax(1)


class JinaRerankerM0(Qwen2VLPreTrainedModel):
    """Qwen2-VL and jina-reranker-m0's score MLP (see the module docstring).

    ``forward(input_ids, attention_mask, pixel_values=None, image_grid_thw=None, ...)`` ->
    ``SequenceClassifierOutputWithPast(logits=[N, 1])``: ``score(h) - logit_bias`` in the score
    head's dtype, ``h`` at each row's last real token."""

    config_class = Qwen2VLConfig
    base_model_prefix = "model"
    _no_split_modules = ["Qwen2VLDecoderLayer", "Qwen2VLVisionBlock"]

    def __init__(self, config: Qwen2VLConfig):
        super().__init__(config)
        self.model = Qwen2VLModel(config)
        hidden = config.get_text_config().hidden_size
        self.score = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.num_labels = 1
        self.logit_bias = LOGIT_BIAS
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.set_input_embeddings(value)

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                pixel_values_videos: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: Any = None, return_dict: bool | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                **kwargs: Any) -> SequenceClassifierOutputWithPast:
        if attention_mask is None:
            raise ValueError("jina-reranker-m0 needs the attention_mask, to find each row's last real token")
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values,
                         image_grid_thw=image_grid_thw, pixel_values_videos=pixel_values_videos,
                         video_grid_thw=video_grid_thw, inputs_embeds=inputs_embeds, use_cache=False,
                         return_dict=True, **kwargs)
        hidden = out.last_hidden_state
        last = hidden[torch.arange(hidden.shape[0], device=hidden.device), _last_positions(attention_mask).to(hidden.device)]
        dtype = next(self.score.parameters()).dtype  # the head may be PEFT's wrapper (modules_to_save)
        return SequenceClassifierOutputWithPast(logits=self.score(last.to(dtype)) - self.logit_bias)

    def save_pretrained(self, save_directory: str, *args: Any, **kwargs: Any) -> None:
        """transformers' folder, with config.json's ``architectures`` jina-reranker-m0's own (and
        its ``auto_map``, where the loaded config had one)."""
        super().save_pretrained(save_directory, *args, **kwargs)
        path = os.path.join(save_directory, "config.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
            config["architectures"] = [ARCHITECTURE]
            with open(path, "w", encoding="utf-8") as f:
                json.dump(config, f, indent=2, sort_keys=True)
                f.write("\n")


def load_jina_reranker(path: str, **kwargs: Any) -> tuple[JinaRerankerM0, dict[str, list[str]]]:
    """:class:`JinaRerankerM0` from the folder ``path`` (either key naming), with
    ``from_pretrained``'s ``kwargs`` (``dtype``, ``attn_implementation``); returns the model and
    the loading info (``missing_keys``, ``unexpected_keys``)."""
    kwargs = {k: v for k, v in kwargs.items() if k not in ("output_loading_info", "trust_remote_code")}
    model, info = JinaRerankerM0.from_pretrained(path, key_mapping=_HUB_KEYS, output_loading_info=True, **kwargs)
    return model, info
