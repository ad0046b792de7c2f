"""Retrieval evaluation on a BEIR-layout folder (mmembed.eval.beir, `mmembed eval --beir`).

A stub embedder makes every query/document score a number written in the test, so the
rankings, and from them nDCG@10 (graded), MRR@10 and recall@k, are computed by hand below.
The end-to-end test runs the CLI with the real all-MiniLM-L6-v2 on a folder made of STS-B
pairs.
"""

import json
import math
import os

import numpy as np
import pytest
from conftest import DATA

from mmembed.eval.beir import BeirData, evaluate_beir, load_beir, ranking_metrics, top_k
from mmembed.tools.cli import main

DOCS = [("d1", "T1", "one"), ("d2", "T2", "two"), ("d3", "", "three"), ("d4", "T4", "four"), ("d5", "T5", "five")]
DOC_TEXTS = ["T1 one", "T2 two", "three", "T4 four", "T5 five"]  # title + " " + text, stripped

# query id -> (text, its score for d1..d5)
QUERIES = {
    "q1": ("first", [0.1, 0.9, 0.5, 0.7, 0.3]),  # ranking d2 d4 d3 d5 d1
    "q2": ("second", [0.5, 0.5, 0.2, 0.5, 0.1]),  # ties by corpus order: d1 d2 d4 d3 d5
    "d2": ("also a doc id", [0.8, 0.95, 0.1, 0.2, 0.3]),  # d2 itself is left out: d1 d5 d4 d3
    "q4": ("only zero grades", [0.9, 0.1, 0.1, 0.1, 0.1]),
    "q5": ("missing doc", [0.9, 0.1, 0.2, 0.3, 0.4]),  # d1 first
    "q6": ("no qrels", [0.2, 0.2, 0.2, 0.2, 0.2]),
}
QRELS_TEST = [
    ("q1", "d3", 2), ("q1", "d1", 1), ("q1", "d4", 0),
    ("q2", "d4", 1),
    ("d2", "d1", 1),
    ("q4", "d1", 0),
    ("q5", "d1", 1), ("q5", "dX", 1),  # dX is not in the corpus
]
QRELS_DEV = [("q1", "d2", 1)]


def _write_beir(folder, docs, queries, splits):
    os.makedirs(os.path.join(folder, "qrels"), exist_ok=True)
    with open(os.path.join(folder, "corpus.jsonl"), "w") as f:
        for _id, title, text in docs:
            f.write(json.dumps({"_id": _id, "title": title, "text": text}) + "\n")
    with open(os.path.join(folder, "queries.jsonl"), "w") as f:
        for _id, text in queries:
            f.write(json.dumps({"_id": _id, "text": text}) + "\n")
    for split, qrels in splits.items():
        with open(os.path.join(folder, "qrels", f"{split}.tsv"), "w") as f:
            f.write("query-id\tcorpus-id\tscore\n")
            for q, d, s in qrels:
                f.write(f"{q}\t{d}\t{s}\n")
    return str(folder)


@pytest.fixture
def beir_folder(tmp_path):
    queries = [(q, text) for q, (text, _) in QUERIES.items()]
    return _write_beir(tmp_path / "tiny", DOCS, queries, {"test": QRELS_TEST, "dev": QRELS_DEV})


class StubEmbedder:
    """Documents are one-hot vectors; a query's vector is its row of scores, so the dot
    product of query q and document j is exactly QUERIES[q][1][j]."""

    def __init__(self, query_prefix="", doc_prefix=""):
        self.prefixes = (query_prefix, doc_prefix)
        self.seen = []
        self.vectors = {text: np.eye(5)[j] for j, text in enumerate(DOC_TEXTS)}
        self.vectors.update({text: np.asarray(scores) for text, scores in QUERIES.values()})

    def encode(self, texts, batch_size=32):
        self.seen += texts
        out = []
        for t in texts:
            for prefix in self.prefixes:
                if prefix and t.startswith(prefix):
                    t = t[len(prefix):]
            out.append(self.vectors[t])
        return np.stack(out).astype(np.float32)


def _log2(x):
    return math.log2(x)


def expected_test_metrics():
    """The four evaluated queries (q4: no grade > 0; q6: no qrels), by hand."""
    q1 = {  # relevant d3 (grade 2) at rank 3, d1 (grade 1) at rank 5
        "ndcg": (2 / _log2(4) + 1 / _log2(6)) / (2 / _log2(2) + 1 / _log2(3)),
        "mrr": 1 / 3, "r1": 0.0, "r10": 1.0, "r100": 1.0,
    }
    q2 = {"ndcg": (1 / _log2(4)) / 1.0, "mrr": 1 / 3, "r1": 0.0, "r10": 1.0, "r100": 1.0}  # d4 at rank 3
    d2 = {"ndcg": 1.0, "mrr": 1.0, "r1": 1.0, "r10": 1.0, "r100": 1.0}  # d1 at rank 1 once d2 is left out
    q5 = {  # d1 at rank 1; dX (missing) still counts in IDCG and recall
        "ndcg": 1.0 / (1.0 + 1 / _log2(3)), "mrr": 1.0, "r1": 0.5, "r10": 0.5, "r100": 0.5,
    }
    per = [q1, q2, d2, q5]
    mean = lambda key: sum(p[key] for p in per) / len(per)  # noqa: E731
    return {
        "ndcg@10": mean("ndcg"), "mrr@10": mean("mrr"),
        "recall@1": mean("r1"), "recall@10": mean("r10"), "recall@100": mean("r100"),
        "num_queries": 4, "num_docs": 5,
    }


