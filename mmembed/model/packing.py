"""Padding-free text batches, and a bounded set of padded widths.

**Packing.** A padded text batch ``[N, L]`` is packed into one sequence ``[1, T]`` of its
real tokens only (``T`` = the sum of the rows' lengths), each row restarting its
``position_ids`` at 0 and attending only to itself. The encoder then computes no padding at
all. How "only to itself" reaches the attention depends on its implementation:

- FlashAttention 2/3, and ``varlen`` (PyTorch's own FlashAttention kernel:
  :mod:`mmembed.model.varlen_attention`): ``cu_seq_lens_q/k`` and ``max_length_q/k``
  (transformers' ``FlashAttentionKwargs``), which select the variable-length kernel; no mask.
- FlexAttention: a ``BlockMask`` of the rows (document masking; causal inside a row for a
  decoder); blocks between rows are skipped.
- SDPA / eager: a dense ``[1, 1, T, T]`` additive mask. The result is the same, but the
  attention is computed over all ``T x T`` pairs, so this is for checking, not for speed.

Pooling reads each row's span of the packed states (its last token, first token, mean or
max). The embeddings and gradients equal those of the padded batch: rows never interact in
the encoder, and position ids restart per row as they do for a right-padded row (a
left-padded decoder row starts later, which rotary positions do not see).

Only families whose positions are plain ``0..len-1`` and whose encoder takes
``position_ids`` are packed (:data:`PACKABLE_MODEL_TYPES`); others keep padded batches.

**Media rows** (Qwen2-VL / GME, Qwen2.5-VL, Qwen3-VL: :data:`MROPE_MODEL_TYPES`). The vision
tower already takes a batch's images as one sequence of patches (no padding there); what is
padded is the language model's sequence of text and image tokens. It is packed the same way,
and its multimodal rotary positions (M-RoPE: temporal, height and width ids that place each
image token by its grid) are the model's own, computed on the padded batch by its
``compute_3d_position_ids`` and read at each row's real tokens (:func:`rope_positions`); the
text positions (0, 1, ... per row) go first, as transformers' ``[4, 1, T]`` layout for packed
rows wants. The image features go in row order, as the padded batch's image tokens come.

**Buckets** (:mod:`mmembed.encoding.buckets`): with ``bucket`` the packed sequence is widened
to a multiple of :data:`PACKED_MULTIPLE`, and length chunks to a bucketed width.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..encoding.buckets import bucket_width, pad_to_width  # noqa: F401  (re-exported)

#: model types whose text encoder is packed: absolute (BERT) or rotary (Qwen2 / Qwen3)
#: positions counted from 0 in each row, ``position_ids`` taken by the forward
#: multimodal families packed with the model's own 3D rotary positions (:func:`rope_positions`)
MROPE_MODEL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl"})
PACKABLE_MODEL_TYPES = frozenset({"bert", "qwen2", "qwen3"}) | MROPE_MODEL_TYPES
#: attention implementations for which packing saves work (others compute a dense mask)
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3", "flex_attention", "varlen")
#: the packed sequence is widened to a multiple of this (FlexAttention's block size), with a
#: filler row that attends to itself only and is pooled by no row
PACKED_MULTIPLE = 128


@dataclass
class Packed:
    """A text batch packed into one sequence (see the module docstring).

    Attributes:
        input_ids: ``[1, T]``: the rows' real tokens, row after row, then the filler.
        position_ids: ``[1, T]``: 0, 1, ... within each row (and the filler).
        segments: ``[T]``: the row each token belongs to (the filler: ``rows``).
        cu_seqlens: ``[S + 1]`` int32: where each row (and the filler, if any) starts, then ``T``.
        max_length: the longest row (or filler).
        rows: ``N``, the batch's rows.
        tokens: the rows' real tokens (``T`` less the filler).
        extra: other per-token inputs (``token_type_ids``), packed the same way.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segments: torch.Tensor
    cu_seqlens: torch.Tensor
    max_length: int
    rows: int
    tokens: int
    extra: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, extra: dict[str, torch.Tensor] | None = None,
         multiple_of: int = 1, pad_id: int = 0) -> Packed:
    """Pack a padded batch (either padding side) into one sequence; with ``multiple_of`` > 1
    a filler row widens it to a multiple of that many tokens."""
    mask = attention_mask.bool()
    lengths = mask.sum(1)
    n = input_ids.shape[0]
    device = input_ids.device
    lengths_list = lengths.tolist()  # the one host sync: the packed width and the longest row
    total = int(sum(lengths_list))
    filler = (-total) % multiple_of if multiple_of > 1 else 0
    seg_lengths = lengths_list + ([filler] if filler else [])
    seg_tensor = torch.tensor(seg_lengths, device=device, dtype=torch.long)
    starts = torch.cumsum(seg_tensor, 0) - seg_tensor
    segments = torch.repeat_interleave(torch.arange(len(seg_lengths), device=device), seg_tensor)
    positions = torch.arange(total + filler, device=device) - starts[segments]
    ids = input_ids[mask]
    packed_extra = {k: v[mask] for k, v in (extra or {}).items()}
    if filler:
        ids = torch.cat([ids, ids.new_full((filler,), pad_id)])
        packed_extra = {k: torch.cat([v, v.new_zeros((filler,))]) for k, v in packed_extra.items()}
    cu = F.pad(torch.cumsum(seg_tensor, 0), (1, 0)).to(torch.int32)
    return Packed(input_ids=ids.unsqueeze(0), position_ids=positions.unsqueeze(0), segments=segments,
                  cu_seqlens=cu, max_length=max(seg_lengths) if seg_lengths else 0, rows=n, tokens=total,
                  extra={k: v.unsqueeze(0) for k, v in packed_extra.items()})


