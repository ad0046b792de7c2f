"""Hub dataset ids (mmembed/data/hub.py): ms-swift's spec syntax, the split loaded by the hub's
client, its rows written once as JSONL and read by the reader under the hub id with the
row's number in the split, ``#N`` as for files, the cache, and the errors.

Hugging Face's client is replaced at its call boundary: ``datasets.load_dataset`` returns small
``datasets.Dataset`` objects built here. The real Hugging Face client against a loopback hub is
tests/training/test_hub_sft.py; ModelScope ids (the default hub) are loaded by modelscope's real
client against the loopback ModelScope in tests/data/test_hub_datasets_modelscope.py.
"""

from __future__ import annotations

import io
import json
import os
import sys

import datasets
import pytest
from conftest import write_jsonl
from PIL import Image

from mmembed.data import DataError, DatasetHubOptions, HubDataset, Sample, SpecError, load_samples, parse_spec
from mmembed.data.dataset_config import read_dataset_config
from mmembed.data.hub import check_hub_client
from mmembed.data.streaming import stream_samples
from mmembed.errors import UsageError


class FakeHub:
    """``datasets.load_dataset`` answering from ``store``:
    ``(repo_id, subset, split) -> datasets.Dataset``; every call recorded."""

    def __init__(self, tmp_path):
        self.store: dict[tuple[str, str, str], datasets.Dataset] = {}
        self.calls: list[tuple[str, str, str, str, dict]] = []
        self.rows = str(tmp_path / "rows")
        self.arrow = str(tmp_path / "arrow")

    def options(self, **kw) -> DatasetHubOptions:
        return DatasetHubOptions(**{"use_hf": True, "cache": self.rows, **kw})

    def load(self, specs, **kw):
        kw.setdefault("hub", self.options())
        return load_samples(specs, cache_dir=self.arrow, **kw)

    def _answer(self, client, repo_id, subset, split, kw):
        self.calls.append((client, repo_id, subset, split, kw))
        if (repo_id, subset, split) not in self.store:
            raise FileNotFoundError(f"Dataset '{repo_id}' doesn't exist on the Hub or cannot be accessed.")
        return self.store[(repo_id, subset, split)]

    def hf_load_dataset(self, path, name=None, split=None, **kw):
        return self._answer("hf", path, name, split, kw)

@pytest.fixture
def hub(tmp_path, monkeypatch):
    fake = FakeHub(tmp_path)
    monkeypatch.setattr(datasets, "load_dataset", fake.hf_load_dataset)
    return fake


def rows(ds):
    return [Sample.from_json(s) for s in ds["sample"]]


def png(color="red") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(out, "PNG")
    return out.getvalue()


QR = {"query": ["q1", "q2", "q3", "q4", "q5"], "response": ["r1", "r2", "", "r4", "r5"]}


# ----------------------------------------------------------------------------- specs


@pytest.mark.parametrize("spec, target, n", [
    ("org/name", HubDataset("org/name"), None),
    ("org/name:sub#10", HubDataset("org/name", ("sub",)), 10),
    ("org/name:a/b", HubDataset("org/name", ("a", "b")), None),
    ("HF::org/name#3", HubDataset("org/name", (), "hf"), 3),
    ("ms::swift/TextCaps:emb", HubDataset("swift/TextCaps", ("emb",), "ms"), None),
    ("hf::imdb", HubDataset("imdb", (), "hf"), None),
])
def test_spec_syntax_is_ms_swifts(spec, target, n):
    assert parse_spec(spec) == (target, n)
    assert str(target) == spec.split("#")[0].replace("HF::", "hf::")


def test_a_local_path_wins_over_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "org" / "name" / "a.jsonl", [{"query": "q", "response": "r"}])
    write_jsonl(tmp_path / "d.jsonl", [{"query": "q", "response": "r"}])
    assert parse_spec("org/name#2") == (str(tmp_path / "org" / "name"), 2)
    assert parse_spec("hf::d.jsonl") == (str(tmp_path / "d.jsonl"), None)  # ms-swift: a prefixed local file is the file


# ----------------------------------------------------------------------------- loading


def test_rows_are_read_under_the_hub_id_and_their_row_in_the_split(hub):
    hub.store["org/tiny", "default", "train"] = datasets.Dataset.from_dict(QR)
    with pytest.raises(DataError) as e:
        hub.load(["org/tiny"])
    assert str(e.value) == "hf::org/tiny[train]:3 field 'response': empty text and no media"
    assert hub.calls[0][:4] == ("hf", "org/tiny", "default", "train")  # ms-swift's subset and split
    loaded = hub.load(["org/tiny"], strict=False)
    assert [s.anchor.text for s in rows(loaded.dataset)] == ["q1", "q2", "q4", "q5"]
    assert [(s.source, s.line) for s in rows(loaded.dataset)][:2] == [("hf::org/tiny[train]", 1), ("hf::org/tiny[train]", 2)]
    assert [str(x) for x in loaded.skipped] == ["hf::org/tiny[train]:3 field 'response': empty text and no media"]
    assert loaded.records == {"hf::org/tiny[train]": 5} and loaded.files == [["hf::org/tiny[train]"]]


