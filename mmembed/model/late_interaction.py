"""Late interaction (multi-vector, ColBERT / ColQwen): one L2-normalised vector per token.

``LateInteractionModel`` is :class:`~mmembed.model.embedding.EmbeddingModel` with the pooling
step replaced: the backbone's last hidden states ``[N, L, H]`` go through a linear projection
``H -> dim`` (no bias; sentence-transformers' ``Dense`` of a ColBERT model, PyLate's projection,
ColQwen2's ``embedding_proj_layer``), are L2-normalised per token, and every position that is not
scored is set to exactly zero. The media towers run once per forward exactly as in the parent
(ZeRO-3 / DDP rules, dummy inputs for text-only batches), so images and videos of Qwen2-VL,
Qwen2.5-VL and Qwen3-VL backbones work as they do for single-vector embeddings.

Output contract (what the MaxSim losses read)::

    {"last_hidden_state": FloatTensor [N, L, dim]}

float32; a kept token's vector has unit norm, every other position (padding, skiplisted tokens)
is exactly ``0.0``: a token is *present* iff its vector is nonzero. ``L`` is the batch's width
as collated (rows are never cut shorter in the output, also when the model computes length
chunks internally).

Which positions are kept (the scoring mask), per row:

* ``token_mask`` (optional ``[N, L]``, bool or 0/1): the positions that are scored. Defaults to
  ``attention_mask``. It differs from ``attention_mask`` for ColBERT query expansion with
  ``attend=False``: the expansion ([MASK]) positions are not attended to by the encoder but are
  scored (sentence-transformers' ``query_expansion_positions``); :func:`expand_query` returns
  both masks.
* ``apply_skiplist`` (optional ``[N]``, bool or 0/1): the rows whose tokens in the model's
  skiplist (``skiplist_ids``, e.g. the ids of ``string.punctuation``) are dropped. ColBERT drops
  them from documents only (sentence-transformers' ``MultiVectorMask`` with
  ``skiplist_tasks=["document"]``), so a collator sets it ``True`` on document rows (positives,
  negatives) and ``False`` on query rows. Absent: no row is skiplisted.

A position is kept iff ``token_mask`` is set there and it is not a skiplisted token of a
skiplisted row.

Qwen-VL rows with images or videos take the processor's inputs as :class:`EmbeddingModel` does
(flat ``pixel_values``, ``image_grid_thw``, and ``mm_token_type_ids``, which transformers 5.24
needs for the multimodal rotary positions). Query expansion (:func:`expand_query`) is for text
encoders (BERT-like); chat-template backbones (ColQwen) append their query augmentation tokens in
the rendered text instead (ColQwen2Processor: ``pad_token * 10``, attended, so ``token_mask`` is
not needed there).
"""

from __future__ import annotations

import os
import string
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError
from .embedding import TOKEN_INPUTS, EmbeddingModel, hidden_size
from .packing import bucket_width

#: ColBERT's / PyLate's document skiplist (sentence-transformers' MultiVectorMask words)
PUNCTUATION_SKIPLIST: tuple[str, ...] = tuple(string.punctuation)

#: the projection's file in an mmembed checkpoint (beside a LoRA adapter or full weights)
PROJECTION_FILE = "late_interaction_projection.safetensors"
#: the projection's tensor name (sentence-transformers' and PyLate's ``Dense``)
PROJECTION_KEY = "linear.weight"

#: the extra forward inputs of :class:`LateInteractionModel` (not passed to the backbone)
SCORING_INPUTS = ("token_mask", "apply_skiplist")


