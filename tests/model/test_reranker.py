"""mmembed.tasks.reranker.model: scores against transformers' own heads and full-vocabulary logits."""

import logging

import numpy as np
import pytest
import torch
from PIL import Image

from mmembed.errors import UsageError
from mmembed.tasks.reranker.model import RerankerModel, last_positions, load_reranker
from mmembed.tasks.reranker.scorer import probabilities

PAIRS = [("what is the capital of France?", "Paris is the capital and largest city of France."),
         ("how do plants make food", "Photosynthesis turns light, water and carbon dioxide into sugar."),
         ("a", "an unrelated, much longer document about the migration of birds over the sea"),
         ("what is the capital of France?", "bananas")]
ROWS = [f"<Query>: {q}\n<Document>: {d}" for q, d in PAIRS]  # a generative reranker's text, roughly


def _batch(tok, texts, side):
    tok.padding_side = side
    batch = tok(texts, padding=True, return_tensors="pt")
    mask = batch["attention_mask"]
    assert (mask[:, 0] == 0).any() if side == "left" else (mask[:, -1] == 0).any()  # padding on that side
    return batch


def _full_logits_scores(causal_lm, batch, ids):
    """The reference: transformers' own forward with every logit, at each row's last real token."""
    with torch.no_grad():
        logits = causal_lm(**batch).logits.float()
    mask = batch["attention_mask"]
    last = torch.tensor([int(torch.nonzero(row).max()) for row in mask])  # per row, the plain way
    picked = logits[torch.arange(len(last)), last]
    return picked[:, ids[0]] - picked[:, ids[1]]


# ----------------------------------------------------------------------------- generative


@pytest.fixture(scope="module")
def qwen3(tiny_model):
    from transformers import AutoTokenizer

    path = tiny_model("qwen3")
    model = load_reranker(path, "generative_reranker").eval()
    return path, model, AutoTokenizer.from_pretrained(path)


def test_last_positions_left_and_right():
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert last_positions(mask).tolist() == [4, 4, 2, 4]


