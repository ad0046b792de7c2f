"""Hard-negative mining (mmembed.tools.mining, `mmembed mine`): the specification as tests.

Most cases use hand-made rows whose answers are known: BM25 rankings are checked against
bm25s scores computed here, and the filters run on a stub embedder whose cosines are set
by hand. The last test mines STS-B rows with the real all-MiniLM-L6-v2.
"""

import json
import math
import os
import shutil

import numpy as np
import pytest
from conftest import DATA

from mmembed.data import DataError, read_file
from mmembed.data.sample import Item
from mmembed.tools.cli import main
from mmembed.tools.mining import MiningConfig, mine_file, mine_rows

BM25_ROWS = [
    {"query": "cat sat on the mat", "response": "a cat is sitting on a mat"},
    {"query": "dog chases the ball", "response": "the dog runs after a red ball"},
    {"query": "cat chases a mouse", "response": "a cat hunting a mouse in the grass"},
    {"query": "children play ball in the park", "response": "kids playing with a ball in a park"},
    {"query": "a mat for yoga", "response": "yoga mat on the floor"},
    {"query": "mouse and keyboard", "response": "a computer mouse next to a keyboard"},
    {"query": "red ball on grass", "response": "a red ball lying in the grass"},
]


def _rows(raw_rows):
    return [(i + 1, dict(r)) for i, r in enumerate(raw_rows)]


def _bm25_reference(queries, docs):
    """bm25s with the settings mmembed documents: default BM25, English stopwords removed."""
    import bm25s

    index = bm25s.BM25()
    index.index(bm25s.tokenize(docs, stopwords="en", return_ids=False, show_progress=False), show_progress=False)
    out = []
    for tokens in bm25s.tokenize(queries, stopwords="en", return_ids=False, show_progress=False):
        out.append(np.asarray(index.get_scores(tokens), dtype=np.float64) if tokens else np.zeros(len(docs)))
    return out


def _expected_ranking(scores, excluded):
    """Candidates with score > 0, best first, ties by document index."""
    cand = [i for i in range(len(scores)) if scores[i] > 0 and i not in excluded]
    return sorted(cand, key=lambda i: (-scores[i], i))


def _mine(raw_rows, tmp_path=None, **kwargs):
    cfg_keys = set(MiningConfig.__dataclass_fields__)
    cfg = MiningConfig(**{k: v for k, v in kwargs.items() if k in cfg_keys})
    other = {k: v for k, v in kwargs.items() if k not in cfg_keys}
    return mine_rows(_rows(raw_rows), "test.jsonl", str(tmp_path or os.getcwd()), config=cfg, **other)


# ----------------------------------------------------------------------------- BM25


def test_bm25_ranking_matches_bm25s_scores():
    out, stats = _mine(BM25_ROWS, num_negatives=100, range_max=100)
    docs = [r["response"] for r in BM25_ROWS]  # all distinct: the corpus, in order
    scores = _bm25_reference([r["query"] for r in BM25_ROWS], docs)
    assert stats.corpus_size == len(docs) and stats.mined_rows == len(BM25_ROWS)
    for i, row in enumerate(out):
        expected = [docs[j] for j in _expected_ranking(scores[i], {i})]
        assert row["rejected_response"] == expected, row["query"]
    # checked by eye: "cat chases a mouse" shares only 'cat' with doc 0 and 'mouse' with doc 5
    assert set(out[2]["rejected_response"]) == {docs[0], docs[5]}


def test_rank_window_and_k():
    docs = [r["response"] for r in BM25_ROWS]
    scores = _bm25_reference([r["query"] for r in BM25_ROWS], docs)
    full = [[docs[j] for j in _expected_ranking(scores[i], {i})] for i in range(len(BM25_ROWS))]
    out, _ = _mine(BM25_ROWS, num_negatives=100, range_min=1, range_max=3)
    for row, ranking in zip(out, full):
        assert row["rejected_response"] == ranking[1:3]
    out, stats = _mine(BM25_ROWS, num_negatives=1, range_min=0, range_max=100)
    for row, ranking in zip(out, full):
        assert row["rejected_response"] == ranking[:1]
    assert sum(stats.histogram.values()) == len(BM25_ROWS)
    assert all(k <= 1 for k in stats.histogram)


