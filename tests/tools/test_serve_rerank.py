"""``mmembed serve`` with a reranker over loopback: ``POST /v1/rerank`` (and ``/v2/rerank``,
``/rerank`` with TEI's form) ranks as ``Reranker.rank`` does, its scores by default those of
sentence-transformers' ``CrossEncoder.predict`` (a sigmoid of the logit, as TEI, Cohere and Jina
report them) and with ``raw_scores: true`` the logit, honours ``top_n`` and
``return_documents``, refuses bad requests with a 400 naming the field, and the embedding and
rerank endpoints each refuse the other kind of model."""

import asyncio
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from conftest import REPO, free_port
from test_serve import ThreadServer, httpx
from transformers import AutoTokenizer

from mmembed.model.embedder import Embedder
from mmembed.task import task_of_folder
from mmembed.tasks.reranker.scorer import Reranker
from mmembed.tools.serve import ServeConfig, create_app, parse_serve_args
from mmembed.tools.serve_rerank import create_rerank_app

QUERY = "A man is playing a flute."
DOCS = ["A man plays the flute.", "Two dogs run through the snow.", "Someone is playing music.",
        "The stock market fell today.", "A woman slices an onion.", "A man is playing a flute."]


@pytest.fixture(scope="module")
def checkpoint(reranker_checkpoints):
    """A one-step full classifier reranker from all-MiniLM-L6-v2 (the session's, tests/conftest.py)."""
    return reranker_checkpoints["classifier_full"]


@pytest.fixture(scope="module")
def reranker(checkpoint):
    return Reranker.from_pretrained(checkpoint, device="cpu")


@pytest.fixture(scope="module")
def server(reranker, checkpoint):
    config = ServeConfig(model=checkpoint, served_model_name="rr", max_inputs=8, max_wait_ms=5)
    with ThreadServer(create_rerank_app(reranker, config)) as s:
        yield s


def _post(server, body, path="/v1/rerank"):
    return httpx.post(server.url + path, json=body, timeout=60)


def test_the_checkpoint_is_served_as_a_reranker(checkpoint, minilm_path):
    assert task_of_folder(checkpoint).name == "reranker"
    assert task_of_folder(minilm_path).name == "embedding"
    assert task_of_folder(minilm_path, "generative_reranker").name == "generative_reranker"
    assert parse_serve_args(["--model", checkpoint, "--task_type", "reranker"]).task_type == "reranker"


@pytest.mark.parametrize("path", ["/v1/rerank", "/v2/rerank", "/rerank"])
def test_results_equal_reranker_rank(server, reranker, checkpoint, path):
    want = reranker.rank(QUERY, DOCS)
    r = _post(server, {"model": "rr", "query": QUERY, "documents": DOCS}, path)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "rr" and body["id"].startswith("rerank-")
    got = body["results"]
    assert [x["index"] for x in got] == [i for i, _ in want]
    np.testing.assert_allclose([x["relevance_score"] for x in got], [s for _, s in want], atol=1e-4)
    scores = [x["relevance_score"] for x in got]
    assert scores == sorted(scores, reverse=True)
    assert [x["document"]["text"] for x in got] == [DOCS[i] for i, _ in want]  # returned by default
    # usage: the tokens of every pair as the model saw them ([CLS] query [SEP] doc [SEP])
    tok = AutoTokenizer.from_pretrained(checkpoint)
    tokens = sum(len(tok(QUERY, d)["input_ids"]) for d in DOCS)
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] == tokens


