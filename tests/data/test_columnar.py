"""The plain rows of a .jsonl file read by Arrow's JSON parser (mmembed/data/columnar.py)
against the general reader (json.loads and parse_row, one row at a time): the same Arrow rows
(sample JSON, source, line, error with its file:line:field message), in order, for both row
forms, every bad-row case, rows the parser reads differently from json.loads, and random rows
of both forms; strict or not, with a label rule, with several positives."""

from __future__ import annotations

import json
import os
import random

import pytest
from conftest import write_jsonl
from PIL import Image

from mmembed.data import arrow_rows, dataset
from mmembed.data.columnar import plain_samples
from mmembed.data.formats import jsonl_lines
from mmembed.data.labels import LabelRule
from mmembed.losses import build_loss

CONTRASTIVE = build_loss("contrastive").label_rule.as_dict()


def _user(text):
    return [{"role": "user", "content": text}]


Q = {"query": "a man plays a flute", "response": "someone plays a flute", "rejected_response": ["a cat", "a dog"]}
M = {"messages": _user("a man plays a flute"), "positive_messages": [_user("someone plays a flute")],
     "negative_messages": [_user("a cat"), _user("a dog")]}


def _options(tmp_path, **options) -> dict:
    return dict({"strict": False, "verify_images": True, "version": "", "work_dir": str(tmp_path)}, **options)


def general(path: str, **options) -> list[dict]:
    """The Arrow rows of the general reader (one row at a time: what the parse wrote before)."""
    return list(arrow_rows._generate([(path, 0, 0, 0, 1)], **options))


def arrow(path: str, **options) -> list[dict]:
    """The Arrow rows the parse writes now (blocks, the plain rows read by Arrow's parser)."""
    rows = []
    for block in arrow_rows._generate_blocks([(path, 0, 0, 0, 1)], **options):
        columns = {k: v.to_pylist() if hasattr(v, "to_pylist") else list(v) for k, v in block.items()}
        rows += [dict(zip(columns, values)) for values in zip(*columns.values())]
    return rows


def assert_same(path: str, tmp_path, **options) -> list[dict]:
    options = _options(tmp_path, **options)
    expected = general(path, **options)
    assert arrow(path, **options) == expected
    return expected


def plain_lines(path: str, **options) -> list[int]:
    """The lines Arrow's path read itself (not handed to the general reader)."""
    lines = [row for rows in jsonl_lines(path) for row in rows]
    got = plain_samples(path, lines, **options).to_pylist()
    return [line for (line, _), text in zip(lines, got) if text is not None]


@pytest.fixture
def media(tmp_path):
    Image.new("RGB", (8, 8), "red").save(tmp_path / "dog.png")
    return tmp_path


def test_plain_rows_of_both_forms_are_read_by_arrow_as_the_general_reader_reads_them(tmp_path):
    rows = ['{"qu\\u0065ry": "escaped key", "response": "b", "": 1}',
            '{"query": "a", "response": "b", "label": 9007199254740993}',
            '{"query": "a", "response": "b", "label": 100000000000000000000000000000000000000000000000001}',
            '{"query": "a", "response": "b", "label": 1E-2}', '{"query": "a", "response": "b", "label": 4.9e-324}',
            '{"query": "a", "response": "b", "label": 0.1000000000000000055511151231257827}',
            Q, M, dict(Q, label=1), dict(M, label=0.25), dict(Q, system="Be brief."), dict(M, system="Be brief."),
            {"query": "q", "response": "p"}, {"messages": _user("q"), "positive_messages": [_user("p")]},
            dict(Q, rejected_response=[]), dict(M, negative_messages=[]), dict(Q, images=[], videos=[]),
            dict(M, images=[], positive_images=[[]], negative_images=[[], None]),
            {"query": 'quotes " and \\ and \n\t\u0001 and naïve ☃', "response": "p\u2028"},
            {"messages": [{"role": "system", "content": "Sys"}, {"role": "User", "content": "q"},
                          {"role": "assistant", "content": ""}, {"role": "gpt", "content": "two"}],
             "positive_messages": [[{"role": "human", "content": "p"}, {"role": "system", "content": ""}]],
             "negative_messages": [[{"role": "bot", "content": "n"}]]},
            dict(Q, id=7, meta={"k": [1, 2]}), dict(M, id=8, meta={"k": [3]}),
            dict(M, messages=[{"role": "user", "content": "q", "name": "x"}])]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    expected = assert_same(path, tmp_path)
    assert all(r["error"] is None for r in expected)
    assert plain_lines(path) == list(range(1, len(rows) + 1))


