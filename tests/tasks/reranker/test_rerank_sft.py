"""``mmembed sft --task_type reranker | generative_reranker``: the training step against plain
references (the loss of the model's scores written out; the gradient cache against the plain
step), the saved folder against the libraries that load it, and the run's guarantees (resume to
the same weights, the up-front data check) holding for rerankers."""

import json
import os
import random
import shutil
import sys

import numpy as np
import pytest
import torch
from conftest import REPO

from mmembed.tasks.reranker.trainer import build_rerank_trainer, model_inputs
from mmembed.training.arguments import parse_sft_args
from mmembed.training.preflight import check_settings
from mmembed.training.sft import run_sft

WORDS = "the a cat dog runs sits on mat under tree red blue small large quickly slowly flute music plays".split()


def _rows(n, seed, negatives=(0, 4)):
    rng = np.random.default_rng(seed)

    def sentence():
        return " ".join(rng.choice(WORDS, size=int(rng.integers(4, 10))))

    return [{"query": sentence(), "response": sentence(),
             "rejected_response": [sentence() for _ in range(int(rng.integers(*negatives)) if negatives[1] else 0)]}
            for _ in range(n)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rerank_data")
    for name, rows in (("train.jsonl", _rows(16, 0, (0, 5))), ("val.jsonl", _rows(5, 1, (2, 4)))):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(folder / "train.jsonl"), str(folder / "val.jsonl")


@pytest.fixture(scope="module")
def qwen3(tiny_model):
    return tiny_model("qwen3")


def _args(model, task, data, out, *extra):
    return parse_sft_args(["--model", model, "--task_type", task, "--dataset", data[0], "--output_dir", str(out),
                           "--per_device_train_batch_size", "4", "--max_steps", "2", "--save_steps", "2",
                           "--report_to", "none", "--disable_tqdm", "true", "--dataloader_num_workers", "0",
                           "--logging_steps", "1", *extra])


def _grads(trainer):
    return {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


CASES = [("reranker", "full", "listwise_reranker"), ("reranker", "lora", "pointwise_reranker"),
         ("generative_reranker", "lora", "listwise_reranker"), ("generative_reranker", "full", "pointwise_reranker")]


@pytest.mark.parametrize("task, tuner, loss", CASES)
def test_the_step_is_the_loss_of_the_scores_and_the_cached_step_gives_its_gradients(
        minilm_path, qwen3, data, tmp_path, task, tuner, loss):
    """One training step's loss is the written-out loss of the model's scores of the batch
    (ms-swift's: BCE with logits, or per group softmax cross-entropy with the positive first),
    and the gradient-cache step (chunks of 3 pairs) leaves the same gradients as the plain step."""
    model = minilm_path if task == "reranker" else qwen3
    flags = ["--tuner_type", tuner, "--loss_type", loss, "--lora_dropout", "0"]
    plain = build_rerank_trainer(a := _args(model, task, data, tmp_path / "a", *flags), check_settings(a))
    cached = build_rerank_trainer(b := _args(model, task, data, tmp_path / "b", *flags, "--gradcache_mini_batch_size", "3"),
                                  check_settings(b))
    cached.model.load_state_dict(plain.model.state_dict())  # a new head / LoRA starts random: the same weights on both
    samples = [plain.train_dataset[i] for i in range(4)]
    batch = plain.data_collator(samples)
    assert torch.equal(batch["labels"], cached.data_collator(samples)["labels"])  # the same draws (RandomState(42) each)

    with torch.no_grad():
        plain.model.eval()
        scores = plain.model(**model_inputs(batch))["scores"]
    labels = batch["labels"]
    if loss == "pointwise_reranker":
        p = torch.sigmoid(scores.double())
        expected = -(labels * torch.log(p) + (1 - labels) * torch.log(1 - p)).mean()
    else:
        groups = []
        for i, y in enumerate(labels.tolist()):
            if y == 1:
                groups.append([i])
            elif groups:
                groups[-1].append(i)
        kept = [g for g in groups if len(g) >= 2]
        expected = sum(-torch.log_softmax(scores.double()[g], 0)[0] for g in kept) / len(kept)
    got = plain.compute_loss(plain.model, dict(batch))
    assert abs(float(got) - float(expected)) < 1e-5

    for t in (plain, cached):  # set by the Trainer's loop, which this test steps outside of
        t.current_gradient_accumulation_steps = 1
        t.model.zero_grad()
    for t in (plain, cached):  # no dropout: the plain step draws its masks over the whole batch, the cache per chunk
        for m in t.model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
    plain.training_step(plain.model, dict(batch))
    cached.training_step(cached.model, dict(batch))
    g1, g2 = _grads(plain), _grads(cached)
    assert g1.keys() == g2.keys() and g1
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_classifier_run_resumes_to_the_same_weights_and_crossencoder_scores_it(minilm_path, data, tmp_path):
    """Four steps in one run equal two steps, then a resume for two more (weights and the
    sampler's rows); the checkpoint loads in sentence-transformers' CrossEncoder with the
    scores of mmembed's Reranker; evaluation logs loss, mrr_at_10, ndcg_at_10 and accuracy."""
    from safetensors.torch import load_file
    from sentence_transformers import CrossEncoder

    from mmembed.tasks.reranker.scorer import Reranker

    common = ["--tuner_type", "full", "--loss_type", "listwise_reranker", "--max_steps", "4", "--save_steps", "2",
              "--val_dataset", data[1], "--eval_steps", "4", "--learning_rate", "1e-3"]
    whole = run_sft(_args(minilm_path, "reranker", data, tmp_path / "whole", *common))
    # the run cut after its step-2 checkpoint: that checkpoint alone in a folder of its own
    shutil.copytree(tmp_path / "whole" / "checkpoint-2", tmp_path / "cut" / "checkpoint-2")
    resumed = run_sft(_args(minilm_path, "reranker", data, tmp_path / "cut", *common,
                            "--resume_from_checkpoint", str(tmp_path / "cut" / "checkpoint-2")))
    a = load_file(os.path.join(whole["last_checkpoint"], "model.safetensors"))
    b = load_file(os.path.join(resumed["last_checkpoint"], "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)
    for name in ("eval_loss", "eval_mrr_at_10", "eval_ndcg_at_10", "eval_accuracy"):
        assert np.isfinite(whole[name]), name
    folder = whole["last_checkpoint"]
    pairs = [("a cat sits on the mat", "the cat sits"), ("flute music plays", "dogs run under a red tree")]
    ours = Reranker.from_pretrained(folder, device="cpu").score_pairs(pairs, raw_scores=True)
    theirs = CrossEncoder(folder, device="cpu").predict(pairs, activation_fn=torch.nn.Identity())
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    config = json.load(open(os.path.join(folder, "mmembed.json")))
    assert config["task_type"] == "reranker" and config["kind"] == "classifier"
    assert not os.path.exists(os.path.join(folder, "modules.json"))  # CrossEncoder must not read an embedder's modules
    charts = tmp_path / "whole" / "charts"  # as for embeddings: the logged series, the scores before / after
    assert {"train_loss.png", "eval_mrr_at_10.png", "eval_accuracy.png", "similarity_histogram.png"} <= set(
        os.listdir(charts))
    card = open(os.path.join(folder, "README.md"), encoding="utf-8").read()
    assert f"mmembed rerank --model {os.path.abspath(folder)} " in card  # the folder's final name, not its staging one


def test_a_generative_run_scores_with_the_yes_and_no_rows_of_its_lm_head(qwen3, data, tmp_path):
    """A full generative run's folder is the causal LM: transformers' logits at the last token of
    the pair's text, logit('yes') - logit('no'), are mmembed's scores."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mmembed.tasks.reranker.scorer import Reranker

    out = run_sft(_args(qwen3, "generative_reranker", data, tmp_path / "gen", "--tuner_type", "full",
                        "--learning_rate", "1e-3"))
    folder = out["last_checkpoint"]
    config = json.load(open(os.path.join(folder, "mmembed.json")))
    tok = AutoTokenizer.from_pretrained(folder)
    assert config["token_ids"] == [tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")]
    query, docs = "a cat sits on the mat", ["the cat sits", "dogs run under a red tree"]
    text = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
            "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n<Instruct>: Given a "
            "web search query, retrieve relevant passages that answer the query\n<Query>: {q}\n<Document>: {d}<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    expected = []
    for d in docs:
        ids = tok(text.format(q=query, d=d), return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            logits = model(**ids).logits[0, -1]
        expected.append(float(logits[config["token_ids"][0]] - logits[config["token_ids"][1]]))
    got = Reranker.from_pretrained(folder, device="cpu").score(query, docs, raw_scores=True)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_a_row_without_a_positive_is_named_before_training(minilm_path, tmp_path):
    from mmembed.data import DataError

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"query": "q", "response": "p"}) + "\n" + json.dumps({"query": "q2"}) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:2"):
        run_sft(_args(minilm_path, "reranker", (str(bad), None), tmp_path / "out", "--tuner_type", "full"))


def test_a_vision_language_reranker_trains_on_image_rows_and_scores_them(tiny_model, tmp_path):
    """Qwen3-VL as a generative reranker (qwen3_vl_reranker) on the messages-form image rows of
    examples/data/mm, LoRA, two steps: the template is found by the model's type among the
    reranker templates, the pairs carry the query's image (pixel values in the batch), and the
    checkpoint scores an image query against captions, finite, the same batch after batch
    (the scores against transformers' full logits: tests/model/test_reranker.py)."""
    from mmembed.tasks.reranker.scorer import Reranker

    mm = os.path.join(REPO, "examples", "data", "mm")
    model = tiny_model("qwen3_vl")
    out = run_sft(parse_sft_args([
        "--model", model, "--task_type", "generative_reranker", "--dataset", os.path.join(mm, "qwen3_vl_train.jsonl"),
        "--output_dir", str(tmp_path / "vl"), "--per_device_train_batch_size", "4", "--max_steps", "2",
        "--save_steps", "2", "--report_to", "none", "--disable_tqdm", "true", "--dataloader_num_workers", "0",
        "--tuner_type", "lora", "--learning_rate", "1e-3", "--max_length", "512"]))
    folder = out["last_checkpoint"]
    assert json.load(open(os.path.join(folder, "mmembed.json")))["template"] == "qwen3_vl_reranker"
    reranker = Reranker.from_pretrained(folder, device="cpu")
    query = {"text": "<image>", "images": [os.path.join(mm, "red_circle.png")]}
    scores = reranker.score(query, ["a red circle", "a blue square"], raw_scores=True)
    assert scores.shape == (2,) and np.isfinite(scores).all()
    batch = reranker.collator([__import__("mmembed.data.sample", fromlist=["Sample"]).Sample(
        anchor=reranker._item(query), positives=[reranker._item("a red circle")])])
    assert batch["pixel_values"].shape[0] > 0  # the query's image is in the pair
    with torch.no_grad():
        again = reranker.model(**{k: v for k, v in batch.items() if k not in ("labels", "group_ids")})["scores"]
    np.testing.assert_allclose(float(again[0]), scores[0], rtol=1e-5, atol=1e-6)


def test_a_tiny_qwen3_vl_generative_reranker_learns_image_text_reranking(tiny_model, tmp_path, monkeypatch):
    """The shape pictures of benchmarks/learn_multimodal.py (6 colours x 3 shapes; its embedding
    twin: tests/encoding/test_multimodal.py) as reranker rows in the direction of the bundled
    Qwen3-VL-Reranker rows (examples/data/mm/qwen3_vl_train.jsonl): a picture is the query, its
    caption the positive, 3 of the other 17 captions the negatives. The tiny random Qwen3-VL
    (qwen3_vl_reranker), full training with the vision tower and aligner frozen (the default),
    listwise loss, 10 epochs of 14 steps. Each held-out picture ranks the 18 captions with
    ``Reranker.rank`` on the start folder (before) and on the checkpoint (after): held-out
    recall@1 < 2x chance before and >= 3x after (measured 0.000 -> 0.278, chance 0.056; 0.278 and
    0.306 with --data_seed 1 / 2). What it takes (README "A reranker learns"): pictures of 16
    tokens (MIN_PIXELS / MAX_PIXELS 128 x 128; at 4 tokens it stays at chance), the warmup (without
    it other data orders stay at chance), the picture as the query (captions as the query and
    pictures as the documents stay at chance for 140 steps), the vision tower frozen (trained, the
    pictures' tokens collapse first)."""
    from mmembed.tasks.reranker.scorer import Reranker

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import learn_multimodal

    side = str(128 * 128)  # the 56-pixel pictures scaled to 128 x 128: 4 x 4 merged patches of 32
    monkeypatch.setenv("MIN_PIXELS", side)
    monkeypatch.setenv("MAX_PIXELS", side)
    data = tmp_path / "data"
    train, test = learn_multimodal.make_task(str(data), train_per_class=6, test_per_class=2, seed=0)
    rows = [json.loads(line) for line in open(train, encoding="utf-8")]  # caption -> <image>
    captions = sorted({r["query"] for r in rows})
    rng = random.Random(0)
    rerank_rows = [{"query": "<image>", "images": r["images"], "response": r["query"],
                    "rejected_response": rng.sample([c for c in captions if c != r["query"]], 3)} for r in rows]
    (data / "rerank.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rerank_rows))

    def recall_at_1(folder):
        reranker = Reranker.from_pretrained(folder, device="cpu")
        return float(np.mean([reranker.rank({"text": "<image>", "images": [picture]}, captions, top_n=1)[0][0]
                              == captions.index(caption) for picture, caption in test]))

    model = tiny_model("qwen3_vl")
    before = recall_at_1(model)
    out = run_sft(parse_sft_args([
        "--model", model, "--task_type", "generative_reranker", "--loss_type", "listwise_reranker",
        "--dataset", str(data / "rerank.jsonl"), "--output_dir", str(tmp_path / "out"), "--tuner_type", "full",
        "--num_train_epochs", "10", "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1",
        "--learning_rate", "1e-3", "--warmup_ratio", "0.1", "--gradient_checkpointing", "false",
        "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true", "--dataloader_num_workers", "0"]))
    after = recall_at_1(out["last_checkpoint"])
    chance = 1 / len(captions)
    assert len(test) == 36 and len(captions) == 18
    assert before < 2 * chance, before
    assert after >= 3 * chance, (before, after)


@pytest.mark.parametrize("task", ["reranker", "generative_reranker"])
def test_a_lora_run_resumes_to_the_same_adapter(minilm_path, qwen3, data, tmp_path, task):
    """A LoRA reranker (a classifier's trained head saved whole beside the adapter, or a
    generative one's adapter) resumed from its step-2 checkpoint ends with the uninterrupted
    run's adapter weights, the head included."""
    from safetensors.torch import load_file

    model = minilm_path if task == "reranker" else qwen3
    common = ["--tuner_type", "lora", "--loss_type", "pointwise_reranker", "--max_steps", "4", "--save_steps", "2",
              "--learning_rate", "1e-2", "--lora_dropout", "0"]
    whole = run_sft(_args(model, task, data, tmp_path / "whole", *common))
    shutil.copytree(tmp_path / "whole" / "checkpoint-2", tmp_path / "cut" / "checkpoint-2")
    resumed = run_sft(_args(model, task, data, tmp_path / "cut", *common,
                            "--resume_from_checkpoint", str(tmp_path / "cut" / "checkpoint-2")))
    a = load_file(os.path.join(whole["last_checkpoint"], "adapter_model.safetensors"))
    b = load_file(os.path.join(resumed["last_checkpoint"], "adapter_model.safetensors"))
    start = load_file(str(tmp_path / "whole" / "checkpoint-2" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    if task == "reranker":
        assert any("classifier" in k for k in a)  # the head, trained and saved whole
    assert any(not torch.equal(a[k], start[k]) for k in a)  # steps 3-4 changed the adapter
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)


def test_a_classifier_with_more_than_one_label_is_refused_before_it_loads(minilm_path, data, tmp_path):
    """An NLI-style head (3 labels) is not a reranker's: one line naming --model, before any weight
    is read (the folder holds no weights at all)."""
    from mmembed.errors import UsageError

    folder = tmp_path / "nli"
    folder.mkdir()
    config = json.load(open(os.path.join(minilm_path, "config.json")))
    config.update(architectures=["BertForSequenceClassification"], id2label={"0": "a", "1": "b", "2": "c"},
                  label2id={"a": 0, "b": 1, "c": 2})
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        shutil.copy(os.path.join(minilm_path, name), folder / name)
    with pytest.raises(UsageError, match=r"its classification head has 3 labels .* a reranker scores a pair with one label"):
        run_sft(_args(str(folder), "reranker", data, tmp_path / "out", "--tuner_type", "full"))
    assert not (tmp_path / "out").exists()
