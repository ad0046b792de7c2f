"""Bad data, as a careless user writes it: every case is an error naming file, line and field
before training starts, or with ``strict=False`` a skipped row listed with its ``file:line``.

One table row per bad file content, read in-process both ways training and users read files
(``load_samples``, the Arrow path of ``mmembed sft``, and ``read_file``); then the checks that
need more than one file (skipping, nothing left), the labels each loss declares, the
data-loader worker's error, and three runs of the real command line.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from conftest import write_video
from forked_cli import run_cli
from PIL import Image

from mmembed.data import DataError, LabelRule, Sample, load_samples, read_file
from mmembed.data.sample import Item
from mmembed.losses import EmbeddingLoss, Layout, build_loss

Q = {"query": "a man plays a flute", "response": "someone plays a flute"}


def row(**fields) -> str:
    return json.dumps({**Q, **fields})


def csv_text(*lines: str) -> str:
    return "\n".join(lines) + "\n"


CONTRASTIVE = build_loss("contrastive").label_rule
ONLINE = build_loss("online_contrastive").label_rule
COSINE = build_loss("cosine_similarity").label_rule
TEXT_ONLY = frozenset()  # the media a text model takes

# id: (file name, content, reading options, line, field, words in the message); a content of
# str is written as UTF-8 text, bytes as they are. The media files of the `media` fixture
# (dog.png, fake.mp4, fake.wav, one.mp4) lie beside the data file.
CASES = {
    # --- CSV
    "csv: unclosed quote swallows the rest": (
        "d.csv", csv_text("query,response", 'q1,"r1', "q2,r2", "q3,r3"), {}, 2, None, ["unclosed quote", "rest of file"]),
    "csv: text after a closing quote": (
        "d.csv", csv_text("query,response", '"a" b,c'), {}, 2, None, ["',' expected", 'written twice: ""']),
    "csv: negatives cell not JSON": (
        "d.csv", csv_text("query,response,rejected_response", 'q,r,"[""a"", ""b"""'), {}, 2, "rejected_response",
        ["not valid JSON"]),
    "csv: negatives cell as a Python list": (
        "d.csv", csv_text("query,response,rejected_response", "q,r,\"['a', 'b']\""), {}, 2, "rejected_response",
        ["not valid JSON", "double quotes"]),
    "csv: images cell not JSON": (
        "d.csv", csv_text("query,response,images", "<image>q,r,[dog.png"), {}, 2, "images", ["not valid JSON"]),
    "csv: more cells than columns": (
        "d.csv", csv_text("query,response", "q,r,extra"), {}, 2, None, ["3 cells", "2 columns"]),
    "csv: bytes that are not UTF-8": (
        "d.csv", b"query,response\nq,r\nq\xff,r\n", {}, 3, "query", ["not valid UTF-8", "0xff"]),
    # --- JSON and JSON Lines
    "jsonl: nested too deeply": (
        "d.jsonl", '{"query": ' + "[" * 100_000 + "]" * 100_000 + ', "response": "r"}\n', {}, 1, None,
        ["nested too deeply"]),
    "json: array element nested too deeply": (
        "d.json", "[" + row() + ",\n" + "[" * 100_000 + "]" * 100_000 + "]", {}, 2, None, ["nested too deeply"]),
    "json: a dict of rows, not a list": (
        "d.json", json.dumps({"train": [Q, Q]}), {}, 1, None, ["one JSON object", "'train'", "an array"]),
    "jsonl: a trailing comma": (
        "d.jsonl", row() + ",\n", {}, 1, None, ["Extra data", "remove the ','"]),
    "jsonl: invalid JSON on line 2": (
        "d.jsonl", row() + "\n{query: x}\n", {}, 2, None, ["invalid JSON"]),
    "jsonl: bytes that are not UTF-8": (
        "d.jsonl", (row() + "\n").encode() + b'{"query": "q\xff", "response": "r"}\n', {}, 2, None,
        ["not valid UTF-8"]),
    "jsonl: a row that is a list": (
        "d.jsonl", "[1, 2]\n", {}, 1, None, ["not a JSON object", "array"]),
    "jsonl: messages without a user turn": (
        "d.jsonl", json.dumps({"messages": [{"role": "system", "content": "be brief"}],
                               "positive_messages": [[{"role": "user", "content": "p"}]]}) + "\n",
        {}, 1, "messages", ["only system messages", "user"]),
    "jsonl: a query that is a number": (
        "d.jsonl", json.dumps({"query": 5, "response": "r"}) + "\n", {}, 1, "query", ["must be a string", "number"]),
    "jsonl: negatives that are a number": (
        "d.jsonl", row(rejected_response=3) + "\n", {}, 1, "rejected_response", ["list of strings"]),
    "jsonl: no query": (
        "d.jsonl", json.dumps({"question_text": "q", "response": "r"}) + "\n", {}, 1, "query",
        ["missing field 'query'", "'question_text'"]),
    # --- labels, against what the loss declares
    "contrastive: a label of 0.5": (
        "d.jsonl", row(label=1) + "\n" + row(label=0.5) + "\n", {"label_rule": CONTRASTIVE}, 2, "label",
        ["is 0.5", "contrastive takes 0 or 1"]),
    "online_contrastive: a label of 2": (
        "d.jsonl", row(label=2) + "\n", {"label_rule": ONLINE}, 1, "label", ["is 2", "online_contrastive takes 0 or 1"]),
    "cosine_similarity: an STS-B score of 4.2": (
        "d.jsonl", row(score=4.2) + "\n", {"label_rule": COSINE}, 1, "score", ["outside [-1, 1]", "scale 0-5"]),
    "a pair loss: no label": (
        "d.jsonl", row() + "\n", {"label_rule": COSINE}, 1, "label", ["missing", "numeric label on every row"]),
    "a label that is text": (
        "d.jsonl", row(label="high") + "\n", {"label_rule": CONTRASTIVE}, 1, "label", ["must be a number"]),
    "csv: a label that is text": (
        "d.csv", csv_text("query,response,label", "q,r,yes"), {"label_rule": CONTRASTIVE}, 2, "label", ["must be a number"]),
    # --- media
    "an image row on a text-only model": (
        "d.jsonl", row(query="<image>what is it", images=["dog.png"]) + "\n", {"media_kinds": TEXT_ONLY}, 1, "images",
        ["image input", "takes text only"]),
    "an image content part on a text-only model": (
        "d.jsonl", json.dumps({"messages": [{"role": "user", "content": [{"type": "image", "image": "dog.png"}]}],
                               "positive_messages": [[{"role": "user", "content": "a dog"}]]}) + "\n",
        {"media_kinds": TEXT_ONLY}, 1, "messages[0].content[0]", ["image input", "takes text only"]),
    "a video row on an image-only model": (
        "d.jsonl", row(query="<video>", videos=["one.mp4"]) + "\n", {"media_kinds": frozenset({"image"})}, 1, "videos",
        ["video input", "takes image"]),
    "a fake .mp4 (text bytes)": (
        "d.jsonl", row() + "\n" + row(query="<video>", videos=["fake.mp4"]) + "\n", {}, 2, "videos[0]",
        ["unreadable video", "fake.mp4"]),
    "a fake .wav": (
        "d.jsonl", row(response="<audio>", audios=["fake.wav"]) + "\n", {}, 1, "audios[0]", ["unreadable audio", "fake.wav"]),
    # --- nothing to read
    "an empty file": ("d.jsonl", "", {}, 0, None, ["no usable rows", "empty"]),
    "a file of blank lines": ("d.jsonl", "\n  \n\n", {}, 0, None, ["no usable rows", "blank lines"]),
    "an empty JSON array": ("d.json", "[]", {}, 0, None, ["no usable rows"]),
    "a CSV with a header only": ("d.csv", csv_text("query,response"), {}, 0, None, ["no usable rows"]),
}


