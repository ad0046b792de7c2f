"""jina-reranker-m0 (``--model_type jina_reranker_m0 --task_type reranker``) on the tiny random
one of examples/tiny_models.py: scores as its model card computes them (written out below on
transformers' plain Qwen2-VL forward), both checkpoint key namings, the first loss of
``swift sft`` (tests/fixtures/swift/make_jina_fixtures.py) with ms-swift's layout, and a LoRA
run saved, exported and scored by ``mmembed rerank`` and ``POST /v1/rerank``."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import REPO
from fixtures.swift.first_loss import recording
from fixtures.swift.make_fixtures import weights_sha256
from safetensors.torch import load_file, save_file

from mmembed.tasks.reranker.scorer import Reranker

SWIFT = os.path.join(REPO, "tests", "fixtures", "swift")
DATA = os.path.join(SWIFT, "data")
PIXELS = {"MAX_PIXELS": "12544", "MIN_PIXELS": "3136"}  # the tiny processor's own budget
LOGIT_BIAS = 2.65
SCORE_TOKEN = 100
QUERY = "which colour is the sky?"
DOCS = ["The sky is blue.", "Grass is green, and it grows in fields.", "Blue."]
PICTURES = ["red.png", "blue.png"]


@pytest.fixture(scope="module")
def jina(tiny_model):
    return tiny_model("jina_reranker_m0")


@pytest.fixture(autouse=True)
def _pixels(monkeypatch):
    for key, value in PIXELS.items():
        monkeypatch.setenv(key, value)


def card_scores(folder, query, documents, images=None):
    """The model card's ``compute_score``, written out: "**Document**:\\n{doc}\\n**Query**:\\n{query}"
    (a picture document is its vision placeholder), left padding, the score token 100 appended,
    the language model's final hidden state there through ``score`` (Linear, ReLU, Linear) from
    the folder's tensors, ``sigmoid(x - 2.65)``."""
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(folder)
    model = Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).model.eval()
    weights = load_file(os.path.join(folder, "model.safetensors"))
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    docs = [placeholder if images else d for d in documents]
    texts = [f"**Document**:\n{d}\n**Query**:\n{query}" for d in docs]
    batch = processor(text=texts, images=images, return_tensors="pt", padding=True, padding_side="left")
    n = batch["input_ids"].shape[0]
    batch["input_ids"] = torch.cat([batch["input_ids"], torch.full((n, 1), SCORE_TOKEN)], 1)
    batch["attention_mask"] = torch.cat([batch["attention_mask"], torch.ones(n, 1, dtype=torch.long)], 1)
    if "mm_token_type_ids" in batch:  # the score token is text
        batch["mm_token_type_ids"] = torch.cat([batch["mm_token_type_ids"], torch.zeros(n, 1, dtype=torch.long)], 1)
    with torch.no_grad():
        h = model(**batch).last_hidden_state[:, -1]
        x = torch.relu(h @ weights["score.0.weight"].T + weights["score.0.bias"])
        x = (x @ weights["score.2.weight"].T + weights["score.2.bias"])[:, 0]
    return torch.sigmoid(x - LOGIT_BIAS).numpy()


def test_text_scores_are_the_model_cards(jina):
    reranker = Reranker.from_pretrained(jina, device="cpu")
    assert reranker.template.name == "jina_reranker_m0" and reranker.task_type == "reranker"
    ours = reranker.score(QUERY, DOCS, batch_size=3)
    np.testing.assert_allclose(ours, card_scores(jina, QUERY, DOCS), atol=1e-5)
    raw = reranker.score(QUERY, DOCS, raw_scores=True)
    np.testing.assert_allclose(1 / (1 + np.exp(-raw)), ours, atol=1e-6)  # raw: score(h) - 2.65