# rows Arrow's parser reads (the block is read) but the general reader must read: bad rows of
# both forms, media, aliases, ... each between two plain rows; each gives the general reader's row
ARROW_READ = {
    # --- the messages form's bad rows (tests/data/test_reader.py's BROKEN, test_bad_data.py's CASES)
    "only system messages": {"messages": [{"role": "system", "content": "be brief"}], "positive_messages": [_user("p")]},
    "missing positive_messages": {"messages": _user("a")},
    "empty messages group": {"messages": _user(""), "positive_messages": [_user("b")]},
    "blank with unicode spaces": {"messages": _user("\u3000\x1c\xa0 "), "positive_messages": [_user("b")]},
    "an empty group": {"messages": [], "positive_messages": [_user("b")]},
    "an empty positive group": dict(M, positive_messages=[[]]),
    "no positive group": dict(M, positive_messages=[]),
    "two positives": dict(M, positive_messages=[_user("b"), _user("c")]),
    "unknown role": {"messages": [{"role": "tool", "content": "a"}], "positive_messages": [_user("b")]},
    "unknown role in a negative": dict(M, negative_messages=[[{"role": "narrator", "content": "c"}]]),
    "no role": dict(M, negative_messages=[[{"content": "c"}]]),
    "no content": dict(M, negative_messages=[[{"role": "user"}]]),
    "from / value": dict(M, negative_messages=[[{"from": "user", "value": "c"}]]),
    "a null message": dict(M, negative_messages=[[None]]),
    "a null group": dict(M, negative_messages=[None]),
    "tags vs paths (negative)": dict(M, negative_messages=[_user("c"), _user("<image><image>")],
                                     negative_images=[[], ["dog.png"]]),
    "anchor tags vs paths": {"messages": _user("<image>"), "positive_messages": [_user("b")]},
    "outer lengths differ": dict(M, positive_messages=[_user("<image>")], positive_images=[["dog.png"], ["dog.png"]]),
    "a media list of the wrong length": dict(M, negative_images=[[]]),
    "a tag in a system message": {"messages": [{"role": "system", "content": "<image>"}, *_user("a")],
                                  "positive_messages": [_user("b")]},
    "system twice": dict(M, system="s", messages=[{"role": "system", "content": "t"}, *_user("a")]),
    "query with messages": dict(M, query="q"),
    "rejected_response with positive_messages": dict(M, rejected_response=["n"]),
    "conversations alias": {"conversations": _user("a"), "positive_messages": [_user("b")]},
    "legacy messages row": {"messages": [*_user("a"), {"role": "assistant", "content": "b"}], "rejected_response": ["n"]},
    "an image row": dict(M, messages=_user("<image>a dog"), images=["dog.png"]),
    "a missing image": dict(M, messages=_user("<image>a dog"), images=["nowhere.png"]),
    "teacher scores": dict(M, teacher_scores=[0.9, 0.1, 0.2]),
    "teacher embeddings": dict(Q, teacher_embeddings=[[0.5, 0.5]] * 4),
    "teacher_ in a text": dict(Q, query='say "teacher_scores"'),  # (to the general reader too: the same row)
    "a label that is not finite": dict(M, label=float("nan")),
    "a label of 0.5 for contrastive": dict(M, label=0.5),
    "a label of -0 (the integer 0 to json.loads)": '{"query": "a", "response": "b", "label": -0}',
    "a label of -0.0": '{"query": "a", "response": "b", "label": -0.0}',
    # --- the query form's
    "missing response": {"query": "a", "rejected_response": ["n"]},
    "empty negative": dict(Q, rejected_response=["x", ""]),
    "a null negative": dict(Q, rejected_response=["x", None]),
    "empty text, no media": {"query": "a", "response": "  "},
    "a tag and its image": dict(Q, query="<image>", images=["dog.png"]),
    "more tags than paths": {"query": "<image>", "response": "<image>", "images": ["dog.png"]},
    "paths without tags": dict(Q, videos=["clip.mp4"]),
    "mixed forms": dict(Q, positive_messages=[_user("b")]),
    "a media list of the messages form": dict(Q, positive_images=[]),
    "anchor alias": {"anchor": "a", "positive": "b"},
    "numbered negatives": {"query": "a", "response": "b", "negative_1": "n"},
    "system_prompt": dict(Q, system_prompt="s"),
    "image alias": dict(Q, image=[]),
    "a value nested deeply": dict(Q, extra=json.loads("[" * 40 + "]" * 40)),
}