def test_own_positives_and_query_copies_are_never_picked():
    rows = [
        {"query": "a cat on a mat", "response": "a cat sitting on a mat"},
        {"query": "a cat on a mat", "response": "a cat lying on the mat"},  # same query, second positive
        {"query": "cat mat", "response": "a cat on a mat"},  # this response is the first rows' query
        {"query": "cats", "response": "a mat with a cat and a dog"},
    ]
    out, _ = _mine(rows, num_negatives=10)
    for row in out[:2]:
        picked = row["rejected_response"]
        assert "a cat sitting on a mat" not in picked and "a cat lying on the mat" not in picked
        assert "a cat on a mat" not in picked  # equal to the query
        assert picked == ["a mat with a cat and a dog"]
    assert "a cat on a mat" not in out[2]["rejected_response"]


def test_no_shared_term_no_candidate():
    rows = [{"query": "zebra", "response": "a striped zebra"}, {"query": "a lion", "response": "the lion sleeps"}]
    out, stats = _mine(rows)
    assert out[0]["rejected_response"] == [] and out[1]["rejected_response"] == []
    assert stats.histogram == {0: 2}


def test_deterministic(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in BM25_ROWS))
    mine_file(str(src), str(tmp_path / "a.jsonl"), config=MiningConfig(num_negatives=2))
    mine_file(str(src), str(tmp_path / "b.jsonl"), config=MiningConfig(num_negatives=2))
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()


# ----------------------------------------------------------------------------- filters (stub scores)


class StubEmbedder:
    """``encode`` looks each text (and its images) up in a table of unit vectors."""

    def __init__(self, table, media=()):
        self.table = {k: np.asarray(v, dtype=np.float32) / np.linalg.norm(v) for k, v in table.items()}
        self.template = type("T", (), {"media": {k: "" for k in media}})()
        self.calls = []

    def encode(self, inputs, batch_size=32):
        keys = [(x.text, tuple(os.path.basename(p) for p in x.images)) if isinstance(x, Item) else (x, ()) for x in inputs]
        self.calls.append(keys)
        return np.stack([self.table[k if k[1] else k[0]] for k in keys])


def _unit(c):
    """A 2-d unit vector whose cosine with (1, 0) is ``c``."""
    return [c, math.sqrt(1.0 - c * c)]


# query q: positive at cosine 0.8; candidates c1..c4 at 0.9, 0.75, 0.6, 0.3
PRIMARY = {"q": [1.0, 0.0], "p": _unit(0.8), "c1": _unit(0.9), "c2": _unit(0.75), "c3": _unit(0.6), "c4": _unit(0.3)}
# guide: positive at 0.5; candidates at 0.5, 0.25, 0.75, 0.0
GUIDE = {"q": [1.0, 0.0], "p": _unit(0.5), "c1": _unit(0.5), "c2": _unit(0.25), "c3": _unit(0.75), "c4": _unit(0.0)}
ONE_ROW = [{"query": "q", "response": "p"}]
CANDIDATES = ["c1", "c2", "c3", "c4"]


def test_dense_ranking_without_filters():
    out, stats = _mine(ONE_ROW, embedder=StubEmbedder(PRIMARY), extra_docs=CANDIDATES, num_negatives=10)
    assert out[0]["rejected_response"] == ["c1", "c2", "c3", "c4"]
    assert stats.dropped == 0 and stats.corpus_size == 5