@pytest.fixture
def media(tmp_path):
    Image.new("RGB", (8, 8), "red").save(tmp_path / "dog.png")
    (tmp_path / "fake.mp4").write_text("this is not a video")
    (tmp_path / "fake.wav").write_text("this is not audio")
    write_video(tmp_path / "one.mp4", frames=1)  # opens fine; too short to sample when a batch is built
    return tmp_path


def write(folder, name, content) -> str:
    path = os.path.join(str(folder), name)
    with open(path, "wb") as f:
        f.write(content if isinstance(content, bytes) else content.encode("utf-8"))
    return path


@pytest.mark.parametrize("name,content,options,line,field,words", CASES.values(), ids=list(CASES))
def test_bad_data_is_an_error_naming_file_line_and_field(media, name, content, options, line, field, words):
    path = write(media, name, content)
    with pytest.raises(DataError) as loaded:
        load_samples([path], cache_dir=str(media / "cache"), **options)
    errors = [loaded.value]
    if line:  # read_file reads a file without rows as no samples; load_samples refuses it
        with pytest.raises(DataError) as read:
            read_file(path, **options)
        errors.append(read.value)
    for e in errors:
        message = str(e)
        assert "\n" not in message and message.startswith(f"{path}:{line}"), message
        assert e.source == path and e.line == line and e.field == field, message
        assert all(w in message for w in words), message
    # the parse of training (a .jsonl file's plain rows read by Arrow's parser) and the general reader agree
    assert len({str(e) for e in errors}) == 1, errors


