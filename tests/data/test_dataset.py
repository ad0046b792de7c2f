"""Dataset specs, Arrow loading, strict / non-strict, #N sampling, caching and splitting."""

from __future__ import annotations

import json
import logging
import os

import pytest
from conftest import write_jsonl
from PIL import Image

from mmembed.data import (
    DataError,
    EmbeddingDataset,
    HubDataset,
    Sample,
    SpecError,
    load_samples,
    parse_spec,
    split_dataset,
)


def qrows(n, prefix="q"):
    return [{"query": f"{prefix}{i}", "response": f"r{i}", "rejected_response": [f"n{i}"] * (i % 3)} for i in range(n)]


def anchors(ds):
    return [Sample.from_json(s).anchor.text for s in ds["sample"]]


@pytest.fixture
def cache(tmp_path):
    return str(tmp_path / "hf_cache")


# ----------------------------------------------------------------------------- specs


def test_parse_spec_path_and_sample_count(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", qrows(2))
    assert parse_spec(path) == (path, None)
    assert parse_spec(path + "#5") == (path, 5)
    assert parse_spec(str(tmp_path)) == (str(tmp_path), None)


def test_parse_spec_prefers_an_existing_path_with_hash_in_its_name(tmp_path):
    path = write_jsonl(tmp_path / "d#3.jsonl", qrows(1))
    assert parse_spec(path) == (path, None)


@pytest.mark.parametrize("spec, target, n", [
    ("AI-ModelScope/LLaVA-Pretrain", HubDataset("AI-ModelScope/LLaVA-Pretrain"), None),
    ("hf::org/name#100", HubDataset("org/name", (), "hf"), 100),
    ("org/name:subset", HubDataset("org/name", ("subset",)), None),
])
def test_hub_ids_parse_as_hub_datasets(spec, target, n):
    """(tests/data/test_hub.py loads them.)"""
    assert parse_spec(spec) == (target, n)


@pytest.mark.parametrize("spec", ["missing.jsonl", "data/missing.jsonl#10", "./org/name"])
def test_missing_local_files_are_not_taken_for_hub_ids(spec):
    with pytest.raises(SpecError, match="not found"):
        parse_spec(spec)


def test_sample_count_must_be_positive(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", qrows(2))
    with pytest.raises(SpecError, match="positive"):
        parse_spec(path + "#0")


# ----------------------------------------------------------------------------- loading


def test_remote_marks_the_rows_whose_media_name_a_url(tmp_path, cache):
    """The ``remote`` column (what the remote media phase decodes) is set by a media reference
    holding a URL, not by a text that mentions one."""
    Image.new("RGB", (8, 8)).save(tmp_path / "dog.png")
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"query": "see https://example.com/a", "response": "http://b.org said so"},
        {"query": "<image>", "images": ["https://example.com/dog.png"], "response": "a dog"},
        {"query": "<image>", "images": ["dog.png"], "response": "a dog", "rejected_response": ["ftp://x y"]},
        {"query": "q", "response": "<image>", "images": ["http://example.com/d.png"]},
    ])
    assert load_samples([path], cache_dir=cache).dataset["remote"] == [False, True, False, True]


def test_load_samples_columns_and_torch_dataset(tmp_path, cache):
    Image.new("RGB", (8, 8)).save(tmp_path / "dog.png")
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [{"query": "<image>", "response": "A dog on grass", "images": ["dog.png"], "rejected_response": ["A cat"]}]
        + qrows(3),
    )
    result = load_samples([path], cache_dir=cache)
    ds = result.dataset
    assert ds.column_names == ["sample", "source", "line", "remote", "row"]
    assert len(ds) == 4 and ds["line"] == [1, 2, 3, 4] and set(ds["source"]) == {path}
    assert result.skipped == [] and result.report() == ""
    assert ds["remote"] == [False] * 4
    torch_ds = EmbeddingDataset(ds)
    assert len(torch_ds) == 4
    first = torch_ds[0]
    assert isinstance(first, Sample)
    assert first.anchor.images == [str(tmp_path / "dog.png")] and first.negatives[0].text == "A cat"
    assert [len(torch_ds[i].negatives) for i in range(1, 4)] == [0, 1, 2]


def test_stored_json_is_exactly_the_dataclass_as_json(tmp_path):
    import dataclasses

    from mmembed.data.reader import read_file

    Image.new("RGB", (8, 8)).save(tmp_path / "dog.png")
    row = {"system": "s", "query": "<image>", "response": "r", "images": ["dog.png"], "negatives": ["n"], "label": 1}
    [sample] = read_file(write_jsonl(tmp_path / "d.jsonl", [row]))
    assert sample.to_json() == json.dumps(dataclasses.asdict(sample), ensure_ascii=False)


@pytest.mark.parametrize("num_proc", [1, 2])
def test_strict_raises_the_data_error_itself(tmp_path, cache, num_proc):
    rows = qrows(5) + [{"query": "x", "response": "y", "label": "not a number"}] + qrows(5, "z")
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError) as e:
        load_samples([path], cache_dir=cache, num_proc=num_proc)
    assert type(e.value) is DataError
    assert (e.value.source, e.value.line, e.value.field) == (path, 6, "label")