@pytest.mark.parametrize(
    "options, expected, dropped",
    [
        # absolute: drop s > 0.8 - 0.1 = 0.7, i.e. c1 (0.9) and c2 (0.75)
        ({"margin": 0.1}, ["c3", "c4"], 2),
        # absolute 0: drop what scores above the positive: c1
        ({"margin": 0.0}, ["c2", "c3", "c4"], 1),
        # relative: drop s > 0.8 * (1 - 0.05) = 0.76, i.e. c1 only
        ({"relative_margin": 0.05}, ["c2", "c3", "c4"], 1),
        # relative: drop s > 0.8 * 0.7 = 0.56: c1, c2, c3
        ({"relative_margin": 0.3}, ["c4"], 3),
    ],
)
def test_margin_filter_drops_exactly_the_expected(options, expected, dropped):
    out, stats = _mine(ONE_ROW, embedder=StubEmbedder(PRIMARY), extra_docs=CANDIDATES, num_negatives=10, **options)
    assert out[0]["rejected_response"] == expected
    assert stats.dropped_margin == dropped and stats.dropped_guide == 0


def test_margin_counts_only_examined_candidates():
    # K=1: c1 is dropped, c2 dropped, c3 taken; c4 is never looked at
    out, stats = _mine(ONE_ROW, embedder=StubEmbedder(PRIMARY), extra_docs=CANDIDATES, num_negatives=1, margin=0.1)
    assert out[0]["rejected_response"] == ["c3"] and stats.dropped_margin == 2


def test_guide_filter():
    # drop g(q, c) >= g(q, p) - 0 = 0.5: c1 (0.5, equal) and c3 (0.75)
    guide = StubEmbedder(GUIDE)
    out, stats = _mine(ONE_ROW, embedder=StubEmbedder(PRIMARY), guide=guide, extra_docs=CANDIDATES, num_negatives=10)
    assert out[0]["rejected_response"] == ["c2", "c4"]
    assert stats.dropped_guide == 2 and stats.dropped_margin == 0
    # guide_margin 0.3: drop g >= 0.2: c1, c2, c3
    out, stats = _mine(ONE_ROW, embedder=StubEmbedder(PRIMARY), guide=StubEmbedder(GUIDE), extra_docs=CANDIDATES,
                       num_negatives=10, guide_margin=0.3)
    assert out[0]["rejected_response"] == ["c4"] and stats.dropped_guide == 3
    # with BM25 as the miner the guide filters the same way
    rows = [{"query": "query word", "response": "positive word"}]
    table = {"query word": [1.0, 0.0], "positive word": _unit(0.5), "alpha word": _unit(0.5), "beta word": _unit(0.25)}
    out, stats = _mine(rows, guide=StubEmbedder(table), extra_docs=["alpha word", "beta word"], num_negatives=10)
    assert out[0]["rejected_response"] == ["beta word"] and stats.dropped_guide == 1


def test_margin_and_guide_together():
    # margin 0.1 drops c1, c2; the guide (threshold 0.5) then looks at c3 (0.75: drop), c4 (keep)
    out, stats = _mine(ONE_ROW, embedder=StubEmbedder(PRIMARY), guide=StubEmbedder(GUIDE), extra_docs=CANDIDATES,
                       num_negatives=10, margin=0.1)
    assert out[0]["rejected_response"] == ["c4"]
    assert (stats.dropped_margin, stats.dropped_guide, stats.dropped) == (2, 1, 3)


# ----------------------------------------------------------------------------- row forms


def test_query_form_keeps_existing_negatives_first_or_overwrites():
    rows = [dict(BM25_ROWS[0], rejected_response=["a lonely negative"], system="sys", extra="kept"), *BM25_ROWS[1:]]
    out, _ = _mine(rows, num_negatives=2)
    assert out[0]["rejected_response"][0] == "a lonely negative" and len(out[0]["rejected_response"]) == 3
    assert out[0]["system"] == "sys" and out[0]["extra"] == "kept"
    assert rows[0]["rejected_response"] == ["a lonely negative"]  # the input is not modified
    out, _ = _mine(rows, num_negatives=2, overwrite=True)
    assert "a lonely negative" not in out[0]["rejected_response"] and len(out[0]["rejected_response"]) == 2


