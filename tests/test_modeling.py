"""Pooling, the model wrapper and templates, against plain references."""

import json
import os

import numpy as np
import pytest
import torch

from mmembed.data.sample import Item
from mmembed.modeling import EmbeddingModel, load_backbone, pool
from mmembed.templates import get_template, list_templates, read_sentence_transformers_pooling


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
    assert os.path.isfile(os.path.join(os.path.dirname(__file__), "..", "templates", "bert.toml"))