@pytest.mark.parametrize("side", ["left", "right"])
def test_generative_scores_equal_the_full_logits(qwen3, side):
    path, model, tok = qwen3
    assert model.kind == "generative" and model.tokens == ("yes", "no")
    assert model.token_ids == (tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no"))
    batch = _batch(tok, ROWS, side)
    head_calls = []
    hook = model.backbone.get_output_embeddings().register_forward_hook(lambda *a: head_calls.append(1))
    try:
        with torch.no_grad():
            scores = model(**batch, labels=torch.ones(4), group_ids=torch.arange(4))["scores"]
    finally:
        hook.remove()
    assert not head_calls  # the full-vocabulary head never runs
    assert scores.dtype == torch.float32 and scores.shape == (4,)
    ref = _full_logits_scores(model.backbone, batch, model.token_ids)
    assert torch.allclose(scores, ref, atol=1e-5, rtol=1e-5), (scores, ref)
    # the same pairs padded on the other side, or alone, score the same
    other = _batch(tok, ROWS, "right" if side == "left" else "left")
    with torch.no_grad():
        assert torch.allclose(model(**other)["scores"], scores, atol=1e-5)
        alone = torch.cat([model(**tok(ROWS[i:i + 1], return_tensors="pt"))["scores"] for i in range(4)])
    assert torch.allclose(alone, scores, atol=1e-5)


def test_generative_probability_is_the_softmax_of_the_no_and_yes_logits(qwen3):
    """What mmembed reports for a generative reranker by default, ``probabilities(score)``, is
    Qwen3-Reranker's own score: the softmax over the [no, yes] logits at the last real token,
    its yes entry (written out here from the full-vocabulary logits)."""
    path, model, tok = qwen3
    batch = _batch(tok, ROWS, "left")
    with torch.no_grad():
        scores = model(**batch)["scores"]
        logits = model.backbone(**batch).logits[:, -1].double()  # left padding: the last column is real
    yes, no = model.token_ids
    reference = torch.softmax(torch.stack([logits[:, no], logits[:, yes]], dim=1), dim=1)[:, 1].numpy()
    np.testing.assert_allclose(probabilities(scores.numpy()), reference, atol=1e-5)
    assert 0 < reference.min() and reference.max() < 1


def test_generative_under_zero3_calls_the_head_on_the_last_rows(qwen3):
    path, model, tok = qwen3
    batch = _batch(tok, ROWS, "left")
    weight = model.backbone.get_output_embeddings().weight
    with torch.no_grad():
        plain = model(**batch)["scores"]
        weight.ds_id = 0  # what DeepSpeed ZeRO-3 marks its partitioned parameters with
        try:
            gathered = model(**batch)["scores"]
        finally:
            del weight.ds_id
    assert torch.allclose(plain, gathered, atol=1e-6)


def test_generative_gradients_flow(qwen3):
    path, _, tok = qwen3
    model = load_reranker(path, "generative_reranker", tokenizer=tok)  # a model of its own: this one trains
    model.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing
    model.train()
    scores = model(**_batch(tok, ROWS, "right"))["scores"]
    (scores * torch.tensor([1.0, -1.0, 0.5, 2.0])).sum().backward()
    head = model.backbone.get_output_embeddings().weight  # tied to the input embeddings
    yes, no = model.token_ids
    assert head.grad[yes].abs().sum() > 0 and head.grad[no].abs().sum() > 0
    layer = model.backbone.model.layers[0].self_attn.q_proj.weight
    assert layer.grad is not None and layer.grad.abs().sum() > 0
    model.gradient_checkpointing_disable()
    assert not model.is_gradient_checkpointing


def test_generative_with_lora(qwen3):
    from peft import LoraConfig, get_peft_model

    path, model, tok = qwen3
    batch = _batch(tok, ROWS, "left")
    with torch.no_grad():
        before = model(**batch)["scores"]
    peft = get_peft_model(load_reranker(path, "generative_reranker", tokenizer=tok).backbone,
                          LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    lora = RerankerModel(peft, "generative", model.token_ids, model.tokens).eval()
    scores = lora(**batch)["scores"]
    assert torch.allclose(scores, before, atol=1e-5)  # LoRA starts as the identity
    scores.sum().backward()
    grads = [p.grad for n, p in peft.named_parameters() if "lora_B" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_generative_save_and_load_round_trip(qwen3, tmp_path):
    from transformers import AutoModelForCausalLM

    path, model, tok = qwen3
    model.save_pretrained(str(tmp_path))
    tok.save_pretrained(str(tmp_path))
    batch = _batch(tok, ROWS, "left")
    with torch.no_grad():
        scores = model(**batch)["scores"]
        again = load_reranker(str(tmp_path), "generative_reranker").eval()(**batch)["scores"]
    causal = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert type(causal).__name__ == "Qwen3ForCausalLM"
    assert torch.allclose(again, scores, atol=1e-6)
    assert torch.allclose(_full_logits_scores(causal, batch, model.token_ids), scores, atol=1e-5)


def test_generative_tokens(qwen3, monkeypatch):
    path, _, tok = qwen3
    monkeypatch.setenv("GENERATIVE_RERANKER_POSITIVE_TOKEN", "true")
    monkeypatch.setenv("GENERATIVE_RERANKER_NEGATIVE_TOKEN", "false")
    model = load_reranker(path, "generative_reranker", tokenizer=tok)
    assert model.tokens == ("true", "false")
    assert model.token_ids == (tok.convert_tokens_to_ids("true"), tok.convert_tokens_to_ids("false"))
    assert load_reranker(path, "generative_reranker", positive_token="yes", negative_token="no").tokens == ("yes", "no")
    with pytest.raises(UsageError, match="GENERATIVE_RERANKER_POSITIVE_TOKEN='yes please'"):
        load_reranker(path, "generative_reranker", positive_token="yes please", tokenizer=tok)
    monkeypatch.setenv("GENERATIVE_RERANKER_NEGATIVE_TOKEN", "notaword_zzq")
    with pytest.raises(UsageError, match="GENERATIVE_RERANKER_NEGATIVE_TOKEN='notaword_zzq'"):
        load_reranker(path, "generative_reranker", tokenizer=tok)
    with pytest.raises(UsageError, match="are one token"):
        load_reranker(path, "generative_reranker", positive_token="yes", negative_token="yes", tokenizer=tok)


def test_bad_task_type_and_kind(qwen3):
    with pytest.raises(UsageError, match="--task_type 'embedding'"):
        load_reranker(qwen3[0], "embedding")
    with pytest.raises(ValueError, match="token_ids"):
        RerankerModel(qwen3[1].backbone, "generative")
    with pytest.raises(ValueError, match="kind"):
        RerankerModel(qwen3[1].backbone, "pairwise")


# ----------------------------------------------------------------------------- multimodal generative

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def _image(seed, h=64, w=48):
    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def vl_rerankers(tiny_model):
    """``get(kind) -> (model, processor)``, each loaded once (the processor's tokenizer gives the
    model its yes / no ids: the folder's tokenizer is read once)."""
    from transformers import AutoProcessor

    loaded = {}

    def get(kind):
        if kind not in loaded:
            path = tiny_model(kind)
            proc = AutoProcessor.from_pretrained(path)
            loaded[kind] = load_reranker(path, "generative_reranker", tokenizer=proc).eval(), proc
        return loaded[kind]

    return get


@pytest.mark.parametrize("kind", ["qwen3_vl", "qwen2_vl"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_vision_language_generative_scores(vl_rerankers, kind, side):
    model, proc = vl_rerankers(kind)
    assert type(model.backbone).__name__.endswith("ForConditionalGeneration")
    proc.tokenizer.padding_side = side
    texts = [f"<|im_start|>user\n{IMAGE}is this a cat?<|im_end|>\n<|im_start|>assistant\n",
             "<|im_start|>user\nonly text here<|im_end|>\n<|im_start|>assistant\n",
             f"<|im_start|>user\n{IMAGE}{IMAGE}two pictures<|im_end|>\n"]
    batch = proc(text=texts, images=[_image(0), _image(1), _image(2, 32, 32)], padding=True, return_tensors="pt")
    assert "pixel_values" in batch
    mask = batch["attention_mask"]
    assert (mask[:, 0] == 0).any() if side == "left" else (mask[:, -1] == 0).any()
    with torch.no_grad():
        scores = model(**batch)["scores"]
    ref = _full_logits_scores(model.backbone, batch, model.token_ids)
    assert torch.allclose(scores, ref, atol=1e-5, rtol=1e-5), (scores, ref)


# ----------------------------------------------------------------------------- classifier


@pytest.fixture(scope="module")
def minilm_reranker(minilm_no_dropout, tmp_path_factory):
    """all-MiniLM-L6-v2 (no head) as a classifier reranker, saved once with its tokenizer."""
    from transformers import AutoTokenizer

    model = load_reranker(minilm_no_dropout, "reranker").eval()
    tok = AutoTokenizer.from_pretrained(minilm_no_dropout)
    folder = str(tmp_path_factory.mktemp("minilm_reranker"))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model, tok, folder


def _pair_batch(tok):
    return tok([q for q, _ in PAIRS], [d for _, d in PAIRS], padding=True, truncation=True, return_tensors="pt")


def test_a_base_model_gets_a_new_head_and_says_so(minilm_no_dropout, caplog):
    with caplog.at_level(logging.WARNING, logger="mmembed"):
        model = load_reranker(minilm_no_dropout, "reranker")
    assert model.kind == "classifier" and model.config.num_labels == 1
    assert type(model.backbone).__name__ == "BertForSequenceClassification"
    assert any("new one" in r.message and "classifier.weight" in r.message for r in caplog.records)


def test_classifier_scores_equal_transformers_logits_and_round_trip(minilm_reranker):
    from transformers import AutoModelForSequenceClassification

    model, tok, folder = minilm_reranker
    batch = _pair_batch(tok)
    assert "token_type_ids" in batch
    with torch.no_grad():
        scores = model(**batch)["scores"]
        ref = AutoModelForSequenceClassification.from_pretrained(folder).eval()(**batch).logits[:, 0]
        again = load_reranker(folder, "reranker").eval()(**batch)["scores"]
    assert scores.dtype == torch.float32 and scores.shape == (4,)
    assert torch.allclose(scores, ref, atol=1e-6) and torch.allclose(again, scores, atol=1e-6)


def test_classifier_loads_in_cross_encoder_with_the_same_scores(minilm_reranker):
    from sentence_transformers import CrossEncoder

    model, tok, folder = minilm_reranker
    with torch.no_grad():
        scores = model(**_pair_batch(tok))["scores"].numpy()
    ce = CrossEncoder(folder, device="cpu")
    raw = ce.predict(PAIRS, activation_fn=torch.nn.Identity(), batch_size=4)
    assert np.allclose(raw, scores, atol=1e-5)
    assert np.allclose(ce.predict(PAIRS, batch_size=4), 1 / (1 + np.exp(-scores)), atol=1e-5)  # its default: sigmoid
    # what mmembed reports by default (rerank_scorer.probabilities): CrossEncoder.predict's default
    np.testing.assert_allclose(probabilities(scores), ce.predict(PAIRS, batch_size=4), atol=1e-6)


def test_classifier_gradients_flow(minilm_no_dropout):
    model = load_reranker(minilm_no_dropout, "reranker")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_no_dropout)
    model.train()
    model.gradient_checkpointing_enable()
    model(**_pair_batch(tok))["scores"].sum().backward()
    assert model.backbone.classifier.weight.grad.abs().sum() > 0
    assert model.backbone.bert.encoder.layer[0].attention.self.query.weight.grad.abs().sum() > 0


@pytest.fixture(scope="module")
def qwen3_classifier(qwen3, tmp_path_factory):
    """The tiny Qwen3 folder loaded as a classifier reranker (its pad id found by load_reranker
    itself), and saved once; with transformers' own load of the saved folder."""
    from transformers import AutoModelForSequenceClassification

    model = load_reranker(qwen3[0], "reranker").eval()
    folder = str(tmp_path_factory.mktemp("qwen3_classifier"))
    model.save_pretrained(folder)
    return model, AutoModelForSequenceClassification.from_pretrained(folder).eval()


@pytest.mark.parametrize("side", ["left", "right"])
def test_decoder_classifier_finds_the_last_token(qwen3, qwen3_classifier, side):
    """A causal LM folder as a sequence classifier (Qwen3ForSequenceClassification): the pad id
    comes from the tokenizer, and the score is the last real token's, on either padding side."""
    _, _, tok = qwen3
    model, saved = qwen3_classifier
    assert model.config.pad_token_id == tok.pad_token_id
    batch = _batch(tok, ROWS, side)
    with torch.no_grad():
        scores = model(**batch)["scores"]
        ref = saved(**batch).logits[:, 0]
        alone = torch.cat([model(**tok(ROWS[i:i + 1], return_tensors="pt"))["scores"] for i in range(4)])
    assert torch.allclose(scores, ref, atol=1e-6) and torch.allclose(alone, scores, atol=1e-5)