def test_top_n_return_documents_objects_and_raw_scores(server, reranker, checkpoint):
    want = reranker.rank(QUERY, DOCS, top_n=3)
    body = _post(server, {"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 3,
                          "return_documents": False}).json()  # no "model": fine (TEI, Jina send none)
    assert [x["index"] for x in body["results"]] == [i for i, _ in want]
    assert all(set(x) == {"index", "relevance_score"} for x in body["results"])
    for top_n in (0, None, 100):  # all of them
        assert len(_post(server, {"query": QUERY, "documents": DOCS, "top_n": top_n}).json()["results"]) == len(DOCS)
    from sentence_transformers import CrossEncoder

    cross_encoder = CrossEncoder(checkpoint, device="cpu")
    pairs = [(QUERY, d) for d in DOCS]
    logits = cross_encoder.predict(pairs, activation_fn=torch.nn.Identity())
    order = list(np.argsort(-logits, kind="stable"))
    # the default (raw_scores absent or false): CrossEncoder.predict's, the sigmoid of the logit
    predicted = cross_encoder.predict(pairs)
    for extra in ({}, {"raw_scores": False}):
        prob = _post(server, {"query": QUERY, "documents": DOCS, **extra}).json()["results"]
        assert [x["index"] for x in prob] == order
        np.testing.assert_allclose([x["relevance_score"] for x in prob], predicted[order], atol=1e-5)
    # raw_scores true (TEI's name): the logit, CrossEncoder.predict without its activation
    raw = _post(server, {"query": QUERY, "documents": DOCS, "raw_scores": True}).json()["results"]
    assert [x["index"] for x in raw] == order
    np.testing.assert_allclose([x["relevance_score"] for x in raw], logits[order], atol=1e-5)
    want = reranker.rank(QUERY, DOCS, raw_scores=True)
    np.testing.assert_allclose([x["relevance_score"] for x in raw], [s for _, s in want], atol=1e-5)
    assert np.ptp(logits) > 1e-4  # the documents score differently: a real comparison
    assert not np.allclose([x["relevance_score"] for x in raw], [x["relevance_score"] for x in prob], atol=1e-3)


def test_tei_form_gets_tei_answer(server, reranker):
    want = reranker.rank(QUERY, DOCS)
    got = _post(server, {"query": QUERY, "texts": DOCS}, "/rerank").json()  # TEI's default: sigmoid scores
    assert isinstance(got, list) and [x["index"] for x in got] == [i for i, _ in want]
    assert all(set(x) == {"index", "score"} for x in got)
    np.testing.assert_allclose([x["score"] for x in got], [s for _, s in want], atol=1e-5)
    raw = _post(server, {"query": QUERY, "texts": DOCS, "raw_scores": True}, "/rerank").json()
    want_raw = reranker.rank(QUERY, DOCS, raw_scores=True)
    assert [x["index"] for x in raw] == [i for i, _ in want_raw]
    np.testing.assert_allclose([x["score"] for x in raw], [s for _, s in want_raw], atol=1e-4)
    with_text = _post(server, {"query": QUERY, "texts": DOCS, "return_text": True}, "/rerank").json()
    assert [x["text"] for x in with_text] == [DOCS[i] for i, _ in want]
    # texts at /v1/rerank: an alias of documents, answered in the object shape
    body = _post(server, {"query": QUERY, "texts": DOCS}).json()
    assert [x["index"] for x in body["results"]] == [i for i, _ in want]


def test_concurrent_requests_are_batched_and_each_ranked_alone(server, reranker):
    queries = [f"{QUERY} number {i}" if i % 2 else f"dogs in the snow {i}" for i in range(12)]
    before = httpx.get(server.url + "/health").json()

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            calls = [client.post(server.url + "/v1/rerank", json={"query": q, "documents": DOCS[:4]}) for q in queries]
            return await asyncio.gather(*calls)

    for q, r in zip(queries, asyncio.run(main())):
        want = reranker.rank(q, DOCS[:4])
        got = r.json()["results"]
        assert [x["index"] for x in got] == [i for i, _ in want], q
        np.testing.assert_allclose([x["relevance_score"] for x in got], [s for _, s in want], atol=1e-4)
    after = httpx.get(server.url + "/health").json()
    assert after["requests"] - before["requests"] == 12 and after["task_type"] == "reranker"
    assert after["batches"] - before["batches"] < 12 and after["largest_batch"] > 4