def test_query_form_aliases_and_numbered_negatives():
    rows = [
        {"anchor": BM25_ROWS[0]["query"], "positive": BM25_ROWS[0]["response"], "negative_1": "first old"},
        dict(BM25_ROWS[1], negatives="one old"),
        *BM25_ROWS[2:],
    ]
    out, _ = _mine(rows, num_negatives=2)
    assert out[0]["negative_1"] == "first old" and "negative_2" in out[0] and "rejected_response" not in out[0]
    assert out[1]["negatives"][0] == "one old" and len(out[1]["negatives"]) == 3
    out, _ = _mine(rows, num_negatives=1, overwrite=True)
    assert out[0]["negative_1"] != "first old" and "negative_2" not in out[0]


def test_messages_form_groups(tmp_path):
    rows = [
        {
            "messages": [{"role": "user", "content": r["query"]}],
            "positive_messages": [[{"role": "system", "content": "Represent the passage."},
                                   {"role": "user", "content": r["response"]}]],
        }
        for r in BM25_ROWS
    ]
    rows[0]["negative_messages"] = [[{"role": "user", "content": "an old negative"}]]
    src = tmp_path / "msgs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stats = mine_file(str(src), str(tmp_path / "out.jsonl"), config=MiningConfig(num_negatives=2))
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert stats.mined_rows == len(rows)
    first = out[0]["negative_messages"]
    assert first[0] == [{"role": "user", "content": "an old negative"}] and len(first) == 3
    assert first[1][0] == {"role": "system", "content": "Represent the passage."}  # rendered like the positive
    assert "rejected_response" not in out[0] and "negative_images" not in out[0]
    samples = read_file(str(tmp_path / "out.jsonl"))
    docs = [r["response"] for r in BM25_ROWS]
    scores = _bm25_reference([r["query"] for r in BM25_ROWS], docs)
    for i, s in enumerate(samples):
        mined = [n.text for n in s.negatives[1 if i == 0 else 0:]]
        assert mined == [docs[j] for j in _expected_ranking(scores[i], {i})][:2]
        assert all(n.system == "Represent the passage." for n in s.negatives[1 if i == 0 else 0:])


def test_legacy_messages_rows_use_rejected_response(tmp_path):
    rows = [{"messages": [{"role": "user", "content": r["query"]}, {"role": "assistant", "content": r["response"]}]}
            for r in BM25_ROWS]
    out, _ = _mine(rows, num_negatives=1)
    assert all(len(r["rejected_response"]) == 1 and "negative_messages" not in r for r in out)


# ----------------------------------------------------------------------------- media rows


