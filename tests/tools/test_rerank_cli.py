"""``mmembed rerank`` and ``mmembed export`` of reranker checkpoints, against independent references:
``sentence_transformers.CrossEncoder.predict`` for a classifier, full checkpoint and LoRA export
alike (its default sigmoid: the default scores; ``activation_fn=Identity()``: ``--raw_scores
true``); transformers' ``AutoModelForCausalLM`` with Qwen3-Reranker's text written out
(``softmax([logit(no), logit(yes)])[1]`` at the last token, Qwen3-Reranker's own score; raw:
``logit(yes) - logit(no)``) and the export card's snippet run as written for a generative LoRA
checkpoint; the results' order (by the raw score, also where probabilities round to one
value), indices and ``--top_n``; bad rows named by file, line and field."""

import json
import os
import re

import numpy as np
import pytest
import torch

from mmembed.tools.cli import main

QUERIES = ["how do flutes work", "what is the capital of France?"]
DOCS = ["A flute is a woodwind instrument: air over an opening makes it sound.",
        "Paris is the capital and largest city of France.",
        "bananas are yellow",
        "question 3 about flutes: the answer is that a flute is a woodwind",
        "The sea is wide."]

# Qwen3-Reranker's text, written out as its model card gives it (not read from mmembed's template)
QWEN3_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def _write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


RUNS = {"full": "classifier_full", "lora": "classifier_lora", "gen_lora": "generative_lora",
        "merged": "classifier_lora_export", "gen_merged": "generative_lora_export", "base": "base"}


@pytest.fixture(scope="module")
def runs(reranker_checkpoints):
    """The session's one-step reranker checkpoints (tests/conftest.py ``reranker_checkpoints``:
    a classifier, full and LoRA, from all-MiniLM-L6-v2 and a generative LoRA from a tiny Qwen3,
    the LoRA ones exported) under this file's names; all made here, before the tests (whose
    captured output must hold the command's alone)."""
    return {name: reranker_checkpoints[key] for name, key in RUNS.items()}


@pytest.fixture(scope="module")
def docs_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("rerank_cli") / "docs.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write(DOCS[0] + "\n\n" + "\n".join(DOCS[1:]) + "\n")  # a blank line: skipped, not a document
    return path