BAD = {
    "wrong model": ({"model": "gpt-4", "query": "q", "documents": ["a"]}, 404, "model"),
    "no query": ({"documents": ["a"]}, 400, "query"),
    "empty query": ({"query": "", "documents": ["a"]}, 400, "query"),
    "query not text": ({"query": 5, "documents": ["a"]}, 400, "query"),
    "no documents": ({"query": "q"}, 400, "documents"),
    "documents not a list": ({"query": "q", "documents": "a"}, 400, "documents"),
    "empty documents": ({"query": "q", "documents": []}, 400, "documents"),
    "too many documents": ({"query": "q", "documents": ["a"] * 9}, 400, "documents"),
    "document not text": ({"query": "q", "documents": ["a", 3]}, 400, "documents[1]"),
    "document object without text": ({"query": "q", "documents": ["a", {"title": "x"}]}, 400, "documents[1].text"),
    "document with an image": ({"query": "q", "documents": [{"text": "a", "image": "x.png"}]}, 400,
                               "documents[0].image"),
    "both documents and texts": ({"query": "q", "documents": ["a"], "texts": ["b"]}, 400, "texts"),
    "negative top_n": ({"query": "q", "documents": ["a"], "top_n": -1}, 400, "top_n"),
    "top_n not an integer": ({"query": "q", "documents": ["a"], "top_n": "2"}, 400, "top_n"),
    "return_documents not a bool": ({"query": "q", "documents": ["a"], "return_documents": "yes"}, 400,
                                    "return_documents"),
    "raw_scores not a bool": ({"query": "q", "documents": ["a"], "raw_scores": 1}, 400, "raw_scores"),
    "body not an object": ([1, 2], 400, None),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_request_names_the_field_and_server_keeps_serving(server, reranker, name):
    body, status, param = BAD[name]
    r = _post(server, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    ok = _post(server, {"query": QUERY, "documents": DOCS[:2]}).json()
    assert [x["index"] for x in ok["results"]] == [i for i, _ in reranker.rank(QUERY, DOCS[:2])]


def test_not_json_and_long_pairs(server, reranker):
    r = httpx.post(server.url + "/v1/rerank", content=b"{oops", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    long = ["word " * 400, "a flute"]  # over max_length: truncated as in training, not refused
    got = _post(server, {"query": QUERY, "documents": long}).json()["results"]
    np.testing.assert_allclose(sorted(x["relevance_score"] for x in got), sorted(reranker.score(QUERY, long)), atol=1e-4)


def test_each_kind_of_model_refuses_the_other_endpoint(server, minilm_path):
    r = httpx.post(server.url + "/v1/embeddings", json={"model": "rr", "input": "a"})
    assert r.status_code == 400 and "reranker" in r.json()["error"]["message"]
    assert "/v1/rerank" in r.json()["error"]["message"]
    embedder = Embedder.from_pretrained(minilm_path, device="cpu")
    with ThreadServer(create_app(embedder, ServeConfig(model=minilm_path, served_model_name="m"))) as emb_server:
        for path in ("/v1/rerank", "/rerank"):
            r = httpx.post(emb_server.url + path, json={"query": "q", "documents": ["a"]})
            assert r.status_code == 400 and "embedding model" in r.json()["error"]["message"], r.text


def test_mmembed_serve_command_serves_the_checkpoint_as_a_reranker(checkpoint, reranker):
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "mmembed.tools.cli", "serve", "--model", checkpoint,
                             "--port", str(port), "--device", "cpu"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "mmembed serve did not come up"
            time.sleep(0.2)
        name = os.path.basename(os.path.normpath(checkpoint))
        body = httpx.post(url + "/v1/rerank", json={"model": name, "query": QUERY, "documents": DOCS, "top_n": 2},
                          timeout=60).json()
        want = reranker.rank(QUERY, DOCS, top_n=2)
        assert [x["index"] for x in body["results"]] == [i for i, _ in want]
        np.testing.assert_allclose([x["relevance_score"] for x in body["results"]], [s for _, s in want], atol=1e-4)
    finally:
        proc.terminate()
        proc.wait(30)