# id: (file name, content, the loss's labels, what the one sample holds): careless, yet fine as they are
ACCEPTED = {
    "jsonl with a BOM": ("d.jsonl", b"\xef\xbb\xbf" + row().encode() + b"\n", None, lambda s: s.anchor.text == Q["query"]),
    "csv with a BOM": ("d.csv", b"\xef\xbb\xbfquery,response\nq,r\n", None, lambda s: s.anchor.text == "q"),
    "negatives as one string: one negative": (
        "d.jsonl", row(rejected_response="a cat, a dog") + "\n", None,
        lambda s: [n.text for n in s.negatives] == ["a cat, a dog"]),
    "csv negatives cell of plain text: one negative": (
        "d.csv", csv_text("query,response,rejected_response", 'q,r,"a cat, a dog"'), None,
        lambda s: [n.text for n in s.negatives] == ["a cat, a dog"]),
    "a .json file holding one pretty-printed row": (
        "d.json", json.dumps(Q, indent=2), None, lambda s: s.positives[0].text == Q["response"]),
    "a label of true for contrastive": ("d.jsonl", row(label=True) + "\n", CONTRASTIVE, lambda s: s.label == 1.0),
    "a label of -0.3 for cosine_similarity": ("d.jsonl", row(label=-0.3) + "\n", COSINE, lambda s: s.label == -0.3),
    "a label on a row for infonce (unused)": ("d.jsonl", row(label=7) + "\n", None, lambda s: s.label == 7.0),
}


@pytest.mark.parametrize("name,content,rule,check", ACCEPTED.values(), ids=list(ACCEPTED))
def test_careless_but_valid_files_are_read(tmp_path, name, content, rule, check):
    path = write(tmp_path, name, content)
    [sample] = load_samples([path], cache_dir=str(tmp_path / "cache"), label_rule=rule).dataset["sample"]
    assert check(Sample.from_json(sample))


def test_strict_false_skips_each_bad_row_and_lists_it(media, caplog):
    rows = [row(label=1), row(label=0.5), row(query="<video>", videos=["fake.mp4"], label=0), "{oops",
            row(query="<image>", images=["dog.png"], label=1), row(label=0)]
    path = write(media, "d.jsonl", "\n".join(rows) + "\n")
    with caplog.at_level(logging.WARNING, logger="mmembed.data.dataset"):
        result = load_samples([path], strict=False, cache_dir=str(media / "cache"), label_rule=CONTRASTIVE,
                              media_kinds=frozenset({"video"}))
    assert len(result.dataset) == 2 and result.dataset["line"] == [1, 6]
    assert [(e.line, e.field) for e in result.skipped] == [(2, "label"), (3, "videos[0]"), (4, None), (5, "images")]
    log = caplog.text
    assert "skipped 4 bad row(s) of 6 read" in log
    assert all(f"{path}:{n}" in log for n in (2, 3, 4, 5))


