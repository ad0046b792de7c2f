"""The ``modeling_wemm_embedding.py`` the tiny WeMM-Embedding folder of examples/tiny_models.py
(kind ``wemm_embedding``) carries, as WeMM-Embedding's hub folders carry theirs: Qwen3.5 with an
``embedding()`` method, last-token pooling and L2 normalisation, which ms-swift 4.6's
``WeMMEmbeddingLoader`` calls. ms-swift runs it (trust_remote_code); mmembed never does: it
computes the same embedding with transformers' own Qwen3.5 classes."""

import torch
import torch.nn.functional as F
from transformers import Qwen3_5ForConditionalGeneration


class WeMMEmbedding(Qwen3_5ForConditionalGeneration):
    def embedding(self, input_ids=None, attention_mask=None, **kwargs):
        self.model.rope_deltas = None
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        if attention_mask is not None:
            last = attention_mask.sum(dim=1) - 1
        else:
            last = torch.full((hidden.shape[0],), hidden.shape[1] - 1, device=hidden.device)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return F.normalize(hidden[rows, last.clamp(min=0)], dim=-1)
