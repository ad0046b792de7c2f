"""A bounded set of padded widths for batches (``--length_buckets``).

A padded batch is widened to one of a few widths (:func:`bucket_width`), so a run meets a few
dozen shapes instead of one per longest row: kernels that prepare per shape (cuDNN attention
plans, compiled graphs, autotuned matmuls) do so a few times. The extra columns are padding:
masked in attention and pooling, so the embeddings are the same.
"""

from __future__ import annotations

from collections.abc import Collection

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
                 exclude: Collection[str] = ()) -> dict[str, torch.Tensor]:
    """A tokenizer's or processor's output ``[N, L]`` padded to ``width >= L`` columns on
    ``side`` (``input_ids`` with ``pad_id``, the attention mask and every other per-token
    ``[N, L]`` tensor with 0); ``exclude`` names tensors that are never per-token (a
    processor's media tensors), whatever their shape."""
    extra = width - enc["input_ids"].shape[1]
    if extra <= 0:
        return enc
    pad = (extra, 0) if side == "left" else (0, extra)
    out = {}
    for key, value in enc.items():
        if key not in exclude and torch.is_tensor(value) and value.dim() == 2 and value.shape == enc["input_ids"].shape:
            out[key] = F.pad(value, pad, value=pad_id if key == "input_ids" else 0)
        else:
            out[key] = value
    return out