def test_strict_false_with_every_row_bad_names_the_file_and_the_count(media, caplog):
    path = write(media, "d.jsonl", "\n".join([row(label=3), "{oops", row(query=7)]) + "\n")
    with caplog.at_level(logging.WARNING, logger="mmembed.data.dataset"), pytest.raises(DataError) as e:
        load_samples([path], strict=False, cache_dir=str(media / "cache"), label_rule=CONTRASTIVE)
    assert str(e.value).startswith(f"{path}:0: no usable rows, 3 skipped")
    assert all(f"{path}:{n}" in caplog.text for n in (1, 2, 3))


def test_too_few_rows_to_split_is_an_error_naming_the_file(tmp_path):
    path = write(tmp_path, "d.jsonl", row() + "\n")
    with pytest.raises(DataError, match=f"^{path}:0: 1 usable row.*leaves no training rows"):
        load_samples([path], split_ratio=0.1, cache_dir=str(tmp_path / "cache"))


# ----------------------------------------------------------------------------- what losses declare


class _PairScore(EmbeddingLoss):
    layout = Layout.PAIR

    def forward(self, outputs, labels):
        return outputs["last_hidden_state"].sum() * 0


def test_each_loss_declares_the_labels_it_takes():
    assert CONTRASTIVE.values == ONLINE.values == (0.0, 1.0) and CONTRASTIVE.required
    assert (COSINE.low, COSINE.high) == (-1.0, 1.0)
    for name in ("infonce", "gist", "distill_mse", "distill_kl"):
        options = {"use_batch": False} if name == "distill_kl" else {}
        assert build_loss(name, **options).label_rule is None, name  # group losses read no labels
    # the Matryoshka wrapper takes its inner loss's; a user's pair loss needs a number on every row
    assert build_loss("matryoshka", dims={8: 1.0}, inner="contrastive").label_rule == CONTRASTIVE
    assert _PairScore().label_rule == LabelRule("_PairScore")
    assert LabelRule("x", required=False).problem(None) is None and LabelRule("x").problem(float("nan"))


# ----------------------------------------------------------------------------- data-loader workers


def test_a_worker_hands_its_data_error_to_the_main_process(minilm_path):
    """torch rebuilds a worker's exception from its traceback text alone; the DataError comes
    through whole instead, as the batch, and the trainer raises it."""
    from transformers import AutoTokenizer

    from mmembed.encoding.collator import DATA_ERROR, EmbeddingCollator, raise_batch_error
    from mmembed.encoding.templates import get_template

    unlabeled = Sample(anchor=Item("a"), positives=[Item("b")], source="d.jsonl", line=7)
    collator = EmbeddingCollator(get_template("bert"), AutoTokenizer.from_pretrained(minilm_path), Layout.PAIR)
    loader = torch.utils.data.DataLoader([unlabeled], batch_size=1, collate_fn=collator, num_workers=1)
    [batch] = list(loader)
    assert set(batch) == {DATA_ERROR}
    with pytest.raises(DataError) as e:
        raise_batch_error(batch)
    assert (e.value.source, e.value.line, e.value.field) == ("d.jsonl", 7, "label")
    with pytest.raises(DataError):  # outside a worker the collator raises it itself
        collator([unlabeled])


# ----------------------------------------------------------------------------- the command line


def sft(model, data, out, *flags):
    """``mmembed sft``, one step; a batch holds every row of these little files."""
    return run_cli(["sft", "--model", model, "--dataset", str(data), "--output_dir", str(out), "--max_steps", "1",
                    "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--max_length", "64",
                    "--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no", *flags])


