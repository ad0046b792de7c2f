"""Data assembly for ``mmembed sft`` (mmembed/training/data_assembly.py), piece by piece and
without a run: the length check (what it drops, skips and names, and the name of its cached
result), the remote media fetched up front, and the refusal of a --dataloader_drop_last that
would drop every batch."""

from __future__ import annotations

import logging
import types

import pytest
from conftest import write_jsonl, write_video
from transformers import AutoProcessor, AutoTokenizer

from mmembed.data import DataError, load_samples
from mmembed.data.paths import MediaFileError
from mmembed.encoding.inputs import InputBuilder
from mmembed.encoding.layout import Layout
from mmembed.encoding.media import MediaBudget, MediaSettings
from mmembed.encoding.remote import DownloadSettings
from mmembed.encoding.templates import get_template
from mmembed.errors import UsageError
from mmembed.training.data_assembly import check_drop_last
from mmembed.training.length_check import drop_overlong, length_check_fingerprint
from mmembed.training.row_checks import fetch_remote_media

Q = {"query": "a man plays a flute", "response": "someone plays a flute"}


# ---- the length check -----------------------------------------------------------------------


def test_the_length_check_drops_the_rows_over_max_length_and_says_how_many(minilm_path, tmp_path, caplog):
    """--truncation_strategy delete: a row with any input over --max_length tokens (here the
    second row's long response) is dropped and counted; with left / right (``truncate``) text
    rows are not measured, to be truncated instead."""
    rows = [Q, {"query": "a long one", "response": " ".join(["word"] * 40)}, {**Q, "rejected_response": ["no flute"]}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    ds = load_samples([path], cache_dir=str(tmp_path / "cache")).dataset
    builder = InputBuilder(get_template("bert"), AutoTokenizer.from_pretrained(minilm_path), 16, truncate=False)
    with caplog.at_level(logging.WARNING, logger="mmembed"):
        kept = drop_overlong(ds, builder, Layout.GROUP, 16, 1, "train")
    assert kept["line"] == [1, 3]
    assert ("train: 1 of 3 rows are longer than --max_length 16 tokens and were deleted (--truncation_strategy delete; "
            "use left/right to truncate them instead)") in caplog.text
    assert len(drop_overlong(ds, builder, Layout.GROUP, 64, 1, "train")) == 3
    assert len(drop_overlong(ds, builder, Layout.GROUP, 16, 1, "train", truncate=True)) == 3


@pytest.mark.parametrize("num_proc", [1, 2])
def test_a_shuffled_set_is_measured_in_the_caches_order_and_keeps_its_own(minilm_path, tmp_path, num_proc):
    """A shuffled (or sampled) set is measured in the order of the cache and its numbers put
    back: the rows kept are exactly those within --max_length, in the set's own order, for one
    and two measuring processes; a row's length is its own (each row's length differs)."""
    rows = [{"query": f"row {i}", "response": " ".join(["word"] * (1 + i % 23))} for i in range(120)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    tok = AutoTokenizer.from_pretrained(minilm_path)
    builder = InputBuilder(get_template("bert"), tok, 16, truncate=False)
    ds = load_samples([f"{path}#100"], shuffle=True, seed=5, cache_dir=str(tmp_path / "cache")).dataset
    assert ds._indices is not None and ds["line"] != sorted(ds["line"])
    want = [line for line in ds["line"] if len(tok(rows[line - 1]["response"])["input_ids"]) <= 16]
    assert 0 < len(want) < len(ds)
    assert drop_overlong(ds, builder, Layout.GROUP, 16, num_proc, "train")["line"] == want


def test_the_length_check_result_is_named_by_its_settings(minilm_path, tmp_path):
    """The length check's cached result is named by the rows, tokenizer files, template,
    --max_length, layout, strictness and media budget (not by pickling the tokenizer, which took ~10 s for
    a Qwen tokenizer): the same settings find the same result, and a change of any is
    measured afresh rather than served a stale one."""
    rows = [{"query": f"short query {i}", "response": " ".join(["word"] * (10 * i + 5))} for i in range(6)]
    ds = load_samples([write_jsonl(tmp_path / "t.jsonl", rows)], cache_dir=str(tmp_path / "cache")).dataset
    tok_dir = tmp_path / "tok"
    AutoTokenizer.from_pretrained(minilm_path).save_pretrained(tok_dir)

    def builder(max_length, folder=tok_dir, template="bert", media=None):
        return InputBuilder(get_template(template), AutoTokenizer.from_pretrained(folder), max_length, truncate=False,
                            media=media)

    # a response of 10*i + 5 words is 10*i + 7 tokens here: max_length 32 keeps i <= 2, 64 keeps all
    assert len(drop_overlong(ds, builder(32), Layout.GROUP, 32, 1, "train")) == 3
    assert len(drop_overlong(ds, builder(64), Layout.GROUP, 64, 1, "train")) == 6
    assert len(drop_overlong(ds, builder(32), Layout.GROUP, 32, 1, "train")) == 3
    base = length_check_fingerprint(ds, builder(32), Layout.GROUP, True)
    assert length_check_fingerprint(ds, builder(32), Layout.GROUP, True) == base
    assert length_check_fingerprint(ds, builder(32, template="modernbert"), Layout.GROUP, True) != base
    assert length_check_fingerprint(ds, builder(64), Layout.GROUP, True) != base
    assert length_check_fingerprint(ds, builder(32, media=MediaSettings(MediaBudget(max_pixels=784))), Layout.GROUP,
                                    True) != base
    assert length_check_fingerprint(ds, builder(32), Layout.PAIR, True) != base
    assert length_check_fingerprint(ds, builder(32), Layout.GROUP, False) != base
    assert length_check_fingerprint(ds.select(range(5)), builder(32), Layout.GROUP, True) != base
    config = tok_dir / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"do_lower_case": true', '"do_lower_case": false'))
    assert length_check_fingerprint(ds, builder(32), Layout.GROUP, True) != base


def test_the_length_check_skips_rows_whose_media_fail_to_decode_with_strict_false(tiny_model, tmp_path, caplog):
    """--truncation_strategy delete (the default) measures every row with its media before
    training: a video that opens but cannot be sampled fails there, an error naming its row,
    or with --strict false a skipped row, listed."""
    write_video(tmp_path / "one.mp4", frames=1)  # opens fine; too short to sample when a batch is built
    write_video(tmp_path / "clip.mp4")
    path = write_jsonl(tmp_path / "d.jsonl", [{**Q, "query": "<video>", "videos": ["one.mp4"]},
                                              {**Q, "query": "<video>", "videos": ["clip.mp4"]}, Q])
    ds = load_samples([path], cache_dir=str(tmp_path / "cache")).dataset
    builder = InputBuilder(get_template("qwen2_gme"), AutoProcessor.from_pretrained(tiny_model("qwen2_vl")), 4096,
                           truncate=False)
    with pytest.raises(DataError, match=f"^{path}:1 field 'query videos\\[0\\]': .*at least 2.*one.mp4"):
        drop_overlong(ds, builder, Layout.GROUP, 4096, 1, "train")
    with caplog.at_level(logging.WARNING, logger="mmembed"):
        kept = drop_overlong(ds, builder, Layout.GROUP, 4096, 1, "train", strict=False)
    assert kept["line"] == [2, 3]
    assert "train: skipped 1 row(s) whose media cannot be loaded" in caplog.text and f"{path}:1 field" in caplog.text


def test_with_strict_false_a_reusing_process_reads_the_length_check_rather_than_measure_again(
        minilm_path, tmp_path, monkeypatch):
    """--strict false measures the rows afresh in each run (a skip recorded for a media file
    since mended must not drop its row for good), but the other processes of the same run
    (``reuse``: read_once's) read the result the reading process has just written: the rows
    are measured once, and every process keeps the same rows."""
    import mmembed.training.length_check as length_check

    rows = [{"query": f"query {i}", "response": " ".join(["word"] * (1 + 7 * i))} for i in range(8)]
    ds = load_samples([write_jsonl(tmp_path / "d.jsonl", rows)], cache_dir=str(tmp_path / "cache")).dataset
    builder = InputBuilder(get_template("bert"), AutoTokenizer.from_pretrained(minilm_path), 24, truncate=False)
    measured = []  # the rows measured (text rows take the JSON fast path)
    real = length_check.json_text_lengths
    monkeypatch.setattr(length_check, "json_text_lengths",
                        lambda t, c, rows, *a, **k: measured.extend(rows) or real(t, c, rows, *a, **k))

    def check(**kw):
        measured.clear()
        return drop_overlong(ds, builder, Layout.GROUP, 24, 1, "train", strict=False, **kw)["line"], len(measured)

    first, n_first = check()  # the reading process
    assert n_first == 8 and 0 < len(first) < 8
    assert check(reuse=True) == (first, 0)  # the others of the run: nothing measured again
    assert check() == (first, 8)  # a later run with --strict false measures afresh


# ---- remote media fetched up front ----------------------------------------------------------


def test_a_url_that_cannot_be_fetched_names_its_row_or_with_strict_false_skips_it(tmp_path, caplog):
    """Every URL of the rows is fetched before training with the run's download settings (here
    offline, and the URL not in the cache): the first failure is an error naming the data file,
    line and field, or with --strict false each row naming it is skipped (in train and val)
    and listed."""
    url = "http://127.0.0.1:9/never-fetched.png"
    path = write_jsonl(tmp_path / "d.jsonl", [{"query": "a red circle", "response": "<image>", "images": [url]}, Q,
                                              {**Q, "rejected_response": ["a flute"]}])
    ds = load_samples([path], cache_dir=str(tmp_path / "cache")).dataset
    offline = DownloadSettings(offline="MMEMBED_OFFLINE=1", cache=str(tmp_path / "media-cache"))
    with pytest.raises(MediaFileError, match=f"^{path}:1 field 'response images\\[0\\]': cannot download \\(offline"):
        fetch_remote_media(ds, None, downloads=offline)
    with caplog.at_level(logging.WARNING, logger="mmembed"):
        train, val = fetch_remote_media(ds, ds.select([0, 1]), strict=False, downloads=offline)
    assert (train["line"], val["line"]) == ([2, 3], [2])
    for what in ("train", "val"):
        assert f"{what}: skipped 1 row(s) whose media cannot be downloaded (--strict false):" in caplog.text
    assert f"  {path}:1 field 'response images[0]': cannot download (offline (MMEMBED_OFFLINE=1)" in caplog.text
    assert fetch_remote_media(ds.select([1, 2]), None, downloads=offline)[0]["line"] == [2, 3]  # no URL: nothing to do


# ---- --dataloader_drop_last -----------------------------------------------------------------


def test_drop_last_with_fewer_rows_than_one_batch_is_refused():
    args = types.SimpleNamespace(dataloader_drop_last=True, per_device_train_batch_size=4, world_size=2)
    data = types.SimpleNamespace(train=list(range(7)))
    with pytest.raises(UsageError, match=r"^--dataloader_drop_last true with 7 training row\(s\), fewer than one batch "
                                         r"\(8 = --per_device_train_batch_size 4 x 2 process\(es\)\)"):
        check_drop_last(args, data)
    check_drop_last(args, types.SimpleNamespace(train=list(range(8))))  # one whole batch
    check_drop_last(args, types.SimpleNamespace(train=iter(())))  # a stream: its length is unknown
    args.dataloader_drop_last = False
    check_drop_last(args, data)