def test_picture_documents_score_as_the_model_card(jina):
    from PIL import Image

    paths = [os.path.join(DATA, "img", p) for p in PICTURES]
    reranker = Reranker.from_pretrained(jina, device="cpu")
    ours = reranker.score(QUERY, [{"text": "<image>", "images": [p]} for p in paths], batch_size=2)
    reference = card_scores(jina, QUERY, ["", ""], images=[Image.open(p).convert("RGB") for p in paths])
    np.testing.assert_allclose(ours, reference, atol=1e-5)


def test_the_hub_checkpoints_key_names_load_the_same(jina, tmp_path):
    """The hub's file names the language model ``model.*`` and the tower ``visual.*``
    (transformers 4's Qwen2-VL); the tiny folder has transformers 5's names: the same scores."""
    hub = str(tmp_path / "hub_names")
    shutil.copytree(jina, hub)
    state = load_file(os.path.join(jina, "model.safetensors"))
    renamed = {k.replace("model.language_model.", "model.", 1).replace("model.visual.", "visual.", 1): v
               for k, v in state.items()}
    assert "model.layers.0.mlp.up_proj.weight" in renamed and "visual.merger.mlp.0.weight" in renamed
    save_file(renamed, os.path.join(hub, "model.safetensors"), metadata={"format": "pt"})
    a = Reranker.from_pretrained(jina, device="cpu").score(QUERY, DOCS, raw_scores=True)
    b = Reranker.from_pretrained(hub, device="cpu").score(QUERY, DOCS, raw_scores=True)
    np.testing.assert_allclose(a, b, atol=1e-6)


# ----------------------------------------------------------------------------- ms-swift's first loss


def _fixture(name):
    with open(os.path.join(SWIFT, "first_loss", f"jina_reranker_m0{name}.json"), encoding="utf-8") as f:
        return json.load(f)


# (rows, loss): data/jina_text.jsonl or data/jina_pictures.jsonl, pointwise_reranker or listwise_reranker
RUNS = ["text_pointwise", "text_listwise", "pictures_pointwise", "pictures_listwise"]


def _flags(recorded, model, output_dir):
    flags = list(recorded)
    for flag, value in (("--model", model), ("--output_dir", output_dir)):
        flags[flags.index(flag) + 1] = value
    return flags


