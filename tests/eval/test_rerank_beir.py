"""A reranker's --eval_beir: BM25's first `depth` candidates of the whole corpus, reordered by the
reranker's scores; the metrics of both orders against the same candidates reordered here by
hand, and a reranker run that logs them."""

import json
import os

import bm25s
import numpy as np
import pytest

from mmembed.eval.beir import load_beir
from mmembed.eval.ranking import ranking_metrics
from mmembed.eval.rerank_beir import rerank_beir

DOCS = [(f"d{i}", "", text) for i, text in enumerate([
    "a man plays a flute on the stage", "the cat sleeps on the warm mat", "stocks fell sharply on monday",
    "a woman plays the violin", "two dogs run through the snow", "the flute is a woodwind instrument",
    "markets rallied after the report", "a kitten naps in the sun", "music from a wooden flute", "snow covers the dogs"])]
QUERIES = [("q0", "who plays the flute"), ("q1", "a cat sleeping"), ("q2", "dogs in snow"), ("q3", "stock markets")]
QRELS = [("q0", "d0", 1), ("q0", "d8", 2), ("q1", "d1", 1), ("q1", "d7", 1), ("q2", "d4", 2), ("q2", "d9", 1),
         ("q3", "d2", 1), ("q3", "d6", 1)]


@pytest.fixture
def beir(tmp_path):
    folder = tmp_path / "beir"
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"_id": i, "title": t, "text": x}) + "\n" for i, t, x in DOCS))
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": i, "text": x}) + "\n" for i, x in QUERIES))
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(f"{q}\t{d}\t{s}\n" for q, d, s in QRELS))
    return str(folder)


def _bm25_orders(data, depth):
    """BM25's order of every query, from bm25s directly (the same defaults), cut at `depth`."""
    tokenize = lambda texts: bm25s.tokenize(list(texts), stopwords="en", return_ids=False, show_progress=False)  # noqa: E731
    index = bm25s.BM25()
    index.index(tokenize(data.doc_texts), show_progress=False)
    orders = []
    for tokens in tokenize(data.query_texts):
        ids = index.get_tokens_ids(tokens)
        scores = index.get_scores_from_ids(ids) if ids else np.zeros(len(data.doc_texts))
        orders.append([int(j) for j in np.argsort(-scores, kind="stable")[:depth]])
    return orders


@pytest.mark.parametrize("depth", [3, 100])
def test_bm25s_candidates_reordered_by_the_reranker_give_both_metrics(beir, depth):
    data = load_beir(beir)
    orders = _bm25_orders(data, depth)
    relevance = [data.qrels[q] for q in data.query_ids]
    # a reranker that knows the grades: each query's relevant candidates first, by grade
    grade = {(data.query_texts[i], data.doc_texts[j]): relevance[i].get(data.doc_ids[j], 0.0)
             for i in range(len(orders)) for j in range(len(data.doc_ids))}
    calls = []

    def oracle(pairs):
        calls.append(list(pairs))
        return np.array([grade[(q, d)] for q, d in pairs])

    got = rerank_beir(oracle, data, depth=depth)
    assert len(calls[0]) == sum(len(o) for o in orders)  # every candidate scored once, in one call
    ids = lambda rows: [[data.doc_ids[j] for j in row] for row in rows]  # noqa: E731
    by_grade = [sorted(o, key=lambda j, i=i: -relevance[i].get(data.doc_ids[j], 0.0)) for i, o in enumerate(orders)]
    after = ranking_metrics(ids(by_grade), relevance, ks=(10,))
    before = ranking_metrics(ids(orders), relevance, ks=(10,))
    for k in after:
        assert got[k] == pytest.approx(after[k]) and got[f"{k}_bm25"] == pytest.approx(before[k]), k
    assert got["num_queries"] == len(QUERIES)
    if depth == 100:
        assert got["ndcg@10"] == pytest.approx(1.0)  # every relevant document is a candidate


def test_an_embedding_first_stage_gives_its_own_candidates(beir):
    """With a dense first stage the candidates are its top `depth` (here: vectors that put the
    relevant documents of each query last), and its metrics are suffixed `_embedder`."""
    from mmembed.eval.first_stage import dense_scorer

    data = load_beir(beir)
    relevance = [data.qrels[q] for q in data.query_ids]
    queries = np.eye(len(data.query_ids), len(data.query_ids) + 1)
    docs = np.zeros((len(data.doc_ids), len(data.query_ids) + 1))
    for i, rel in enumerate(relevance):
        for j, d in enumerate(data.doc_ids):
            docs[j, i] = -1.0 if rel.get(d, 0) > 0 else 0.0  # relevant documents last for that query
    got = rerank_beir(lambda pairs: np.zeros(len(pairs)), data, depth=4, first_stage=dense_scorer(queries, docs),
                      first_stage_name="embedder")
    assert got["ndcg@10_embedder"] == 0.0 == got["ndcg@10"]  # 4 candidates, none relevant; ties keep its order
    assert "ndcg@10_bm25" not in got


@pytest.mark.parametrize("first_stage", [None, "minilm"])
def test_a_reranker_run_logs_the_beir_metrics_before_and_after(minilm_path, beir, tmp_path, first_stage):
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.sft import run_sft

    rows = tmp_path / "train.jsonl"
    rows.write_text("".join(json.dumps({"query": q, "response": DOCS[i][2], "rejected_response": [DOCS[i + 1][2]]}) + "\n"
                            for i, (_, q) in enumerate(QUERIES)))
    out = run_sft(parse_sft_args(["--model", minilm_path, "--task_type", "reranker", "--tuner_type", "full",
                                  "--dataset", str(rows), "--eval_beir", beir, "--max_steps", "1", "--save_steps", "1",
                                  "--per_device_train_batch_size", "2", "--output_dir", str(tmp_path / "out"),
                                  "--report_to", "none", "--disable_tqdm", "true", "--dataloader_num_workers", "0",
                                  *(["--eval_beir_first_stage", minilm_path] if first_stage else [])]))
    suffix = "embedder" if first_stage else "bm25"
    for name in ("eval_beir_ndcg_at_10", "eval_beir_mrr_at_10", "eval_beir_recall_at_10", f"eval_beir_ndcg_at_10_{suffix}"):
        assert np.isfinite(out[name]) and 0 <= out[name] <= 1, name
    state = json.load(open(os.path.join(out["last_checkpoint"], "trainer_state.json")))
    assert any("eval_beir_ndcg_at_10" in entry for entry in state["log_history"])