class LateInteractionModel(EmbeddingModel):
    """A multi-vector model: ``forward(**batch) -> {"last_hidden_state": [N, L, dim]}``.

    Args:
        backbone: a transformers model (or PEFT model) whose output has ``last_hidden_state``
            (BertModel and other encoders, Qwen2-VL / Qwen2.5-VL / Qwen3-VL base models).
        dim: the width of the token vectors (ColBERT / ColQwen: 128).
        skiplist_ids: token ids dropped on the rows the batch marks with ``apply_skiplist``
            (documents); :func:`skiplist_token_ids` turns words into ids as sentence-transformers
            does.
        tower: the media tower run on every forward (as :class:`EmbeddingModel`).
        length_chunks: as :class:`EmbeddingModel`: a text-only batch is embedded in up to this
            many chunks of rows sorted by length, each cut to its own longest row; the outputs
            are padded back (with zeros) to the batch's width. The length of a row here is the
            span of its attended *and* scored positions, so query-expansion tokens are computed.
        bucket: as :class:`EmbeddingModel` (chunk widths rounded up to a bounded set).
        projection: an ``nn.Linear(hidden, dim, bias=False)`` to use (e.g. loaded back from a
            checkpoint); default a fresh one with ``nn.Linear``'s initialisation, as
            sentence-transformers' ``Dense`` has.

    The projection lives on this wrapper, not in the backbone: under LoRA the PEFT model wraps
    the backbone only, so the projection stays fully trainable (no ``modules_to_save`` needed)
    and is saved beside the adapter by :func:`mmembed.model.multivector_io.save_projection`.
    ``padding_free`` (packing) is refused: the output is per token and padded.
    """

    def __init__(self, backbone: nn.Module, dim: int = 128, *, skiplist_ids: Iterable[int] = (),
                 tower: str | None = None, length_chunks: int = 4, bucket: bool = False,
                 padding_free: bool = False, projection: nn.Linear | None = None):
        if padding_free:
            raise UsageError("padding_free (packing) is not supported for late interaction: its output is one "
                             "vector per token of each padded row; use padding_free false")
        super().__init__(backbone, "mean", normalize=True, length_chunks=length_chunks, tower=tower,
                         padding_free=False, bucket=bucket)
        self.pooling = "tokens"  # no pooling: one vector per token
        hidden = hidden_size(backbone.config)
        if projection is None:
            projection = nn.Linear(hidden, dim, bias=False)
        if projection.bias is not None or projection.in_features != hidden or projection.out_features != dim:
            raise ValueError(f"projection must be nn.Linear({hidden}, {dim}, bias=False), got {projection}")
        self.projection = projection
        self.dim = dim
        self.register_buffer("skiplist_ids", torch.tensor(sorted(set(int(i) for i in skiplist_ids)), dtype=torch.long),
                             persistent=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_mask: torch.Tensor | None = None,
                apply_skiplist: torch.Tensor | None = None, **inputs: Any) -> dict[str, torch.Tensor]:
        """Token vectors ``[N, L, dim]`` (float32, unit norm where kept, exactly zero elsewhere).

        Args:
            input_ids: ``[N, L]``, as collated (either padding side).
            attention_mask: ``[N, L]``, the attended positions.
            token_mask: ``[N, L]`` the scored positions (default ``attention_mask``).
            apply_skiplist: ``[N]`` the rows whose skiplist tokens are dropped (documents).
            **inputs: the other backbone inputs (``token_type_ids``, ``pixel_values``,
                ``image_grid_thw``, ``mm_token_type_ids``, ...), as for :class:`EmbeddingModel`.
        """
        inputs.pop("media_counts", None)
        keep = (attention_mask if token_mask is None else token_mask).bool()
        inputs, zero = self._run_media_towers(inputs)
        text_only = set(inputs) <= TOKEN_INPUTS
        if text_only and not self._zero3():
            chunks = max(1, min(self.length_chunks, input_ids.shape[0] // 8))
            hidden = self._hidden_by_length(input_ids, attention_mask, inputs, keep, chunks)
        else:
            hidden = self._hidden(input_ids, attention_mask, inputs)
        emb = self.projection(hidden.to(self.projection.weight.dtype)).float()
        if zero is not None:
            emb = emb + zero.float()
        emb = F.normalize(emb, dim=-1)
        if apply_skiplist is not None and self.skiplist_ids.numel():
            skipped = torch.isin(input_ids, self.skiplist_ids.to(input_ids.device))
            keep = keep & ~(skipped & apply_skiplist.bool().to(keep.device).unsqueeze(1))
        return {"last_hidden_state": torch.where(keep.unsqueeze(-1), emb, torch.zeros((), dtype=emb.dtype,
                                                                                        device=emb.device))}

    def save_head(self, folder: str, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """The projection into ``folder`` (:func:`~mmembed.model.multivector_io.save_projection`);
        from ``state_dict`` (the whole model's, gathered by DeepSpeed) when given."""
        weight = state_dict.get("projection.weight") if state_dict is not None else None
        save_projection(folder, weight if weight is not None else self.projection)

    def load_head(self, folder: str) -> None:
        """The projection saved in ``folder`` back into this model (its width must match)."""
        weight = load_projection(folder)
        if tuple(weight.shape) != tuple(self.projection.weight.shape):
            raise ValueError(f"{folder}: the saved projection is {tuple(weight.shape)}, this model's "
                             f"{tuple(self.projection.weight.shape)} (--late_interaction_dim)")
        with torch.no_grad():
            self.projection.weight.copy_(weight.to(self.projection.weight.dtype))

    def _hidden(self, input_ids, attention_mask, inputs) -> torch.Tensor:
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, return_dict=True, **inputs)
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    def _hidden_by_length(self, input_ids, attention_mask, inputs, keep, chunks: int) -> torch.Tensor:
        """Hidden states ``[N, L, H]`` computed in ``chunks`` calls of rows sorted by length,
        each cut to its longest row and padded back to ``L`` (the pad positions are masked out
        of the output anyway). A row's length is the span of its attended or scored positions,
        from the side it is not padded on."""
        if self.length_chunks == 1:
            return self._hidden(input_ids, attention_mask, inputs)
        span = attention_mask.bool() | keep
        width_all = input_ids.shape[1]
        left_padded = bool(span[:, -1].all()) and not bool(span[:, 0].all())
        positions = torch.arange(width_all, device=span.device)
        if left_padded:  # from the first spanned column to the end
            lengths = width_all - torch.where(span, positions, width_all).min(1).values
        else:  # up to the last spanned column
            lengths = torch.where(span, positions + 1, 0).max(1).values

        def call(rows):
            width = max(1, int(lengths[rows].max()))
            if self.bucket:
                width = min(bucket_width(width), width_all)
            cols = slice(width_all - width, None) if left_padded else slice(0, width)
            sub = {k: v[rows][:, cols] for k, v in inputs.items()}
            hidden = self._hidden(input_ids[rows][:, cols], attention_mask[rows][:, cols], sub)
            pad = (0, 0, width_all - width, 0) if left_padded else (0, 0, 0, width_all - width)
            return F.pad(hidden, pad)

        if chunks == 1:
            return call(slice(None))
        order = torch.argsort(lengths, stable=True)
        hidden = torch.cat([call(idx) for idx in order.chunk(chunks)])
        return hidden[torch.argsort(order)]


def skiplist_token_ids(tokenizer: Any, words: Iterable[str] = PUNCTUATION_SKIPLIST) -> list[int]:
    """The token ids of ``words`` as sentence-transformers' ``MultiVectorMask`` resolves them
    (``convert_tokens_to_ids``; a word that is not one vocabulary token, i.e. resolves to the
    unknown token, is left out unless it is the unknown token itself)."""
    unk_id, unk = getattr(tokenizer, "unk_token_id", None), getattr(tokenizer, "unk_token", None)
    ids = []
    for word in words:
        token_id = tokenizer.convert_tokens_to_ids(word)
        if token_id is None or (unk_id is not None and token_id == unk_id and word != unk):
            continue
        ids.append(int(token_id))
    return ids


def query_expansion_config(length: int = 32, *, strategy: str = "fixed", attend: bool = False,
                           token: str | None = None) -> dict[str, Any]:
    """A sentence-transformers ``query_expansion`` dict (``Transformer`` config), validated:
    ``strategy`` ``fixed`` (every query exactly ``length`` tokens: shorter ones padded with the
    expansion token, longer ones truncated) or ``min`` (``length`` is a floor only);
    ``attend``: whether the encoder attends to the expansion positions (they are scored either
    way); ``token``: the expansion token (default the tokenizer's mask token, else its eos)."""
    if strategy not in ("fixed", "min"):
        raise ValueError(f"query expansion strategy must be fixed or min, got {strategy!r}")
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise ValueError(f"query expansion length must be a positive int, got {length!r}")
    return {"strategy": strategy, "attend": bool(attend), "token": token, "length": length}


def expansion_token_id(tokenizer: Any, token: str | None = None) -> int:
    """The id the expansion positions take: ``token``'s, else the mask token's, else eos's
    (sentence-transformers' and PyLate's fallback chain)."""
    if token is not None:
        token_id = tokenizer.convert_tokens_to_ids(token)
    else:
        token_id = tokenizer.mask_token_id if tokenizer.mask_token_id is not None else tokenizer.eos_token_id
    if token_id is None:
        raise ValueError("the tokenizer has no mask or eos token to expand queries with; set the expansion token")
    return int(token_id)


def expand_query(input_ids: torch.Tensor, attention_mask: torch.Tensor, *, length: int, token_id: int,
                 attend: bool = False, token_type_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """ColBERT query expansion of a tokenised query batch, as sentence-transformers 6.2's
    ``Transformer.preprocess`` does it for ``task="query"``.

    The batch must be tokenised as sentence-transformers tokenises it (see
    :func:`tokenize_queries`): strategy ``fixed``: ``padding="max_length", max_length=length,
    truncation=True``; strategy ``min``: ``padding=True`` with the query length cap as
    ``max_length``. Then a batch narrower than ``length`` is widened with padding to ``length``,
    and every padding position in the first ``length`` columns (on either padding side) becomes
    an *expansion position*: its id is set to ``token_id`` (the mask token); it is scored
    (``token_mask``), and attended by the encoder only when ``attend``.

    Returns:
        ``input_ids``, ``attention_mask`` (with the expansion positions set iff ``attend``),
        ``token_mask`` (the scored positions: real tokens and expansion positions; pass it to
        :class:`LateInteractionModel` as ``token_mask``) and, when given, ``token_type_ids``
        (widened with zeros).
    """
    if input_ids.shape[1] < length:
        missing = length - input_ids.shape[1]
        input_ids = F.pad(input_ids, (0, missing), value=0)
        attention_mask = F.pad(attention_mask, (0, missing), value=0)
        if token_type_ids is not None:
            token_type_ids = F.pad(token_type_ids, (0, missing), value=0)
    expansion = (attention_mask == 0) & (torch.arange(input_ids.shape[1], device=input_ids.device) < length)
    out = {
        "input_ids": input_ids.masked_fill(expansion, token_id),
        "attention_mask": attention_mask.masked_fill(expansion, 1) if attend else attention_mask,
        "token_mask": attention_mask.bool() | expansion,
    }
    if token_type_ids is not None:
        out["token_type_ids"] = token_type_ids
    return out


def tokenize_queries(tokenizer: Any, texts: Sequence[str], query_expansion: dict[str, Any] | None, *,
                     prefix: str = "", query_length: int | None = None) -> dict[str, torch.Tensor]:
    """Queries tokenised (``prefix + text``) and expanded as sentence-transformers 6.2 does for
    a text model with this ``query_expansion`` (``None``: no expansion, ``query_length`` caps
    the length). Returns the model inputs, ``token_mask`` included."""
    texts = [prefix + t for t in texts]
    if query_expansion is None:
        kwargs: dict[str, Any] = {"padding": True, "truncation": "longest_first"}
        if query_length is not None:
            kwargs["max_length"] = query_length
        enc = dict(tokenizer(texts, return_tensors="pt", **kwargs))
        enc["token_mask"] = enc["attention_mask"].bool()
        return enc
    length = int(query_expansion["length"])
    if query_expansion["strategy"] == "fixed":
        enc = tokenizer(texts, return_tensors="pt", padding="max_length", truncation="longest_first", max_length=length)
    else:
        kwargs = {"padding": True, "truncation": "longest_first"}
        if query_length is not None:
            kwargs["max_length"] = max(query_length, length)
        enc = tokenizer(texts, return_tensors="pt", **kwargs)
    return expand_query(enc["input_ids"], enc["attention_mask"], length=length,
                        token_id=expansion_token_id(tokenizer, query_expansion.get("token")),
                        attend=bool(query_expansion.get("attend", False)), token_type_ids=enc.get("token_type_ids"))


def token_vectors(output: torch.Tensor) -> list[torch.Tensor]:
    """The present token vectors of each row of a :class:`LateInteractionModel` output
    ``[N, L, D]``: a list of ``[k_i, D]`` (a token is present iff its vector is nonzero)."""
    present = output.ne(0).any(-1)
    return [row[m] for row, m in zip(output, present)]


def _weight_of(projection: nn.Module | torch.Tensor) -> torch.Tensor:
    if hasattr(projection, "projection") and isinstance(projection.projection, nn.Module):
        projection = projection.projection
    weight = projection.weight if isinstance(projection, nn.Module) else projection
    if weight.ndim != 2:
        raise ValueError(f"a projection weight is [dim, hidden], got shape {tuple(weight.shape)}")
    return weight.detach().cpu().contiguous()


def save_projection(folder: str, projection: nn.Module | torch.Tensor) -> str:
    """Write the projection (a :class:`LateInteractionModel`, its ``nn.Linear`` or the weight
    ``[dim, hidden]``) to ``folder/late_interaction_projection.safetensors`` under
    ``linear.weight``; returns the file's path. Under ZeRO-3, gather the weight first."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, PROJECTION_FILE)
    save_file({PROJECTION_KEY: _weight_of(projection)}, path, metadata={"format": "pt"})
    return path


def load_projection(folder: str) -> torch.Tensor:
    """The projection weight ``[dim, hidden]`` saved by :func:`save_projection` in ``folder``."""
    from safetensors.torch import load_file

    path = os.path.join(folder, PROJECTION_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder}: no {PROJECTION_FILE} (the late-interaction projection)")
    state = load_file(path)
    if set(state) != {PROJECTION_KEY}:
        raise ValueError(f"{path}: expected the one tensor {PROJECTION_KEY!r}, found {sorted(state)}")
    return state[PROJECTION_KEY]