@pytest.mark.parametrize("name", list(ARROW_READ), ids=list(ARROW_READ))
@pytest.mark.parametrize("rule", [None, CONTRASTIVE], ids=["infonce", "contrastive"])
def test_a_row_arrow_reads_but_hands_to_the_general_reader(media, name, rule):
    good = [dict(M, label=1), dict(Q, label=0)]
    path = write_jsonl(media / "d.jsonl", [good[0], ARROW_READ[name], good[1]])
    expected = assert_same(path, media, label_rule=rule)
    assert [r["line"] for r in expected] == [1, 2, 3]
    plain = [1, 2, 3] if name == "a label of 0.5 for contrastive" and rule is None else [1, 3]  # infonce takes it
    assert plain_lines(path, label_rule=LabelRule.from_dict(rule) if rule else None) == plain
    for strict in (True, False):  # strict: the rows up to the first bad one
        assert_same(path, media, strict=strict, label_rule=rule)


# lines Arrow's parser does not read as json.loads reads them (or at all): the block goes to the
# general reader whole, which gives its rows and errors
NOT_ARROW = {
    "invalid JSON": "{query: x}",
    "a trailing comma": json.dumps(Q) + ",",
    "two values on a line": json.dumps(Q) + " " + json.dumps(Q),
    "a carriage return between values": json.dumps(Q) + "\r" + json.dumps(Q),
    "not an object": "[1, 2]",
    "a number": "5",
    "duplicate keys": '{"query": "a", "query": "b", "response": "r"}',
    "a label that is true": json.dumps(dict(Q, label=True)),
    "a label that is text": json.dumps(dict(Q, label="high")),
    "NaN": '{"query": "a", "response": "b", "label": NaN}',
    "Infinity": '{"query": "a", "response": "b", "label": -Infinity}',
    "a label too large": '{"query": "a", "response": "b", "label": 1e400}',
    "content as parts": json.dumps(dict(M, messages=[{"role": "user", "content": [{"type": "text", "text": "a"}]}])),
    "content a number": json.dumps(dict(M, messages=[{"role": "user", "content": 5}])),
    "positive_messages without the outer list": json.dumps(dict(M, positive_messages=_user("b"))),
    "negatives as one string": json.dumps(dict(Q, rejected_response="one negative")),
    "images as one string": json.dumps(dict(Q, query="<image>", images="dog.png")),
    "a lone surrogate": '{"query": "a\\ud800", "response": "b"}',
    "a control character": '{"query": "a\tb", "response": "b"}',
    "nested too deeply": '{"query": "a", "response": "b", "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "not UTF-8": b'{"query": "q\xff", "response": "r"}',
    "a field of two types": json.dumps(dict(Q, id="seven")),
    "a BOM on a later line": "\ufeff" + json.dumps(Q),
    "a key twice, once escaped": '{"query": "a", "qu\\u0065ry": "b", "response": "r"}',
    "a vertical tab between values": '{"query": "a",\x0b"response": "b"}',
}