def test_non_strict_skips_and_reports_every_bad_line(tmp_path, cache, caplog):
    rows = (
        qrows(2)
        + ["{broken", {"query": "a"}]
        + qrows(1, "k")
        + [{"query": "b", "response": "c", "images": ["gone.png"]}]
    )
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with caplog.at_level(logging.WARNING):
        result = load_samples([path], strict=False, cache_dir=cache)
    assert anchors(result.dataset) == ["q0", "q1", "k0"]
    assert result.dataset["line"] == [1, 2, 5]
    assert [(e.line, e.field) for e in result.skipped] == [(3, None), (4, "response"), (6, "images")]
    assert result.rows_read == 6
    report = result.report()
    assert report.startswith("skipped 3 bad row(s) of 6 read")
    for line in (3, 4, 6):
        assert f"d.jsonl:{line}" in report
    assert "d.jsonl:6 field 'images'" in caplog.text
    short = result.report(limit=1)
    assert "d.jsonl:3" in short and "2 more in " + path + ", lines 4, 6" in short


def test_num_proc_keeps_order_and_line_numbers(tmp_path, cache):
    rows = []
    for i in range(200):
        rows.append({"query": f"q{i}", "response": "r"})
        if i % 7 == 0:
            rows.append("")
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    one = load_samples([path], cache_dir=cache, num_proc=1).dataset
    four = load_samples([path], cache_dir=cache, num_proc=4).dataset
    assert anchors(four) == anchors(one) == [f"q{i}" for i in range(200)]
    assert four["line"] == one["line"]
    lines = open(path).read().split("\n")
    assert all(json.loads(lines[n - 1])["query"] == f"q{i}" for i, n in enumerate(one["line"]))


def test_specs_concatenate_in_order_and_folders_read_sorted_files(tmp_path, cache):
    folder = tmp_path / "folder"
    write_jsonl(folder / "b.jsonl", qrows(2, "b"))
    write_jsonl(folder / "a.jsonl", qrows(1, "a"))
    (folder / "nested").mkdir()
    (folder / "nested" / "c.json").write_text(json.dumps(qrows(1, "c")))
    (folder / "notes.txt").write_text("ignored")
    (folder / "x.csv").write_text("query,response\nx0,r\n")
    first = write_jsonl(tmp_path / "first.jsonl", qrows(1, "f"))
    ds = load_samples([first, str(folder)], cache_dir=cache).dataset
    assert anchors(ds) == ["f0", "a0", "b0", "b1", "c0", "x0"]


def test_empty_folder_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecError, match="no data files"):
        load_samples([str(tmp_path / "empty")])


def test_json_array_and_csv_files_load(tmp_path, cache):
    (tmp_path / "d.json").write_text(json.dumps(qrows(3), indent=2))
    (tmp_path / "d.csv").write_text('query,response,rejected_response\nq,r,"[""n1"", ""n2""]"\n')
    ds = load_samples([str(tmp_path / "d.json"), str(tmp_path / "d.csv")], cache_dir=cache).dataset
    samples = [Sample.from_json(s) for s in ds["sample"]]
    assert [s.anchor.text for s in samples] == ["q0", "q1", "q2", "q"]
    assert [n.text for n in samples[3].negatives] == ["n1", "n2"]


# ----------------------------------------------------------------------------- #N sampling


def test_sampling_count_is_deterministic_and_without_replacement(tmp_path, cache):
    path = write_jsonl(tmp_path / "d.jsonl", qrows(20))
    a = anchors(load_samples([path + "#8"], cache_dir=cache, seed=1, shuffle=True).dataset)
    b = anchors(load_samples([path + "#8"], cache_dir=cache, seed=1, shuffle=True).dataset)
    c = anchors(load_samples([path + "#8"], cache_dir=cache, seed=2, shuffle=True).dataset)
    assert len(a) == 8 and len(set(a)) == 8
    assert a == b and a != c
    # without shuffle (ms-swift's --dataset_shuffle false) #N takes the first N rows
    assert anchors(load_samples([path + "#8"], cache_dir=cache, seed=1).dataset) == [f"q{i}" for i in range(8)]


def test_sampling_beyond_the_rows_repeats_them(tmp_path, cache):
    path = write_jsonl(tmp_path / "d.jsonl", qrows(4))
    got = anchors(load_samples([path + "#10"], cache_dir=cache).dataset)
    assert len(got) == 10
    assert got[:8] == ["q0", "q1", "q2", "q3"] * 2  # every row twice, then 2 random distinct rows
    assert len(set(got[8:])) == 2


def test_sampling_applies_per_spec(tmp_path, cache):
    a = write_jsonl(tmp_path / "a.jsonl", qrows(10, "a"))
    b = write_jsonl(tmp_path / "b.jsonl", qrows(3, "b"))
    got = anchors(load_samples([a + "#2", b], cache_dir=cache).dataset)
    assert len(got) == 5 and all(x.startswith("a") for x in got[:2]) and got[2:] == ["b0", "b1", "b2"]