def _train(flags, monkeypatch):
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.sft import run_sft

    for var in ("MAX_POSITIVE_SAMPLES", "MAX_NEGATIVE_SAMPLES", "LISTWISE_RERANKER_TEMPERATURE",
                "LISTWISE_RERANKER_MIN_GROUP_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(DATA)  # the commands name the rows files as ms-swift ran them
    with recording() as rec:
        run_sft(parse_sft_args(flags))
    return rec["first_loss"]


def test_the_tiny_model_is_the_one_ms_swift_trained(jina):
    meta = _fixture(".meta")
    assert weights_sha256(jina) == meta["base_sha256"]
    assert meta["env"] == PIXELS and sorted(meta["runs"]) == sorted(RUNS)
    assert "in_features" in meta["unpatched_load"]  # ms-swift 4.6 as shipped: docs/swift.md


@pytest.mark.parametrize("run", RUNS)
def test_first_loss_with_ms_swifts_layout_is_ms_swifts(run, jina, tmp_path, monkeypatch):
    """``mmembed sft`` with the recorded ``swift sft`` flags (learning rate 0, one step) and
    ``--template jina_reranker_m0_swift``: the loss of ms-swift's first step (1e-5)."""
    recorded = _fixture(f"_{run}")
    assert recorded["versions"]["ms_swift"] == "4.6.0" and recorded["env"] == PIXELS
    flags = _flags(recorded["flags"], jina, str(tmp_path / "out")) + ["--template", "jina_reranker_m0_swift"]
    loss = _train(flags, monkeypatch)
    assert abs(loss - recorded["first_loss"]) <= 1e-5, (loss, recorded["first_loss"])


# ----------------------------------------------------------------------------- train, save, export, serve


@pytest.fixture(scope="module")
def lora_run(jina, tmp_path_factory):
    """Two LoRA steps (rank 4, lr 1e-2) with the default template on the text rows, then exported."""
    from mmembed.tools.cli import main

    out = str(tmp_path_factory.mktemp("jina_lora"))
    previous = {k: os.environ.get(k) for k in PIXELS}
    os.environ.update(PIXELS)
    try:
        code = main(["sft", "--model", jina, "--model_type", "jina_reranker_m0", "--task_type", "reranker",
                     "--loss_type", "listwise_reranker", "--tuner_type", "lora", "--lora_rank", "4",
                     "--learning_rate", "1e-2", "--dataset", os.path.join(DATA, "jina_text.jsonl"),
                     "--per_device_train_batch_size", "2", "--max_steps", "2", "--save_steps", "2",
                     "--output_dir", out, "--report_to", "none", "--disable_tqdm", "true"])
        assert code == 0
        checkpoint = os.path.join(out, "checkpoint-2")
        assert main(["export", "--adapters", checkpoint, "--merge_lora", "true"]) == 0
    finally:
        for k, v in previous.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return checkpoint, checkpoint + "-merged"


def test_lora_trains_the_head_and_the_export_scores_as_the_checkpoint(jina, lora_run):
    checkpoint, merged = lora_run
    with open(os.path.join(checkpoint, "mmembed.json"), encoding="utf-8") as f:
        assert json.load(f)["template"] == "jina_reranker_m0"
    adapter = load_file(os.path.join(checkpoint, "adapter_model.safetensors"))
    head = [k for k in adapter if ".score." in k]
    assert head, "the score MLP is saved beside the adapter (PEFT's SEQ_CLS modules_to_save)"
    with open(os.path.join(merged, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    assert config["architectures"] == ["JinaVLForRanking"] and config["auto_map"]["AutoModel"]
    base = load_file(os.path.join(jina, "model.safetensors"))["score.0.weight"]
    trained = load_file(os.path.join(merged, "model.safetensors"))["score.0.weight"]
    assert not torch.equal(base, trained)
    a = Reranker.from_pretrained(checkpoint, device="cpu").score(QUERY, DOCS, raw_scores=True)
    b = Reranker.from_pretrained(merged, device="cpu").score(QUERY, DOCS, raw_scores=True)
    np.testing.assert_allclose(a, b, atol=1e-5)
    # the exported folder scores as the model card does, like any jina-reranker-m0 folder
    np.testing.assert_allclose(1 / (1 + np.exp(-b)), card_scores(merged, QUERY, DOCS), atol=1e-5)


def test_rerank_cli_and_the_endpoint_rank_with_the_cards_scores(jina, capsys, tmp_path):
    from tools.test_serve import ThreadServer, httpx

    from mmembed.tools.cli import main
    from mmembed.tools.serve import ServeConfig
    from mmembed.tools.serve_rerank import create_rerank_app

    docs = tmp_path / "docs.txt"
    docs.write_text("\n".join(DOCS) + "\n", encoding="utf-8")
    card = card_scores(jina, QUERY, DOCS)
    assert main(["rerank", "--model", jina, "--query", QUERY, "--documents", str(docs)]) == 0
    line = json.loads(capsys.readouterr().out.splitlines()[-1])
    cli = {r["index"]: r["relevance_score"] for r in line["results"]}
    np.testing.assert_allclose([cli[i] for i in range(len(DOCS))], card, atol=1e-5)
    reranker = Reranker.from_pretrained(jina, device="cpu")
    with ThreadServer(create_rerank_app(reranker, ServeConfig(model=jina, served_model_name="jina"))) as server:
        reply = httpx.post(server.url + "/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2},
                           timeout=60).json()
    assert [r["index"] for r in reply["results"]] == list(np.argsort(-card, kind="stable")[:2])
    np.testing.assert_allclose([r["relevance_score"] for r in reply["results"]], np.sort(card)[::-1][:2], atol=1e-5)