def rope_positions(base: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   inputs: dict, packed: Packed) -> torch.Tensor:
    """``[4, 1, T]`` position ids of a packed multimodal batch: the text positions (0, 1, ...
    per row, transformers' sign of packed rows), then the model's 3D rotary positions of the
    padded batch (``compute_3d_position_ids`` over ``input_ids`` / ``attention_mask`` and the
    grids in ``inputs``) at each row's real tokens; a batch without media gets the text
    positions on all three."""
    compute = base.compute_3d_position_ids
    given = {"input_ids": input_ids, "attention_mask": attention_mask}
    names = [n for n in inspect.signature(compute).parameters if n not in ("self", "args", "kwargs")]
    rope = compute(**{n: given.get(n, inputs.get(n)) for n in names})
    text = packed.position_ids
    spatial = text.expand(3, -1, -1).clone()
    if rope is not None:
        spatial[:, 0, : packed.tokens] = rope[:, attention_mask.bool()].to(spatial.dtype)
    return torch.cat([text.unsqueeze(0), spatial])


def attention_inputs(packed: Packed, implementation: str, causal: bool, dtype: torch.dtype) -> dict:
    """The keyword arguments that keep each packed row to itself under ``implementation``
    (transformers' ``config._attn_implementation``)."""
    if implementation == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        segments = packed.segments

        def same_row(b, h, q, kv):
            return segments[q] == segments[kv]

        def same_row_causal(b, h, q, kv):
            return (segments[q] == segments[kv]) & (q >= kv)

        block = create_block_mask(same_row_causal if causal else same_row, None, None, packed.length, packed.length,
                                  device=packed.input_ids.device)
        return {"attention_mask": block}
    if implementation in ("sdpa", "eager"):
        seg = packed.segments
        allowed = seg[:, None] == seg[None, :]
        if causal:
            allowed = allowed.tril()
        mask = torch.zeros(allowed.shape, dtype=dtype, device=seg.device).masked_fill(~allowed, torch.finfo(dtype).min)
        return {"attention_mask": mask[None, None]}
    # FlashAttention (and kernels registered under other names): variable-length rows
    return {"attention_mask": None, "cu_seq_lens_q": packed.cu_seqlens, "cu_seq_lens_k": packed.cu_seqlens,
            "max_length_q": packed.max_length, "max_length_k": packed.max_length}


def packed_forward(model: torch.nn.Module, base: torch.nn.Module, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor, inputs: dict, multiple_of: int = 1,
                   causal: bool | None = None) -> tuple[torch.Tensor, Packed]:
    """``model`` (what is called: the backbone, maybe PEFT-wrapped; ``base``: the transformer it
    runs, whose config and rotary positions are read) on the padded batch packed into one
    sequence: its token states ``[T, D]`` and the :class:`Packed` layout. Per-token inputs
    (shaped as ``input_ids``) are packed too; the others (media and their grids, a media
    tower's outputs) go as they are. A multimodal family (one with ``compute_3d_position_ids``)
    gets its 3D rotary positions per row (:func:`rope_positions`). ``causal``: whether the
    attention is causal (None: read from ``base``'s attention modules)."""
    per_token = {k: v for k, v in inputs.items() if torch.is_tensor(v) and v.shape[:2] == input_ids.shape}
    rest = {k: v for k, v in inputs.items() if k not in per_token}
    packed = pack(input_ids, attention_mask, per_token, multiple_of=multiple_of)
    positions = packed.position_ids
    if hasattr(base, "compute_3d_position_ids"):
        positions = rope_positions(base, input_ids, attention_mask, inputs, packed)
    dtype = next((p.dtype for p in base.parameters() if p.is_floating_point()), torch.float32)
    causal = is_causal(base) if causal is None else causal
    attention = attention_inputs(packed, base.config._attn_implementation, causal, dtype)
    out = model(input_ids=packed.input_ids, position_ids=positions, return_dict=True, **packed.extra, **rest,
                **attention)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden[0], packed


def pool_packed(hidden: torch.Tensor, packed: Packed, mode: str, skip: int = 0) -> torch.Tensor:
    """Pool packed token states ``[T, D]`` into ``[N, D]``, one vector per row, as
    :func:`mmembed.model.embedding.pool` pools the padded batch (``skip``: its ``last``'s step back)."""
    n = packed.rows
    starts, ends = packed.cu_seqlens[:n].long(), packed.cu_seqlens[1 : n + 1].long()
    if mode == "last":
        return hidden[ends - 1 - skip]
    if mode == "cls":
        return hidden[starts]
    seg = packed.segments[: packed.tokens]
    tokens = hidden[: packed.tokens]
    if mode == "mean":
        sums = hidden.new_zeros((n, hidden.shape[1])).index_add(0, seg, tokens)
        return sums / (ends - starts).clamp_min(1).unsqueeze(1).to(hidden.dtype)
    if mode == "max":
        init = hidden.new_full((n, hidden.shape[1]), torch.finfo(hidden.dtype).min)
        return init.scatter_reduce(0, seg.unsqueeze(1).expand_as(tokens), tokens, reduce="amax", include_self=True)
    raise ValueError(f"unknown pooling {mode!r}")


def is_causal(model: torch.nn.Module) -> bool:
    """Whether the encoder's self-attention is causal (a decoder such as Qwen3), read from its
    attention modules (transformers sets ``is_causal`` on each)."""
    return any(getattr(m, "is_causal", False) is True for m in model.modules())