@pytest.mark.parametrize("name", list(NOT_ARROW), ids=list(NOT_ARROW))
def test_a_line_arrow_does_not_read_as_json_loads_sends_the_block_to_the_general_reader(media, name):
    line = NOT_ARROW[name]
    path = str(media / "d.jsonl")
    with open(path, "wb") as f:
        for row in (json.dumps(dict(Q, id=1)).encode(), line if isinstance(line, bytes) else line.encode("utf-8"),
                    json.dumps(M).encode()):
            f.write(row + b"\n")
    for strict in (False, True):
        assert_same(path, media, strict=strict)


def test_lines_blank_lines_a_bom_and_crlf_keep_their_numbers(tmp_path):
    path = str(tmp_path / "d.jsonl")
    with open(path, "wb") as f:
        f.write(b"\xef\xbb\xbf" + json.dumps(Q).encode() + b"\r\n\r\n   \n" + json.dumps(M).encode() + b"\r\n\n"
                + b"\t" + json.dumps(Q).encode())  # the last line without a newline
    expected = assert_same(path, tmp_path)
    assert [r["line"] for r in expected] == [1, 4, 6] and all(r["error"] is None for r in expected)
    assert plain_lines(path) == [1, 4, 6]


def test_the_parse_gives_the_general_readers_rows_across_blocks_and_processes(tmp_path, monkeypatch):
    """Thousands of rows in several blocks (bad rows in some), parsed whole by load_samples in 1
    and 2 processes: the rows, lines and skipped rows of the general reader."""
    from mmembed.data.dataset import load_samples

    rows = [random_row(random.Random(k)) for k in range(6000)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    expected = assert_same(path, tmp_path)
    monkeypatch.setattr(arrow_rows, "_TABLE_ROWS", 500)
    assert_same(path, tmp_path)
    good = [r for r in expected if r["error"] is None]
    bad = [r for r in expected if r["error"] is not None]
    assert len(good) > 3000 and len(bad) > 100
    one = load_samples(path, strict=False, cache_dir=str(tmp_path / "c1"), num_proc=1)
    monkeypatch.setattr(dataset, "_MIN_SHARD_BYTES", 1 << 16)
    two = load_samples(path, strict=False, cache_dir=str(tmp_path / "c2"), num_proc=2)
    for result in (one, two):
        assert result.dataset["sample"] == [r["sample"] for r in good]
        assert result.dataset["line"] == [r["line"] for r in good]
        assert [e.line for e in result.skipped] == [r["line"] for r in bad]


def test_random_rows_of_both_forms_give_the_general_readers_rows(tmp_path):
    for seed in range(6):
        rng = random.Random(seed)
        rows = [random_row(rng) for _ in range(400)]
        rule = CONTRASTIVE if seed % 3 == 2 else None
        for row in rows if rule else []:  # a pair loss's rows: most with a label it takes
            if rng.random() < 0.9:
                row["label"] = rng.choice([0, 1, 1.0])  # (true: the block is not read by Arrow, see NOT_ARROW)
        path = write_jsonl(tmp_path / f"d{seed}.jsonl", rows)
        for several in (False, True):
            expected = assert_same(path, tmp_path, label_rule=rule, several_positives=several)
            plain = plain_lines(path, label_rule=LabelRule.from_dict(rule) if rule else None, several_positives=several)
            assert len(plain) > 150, len(plain)  # most rows read by Arrow (not all: bad ones, tags, ...)
            assert set(plain) <= {r["line"] for r in expected if r["error"] is None}


_TEXTS = ["a man plays a flute", "", " ", "\u3000", "\x1c", "x\x1f", "<image>", "a <video> b", "a < b", "<imag>",
          'say "hi"', "back\\slash", "tab\there", "new\nline", "\u0000nul", "naïve ☃ 😀", "\u2028", "  padded  ",
          "<audio>x"]


def _text(rng):
    return rng.choice(_TEXTS) if rng.random() < 0.3 else f"text {rng.randrange(10**6)}"


def _message(rng):
    if rng.random() < 0.02:
        return rng.choice([None, {"content": "no role"}, {"role": "user"}, {"role": None, "content": "x"}])
    role = rng.choice(["user"] * 8 + ["assistant", "system", "User", "HUMAN", "gpt", "bot", "tool"])
    return {"role": role, "content": _text(rng)}


def _group(rng):
    if rng.random() < 0.8:
        return [{"role": "user", "content": _text(rng)}]
    return [_message(rng) for _ in range(rng.randrange(0, 4))]


def random_row(rng) -> dict:
    """A row of either form, usually plain, now and then with one of the things that make it
    bad or send it to the general reader."""
    row: dict = {}
    if rng.random() < 0.5:
        row["query"], row["response"] = _text(rng), _text(rng)
        if rng.random() < 0.8:
            row["rejected_response"] = [_text(rng) for _ in range(rng.randrange(0, 5))]
    else:
        row["messages"] = _group(rng)
        row["positive_messages"] = [_group(rng) for _ in range(1 if rng.random() < 0.9 else rng.randrange(0, 3))]
        if rng.random() < 0.8:
            row["negative_messages"] = [_group(rng) for _ in range(rng.randrange(0, 5))]
        if rng.random() < 0.1:
            row["negative_images"] = [[] for _ in row.get("negative_messages", [])]
    if rng.random() < 0.3:
        row["label"] = rng.choice([0, 1, 0.5, -0.25, 1e-7, 123456789, 0.1 + 0.2, 1 / 3, -0.0, None])
    if rng.random() < 0.1:
        row["system"] = rng.choice(["Be brief.", "", "<image>", None])
    if rng.random() < 0.05:
        row["images"] = rng.choice([[], None])
    if rng.random() < 0.05:
        row["id"] = rng.randrange(100)
    return row


def test_a_reranker_run_reads_several_positive_groups_by_arrow(tmp_path):
    row = dict(M, positive_messages=[_user("b"), _user("c")])
    path = write_jsonl(tmp_path / "d.jsonl", [row, M])
    assert_same(path, tmp_path, several_positives=True)
    assert plain_lines(path, several_positives=True) == [1, 2]
    assert plain_lines(path) == [2]


def test_renamed_columns_and_other_formats_take_the_general_reader(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text1": "a", "text2": "b"}, Q])
    assert_same(path, tmp_path, columns={"text1": "query", "text2": "response"})
    json_path = str(tmp_path / "d.json")
    with open(json_path, "w") as f:
        json.dump([Q, M], f)
    assert_same(json_path, tmp_path)
    assert os.path.exists(json_path)


def test_a_deep_value_is_measured_outside_strings(tmp_path):
    from mmembed.data.columnar import _MANY_OPENINGS, _nests_deeply

    deep = _MANY_OPENINGS + 1
    assert _nests_deeply(json.dumps({"x": json.loads("[" * deep + "]" * deep)}).encode())
    assert not _nests_deeply(json.dumps({"x": json.loads("[" * (deep - 2) + "]" * (deep - 2))}).encode())
    many = dict(M, negative_messages=[_user(f"n{k}") for k in range(300)])  # wide, not deep
    assert not _nests_deeply(json.dumps(many).encode())
    brackets = {"query": "[" * 400 + '\\" {' * 100, "response": "]" * 400, "x": json.loads("[" * 20 + "]" * 20)}
    assert not _nests_deeply(json.dumps(brackets).encode())
    path = write_jsonl(tmp_path / "d.jsonl", [many, brackets, Q])
    assert_same(path, tmp_path)
    assert plain_lines(path) == [1, 2, 3]
