"""``--attn_impl varlen``: packed batches under PyTorch's own FlashAttention kernel.

Padding-free batches (:mod:`mmembed.model.packing`) need an attention that keeps each packed
row to itself without a dense ``T x T`` mask: FlashAttention's variable-length kernel, which
transformers reaches through the flash-attn package (a CUDA build that many machines lack:
it is not on PyPI as a wheel for every torch). PyTorch ships the same kind of kernel,
``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10, CUDA). This module registers it
with transformers as the attention implementation ``varlen``:

- a call that carries ``cu_seq_lens_q`` (a packed batch: the spans of its rows) goes to
  ``varlen_attn`` on a CUDA device in half precision, causal inside each span for a causal
  module (``window_size=(-1, 0)``); elsewhere (the CPU, float32) to one SDPA call per span,
  the same attention written out;
- any other call (a padded batch, a vision tower's per-image call) is transformers' SDPA
  with SDPA's mask, so the model behaves as under ``--attn_impl sdpa``.

The mask function is SDPA's, except that a call without an attention mask gets none (a
packed batch's rows are kept apart by the spans, not by a mask). The kernel has no attention
dropout; a model whose config asks for it is refused before the run
(:func:`mmembed.training.model_assembly.check_attention_dropout`).
"""

from __future__ import annotations

import inspect
import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger("mmembed")
_warned: list[bool] = []  # the slow path on a GPU, said once per process


def _kernel_takes_grouped_heads() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch before 2.10: no kernel (packed calls run as SDPA per row)
        return False
    return "enable_gqa" in inspect.signature(varlen_attn).parameters


#: whether this torch's varlen kernel takes fewer key / value heads than query heads
KERNEL_GQA = _kernel_takes_grouped_heads()

#: the name ``--attn_impl`` and transformers' ``attn_implementation`` know it by
NAME = "varlen"
#: the same function under the name a vision tower's config gets (:func:`use_for_towers`): with
#: "flash" in its name, transformers sends a Qwen-VL tower's pictures to attention as one call
#: with their spans (``cu_seqlens``), not as one call per picture
TOWER_NAME = "varlen_flash"
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def transformers_name(attn_impl: str) -> str:
    """transformers' ``attn_implementation`` for ``--attn_impl`` (ms-swift's ``flash_attn`` is
    FlashAttention 2; ``varlen`` is registered here first)."""
    if attn_impl == NAME:
        register()
    return {"flash_attn": "flash_attention_2"}.get(attn_impl, attn_impl)


def register() -> None:
    """Make ``attn_implementation="varlen"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS.valid_keys():
        AttentionInterface.register(NAME, varlen_attention)
        AttentionInterface.register(TOWER_NAME, varlen_attention)
        AttentionMaskInterface.register(NAME, varlen_mask)


def use_for_towers(model) -> None:
    """A model loaded with ``attn_implementation="varlen"``: its vision tower (``vision_config``)
    attends over all of a batch's pictures in one call per layer, by their spans (the kernel on
    a GPU; one SDPA call per picture elsewhere, as before). transformers does so for a name with
    "flash" in it, which it would try to load as a FlashAttention kernel if the model were loaded
    under it, so the tower's config is renamed once loaded (the name is not saved with it)."""
    vision = getattr(getattr(model, "config", None), "vision_config", None)
    if vision is not None and getattr(vision, "_attn_implementation", None) == NAME:
        register()
        vision._attn_implementation = TOWER_NAME


def varlen_mask(*args, **kwargs):
    """SDPA's mask, or none where the call has no attention mask (packed: the spans keep rows apart)."""
    from transformers.masking_utils import sdpa_mask

    if kwargs.get("attention_mask") is None:
        return None
    return sdpa_mask(*args, **kwargs)


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention function contract: ``query`` ``[B, H, T, D]`` (``key`` /
    ``value`` with ``H_kv`` heads), output ``[B, T, H, D]``."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"--attn_impl {NAME}: a packed batch is one sequence, got a batch of {query.shape[0]}")
    if dropout:
        raise ValueError(f"--attn_impl {NAME}: the variable-length kernel has no attention dropout")
    causal = bool(getattr(module, "is_causal", False))
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, D]
    longest = int(kwargs.get("max_length_q") or int((cu[1:] - cu[:-1]).max()))
    out = spans_attention(q, k, v, cu, longest, scaling, causal)
    return out.unsqueeze(0), None


def uses_kernel(q: torch.Tensor) -> bool:
    """Whether PyTorch's varlen kernel takes these queries (CUDA, half precision, head size a
    multiple of 8 up to 256); otherwise each span is one SDPA call."""
    return q.is_cuda and q.dtype in _KERNEL_DTYPES and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256


def spans_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int,
                    scaling: float | None, causal: bool) -> torch.Tensor:
    """Attention of ``q`` ``[T, H, D]`` within each span ``cu[i]:cu[i+1]``: ``[T, H, D]``. ``k`` /
    ``v`` may have fewer heads (grouped-query attention: each serves ``H / H_kv`` query heads)."""
    grouped = k.shape[1] != q.shape[1]
    if uses_kernel(q):
        from torch.nn.attention.varlen import varlen_attn

        cu = cu.to(torch.int32)
        options = {}
        if grouped and KERNEL_GQA:  # the kernel reads the shared heads (torch 2.14 does; 2.11 does not): no copies
            options["enable_gqa"] = True
        elif grouped:
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        return varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling,
                           window_size=(-1, 0) if causal else (-1, -1), **options)
    if q.is_cuda and not _warned:
        _warned.append(True)
        logger.warning("--attn_impl %s: %s queries of head size %d on the GPU, which PyTorch's varlen kernel does not "
                       "take (float16 / bfloat16, a multiple of 8 up to 256): each packed row is one SDPA call (the "
                       "same attention, slower); train with --bf16 true", NAME, q.dtype, q.shape[-1])
    outs = []
    for a, b in zip(cu.tolist(), cu[1:].tolist()):
        span = [x[a:b].transpose(0, 1) for x in (q, k, v)]  # [H, n, D]
        outs.append(F.scaled_dot_product_attention(*span, is_causal=causal, scale=scaling,
                                                   enable_gqa=grouped).transpose(0, 1))
    return torch.cat(outs)