@pytest.fixture
def mm_dir(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    for name in ("red_circle", "red_square", "blue_circle", "blue_square", "green_circle"):
        shutil.copy(os.path.join(DATA, "mm", f"{name}.png"), d / f"{name}.png")
    return d


# captions and images on a circle of angles: a caption is near its own image and its neighbours
_ANGLES = {"red_circle": 0.0, "red_square": 0.3, "blue_circle": 0.7, "blue_square": 1.2, "green_circle": 1.8}


def _mm_table():
    table = {}
    for name, a in _ANGLES.items():
        table[name.replace("_", " ")] = [math.cos(a), math.sin(a)]
        table[("<image>", (f"{name}.png",))] = [math.cos(a + 0.01), math.sin(a + 0.01)]
    return table


def test_media_rows_query_and_messages_forms(mm_dir, tmp_path):
    rows = [
        {"query": "red circle", "response": "<image>", "images": ["red_circle.png"]},
        {"query": "red square", "response": "<image>", "images": ["red_square.png"], "rejected_response": ["<image>"]},
        {"messages": [{"role": "user", "content": "blue circle"}],
         "positive_messages": [[{"role": "user", "content": "<image>"}]], "positive_images": [["blue_circle.png"]],
         "negative_messages": [[{"role": "user", "content": "a text negative"}]]},
        {"messages": [{"role": "user", "content": "blue square"}],
         "positive_messages": [[{"role": "user", "content": [{"type": "image", "image": "blue_square.png"}]}]]},
        {"query": "green circle", "response": "<image>", "images": ["green_circle.png"]},
    ]
    rows[1]["images"] = ["red_square.png", "green_circle.png"]  # the existing negative's image comes last
    src = mm_dir / "mm.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out_path = tmp_path / "out" / "mined.jsonl"  # another folder: media paths must be rewritten relative to it
    out_path.parent.mkdir()
    import mmembed.tools.mining as mining

    stats = mining.mine_file(str(src), str(out_path), model=StubEmbedder(_mm_table(), media=("image",)),
                             config=MiningConfig(num_negatives=2))
    assert stats.mined_rows == 5
    out = [json.loads(line) for line in out_path.read_text().splitlines()]
    samples = read_file(str(out_path))  # tags and paths still bind
    name = lambda p: os.path.basename(p)[: -len(".png")]  # noqa: E731
    # red circle: nearest other images are red_square (0.3), blue_circle (0.7)
    assert out[0]["rejected_response"] == ["<image>", "<image>"]
    assert out[0]["images"] == ["../data/red_circle.png", "../data/red_square.png", "../data/blue_circle.png"]
    assert [name(n.images[0]) for n in samples[0].negatives] == ["red_square", "blue_circle"]
    # red square: its existing negative (green_circle) is kept first and not picked again
    assert [name(n.images[0]) for n in samples[1].negatives] == ["green_circle", "red_circle", "blue_circle"]
    # messages form: negative_images aligned with the groups ([] for the text group)
    assert len(out[2]["negative_images"]) == len(out[2]["negative_messages"]) == 3 and out[2]["negative_images"][0] == []
    assert [name(n.images[0]) for n in samples[2].negatives[1:]] == ["red_square", "blue_square"]
    assert samples[2].negatives[0].text == "a text negative"
    # a positive written with a content part is found as a document too (its path rebased as well)
    assert out[3]["positive_messages"][0][0]["content"][0]["image"] == "../data/blue_square.png"
    assert [name(n.images[0]) for n in samples[3].negatives] == ["blue_circle", "green_circle"]
    for s in samples:
        assert all(n.images != s.positives[0].images for n in s.negatives)

    # the same rows under BM25 (text only): copied unchanged and reported
    stats = mining.mine_file(str(src), str(mm_dir / "bm25.jsonl"))
    assert stats.mined_rows == 0 and sum(len(v) for v in stats.copied.values()) == 5
    assert "media" in stats.summary()
    assert [json.loads(x) for x in (mm_dir / "bm25.jsonl").read_text().splitlines()] == rows


def test_overwrite_removes_old_negative_media(mm_dir):
    rows = [
        {"query": "red square", "response": "<image>", "rejected_response": ["<image>"],
         "images": ["red_square.png", "green_circle.png"]},
        {"query": "red circle", "response": "<image>", "images": ["red_circle.png"]},
        {"query": "blue circle", "response": "<image>", "images": ["blue_circle.png"]},
    ]
    out, _ = mine_rows(_rows(rows), "t.jsonl", str(mm_dir), embedder=StubEmbedder(_mm_table(), media=("image",)),
                       config=MiningConfig(num_negatives=1, overwrite=True), media_root=str(mm_dir))
    assert out[0]["rejected_response"] == ["<image>"]
    assert out[0]["images"] == ["red_square.png", "red_circle.png"]


def test_pair_rows_with_labels_are_copied():
    rows = [dict(r, label=0.4 if i == 0 else 1.0) for i, r in enumerate(BM25_ROWS)]
    out, stats = _mine(rows)
    assert out[0] == rows[0] and stats.mined_rows == len(rows) - 1
    assert any("label" in reason for reason in stats.copied)


# ----------------------------------------------------------------------------- files and CLI


def test_corpus_file_and_cli(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in BM25_ROWS))
    corpus = tmp_path / "extra.txt"
    corpus.write_text("a zebra eats grass\n\nthe grass is green\n")
    code = main(["mine", "--dataset", str(src), "--output", str(tmp_path / "o.jsonl"), "--corpus", str(corpus),
                 "--num_negatives", "5"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "negatives per row" in printed and "dropped as likely false negatives" in printed
    out = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    grass = out[6]["rejected_response"]  # "red ball on grass"
    assert "a zebra eats grass" in grass and "the grass is green" in grass
    assert len(read_file(str(tmp_path / "o.jsonl"))) == len(BM25_ROWS)
    corpus_jsonl = tmp_path / "extra.jsonl"
    corpus_jsonl.write_text(json.dumps({"_id": "1", "title": "", "text": "grass grows"}) + "\n")
    assert main(["mine", "--dataset", str(src), "--output", str(tmp_path / "o.json"), "--corpus", str(corpus_jsonl),
                 "--num_negatives", "5"]) == 0
    assert any("grass grows" in r["rejected_response"] for r in json.loads((tmp_path / "o.json").read_text()))


def test_bad_input_leaves_no_output(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps(BM25_ROWS[0]) + "\n" + json.dumps({"query": "no response"}) + "\n")
    out = tmp_path / "out.jsonl"
    with pytest.raises(DataError, match="bad.jsonl:2"):
        mine_file(str(src), str(out))
    assert not out.exists()


def test_failed_write_keeps_previous_output(tmp_path):
    from mmembed.tools.mined_rows import write_rows

    out = tmp_path / "out.jsonl"
    out.write_text("previous\n")
    with pytest.raises(TypeError):
        write_rows([{"ok": 1}, {"bad": object()}], str(out))  # fails half way through
    assert out.read_text() == "previous\n"
    assert os.listdir(tmp_path) == ["out.jsonl"]  # no temporary file left behind


def test_config_is_checked(capsys):
    for bad in ({"num_negatives": 0}, {"range_min": 5, "range_max": 5}, {"relative_margin": 1.0}):
        with pytest.raises(ValueError):
            MiningConfig(**bad).validate()
    # checked before any work: one line, exit status 2
    assert main(["mine", "--dataset", os.path.join(DATA, "stsb_dev_pairs.jsonl"), "--output", "out.csv"]) == 2
    assert capsys.readouterr().err.startswith("mmembed mine: error: --output 'out.csv': mining writes .jsonl")


# ----------------------------------------------------------------------------- real model


def test_dense_mining_with_minilm(minilm_path, tmp_path):
    from mmembed.model.embedder import Embedder

    src = tmp_path / "stsb50.jsonl"
    with open(os.path.join(DATA, "stsb_train_pairs.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(next(f)) for _ in range(50)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out_path = tmp_path / "mined.jsonl"
    margin = 0.05
    code = main(["mine", "--dataset", str(src), "--output", str(out_path), "--model", minilm_path,
                 "--num_negatives", "3", "--range_min", "0", "--range_max", "20", "--margin", str(margin)])
    assert code == 0
    samples = read_file(str(out_path))
    assert len(samples) == 50
    embedder = Embedder.from_pretrained(minilm_path)
    n_neg = 0
    for s in samples:
        negatives = [n.text for n in s.negatives]
        assert s.positives[0].text not in negatives
        assert s.anchor.text not in negatives
        assert len(negatives) <= 3 and len(set(negatives)) == len(negatives)
        if not negatives:
            continue
        emb = embedder.encode([s.anchor.text, s.positives[0].text, *negatives])
        pos = float(emb[0] @ emb[1])
        neg = emb[2:] @ emb[0]
        assert np.all(neg < pos - margin + 1e-5), (s.anchor.text, pos, neg.tolist())
        n_neg += len(negatives)
    assert n_neg >= 100  # most rows get their 3
