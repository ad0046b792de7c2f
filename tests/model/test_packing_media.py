"""Padding-free (packed) image and video rows give the padded batch's embeddings and gradients
for the Qwen vision-language families (GME on Qwen2-VL, Qwen2.5-VL, Qwen3-VL-Embedding):
``EmbeddingModel(padding_free=True)`` packs the language model's sequence of text and media
tokens and gives it each row's own 3D rotary positions (mmembed.model.packing.rope_positions).

The reference is the padded forward under eager attention: one call on the batch as the
template's collator builds it (right-padded, rows from 21 to 300+ tokens: a video row among
short captions). FlashAttention cannot run on a CPU; its path is checked through an
attention function registered here that does what its variable-length kernel does, written
out (attention within each ``cu_seq_lens`` span; the vision tower's per-image calls, which
carry no spans, plain attention). transformers offers no FlexAttention for these families.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from conftest import DATA, write_jsonl
from transformers import AttentionInterface

import mmembed.model.packing as packing_module
from mmembed.model.embedding import EmbeddingModel, load_backbone

MM = os.path.join(DATA, "mm")
FAMILIES = {  # tiny model kind -> template
    "qwen2_vl": "qwen2_gme",
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen3_vl": "qwen3_vl_emb",
}
ROWS = [
    {"query": "<image>", "response": "a red circle drawn in the middle of a white page, large and bright",
     "rejected_response": ["a blue square"], "images": [f"{MM}/red_circle.png"]},
    {"query": "<image><image>which two shapes?", "response": "green",
     "images": [f"{MM}/green_triangle.png", f"{MM}/blue_square.png"]},
    {"query": "a short query", "response": "<image>",
     "rejected_response": ["x", "a much longer negative text with many many words in it to make the row long"],
     "images": [f"{MM}/yellow_square.png"]},
    {"query": "<video>", "response": "a red square moving", "rejected_response": ["still"],
     "videos": [f"{MM}/clip.mp4"]},
]


def spans_or_plain_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """FlashAttention's variable-length contract written out: with ``cu_seq_lens_q`` each span
    attends within itself only (causally in a causal module); without (the vision tower calls
    once per image), plain attention."""
    if "cu_seq_lens_q" not in kwargs:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    cu = kwargs["cu_seq_lens_q"].tolist()
    assert kwargs["cu_seq_lens_k"].tolist() == cu and attention_mask is None
    if key.shape[1] != query.shape[1]:  # grouped-query attention
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    causal = bool(getattr(module, "is_causal", False))
    outs = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=causal,
                                           scale=scaling) for a, b in zip(cu, cu[1:])]
    return torch.cat(outs, 2).transpose(1, 2).contiguous(), None


AttentionInterface.register("varlen_media_reference", spans_or_plain_attention)


@pytest.fixture(scope="module")
def batches(tiny_model, tmp_path_factory):
    """kind -> (model folder, pooling, the collated batch of ROWS without labels)."""
    from mmembed.data import read_file
    from mmembed.encoding.collator import EmbeddingCollator
    from mmembed.encoding.layout import Layout
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.model_assembly import Encoding

    path = write_jsonl(tmp_path_factory.mktemp("media_rows") / "rows.jsonl", ROWS)
    out = {}
    for kind, template in FAMILIES.items():
        folder = tiny_model(kind)
        args = parse_sft_args(["--model", folder, "--template", template, "--dataset", path, "--output_dir", "unused"])
        encoding = Encoding.resolve(args)
        batch = EmbeddingCollator(encoding.template, encoding.processing, Layout.GROUP)(read_file(path))
        batch.pop("labels")
        out[kind] = (folder, encoding.pooling, batch)
    return out


def embed(folder: str, pooling: str, batch: dict, implementation: str, padding_free: bool, bucket: bool = False,
          weights: torch.Tensor | None = None):
    """The embeddings, and with ``weights`` every parameter's gradient of sum(weights * embeddings)."""
    torch.manual_seed(0)
    backbone = load_backbone(folder, attn_impl=implementation)
    model = EmbeddingModel(backbone, pooling, length_chunks=1, tower="vision", padding_free=padding_free,
                           bucket=bucket)
    if weights is None:
        with torch.no_grad():
            return model(**batch)["last_hidden_state"], {}
    emb = model(**batch)["last_hidden_state"]
    (emb * weights).sum().backward()
    return emb.detach(), {n: p.grad for n, p in backbone.named_parameters() if p.grad is not None}


