"""What ``mmembed serve`` runs with: its flags, parsed once (``parse_serve_args`` in
:mod:`mmembed.tools.serve`), read by both servers (embeddings in :mod:`~mmembed.tools.serve`,
rerank in :mod:`~mmembed.tools.serve_rerank`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["ServeConfig"]


@dataclass
class ServeConfig:
    """What ``mmembed serve`` runs with (its flags)."""

    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # default: the model folder's name
    allowed_media_dir: str | None = None  # media paths must lie inside; None: data: URIs only
    max_batch_size: int = 64  # inputs embedded together at most (a larger request goes alone)
    max_wait_ms: float = 2.0  # how long the first request of a batch waits for company
    batching: bool = True  # false: one encode call per request (the baseline of bench_serve.py)
    max_inputs: int = 2048  # inputs per request (OpenAI's limit)
    encode_batch_size: int = 32  # Embedder.encode's batch_size
    device: str | None = None
    torch_dtype: str | None = None
    task_type: str | None = None  # embedding | reranker | generative_reranker; None: from the folder
    use_hf: bool = False  # --model ORG/NAME is Hugging Face's (else ModelScope's): mmembed.hub
    model_revision: str | None = None
    hub_token: str | None = None

    def name(self) -> str:
        return self.served_model_name or os.path.basename(os.path.normpath(self.model))
