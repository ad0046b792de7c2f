"""A bounded set of padded widths for batches (``--length_buckets``).

A padded batch is widened to one of a few widths (:func:`bucket_width`), so a run meets a few
dozen shapes instead of one per longest row: kernels that prepare per shape (cuDNN attention
plans, compiled graphs, autotuned matmuls) do so a few times. The extra columns are padding:
masked in attention and pooling, so the embeddings are the same.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def bucket_width(length: int, minimum: int = 16) -> int:
    """The bucketed width of a batch whose longest row has ``length`` tokens: a multiple of
    ``minimum``, and above ``4 * minimum`` a multiple of a quarter of the largest power of two
    not above ``length`` (so at most about 25% padding is added, and each doubling of the
    length adds four widths): 16, 32, ..., 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, ..."""
    if length <= 0:
        return length
    step = max(minimum, (1 << (length.bit_length() - 1)) // 4)
    return -(-length // step) * step


def pad_to_width(enc: dict[str, torch.Tensor], width: int, pad_id: int, side: str,
                 keys: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """A tokenizer's output ``[N, L]`` padded to ``width >= L`` columns on ``side``
    (``input_ids`` with ``pad_id``, the attention mask and every other per-token tensor with 0).
    ``keys``: the per-token tensors, where ``enc`` also holds others (a processor's media
    tensors); by default every ``[N, L]`` tensor."""
    extra = width - enc["input_ids"].shape[1]
    if extra <= 0:
        return enc
    pad = (extra, 0) if side == "left" else (0, extra)
    out = {}
    for key, value in enc.items():
        per_token = key in keys if keys is not None else (
            torch.is_tensor(value) and value.dim() == 2 and value.shape == enc["input_ids"].shape)
        if per_token:
            out[key] = F.pad(value, pad, value=pad_id if key == "input_ids" else 0)
        else:
            out[key] = value
    return out