# ----------------------------------------------------------------------------- caching


def test_editing_a_file_after_loading_gives_the_new_content(tmp_path, cache):
    path = write_jsonl(tmp_path / "d.jsonl", qrows(2))
    assert anchors(load_samples([path], cache_dir=cache).dataset) == ["q0", "q1"]
    write_jsonl(path, [{"query": "edited", "response": "r"}])
    assert anchors(load_samples([path], cache_dir=cache).dataset) == ["edited"]
    again = load_samples([path], cache_dir=cache, load_from_cache_file=False).dataset
    assert anchors(again) == ["edited"]


def test_unchanged_file_is_served_from_cache(tmp_path, cache):
    path = write_jsonl(tmp_path / "d.jsonl", qrows(3))
    first = load_samples([path], cache_dir=cache).dataset
    second = load_samples([path], cache_dir=cache).dataset
    assert first.cache_files == second.cache_files


def test_rows_bad_for_a_missing_image_are_checked_again_once_it_exists(tmp_path, cache):
    path = write_jsonl(tmp_path / "d.jsonl", [{"query": "<image>", "response": "r", "images": ["late.png"]}])
    with pytest.raises(DataError, match="not found"):
        load_samples([path], cache_dir=cache)
    Image.new("RGB", (8, 8)).save(tmp_path / "late.png")
    assert len(load_samples([path], cache_dir=cache).dataset) == 1


def test_non_strict_rechecks_rows_skipped_for_media(tmp_path, cache):
    rows = [{"query": "<image>", "response": "r", "images": ["late.png"]}, {"query": "q", "response": "r"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    first = load_samples([path], strict=False, cache_dir=cache)
    assert len(first.dataset) == 1 and [e.line for e in first.skipped] == [1]
    Image.new("RGB", (8, 8)).save(tmp_path / "late.png")
    second = load_samples([path], strict=False, cache_dir=cache)
    assert len(second.dataset) == 2 and second.skipped == []


def test_a_spec_without_rows_is_an_error_naming_it(tmp_path, cache):
    path = str(tmp_path / "empty.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    for spec in (path, path + "#3"):
        with pytest.raises(DataError, match=f"^{path}:0: no usable rows"):
            load_samples([spec], cache_dir=cache)
    # an empty file among others in a folder is no error: the folder has rows
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "empty.jsonl").write_text("")
    write_jsonl(tmp_path / "folder" / "more.jsonl", qrows(2))
    assert len(load_samples([str(tmp_path / "folder")], cache_dir=cache).dataset) == 2


def test_more_processes_than_rows(tmp_path, cache):
    path = write_jsonl(tmp_path / "d.jsonl", qrows(2))
    assert anchors(load_samples([path], cache_dir=cache, num_proc=4).dataset) == ["q0", "q1"]


# ----------------------------------------------------------------------------- split


def test_split_dataset_like_ms_swift(tmp_path, cache):
    ds = load_samples([write_jsonl(tmp_path / "d.jsonl", qrows(10))], cache_dir=cache).dataset
    train, val = split_dataset(ds, 0, seed=42)
    assert train is ds and val is None
    train, val = split_dataset(ds, 0.2, seed=42)
    assert (len(train), len(val)) == (8, 2)
    assert sorted(anchors(train) + anchors(val)) == sorted(anchors(ds))
    again_train, again_val = split_dataset(ds, 0.2, seed=42)
    assert anchors(again_val) == anchors(val)
    _, tiny = split_dataset(ds, 0.01, seed=42)
    assert len(tiny) == 1  # at least one validation row
    with pytest.raises(ValueError):
        split_dataset(ds, 1.5, seed=42)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the resident set from Linux's /proc")
def test_release_mapped_drops_the_read_cache_pages_from_the_resident_set(tmp_path):
    """After a pass over a memory-mapped cache file, ``release_mapped`` takes its pages out of
    the process's resident set (file-backed RSS falls by about the file's size), and the rows
    read back the same afterwards."""
    import datasets

    from mmembed.data.dataset import release_mapped

    def rss_file_mb():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) // 1024 for line in f if line.startswith("RssFile"))

    rows = [f"{i:07d}" + "x" * 993 for i in range(60000)]  # about 60 MB of text
    datasets.Dataset.from_dict({"text": rows}).save_to_disk(str(tmp_path / "ds"))
    ds = datasets.load_from_disk(str(tmp_path / "ds"))
    files = frozenset(f["filename"] for f in ds.cache_files)
    release_mapped(files)
    before = rss_file_mb()
    assert ds.data.column("text").to_pylist() == rows
    read = rss_file_mb()
    release_mapped(files)
    after = rss_file_mb()
    assert read - before >= 50 and read - after >= 50, (before, read, after)
    assert ds[12345]["text"] == rows[12345] and ds.data.column("text").to_pylist() == rows
