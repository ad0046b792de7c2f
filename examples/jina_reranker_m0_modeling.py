"""The ``modeling.py`` that examples/tiny_models.py copies into its tiny ``jina_reranker_m0`` folder.

jina-reranker-m0's hub folder ships its own model code (``config.json``'s ``auto_map``:
``{"AutoModel": "modeling.JinaVLForRanking"}``), and ms-swift 4.6's ``JinaRerankerM0Loader``
loads it with ``AutoModel.from_pretrained(..., trust_remote_code=True)``. This file stands for
that code in the tiny folder, so that ms-swift loads the tiny model as it loads the real one;
it is written here from the published class's behaviour, not copied:

- ``JinaVLForRanking`` is a ``Qwen2VLForConditionalGeneration`` whose LM head does nothing
  (``nn.Identity``: no ``lm_head`` weights) and which adds ``score = Sequential(Linear(H, H),
  ReLU, Linear(H, 1))`` (weights ``score.0.*``, ``score.2.*``);
- ``forward`` returns ``score(h[:, -1])`` of the language model's final (normed) hidden states,
  one raw score per row: the last column, so the model card pads on the left and appends the
  score token (id 100) itself; ms-swift's loader subtracts ``logit_bias`` (2.65) from it, and the
  model card's score is ``sigmoid(raw - 2.65)``.

mmembed never runs this file: it loads such folders with transformers' Qwen2-VL classes
(mmembed/tasks/reranker/jina.py).
"""

import torch
from torch import nn
from transformers import Qwen2VLForConditionalGeneration


class JinaVLForRanking(Qwen2VLForConditionalGeneration):
    def __init__(self, config):
        config.tie_word_embeddings = False  # the LM head is replaced: nothing to tie it to
        super().__init__(config)
        self.lm_head = nn.Identity()
        hidden = config.get_text_config().hidden_size
        self.score = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, pixel_values=None, image_grid_thw=None,
                video_grid_thw=None, **kwargs) -> torch.Tensor:
        for key in ("labels", "output_hidden_states", "use_cache", "return_dict"):
            kwargs.pop(key, None)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values,
                         image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw, use_cache=False,
                         return_dict=True, **kwargs)
        return self.score(out.last_hidden_state[:, -1]).squeeze(-1)