def test_metrics_match_hand_computation(beir_folder):
    got = evaluate_beir(StubEmbedder(), beir_folder, split="test")
    expected = expected_test_metrics()
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-12), key


def test_split_and_preloaded_data(beir_folder):
    data = load_beir(beir_folder, "dev")
    assert isinstance(data, BeirData) and data.query_ids == ["q1"]
    got = evaluate_beir(StubEmbedder(), data)
    # q1 ranks d2 first and d2 is its only relevant document
    assert got["ndcg@10"] == 1.0 and got["mrr@10"] == 1.0 and got["recall@1"] == 1.0 and got["num_queries"] == 1
    with pytest.raises(FileNotFoundError, match="qrels/train.tsv"):
        load_beir(beir_folder, "train")


def test_prefixes_are_prepended(beir_folder):
    stub = StubEmbedder("query: ", "passage: ")
    got = evaluate_beir(stub, beir_folder, query_prefix="query: ", doc_prefix="passage: ")
    assert "query: first" in stub.seen and "passage: T1 one" in stub.seen and "passage: three" in stub.seen
    assert got["ndcg@10"] == pytest.approx(expected_test_metrics()["ndcg@10"], abs=1e-12)


def test_top_k_ties_and_excluded():
    s = np.array([[0.5, 0.9, 0.5, -np.inf, 0.5], [1.0, -np.inf, -np.inf, 0.0, np.nan]])
    got = top_k(s, 3)
    assert got[0].tolist() == [1, 0, 2]  # equal scores by increasing index, cut at k
    assert got[1].tolist() == [0, 3]  # -inf and nan are never returned


def test_ranking_metrics_graded_gain_is_linear():
    # one query; grades 3 and 1 at ranks 2 and 1: DCG = 1/log2(2) + 3/log2(3), IDCG = 3 + 1/log2(3)
    got = ranking_metrics([["a", "b", "c"]], [{"a": 1, "b": 3, "z": 0}], ks=(1, 2))
    assert got["ndcg@10"] == pytest.approx((1 + 3 / _log2(3)) / (3 + 1 / _log2(3)))
    assert got["mrr@10"] == 1.0 and got["recall@1"] == 0.5 and got["recall@2"] == 1.0
    with pytest.raises(ValueError):
        ranking_metrics([["a"]], [{"a": 0}])


def test_bad_folder_errors(tmp_path):
    folder = _write_beir(tmp_path / "b", DOCS, [("q1", "first")], {"test": [("qX", "d1", 1)]})
    with pytest.raises(ValueError, match="qX"):
        load_beir(folder)


# ----------------------------------------------------------------------------- real model, CLI


def _stsb_beir(folder, n=40):
    with open(os.path.join(DATA, "stsb_dev_pairs.jsonl"), encoding="utf-8") as f:
        pairs = [json.loads(next(f)) for _ in range(n)]
    docs = [(f"d{i}", "", p["response"]) for i, p in enumerate(pairs)]
    queries = [(f"q{i}", p["query"]) for i, p in enumerate(pairs)]
    qrels = [(f"q{i}", f"d{i}", 1) for i in range(n)]
    return _write_beir(folder, docs, queries, {"test": qrels})


def test_cli_end_to_end_with_minilm(minilm_path, tmp_path, capsys):
    from mmembed.model.embedder import Embedder

    folder = _stsb_beir(tmp_path / "stsb_beir")
    out = tmp_path / "metrics.json"
    assert main(["eval", "--model", minilm_path, "--beir", folder, "--split", "test", "--json", str(out)]) == 0
    metrics = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == metrics  # printed too
    for key in ("ndcg@10", "mrr@10", "recall@1", "recall@10", "recall@100"):
        assert 0.0 <= metrics[key] <= 1.0, key
    assert metrics["num_queries"] == 40 and metrics["num_docs"] == 40
    assert metrics["recall@100"] == 1.0  # 40 documents: everything is within 100
    assert metrics["ndcg@10"] > 0.8 and metrics["recall@10"] >= metrics["recall@1"]  # paraphrases are easy
    # the function the trainer calls, with an already-loaded Embedder, gives the same numbers
    again = evaluate_beir(Embedder.from_pretrained(minilm_path), folder, "test", 16)
    for key in metrics:
        assert again[key] == pytest.approx(metrics[key], abs=1e-6), key

    # --sts and --beir together: one section per task
    sts = tmp_path / "sts.jsonl"
    with open(os.path.join(DATA, "stsb_test_scored.jsonl"), encoding="utf-8") as f:
        sts.write_text("".join(next(f) for _ in range(40)))
    assert main(["eval", "--model", minilm_path, "--beir", folder, "--sts", str(sts), "--json", str(out)]) == 0
    both = json.loads(out.read_text())
    assert set(both) == {"sts", "beir"} and "spearman_cosine" in both["sts"]
    assert both["beir"]["ndcg@10"] == pytest.approx(metrics["ndcg@10"], abs=1e-6)