def test_sample_count_draws_as_from_a_file(hub, tmp_path):
    hub.store["org/tiny", "default", "train"] = datasets.Dataset.from_dict({k: v[:2] + v[3:] for k, v in QR.items()})
    local = write_jsonl(tmp_path / "same.jsonl", [{"query": q, "response": r} for q, r in zip(QR["query"], QR["response"])
                                                  if r])
    for spec_n in ("#3", "#9"):
        got = hub.load([f"org/tiny{spec_n}"], shuffle=True, seed=7)
        want = load_samples([local + spec_n], shuffle=True, seed=7, cache_dir=hub.arrow)
        assert [s.anchor.text for s in rows(got.dataset)] == [s.anchor.text for s in rows(want.dataset)]


def test_rows_are_written_once_and_again_when_the_data_changes(hub):
    hub.store["org/tiny", "default", "train"] = datasets.Dataset.from_dict({"query": ["a"], "response": ["b"]})
    hub.load(["org/tiny"])
    [first] = [os.path.join(root, f) for root, _, files in os.walk(hub.rows) for f in files if f == "train.jsonl"]
    stamp = os.stat(first).st_mtime_ns
    hub.load(["org/tiny"])
    assert os.stat(first).st_mtime_ns == stamp and len(hub.calls) == 2  # asked again (the fingerprint), not written
    hub.load(["org/tiny"], hub=hub.options(download_mode="force_redownload"))
    assert os.stat(first).st_mtime_ns != stamp and hub.calls[-1][4]["download_mode"] == "force_redownload"
    hub.store["org/tiny", "default", "train"] = datasets.Dataset.from_dict({"query": ["new"], "response": ["b"]})
    assert rows(hub.load(["org/tiny"]).dataset)[0].anchor.text == "new"  # a new revision: new rows


def test_embedded_images_are_written_as_files(hub, tmp_path):
    here = tmp_path / "cached.png"
    here.write_bytes(png("blue"))
    features = datasets.Features({"query": datasets.Value("string"), "images": datasets.List(datasets.Image()),
                                  "response": datasets.Value("string")})
    hub.store["org/pics", "default", "train"] = datasets.Dataset.from_dict({
        "query": ["<image>a red square", "<image>", "<image>"],
        "images": [[{"bytes": png(), "path": "red.png"}], [{"bytes": None, "path": str(here)}],
                   [{"bytes": None, "path": "nowhere.png"}]],
        "response": ["red", "blue", "gone"]}, features=features)
    with pytest.raises(DataError, match=r"^hf::org/pics\[train\]:3 field 'images\[0\]': image file not found"):
        hub.load(["org/pics"])
    got = rows(hub.load(["org/pics#2"], strict=False).dataset)
    red, blue = sorted(got, key=lambda s: s.line)
    assert Image.open(red.anchor.images[0]).getpixel((0, 0)) == (255, 0, 0)
    assert red.anchor.images[0].startswith(hub.rows) and blue.anchor.images[0] == str(here)  # a file there: as it is


def test_sentence_transformers_columns(hub):
    hub.store["org/sick", "default", "train"] = datasets.Dataset.from_dict(
        {"sentence_A": ["A dog runs."], "sentence_B": ["A dog is running."], "score": [0.9]})
    hub.store["org/triplets", "default", "train"] = datasets.Dataset.from_dict(
        {"anchor": ["q"], "positive": ["p"], "negative_1": ["n1"], "negative_2": ["n2"]})
    [pair] = rows(hub.load(["org/sick"]).dataset)
    assert (pair.anchor.text, pair.positives[0].text, pair.label) == ("A dog runs.", "A dog is running.", 0.9)
    [triplet] = rows(hub.load(["org/triplets"]).dataset)
    assert [n.text for n in triplet.negatives] == ["n1", "n2"]


def test_columns_flag_renames_before_the_mapping(hub):
    hub.store["org/pairs", "default", "train"] = datasets.Dataset.from_dict({"text1": ["a"], "text2": ["b"], "id": [3]})
    [row] = rows(hub.load(["org/pairs"], columns={"text1": "query", "text2": "response"}).dataset)
    assert (row.anchor.text, row.positives[0].text) == ("a", "b")


def test_stsb_positive_keeps_the_hub_row_numbers(hub):
    """ms-swift's stsb:positive drops the pairs scored under 0.75; the rows after them keep
    their number in the split (a dropped row is a blank line of the JSONL file)."""
    hub.store["sentence-transformers/stsb", "default", "train"] = datasets.Dataset.from_dict(
        {"sentence1": ["a", "b", "c", "d"], "sentence2": ["A", "B", "C", ""], "score": [0.2, 0.8, 0.5, 0.9]})
    with pytest.raises(DataError, match=r"^hf::sentence-transformers/stsb:positive\[train\]:4 field "
                                        r"'positive_messages\[0\]'"):
        hub.load(["sentence-transformers/stsb:positive"])
    [kept] = rows(hub.load(["sentence-transformers/stsb:positive"], strict=False).dataset)
    assert (kept.line, kept.anchor.text, kept.label) == (2, "b", 0.8)
    assert [s.label for s in rows(hub.load(["sentence-transformers/stsb#2"], strict=False).dataset)] == [0.2, 0.8]


