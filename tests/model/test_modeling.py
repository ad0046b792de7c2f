"""Pooling, the model wrapper and templates, against plain references."""

import json
import os

import numpy as np
import pytest
import torch
from conftest import REPO

from mmembed.data.sample import Item
from mmembed.encoding.templates import get_template, list_templates, read_sentence_transformers_pooling
from mmembed.model.embedding import EmbeddingModel, load_backbone, pool


def _reference_pool(hidden, mask, mode):
    """One row at a time, only the real tokens: what each pooling means."""
    rows = []
    for h, m in zip(hidden, mask):
        real = h[m.bool()]
        idx = torch.nonzero(m).flatten()
        if mode == "mean":
            rows.append(real.mean(0))
        elif mode == "max":
            rows.append(real.max(0).values)
        elif mode == "cls":
            rows.append(h[0])
        elif mode == "last":
            rows.append(h[idx[-1]])
    return torch.stack(rows)


# CLS pooling belongs to encoders, which pad on the right
@pytest.mark.parametrize("mode,side", [(m, s) for m in ("mean", "max", "last") for s in ("left", "right")] + [("cls", "right")])
def test_pool_matches_reference_under_both_padding_sides(mode, side):
    g = torch.Generator().manual_seed(0)
    lengths = [5, 2, 7, 1]
    L = max(lengths)
    hidden = torch.randn(len(lengths), L, 6, generator=g)
    mask = torch.zeros(len(lengths), L, dtype=torch.long)
    for i, n in enumerate(lengths):
        if side == "right":
            mask[i, :n] = 1
        else:
            mask[i, L - n :] = 1
    got = pool(hidden, mask, mode)
    torch.testing.assert_close(got, _reference_pool(hidden, mask, mode))


def test_last_token_pooling_picks_the_real_last_token_not_the_final_column():
    hidden = torch.arange(2 * 4, dtype=torch.float32).view(2, 4, 1)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])  # right padding: row 0 ends at position 1
    assert pool(hidden, mask, "last").flatten().tolist() == [1.0, 7.0]


def test_model_outputs_normalized_embeddings_matching_sentence_transformers(minilm_path):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    texts = ["A man is playing a flute.", "Two dogs run through the snow after a red ball."]
    template = get_template(config_model_type="bert")
    pooling = template.resolve_pooling(minilm_path)
    assert pooling == "mean"  # from the model's 1_Pooling/config.json
    model = EmbeddingModel(load_backbone(minilm_path), pooling).eval()
    tok = AutoTokenizer.from_pretrained(minilm_path)
    enc = tok([template.render(Item(t)) for t in texts], padding=True, return_tensors="pt")
    with torch.no_grad():
        ours = model(**enc)["last_hidden_state"].numpy()
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-6)
    ref = SentenceTransformer(minilm_path, device="cpu").encode(texts, normalize_embeddings=True)
    np.testing.assert_allclose(ours, ref, atol=1e-5)


def test_templates_render_exact_strings():
    assert list_templates() == sorted(list_templates()) and "bert" in list_templates()
    bert = get_template("bert")
    assert bert.render(Item("hello")) == "hello"
    assert bert.add_special_tokens
    q3 = get_template(model_type="qwen3_emb")
    assert q3.render(Item("what is a cat?")) == "what is a cat?<|endoftext|>"
    assert q3.render(Item("what is a cat?", system="Find the answer")) == "Find the answer what is a cat?<|endoftext|>"
    assert get_template(config_model_type="qwen2").name == "gte_qwen2"
    assert get_template(model_type="modern_bert_gte").name == "modernbert"


def test_template_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown template 'nope'"):
        get_template("nope")
    with pytest.raises(ValueError, match="unknown --model_type 'nope'"):
        get_template(model_type="nope")
    with pytest.raises(ValueError, match="has no placeholder for image"):
        get_template("bert").render(Item("<image> a cat", images=["/x.png"]))


def test_sentence_transformers_pooling_config_is_read(tmp_path):
    assert read_sentence_transformers_pooling(str(tmp_path)) is None
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(json.dumps([{"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    assert read_sentence_transformers_pooling(str(tmp_path)) == "cls"
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    assert read_sentence_transformers_pooling(str(tmp_path)) == "last"
    assert get_template("bert").resolve_pooling(str(tmp_path)) == "last"
    assert get_template("modernbert").resolve_pooling(str(tmp_path / "missing")) == "cls"


def test_templates_ship_in_the_package():
    from importlib import resources

    names = {p.name for p in resources.files("mmembed.template_files").iterdir()}
    assert {"bert.toml", "modernbert.toml", "gte_qwen2.toml", "qwen3_emb.toml"} <= names
    assert os.path.isfile(os.path.join(REPO, "templates", "bert.toml"))


def _chunk_equivalence(model, enc):
    """Embeddings and parameter gradients with length chunks equal one padded call."""
    results = []
    calls = []
    hook = model.backbone.register_forward_hook(lambda mod, args, out: calls.append(1))
    for chunks in (1, 4):
        model.length_chunks = chunks
        model.zero_grad()
        calls.clear()
        emb = model(**enc)["last_hidden_state"]
        assert len(calls) == chunks  # the chunked path really ran
        (emb * torch.linspace(-1, 1, emb.numel()).view_as(emb)).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((emb.detach(), grads))
    hook.remove()
    (e1, g1), (e4, g4) = results
    torch.testing.assert_close(e4, e1, atol=2e-5, rtol=1e-4)
    assert g1.keys() == g4.keys() and g1
    for k in g1:
        torch.testing.assert_close(g4[k], g1[k], atol=5e-5, rtol=1e-3)


def _varied_texts(n):
    words = "a man is playing the flute while two dogs run in the snow after a red ball".split()
    return [" ".join(words[: 2 + (i * 7) % (len(words) - 2)]) for i in range(n)]


def test_length_chunks_give_the_same_embeddings_and_gradients_right_padding(minilm_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_path)
    enc = tok(_varied_texts(32), padding=True, return_tensors="pt")
    assert (enc["attention_mask"].sum(1) < enc["attention_mask"].shape[1]).any()  # there is padding to skip
    model = EmbeddingModel(load_backbone(minilm_path), "mean")
    _chunk_equivalence(model, dict(enc))


def test_length_chunks_give_the_same_embeddings_and_gradients_left_padding(tmp_path):
    """A tiny random Qwen2 decoder, saved and loaded as a user would, last-token pooling."""
    from transformers import Qwen2Config, Qwen2Model

    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    Qwen2Model(cfg).save_pretrained(tmp_path)
    model = EmbeddingModel(load_backbone(str(tmp_path)), "last")
    g = torch.Generator().manual_seed(1)
    lengths = [3 + (i * 5) % 17 for i in range(32)]
    width = max(lengths)
    ids = torch.randint(1, 64, (32, width), generator=g)
    mask = torch.zeros(32, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, width - n :] = 1
    ids[mask == 0] = 0
    _chunk_equivalence(model, {"input_ids": ids, "attention_mask": mask})