def _rerank(argv, capsys):
    code = main(["rerank", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _scores_by_index(line, n):
    scores = np.full(n, np.nan)
    for r in line["results"]:
        scores[r["index"]] = r["relevance_score"]
    return scores


_LOADED: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _loaded_once():
    """``_reranker(folder)`` loads each folder once for the file (the references of several
    tests), and lets them go after it."""
    yield
    _LOADED.clear()


def _reranker(folder):
    from mmembed.tasks.reranker.scorer import Reranker

    if folder not in _LOADED:
        _LOADED[folder] = Reranker.from_pretrained(folder, device="cpu")
    return _LOADED[folder]


def _cross_encoder_predict(folder, query, documents, **kwargs):
    """``CrossEncoder(folder).predict`` of the pairs: its default activation (a sigmoid for one
    label), or as ``kwargs`` say."""
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(folder, device="cpu")
    return model.predict([(query, d) for d in documents], batch_size=2, **kwargs)


# ----------------------------------------------------------------------------- classifier


@pytest.mark.parametrize("which", ["full", "merged"])
def test_cli_scores_are_cross_encoder_predict_and_raw_scores_its_logits(runs, docs_file, capsys, which):
    folder = runs[which]
    argv = ["--model", folder, "--query", QUERIES[0], "--documents", docs_file, "--batch_size", "2"]
    code, out, err = _rerank(argv, capsys)
    assert code == 0, err
    lines = [json.loads(x) for x in out.splitlines()]  # stdout holds the JSON lines alone
    assert len(lines) == 1 and lines[0]["query"] == QUERIES[0]
    cli = _scores_by_index(lines[0], len(DOCS))
    # the default: what sentence-transformers' CrossEncoder.predict gives (its sigmoid for one label)
    st = _cross_encoder_predict(folder, QUERIES[0], DOCS)
    np.testing.assert_allclose(cli, st, atol=1e-5)
    np.testing.assert_allclose(cli, _reranker(folder).score(QUERIES[0], DOCS), atol=1e-6)
    assert ((cli > 0) & (cli < 1)).all()
    # --raw_scores true: the logit, CrossEncoder.predict without its activation
    code, out, err = _rerank([*argv, "--raw_scores", "true"], capsys)
    assert code == 0, err
    (line,) = [json.loads(x) for x in out.splitlines()]
    raw = _scores_by_index(line, len(DOCS))
    logits = _cross_encoder_predict(folder, QUERIES[0], DOCS, activation_fn=torch.nn.Identity())
    np.testing.assert_allclose(raw, logits, atol=1e-5)
    np.testing.assert_allclose(raw, _reranker(folder).score(QUERIES[0], DOCS, raw_scores=True), atol=1e-6)
    np.testing.assert_allclose(cli, 1 / (1 + np.exp(-raw)), atol=1e-6)
    assert [r["index"] for r in line["results"]] == [r["index"] for r in lines[0]["results"]]  # the same order
    assert np.ptp(raw) > 1e-4  # the documents score differently: a real comparison


def test_probabilities_are_stable_and_the_order_follows_the_raw_scores():
    """sigmoid of large raw scores neither overflows nor fails (-1000: 0.0, 1000: 1.0), and where
    the probabilities of two raw scores round to one float the results keep the raw order."""
    import warnings

    from mmembed.tasks.reranker.scorer import probabilities
    from mmembed.tools.rerank import RerankQuery, result_line

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warning either
        p = probabilities(np.array([-1000.0, -50.0, 0.0, 3.0, 50.0, 1000.0]))
    assert p.dtype == np.float32 and np.isfinite(p).all()
    np.testing.assert_allclose(p, [0.0, 1 / (1 + np.exp(50.0)), 0.5, 1 / (1 + np.exp(-3.0)), 1.0, 1.0], rtol=1e-6,
                               atol=0)
    assert p[1] > 0  # not flushed to 0 at -50
    query = RerankQuery("q", ["a", "b", "c", "d"], "<test>", 1)
    raw = np.array([30.0, 40.0, -2.0, 30.0], dtype=np.float32)  # sigmoid(30) == sigmoid(40) == 1.0 in float32
    line = result_line(query, raw)
    assert [r["index"] for r in line["results"]] == [1, 0, 3, 2]  # by the raw score; the tie 0 / 3 in order
    assert [r["relevance_score"] for r in line["results"]][:3] == [1.0, 1.0, 1.0]
    assert [r["relevance_score"] for r in result_line(query, raw, raw_scores=True)["results"]] == [40.0, 30.0, 30.0,
                                                                                                   -2.0]


def test_lora_export_scores_as_the_checkpoint(runs):
    pairs = [(q, d) for q in QUERIES for d in DOCS]
    checkpoint = _reranker(runs["lora"]).score_pairs(pairs, raw_scores=True)
    merged = _reranker(runs["merged"]).score_pairs(pairs, raw_scores=True)
    np.testing.assert_allclose(merged, checkpoint, atol=1e-5)
    # the trained head (PEFT's modules_to_save, saved whole in the adapter) is the one exported
    from safetensors.torch import load_file

    adapter = load_file(os.path.join(runs["lora"], "adapter_model.safetensors"))
    exported = load_file(os.path.join(runs["merged"], "model.safetensors"))
    for name in ("classifier.weight", "classifier.bias"):
        assert torch.equal(exported[name], adapter["base_model.model." + name]), name


def test_classifier_export_is_a_cross_encoder_folder(runs):
    from transformers import AutoModelForSequenceClassification

    folder = runs["merged"]
    files = set(os.listdir(folder))
    assert not files & {"modules.json", "1_Pooling", "config_sentence_transformers.json", "sentence_bert_config.json",
                        "adapter_config.json", "optimizer.pt", "training_args.bin"}, files
    assert {"config.json", "model.safetensors", "tokenizer.json", "mmembed.json", "README.md"} <= files
    config = json.load(open(os.path.join(folder, "config.json")))
    assert config["architectures"][0].endswith("ForSequenceClassification") and config.get("num_labels", 1) == 1
    _, info = AutoModelForSequenceClassification.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    cfg = json.load(open(os.path.join(folder, "mmembed.json")))
    assert cfg["task_type"] == "reranker" and cfg["kind"] == "classifier" and cfg["tuner_type"] == "full"
    assert cfg["trained_from"] == os.path.abspath(runs["base"]) and cfg["base_model"] == os.path.abspath(folder)
    assert cfg["exported_from"] == os.path.abspath(runs["lora"])
    card = open(os.path.join(folder, "README.md"), encoding="utf-8").read()
    assert "### sentence-transformers" in card and f"CrossEncoder({os.path.abspath(folder)!r})" in card
    assert f"mmembed rerank --model {os.path.abspath(folder)}" in card and ".partial" not in card


def test_results_sorted_with_indices_top_n_and_documents(runs, capsys, tmp_path):
    documents = [DOCS[0], {"text": DOCS[1]}, DOCS[2], {"text": DOCS[3]}, DOCS[4]]
    path = _write_jsonl(tmp_path / "in.jsonl", [{"query": q, "documents": documents, "id": k}
                                                 for k, q in enumerate(QUERIES)])
    output = str(tmp_path / "out.jsonl")
    code, out, err = _rerank(["--model", runs["full"], "--input", path, "--top_n", "3", "--return_documents", "true",
                              "--output", output], capsys)
    assert code == 0, err
    assert out == ""  # the results are in the file
    lines = [json.loads(x) for x in open(output, encoding="utf-8")]
    reranker = _reranker(runs["full"])
    for query, line in zip(QUERIES, lines):
        assert line["query"] == query
        texts = [d if isinstance(d, str) else d["text"] for d in documents]
        scores = reranker.score(query, texts)
        best = list(np.argsort(-reranker.score(query, texts, raw_scores=True), kind="stable")[:3])
        assert [r["index"] for r in line["results"]] == best
        got = [r["relevance_score"] for r in line["results"]]
        assert got == sorted(got, reverse=True)
        np.testing.assert_allclose(got, scores[best], atol=1e-6)
        for r in line["results"]:
            d = documents[r["index"]]
            assert r["document"] == ({"text": d} if isinstance(d, str) else d)
    # without --return_documents: index and relevance_score only; no --top_n: every document
    code, out, err = _rerank(["--model", runs["full"], "--input", path], capsys)
    assert code == 0, err
    for line in map(json.loads, out.splitlines()):
        assert len(line["results"]) == len(documents)
        assert all(set(r) == {"index", "relevance_score"} for r in line["results"])


# ----------------------------------------------------------------------------- generative


def _qwen3_reference_logits(folder, pairs):
    """Qwen3-Reranker's scoring with plain transformers: its text written out, left padding;
    ``(logit(yes), logit(no))`` at the last position, float32 ``[N]`` each."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    texts = [f"{QWEN3_PREFIX}<Instruct>: {QWEN3_INSTRUCTION}\n<Query>: {q}\n<Document>: {d}{QWEN3_SUFFIX}"
             for q, d in pairs]
    enc = tok(texts, return_tensors="pt", padding=True)
    assert (enc["attention_mask"][:, 0] == 0).any()  # padded rows among them
    with torch.no_grad():
        logits = model(**enc).logits[:, -1].float()
    return logits[:, yes], logits[:, no]


def _qwen3_reference_scores(folder, pairs):
    """The raw score: ``logit(yes) - logit(no)``."""
    yes, no = _qwen3_reference_logits(folder, pairs)
    return (yes - no).numpy()


def _qwen3_reference_probabilities(folder, pairs):
    """Qwen3-Reranker's own score, as its model card computes it: log-softmax over the [no, yes]
    logits, the exponent of the yes entry."""
    yes, no = _qwen3_reference_logits(folder, pairs)
    return torch.nn.functional.log_softmax(torch.stack([no, yes], dim=1).double(), dim=1)[:, 1].exp().numpy()


def test_generative_export_scores_as_the_checkpoint_in_plain_transformers(runs):
    from transformers import AutoConfig

    export = runs["gen_merged"]
    assert AutoConfig.from_pretrained(export).architectures[0].endswith("ForCausalLM")
    assert not os.path.exists(os.path.join(export, "adapter_config.json"))
    cfg = json.load(open(os.path.join(export, "mmembed.json")))
    assert cfg["task_type"] == "generative_reranker" and cfg["tuner_type"] == "full" and cfg["tokens"] == ["yes", "no"]
    pairs = [(q, d) for q in QUERIES for d in DOCS]
    checkpoint = _reranker(runs["gen_lora"]).score_pairs(pairs, batch_size=4, raw_scores=True)
    reference = _qwen3_reference_scores(export, pairs)
    np.testing.assert_allclose(reference, checkpoint, atol=1e-4)
    assert np.ptp(checkpoint) > 1e-3


def test_generative_card_snippet_as_written(runs):
    from mmembed.model.card import CARD

    export = runs["gen_merged"]
    card = open(os.path.join(export, CARD), encoding="utf-8").read()
    found = re.search(r"### transformers\n.*?```python\n(.*?)```", card, re.S)
    assert found, card
    namespace: dict = {}
    exec(found.group(1), namespace)
    ours = _reranker(runs["gen_lora"]).score("how do flutes work", ["A flute is a woodwind instrument."])
    np.testing.assert_allclose(namespace["score"].numpy(), ours, atol=1e-5)
    raw = _reranker(runs["gen_lora"]).score("how do flutes work", ["A flute is a woodwind instrument."], raw_scores=True)
    np.testing.assert_allclose(namespace["raw"].numpy(), raw, atol=1e-4)


def test_generative_cli_scores_are_the_reranker_scores(runs, capsys, tmp_path):
    documents = _write_jsonl(tmp_path / "docs.jsonl", [json.dumps(d) for d in DOCS[:3]] + [{"text": DOCS[3]}])
    code, out, err = _rerank(["--model", runs["gen_lora"], "--query", QUERIES[0], "--documents", documents,
                              "--top_n", "2", "--device", "cpu"], capsys)
    assert code == 0, err
    (line,) = [json.loads(x) for x in out.splitlines()]
    scores = _reranker(runs["gen_lora"]).score(QUERIES[0], DOCS[:4])
    best = list(np.argsort(-_reranker(runs["gen_lora"]).score(QUERIES[0], DOCS[:4], raw_scores=True), kind="stable")[:2])
    assert [r["index"] for r in line["results"]] == best
    np.testing.assert_allclose([r["relevance_score"] for r in line["results"]], scores[best], atol=1e-5)


def test_generative_cli_scores_are_qwen3_reranker_probabilities_and_raw_the_difference(runs, docs_file, capsys):
    """The default score of a generative reranker is softmax([logit(no), logit(yes)])[1] at the
    last position, computed here from the causal LM's logits; --raw_scores true gives
    logit(yes) - logit(no)."""
    export = runs["gen_merged"]
    argv = ["--model", export, "--query", QUERIES[0], "--documents", docs_file, "--device", "cpu"]
    code, out, err = _rerank(argv, capsys)
    assert code == 0, err
    (line,) = [json.loads(x) for x in out.splitlines()]
    got = _scores_by_index(line, len(DOCS))
    pairs = [(QUERIES[0], d) for d in DOCS]
    np.testing.assert_allclose(got, _qwen3_reference_probabilities(export, pairs), atol=1e-5)
    code, out, err = _rerank([*argv, "--raw_scores", "true"], capsys)
    assert code == 0, err
    (raw_line,) = [json.loads(x) for x in out.splitlines()]
    raw = _scores_by_index(raw_line, len(DOCS))
    np.testing.assert_allclose(raw, _qwen3_reference_scores(export, pairs), atol=1e-4)
    assert [r["index"] for r in raw_line["results"]] == [r["index"] for r in line["results"]]
    assert np.ptp(raw) > 1e-3


# ----------------------------------------------------------------------------- errors


BAD_ROWS = [
    ('["a list"]', 2, None),
    ({"documents": ["x"]}, 2, None),  # no query: named below
    ({"query": "q", "documents": "one string"}, 2, "documents"),
    ({"query": "q", "documents": []}, 2, "documents"),
    ({"query": "q", "documents": ["fine", 3]}, 2, "documents[1]"),
    ({"query": "q", "documents": ["fine", {"text": 5}]}, 2, "documents[1].text"),
    ({"query": "q", "documents": [{"text": "t", "image": ["a.png"]}]}, 2, "documents[0].image"),
    ({"query": "q", "documents": [{"text": "t", "images": ["missing.png"]}]}, 2, "documents[0].images[0]"),
    ({"query": ["q"], "documents": ["d"]}, 2, "query"),
    ('{"query": "q", "documents": [', 2, None),
]


@pytest.mark.parametrize("row,line,field", BAD_ROWS, ids=[f"case{i}" for i in range(len(BAD_ROWS))])
def test_bad_input_rows_named_by_file_line_and_field(runs, capsys, tmp_path, row, line, field):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"query": "fine", "documents": ["d"]}, row])
    code, out, err = _rerank(["--model", runs["full"], "--input", path], capsys)
    assert code == 1 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert f"{path}:{line}" in err, err
    if field is not None:
        assert f"field '{field}'" in err, err
    if isinstance(row, dict) and "query" not in row:
        assert "field 'query'" in err and "missing" in err


def test_bad_documents_file_and_usage_errors(runs, capsys, tmp_path):
    path = _write_jsonl(tmp_path / "docs.jsonl", [json.dumps("a document"), {"txt": "typo"}])
    code, out, err = _rerank(["--model", runs["full"], "--query", "q", "--documents", path], capsys)
    assert code == 1 and f"{path}:2 field 'txt'" in err and len(err.strip().splitlines()) == 1, err
    for argv, words in [(["--query", "q"], "--documents"), (["--documents", path], "--query"),
                        (["--input", path, "--query", "q"], "not both"),
                        (["--query", "q", "--documents", path, "--top_n", "0"], "--top_n"),
                        (["--query", "q", "--documents", path, "--batch_size", "0"], "--batch_size")]:
        code, out, err = _rerank(["--model", runs["full"], *argv], capsys)
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, (argv, err)
    code, out, err = _rerank(["--model", runs["full"], "--input", str(tmp_path / "nope.jsonl")], capsys)
    assert code == 1 and "nope.jsonl" in err


def test_an_error_while_scoring_names_the_row_and_document(runs, capsys, tmp_path):
    """Media for a text-pair reranker: found when the pairs are encoded (the model loaded), and
    still named by the --input row and its document."""
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "red.png")
    path = _write_jsonl(tmp_path / "media.jsonl", [{"query": "q", "documents": ["d"]},
                                                   {"query": "q", "documents": ["d", {"text": "t", "images": ["red.png"]}]}])
    code, out, err = _rerank(["--model", runs["full"], "--input", path], capsys)
    assert code == 1 and out == "", err
    errors = [x for x in err.splitlines() if "error" in x]  # the model's loading bars aside
    assert len(errors) == 1 and errors[0].startswith("mmembed rerank: error: "), err
    assert f"{path}:2 field 'documents[1]'" in errors[0] and "takes no media" in errors[0], err