def test_rows_differ_in_length(batches):
    """The case is one where packing matters: most of the padded batch is padding."""
    for _, _, batch in batches.values():
        lengths = batch["attention_mask"].sum(1)
        assert lengths.max() > 5 * lengths.median() and batch.get("pixel_values_videos") is not None
        assert (batch["attention_mask"] == 0).float().mean() > 0.5


@pytest.mark.parametrize("kind", sorted(FAMILIES))
@pytest.mark.parametrize("implementation,bucket", [("eager", False), ("sdpa", True),
                                                   ("varlen_media_reference", False),
                                                   ("varlen_media_reference", True), ("varlen", False)])
def test_packed_media_rows_give_the_padded_embeddings_and_gradients(batches, kind, implementation, bucket):
    folder, pooling, batch = batches[kind]
    ref, _ = embed(folder, pooling, batch, "eager", False)
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    ref, want = embed(folder, pooling, batch, "eager", False, weights=weights)
    emb, got = embed(folder, pooling, batch, implementation, True, bucket=bucket, weights=weights)
    assert emb.shape[0] == batch["input_ids"].shape[0]
    torch.testing.assert_close(emb, ref, atol=2e-6, rtol=1e-4)
    assert want.keys() == got.keys() and len(want) > 50  # the tower, the aligner and the language model
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=5e-5, rtol=1e-3, msg=name)


def test_text_positions_alone_would_be_wrong(batches, monkeypatch):
    """The control: packed media rows given plain 0..n-1 positions on all three rotary axes (what
    packing a text batch does) embed differently, so the tests above see the 3D positions."""
    folder, pooling, batch = batches["qwen2_vl"]
    ref, _ = embed(folder, pooling, batch, "eager", False)

    def text_only(base, input_ids, attention_mask, inputs, packed):
        text = packed.position_ids
        return torch.cat([text.unsqueeze(0), text.expand(3, -1, -1)])

    monkeypatch.setattr(packing_module, "rope_positions", text_only)
    emb, _ = embed(folder, pooling, batch, "eager", True)
    image_rows = batch["mm_token_type_ids"].ne(0).any(1)
    assert (emb - ref)[image_rows].abs().max() > 1e-4  # 50x the tolerance the tests above hold
    torch.testing.assert_close(emb[~image_rows], ref[~image_rows], atol=2e-6, rtol=1e-4)  # text rows: 1D is right



@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_under_varlen_the_tower_takes_the_pictures_in_one_call_per_layer(batches, kind, monkeypatch):
    """--attn_impl varlen renames the loaded tower's attention so that transformers hands it all
    the batch's pictures at once with their spans (one kernel call per layer on a GPU); the
    language model's packed call comes with the rows' spans, causal. Embeddings as padded SDPA."""
    import mmembed.model.varlen_attention as varlen

    folder, pooling, batch = batches[kind]
    calls = []
    real = varlen.spans_attention

    def spy(q, k, v, cu, longest, scaling, causal):
        calls.append((causal, len(cu) - 1, q.shape[0]))
        return real(q, k, v, cu, longest, scaling, causal)

    monkeypatch.setattr(varlen, "spans_attention", spy)
    ref, _ = embed(folder, pooling, batch, "sdpa", False)
    calls.clear()
    emb, _ = embed(folder, pooling, batch, "varlen", True)
    torch.testing.assert_close(emb, ref, atol=2e-6, rtol=1e-4)
    config = load_backbone(folder, attn_impl="varlen").config
    tower = [c for c in calls if not c[0]]
    language = [c for c in calls if c[0]]
    patches = int(batch["image_grid_thw"].prod(1).sum())
    videos = int(batch["video_grid_thw"].prod(1).sum())
    assert config.vision_config._attn_implementation == varlen.TOWER_NAME
    assert len(tower) == config.vision_config.depth  # one call per tower layer
    assert all(t[2] == patches + videos for t in tower)  # every picture's and frame's patches at once
    assert all(t[1] >= len(batch["image_grid_thw"]) + len(batch["video_grid_thw"]) for t in tower)
    assert len(language) == config.get_text_config().num_hidden_layers
    assert all(n == batch["input_ids"].shape[0] for _, n, _ in language)  # one span per row
