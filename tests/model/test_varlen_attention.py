"""``--attn_impl varlen`` (mmembed.model.varlen_attention): packed batches under PyTorch's own
FlashAttention kernel, everything else under SDPA.

On the CPU the packed path runs one SDPA call per span (tests/model/test_packing.py and
test_packing_media.py check it against the padded batch). The CUDA path calls
``torch.nn.attention.varlen.varlen_attn``; here that function is replaced by its documented
contract written out with an explicit softmax (queries ``[T, H, D]``, spans ``cu_seq_q``,
``window_size=(-1, 0)`` causal, ``(-1, -1)`` full), and the model's embeddings must still be
the padded batch's: what is checked is what mmembed hands the kernel.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.varlen as torch_varlen
from transformers import AutoModel, AutoTokenizer

import mmembed.model.varlen_attention as varlen
from mmembed.model.embedding import EmbeddingModel, pool

TEXTS = ["a man is playing a guitar on the stage tonight", "dogs", "two women are dancing in the rain", "x"]


def documented_varlen_attn(calls):
    def fake(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        calls.append({"cu": cu_q.tolist(), "dtype": cu_q.dtype, "max": (max_q, max_k), "window": tuple(window_size),
                      "shape": tuple(q.shape), "kv_heads": k.shape[1]})
        assert torch.equal(cu_q, cu_k) and q.dim() == 3 and k.shape == v.shape
        assert (k.shape[1] != q.shape[1]) == enable_gqa  # grouped heads only where the kernel is told
        if enable_gqa:  # each key / value head serves q_heads / kv_heads query heads, in order
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        out = torch.empty_like(q)
        bounds = cu_q.tolist()
        for a, b in zip(bounds, bounds[1:]):
            scores = torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) * scale
            if window_size == (-1, 0):
                scores = scores.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
            out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[a:b])
        return out

    return fake


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(varlen, "uses_kernel", lambda q: True)
    monkeypatch.setattr(torch_varlen, "varlen_attn", documented_varlen_attn(calls))
    return calls


@pytest.mark.parametrize("family,pooling,side,causal", [("qwen3", "last", "left", True), ("bert", "mean", "right", False)])
def test_the_kernel_gets_the_spans_and_the_causal_window(tiny_model, minilm_no_dropout, kernel_calls, family, pooling,
                                                         side, causal):
    folder = tiny_model("qwen3") if family == "qwen3" else minilm_no_dropout
    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = side
    enc = dict(tok(TEXTS, padding=True, return_tensors="pt"))
    with torch.no_grad():
        ref = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
        want = torch.nn.functional.normalize(pool(ref(**enc).last_hidden_state, enc["attention_mask"], pooling), dim=-1)
        model = AutoModel.from_pretrained(folder, attn_implementation=varlen.transformers_name("varlen")).eval()
        got = EmbeddingModel(model, pooling, length_chunks=1, padding_free=True)(**enc)["last_hidden_state"]
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-4)
    lengths = enc["attention_mask"].sum(1).tolist()
    spans = [0]
    for n in lengths:
        spans.append(spans[-1] + n)
    layers = model.config.num_hidden_layers
    assert len(kernel_calls) == layers  # every layer's attention went to the kernel, one call each
    for call in kernel_calls:
        assert call["cu"] == spans and call["dtype"] == torch.int32 and call["max"] == (max(lengths),) * 2
        assert call["window"] == ((-1, 0) if causal else (-1, -1)) and call["shape"][0] == spans[-1]
    heads = model.config.num_attention_heads
    kv_heads = getattr(model.config, "num_key_value_heads", heads)
    assert kernel_calls[0]["shape"][1] == heads
    # grouped-query attention (the tiny Qwen3: 2 key / value heads for 4 query heads): handed over
    # as they are where the kernel takes them (torch 2.14; not 2.11), repeated before
    assert kernel_calls[0]["kv_heads"] == (kv_heads if varlen.KERNEL_GQA else heads)
    if family == "qwen3":
        assert kv_heads < heads


def test_uses_kernel_only_where_it_runs():
    q = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    assert not varlen.uses_kernel(q)  # the CPU: one SDPA call per span
    if torch.cuda.is_available():
        assert varlen.uses_kernel(q.cuda()) and not varlen.uses_kernel(q.float().cuda())


def test_an_unpacked_call_is_sdpa(tiny_model):
    """A padded batch under varlen: SDPA's mask and SDPA's attention, so SDPA's embeddings."""
    folder = tiny_model("qwen3")
    tok = AutoTokenizer.from_pretrained(folder)
    enc = dict(tok(TEXTS, padding=True, return_tensors="pt"))
    with torch.no_grad():
        sdpa = AutoModel.from_pretrained(folder, attn_implementation="sdpa").eval()(**enc).last_hidden_state
        mine = AutoModel.from_pretrained(folder, attn_implementation=varlen.transformers_name("varlen")).eval()
        got = mine(**enc).last_hidden_state
    mask = enc["attention_mask"].bool()
    torch.testing.assert_close(got[mask], sdpa[mask])
    assert varlen.varlen_mask(attention_mask=None) is None


def test_packed_calls_refuse_a_batch_and_dropout():
    module = torch.nn.Module()
    q = torch.zeros(2, 1, 3, 8)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="a packed batch is one sequence, got a batch of 2"):
        varlen.varlen_attention(module, q, q, q, None, cu_seq_lens_q=cu, max_length_q=3)
    with pytest.raises(ValueError, match="no attention dropout"):
        varlen.varlen_attention(module, q[:1], q[:1], q[:1], None, dropout=0.1, cu_seq_lens_q=cu, max_length_q=3)