@pytest.mark.parametrize("with_val", [False, True], ids=["tasks-only", "with-val"])
def test_training_evaluates_beir_and_sts_as_mmembed_eval_does(minilm_path, tmp_path, with_val):
    """--eval_beir and --eval_sts during training (with or without an eval set) report the
    numbers `mmembed eval` gives for the checkpoint saved at that step."""
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.sft import run_sft

    folder = _stsb_beir(tmp_path / "stsb_beir")
    sts = tmp_path / "sts.jsonl"
    with open(os.path.join(DATA, "stsb_test_scored.jsonl"), encoding="utf-8") as f:
        sts.write_text("".join(next(f) for _ in range(40)))
    val = ["--val_dataset", os.path.join(DATA, "stsb_dev_pairs.jsonl#8")] if with_val else []
    metrics = run_sft(parse_sft_args([
        "--model", minilm_path, "--dataset", os.path.join(DATA, "stsb_train_hardneg.jsonl#8"), "--tuner_type", "full",
        "--max_steps", "2", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
        "--learning_rate", "1e-4", "--output_dir", str(tmp_path / "out"), "--report_to", "none",
        "--eval_beir", folder, "--eval_sts", str(sts), "--per_device_eval_batch_size", "16", *val]))
    assert ("eval_recall_at_1" in metrics) == with_val and ("eval_loss" in metrics) == with_val
    assert main(["eval", "--model", metrics["last_checkpoint"], "--beir", folder, "--sts", str(sts),
                 "--json", str(tmp_path / "m.json")]) == 0
    want = json.loads((tmp_path / "m.json").read_text())
    for task in ("beir", "sts"):
        for key, value in want[task].items():
            assert metrics[f"eval_{task}_{key.replace('@', '_at_')}"] == pytest.approx(value, abs=1e-5), (task, key)


def test_a_bad_eval_task_fails_before_training(minilm_path, tmp_path):
    from mmembed.data import DataError
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.sft import run_sft

    sts = tmp_path / "sts.jsonl"
    sts.write_text('{"query": "a", "response": "b", "label": 0.5}\n{"query": "c", "response": "d"}\n')
    with pytest.raises(DataError) as e:
        run_sft(parse_sft_args(["--model", minilm_path, "--dataset", os.path.join(DATA, "stsb_train_hardneg.jsonl#8"),
                                "--output_dir", str(tmp_path / "out"), "--report_to", "none", "--eval_sts", str(sts)]))
    assert (e.value.line, e.value.field) == (2, "label")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("checkpoint-*"))


def test_best_checkpoint_by_a_task_metric_is_loaded_at_the_end(minilm_path, tmp_path):
    """--metric_for_best_model on a held-out task's metric with --load_best_model_at_end: the
    checkpoint picked is the one whose logged metric is best, and the final evaluation
    (after training) repeats that checkpoint's numbers, not the last step's."""
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.sft import run_sft

    sts = tmp_path / "sts.jsonl"
    with open(os.path.join(DATA, "stsb_test_scored.jsonl"), encoding="utf-8") as f:
        sts.write_text("".join(next(f) for _ in range(40)))
    out = tmp_path / "out"
    # 3 steps at a high learning rate lower the Spearman of this model on these rows (ms-swift's
    # data order, --data_seed 42), so the best checkpoint is an early one, not the last
    metrics = run_sft(parse_sft_args([
        "--model", minilm_path, "--dataset", os.path.join(DATA, "stsb_train_hardneg.jsonl#12"), "--tuner_type", "full",
        "--max_steps", "3", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
        "--learning_rate", "2e-4", "--lr_scheduler_type", "constant", "--output_dir", str(out), "--report_to", "none",
        "--eval_sts", str(sts), "--eval_steps", "1", "--save_steps", "1", "--load_best_model_at_end", "true",
        "--metric_for_best_model", "eval_sts_spearman_cosine", "--greater_is_better", "true"]))
    history = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())["log_history"]
    logged = {h["step"]: h["eval_sts_spearman_cosine"] for h in history if "eval_sts_spearman_cosine" in h}
    assert sorted(logged) == [1, 2, 3]
    best_step = max(logged, key=logged.get)
    assert metrics["best_model_checkpoint"] == str(out / f"checkpoint-{best_step}")
    assert best_step != 3, logged  # otherwise the test would not tell loading from not loading
    assert metrics["eval_sts_spearman_cosine"] == pytest.approx(logged[best_step], abs=1e-6)
    assert metrics["eval_sts_spearman_cosine"] != pytest.approx(logged[3], abs=1e-4)
