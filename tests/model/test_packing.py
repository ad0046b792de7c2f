"""Padding-free (packed) text batches and bucketed widths give the padded batch's embeddings
and gradients (mmembed.model.packing, EmbeddingModel(padding_free=..., bucket=...)).

The reference is the plain padded forward: one call on the batch as the tokenizer pads it,
pooled by ``embedding.pool``. FlashAttention cannot run on a CPU, so its path is checked
through an attention function registered here that does what FlashAttention's
variable-length kernel does, written out: attention within each ``cu_seq_lens`` span.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AutoModel, AutoTokenizer

from mmembed.model.embedding import EmbeddingModel, pool
from mmembed.model.packing import (
    attention_inputs,
    bucket_width,
    is_causal,
    pack,
    pad_to_width,
    pool_packed,
)
from mmembed.model.varlen_attention import register as register_varlen

TEXTS = [
    "a man is playing a guitar on the stage tonight",
    "dogs",
    "the quick brown fox jumps over the lazy dog and runs into the forest far away",
    "two women are dancing",
    "x",
    "a child rides a bicycle down the hill",
]


def varlen_reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """FlashAttention's variable-length contract, written out: rows are the spans between
    consecutive ``cu_seq_lens_q`` entries, each attending only within itself (causally for
    a causal module)."""
    cu = kwargs["cu_seq_lens_q"].tolist()
    assert kwargs["cu_seq_lens_k"].tolist() == cu and attention_mask is None
    assert kwargs["max_length_q"] == max(b - a for a, b in zip(cu, cu[1:]))
    if key.shape[1] != query.shape[1]:  # grouped-query attention
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    outs = []
    for a, b in zip(cu, cu[1:]):
        outs.append(F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
                                                   is_causal=bool(getattr(module, "is_causal", False)), scale=scaling))
    return torch.cat(outs, 2).transpose(1, 2).contiguous(), None


AttentionInterface.register("varlen_reference", varlen_reference_attention)
register_varlen()  # mmembed's --attn_impl varlen (on the CPU: one SDPA call per span)


@pytest.fixture(scope="module")
def models(minilm_no_dropout, tiny_model):
    """(name, folder, pooling, padding side) of each packable family."""
    return {
        "bert": (minilm_no_dropout, "mean", "right"),
        "qwen3": (tiny_model("qwen3"), "last", "left"),
        "qwen2": (tiny_model("qwen2"), "last", "left"),
    }


def load(folder: str, implementation: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModel.from_pretrained(folder, attn_implementation=implementation, dtype=torch.float32)
    return model.eval()


@functools.cache
def tokenizer(folder: str):
    return AutoTokenizer.from_pretrained(folder)  # the Qwen tokenizer takes seconds to build


def batch(folder: str, side: str, texts=TEXTS):
    tok = tokenizer(folder)
    tok.padding_side = side
    return dict(tok(texts, padding=True, return_tensors="pt"))


def padded_reference(model, enc, pooling):
    out = model(**enc).last_hidden_state
    return F.normalize(pool(out, enc["attention_mask"], pooling).float(), dim=-1)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["bert", "qwen3", "qwen2"])
@pytest.mark.parametrize("implementation", ["sdpa", "eager", "varlen_reference", "varlen"])
@pytest.mark.parametrize("bucket", [False, True])
def test_packed_batch_gives_the_padded_embeddings_and_gradients(models, family, implementation, bucket):
    folder, pooling, side = models[family]
    enc = batch(folder, side)
    weights = torch.randn(len(TEXTS), generator=torch.Generator().manual_seed(1))

    ref_model = load(folder, "eager")
    ref = padded_reference(ref_model, enc, pooling)
    (ref.sum(1) * weights).sum().backward()

    model = load(folder, implementation)
    wrapped = EmbeddingModel(model, pooling, length_chunks=1, padding_free=True, bucket=bucket)
    emb = wrapped(**enc)["last_hidden_state"]
    (emb.sum(1) * weights).sum().backward()

    torch.testing.assert_close(emb, ref, atol=2e-5, rtol=1e-4)
    want, got = grads(ref_model), grads(model)
    assert want.keys() == got.keys() and want
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=5e-5, rtol=1e-3, msg=name)


@pytest.mark.parametrize("family", ["bert", "qwen3"])
def test_flex_attention_packed_forward_gives_the_padded_embeddings(models, family):
    """FlexAttention with a block mask of the rows (its backward needs a GPU, so the forward only)."""
    folder, pooling, side = models[family]
    enc = batch(folder, side)
    with torch.no_grad():
        ref = padded_reference(load(folder, "eager"), enc, pooling)
        wrapped = EmbeddingModel(load(folder, "flex_attention"), pooling, length_chunks=1, padding_free=True,
                                 bucket=True)
        emb = wrapped(**enc)["last_hidden_state"]
    torch.testing.assert_close(emb, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("pooling", ["mean", "cls", "max", "last"])
def test_every_pooling_reads_each_rows_span(minilm_no_dropout, pooling):
    enc = batch(minilm_no_dropout, "right")
    model = load(minilm_no_dropout, "sdpa")
    with torch.no_grad():
        ref = padded_reference(model, enc, pooling)
        emb = EmbeddingModel(model, pooling, length_chunks=1, padding_free=True)(**enc)["last_hidden_state"]
    torch.testing.assert_close(emb, ref, atol=2e-5, rtol=1e-4)


def test_pack_layout_by_hand():
    """Two rows (left padded), widened to a multiple of 8 by a filler row."""
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    types = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]])
    p = pack(ids, mask, {"token_type_ids": types}, multiple_of=8, pad_id=99)
    assert p.input_ids.tolist() == [[5, 6, 7, 1, 2, 3, 4, 9]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    assert p.segments.tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert p.cu_seqlens.tolist() == [0, 3, 8] and p.cu_seqlens.dtype == torch.int32
    assert p.extra["token_type_ids"].tolist() == [[1, 1, 1, 0, 0, 0, 1, 1]]
    assert (p.rows, p.tokens, p.max_length) == (2, 8, 5)

    p = pack(ids[:1], mask[:1], multiple_of=8, pad_id=99)  # 3 tokens + a filler row of 5
    assert p.input_ids.tolist() == [[5, 6, 7, 99, 99, 99, 99, 99]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    assert p.segments.tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert p.cu_seqlens.tolist() == [0, 3, 8] and (p.rows, p.tokens) == (1, 3)
    hidden = torch.arange(8.0).unsqueeze(1)
    assert pool_packed(hidden, p, "mean").tolist() == [[1.0]]  # the filler is pooled by no row
    assert pool_packed(hidden, p, "max").tolist() == [[2.0]]
    assert pool_packed(hidden, p, "last").tolist() == [[2.0]]


def test_masks_keep_rows_apart():
    ids = torch.tensor([[4, 5, 0], [6, 7, 8]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    p = pack(ids, mask)
    dense = attention_inputs(p, "sdpa", causal=False, dtype=torch.float32)["attention_mask"][0, 0] == 0
    assert dense.tolist() == [[True, True, False, False, False], [True, True, False, False, False],
                              [False, False, True, True, True], [False, False, True, True, True],
                              [False, False, True, True, True]]
    causal = attention_inputs(p, "eager", causal=True, dtype=torch.float32)["attention_mask"][0, 0] == 0
    assert causal.tolist() == [[True, False, False, False, False], [True, True, False, False, False],
                               [False, False, True, False, False], [False, False, True, True, False],
                               [False, False, True, True, True]]
    flash = attention_inputs(p, "flash_attention_2", causal=True, dtype=torch.float32)
    assert flash["attention_mask"] is None and flash["cu_seq_lens_q"].tolist() == [0, 2, 5]
    assert flash["max_length_q"] == flash["max_length_k"] == 3


def test_causal_is_read_from_the_attention_modules(models):
    assert not is_causal(load(models["bert"][0], "sdpa"))
    assert is_causal(load(models["qwen3"][0], "sdpa"))


def test_bucket_widths_are_few_and_add_at_most_a_quarter():
    widths = {bucket_width(n) for n in range(1, 8193)}
    assert sorted(widths)[:12] == [16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256]
    assert len(widths) == 4 + 4 * 7  # 16..64 by 16, then four per doubling up to 8192
    for n in range(1, 8193):
        w = bucket_width(n)
        assert w >= n and w % 16 == 0
        assert n <= 64 or w <= 1.25 * n + 1e-9


def test_pad_to_width_on_either_side():
    enc = {"input_ids": torch.tensor([[5, 6]]), "attention_mask": torch.tensor([[1, 1]])}
    left = pad_to_width(enc, 4, pad_id=0, side="left")
    assert left["input_ids"].tolist() == [[0, 0, 5, 6]] and left["attention_mask"].tolist() == [[0, 0, 1, 1]]
    right = pad_to_width(enc, 4, pad_id=9, side="right")
    assert right["input_ids"].tolist() == [[5, 6, 9, 9]] and right["attention_mask"].tolist() == [[1, 1, 0, 0]]


def test_bucketed_length_chunks_give_the_same_embeddings(minilm_no_dropout):
    texts = TEXTS * 3
    enc = batch(minilm_no_dropout, "right", texts)
    model = load(minilm_no_dropout, "sdpa")
    with torch.no_grad():
        ref = padded_reference(model, enc, "mean")
        chunked = EmbeddingModel(model, "mean", length_chunks=2, bucket=True)(**enc)["last_hidden_state"]
    torch.testing.assert_close(chunked, ref, atol=2e-5, rtol=1e-4)