def error_line(result) -> str:
    lines = [x for x in result.stderr.splitlines() if x.startswith("mmembed sft: error:")]
    assert result.returncode == 1 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def video_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("videos")
    write_video(d / "clip.mp4", frames=4)
    write_video(d / "one.mp4", frames=1)
    (d / "fake.mp4").write_text("this is not a video")
    good = [row(query="<video>a clip", videos=["clip.mp4"]), row()]
    return d, good


def test_a_fake_video_read_with_workers_is_one_line_before_training(tiny_model, video_data, tmp_path):
    d, good = video_data
    data = write(d, "fake.jsonl", "\n".join(good + [row(query="<video>", videos=["fake.mp4"])]) + "\n")
    line = error_line(sft(tiny_model("qwen2_vl"), data, tmp_path / "out", "--dataloader_num_workers", "1"))
    assert f"{data}:3 field 'videos[0]': unreadable video {d / 'fake.mp4'}" in line
    assert not (tmp_path / "out" / "checkpoint-1").exists()


def test_strict_false_skips_corrupt_videos_before_training_under_truncation(tiny_model, video_data, tmp_path):
    """The fake video fails its header check at load; the one-frame video opens but does not
    decode. With --truncation_strategy right the media rows are still decoded at load (a row
    with media is never truncated), so both are skipped and listed before training, and the
    run trains on the rest; with --strict true the second is one line naming it, before
    training."""
    d, good = video_data
    data = write(d, "mixed.jsonl", "\n".join([row(query="<video>", videos=["fake.mp4"]), row(query="<video>", videos=["one.mp4"]),
                                              *good]) + "\n")
    r = sft(tiny_model("qwen2_vl"), data, tmp_path / "out", "--strict", "false", "--dataloader_num_workers", "1",
            "--truncation_strategy", "right", "--per_device_train_batch_size", "2", "--max_length", "2048")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "skipped 1 bad row(s) of 4 read" in r.stderr and f"{data}:1 field 'videos[0]': unreadable video" in r.stderr
    assert "skipped 1 row(s) whose media cannot be loaded or are over --max_length with them" in r.stderr
    assert f"{data}:2 field 'query videos[0]':" in r.stderr and "at least 2" in r.stderr
    strict = sft(tiny_model("qwen2_vl"), write(d, "one.jsonl", "\n".join([row(query="<video>", videos=["one.mp4"]), *good])
                                                + "\n"), tmp_path / "strict", "--truncation_strategy", "right")
    line = error_line(strict)
    assert "field 'query videos[0]':" in line and str(d / "one.mp4") in line
    assert not (tmp_path / "strict" / "checkpoint-1").exists()
    long = sft(tiny_model("qwen2_vl"), write(d, "long.jsonl", "\n".join(good) + "\n"), tmp_path / "long",
               "--truncation_strategy", "right", "--max_length", "12")
    line = error_line(long)
    assert f"{d / 'long.jsonl'}:1" in line and "tokens with its media, over --max_length 12" in line


def test_strict_false_with_every_row_bad_is_one_line(minilm_path, tmp_path):
    """Each row breaks something the run checks at load: the loss's labels, the text model's
    media, the JSON. Nothing is left: one line with the count; the log lists each row."""
    Image.new("RGB", (8, 8)).save(tmp_path / "dog.png")
    data = write(tmp_path, "d.jsonl", "\n".join([row(label=0.5), row(query="<image>", images=["dog.png"], label=1),
                                                 "{oops"]) + "\n")
    r = sft(minilm_path, data, tmp_path / "out", "--loss_type", "contrastive", "--strict", "false")
    assert error_line(r).startswith(f"mmembed sft: error: {data}:0: no usable rows, 3 skipped")
    for n, why in ((1, "field 'label': is 0.5"), (2, "field 'images': the row has image input"), (3, "invalid JSON")):
        assert f"{data}:{n} {why}" in r.stderr or f"{data}:{n}: {why}" in r.stderr, r.stderr[-3000:]