def test_several_subsets_in_the_specs_order(hub):
    for sub in ("a", "b"):
        hub.store["org/multi", sub, "train"] = datasets.Dataset.from_dict({"query": [sub], "response": ["r"]})
    loaded = hub.load(["org/multi:b/a"])
    assert [(s.source, s.anchor.text) for s in rows(loaded.dataset)] == [("hf::org/multi:b[train]", "b"),
                                                                         ("hf::org/multi:a[train]", "a")]


@pytest.mark.parametrize("spec, message", [
    ("swift/TextCaps", "subset 'default' is ms-swift's captioning rows .* use swift/TextCaps:emb"),
    ("sentence-transformers/stsb:reg", "subset 'reg' is ms-swift's regression rows"),
    ("sentence-transformers/stsb", r"reads the column\(s\) score, which it does not have .*--columns"),
    ("org/absent", r"^dataset org/absent: not a local file or folder, so Hugging Face dataset org/absent \(subset "
                   r"'default', split 'train'\) could not be loaded: FileNotFoundError: Dataset 'org/absent' doesn't "
                   r"exist"),
    ("hf::org/absent", r"^dataset hf::org/absent: Hugging Face dataset org/absent \(subset 'default'"),
])
def test_what_cannot_be_read_is_one_spec_error(hub, spec, message):
    hub.store["sentence-transformers/stsb", "default", "train"] = datasets.Dataset.from_dict(
        {"sentence1": ["a"], "sentence2": ["b"]})
    with pytest.raises(SpecError, match=message):
        hub.load([spec])


def test_modelscope_is_the_default_hub_and_its_client_optional(monkeypatch):
    monkeypatch.setitem(sys.modules, "modelscope", None)  # not installed
    message = (r"^dataset org/tiny: not a local file or folder, so a ModelScope id \(the default hub, as in "
               r"ms-swift\), and the optional modelscope package is not installed: pip install 'mmembed\[modelscope\]'"
               r" \(or pip install modelscope\), or pass --use_hf true")
    with pytest.raises(UsageError, match=message):
        check_hub_client(HubDataset("org/tiny"), DatasetHubOptions())
    check_hub_client(HubDataset("org/tiny", (), "hf"), DatasetHubOptions())  # a prefix picks the hub
    check_hub_client(HubDataset("org/tiny"), DatasetHubOptions(use_hf=True))


def test_use_hf_comes_from_the_flag_or_the_variable(tmp_path):
    ms, hf = HubDataset("org/x", (), "ms"), HubDataset("org/x")
    assert DatasetHubOptions.of(None, {}).hub_of(hf) == "ms"
    assert DatasetHubOptions.of(True, {}).hub_of(hf) == "hf" and DatasetHubOptions.of(False, {"USE_HF": "1"}).hub_of(hf) == "hf"
    assert DatasetHubOptions.of(True, {}).hub_of(ms) == "ms"
    assert DatasetHubOptions.of(None, {"XDG_CACHE_HOME": str(tmp_path)}).cache == str(tmp_path / "mmembed" / "hub_datasets")
    assert DatasetHubOptions.of(None, {"XDG_CACHE_HOME": "/x", "MMEMBED_HUB_CACHE": str(tmp_path)}).cache == str(tmp_path)
    assert DatasetHubOptions.of(None, {"MAX_NEGATIVE_SAMPLES": "3"}).max_negative == 3
    with pytest.raises(UsageError, match="USE_HF must be true or false"):
        DatasetHubOptions.of(None, {"USE_HF": "maybe"})


def test_a_dataset_config_path_may_be_a_hub_id(tmp_path):
    config = tmp_path / "data.yaml"
    config.write_text(json.dumps({"datasets": [{"name": "sts", "path": "sentence-transformers/stsb:positive",
                                                "sample": 100, "val": "hf::org/dev#20"}]}))
    [entry] = read_dataset_config(str(config))
    assert entry.specs() == ["sentence-transformers/stsb:positive#100"] and entry.val == ["hf::org/dev#20"]


def test_streaming_reads_the_written_rows(hub):
    hub.store["org/tiny", "default", "train"] = datasets.Dataset.from_dict(QR)
    stream = stream_samples(["org/tiny#2"], strict=True, seed=1, shuffle=False, buffer_size=10, hub=hub.options())
    assert [(s.source, s.line) for s in stream] == [("hf::org/tiny[train]", 1), ("hf::org/tiny[train]", 2)]
