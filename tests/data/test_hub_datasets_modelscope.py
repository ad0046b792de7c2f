"""ModelScope dataset ids (the default hub, as in ms-swift) loaded by modelscope's real client
(mmembed/data/hub.py) from the loopback ModelScope of tests/fixtures/modelscope_server.py,
which serves dataset repositories as modelscope.cn does: ``MODELSCOPE_ENDPOINT`` points the
client at it, ``MODELSCOPE_CACHE`` is a folder of the test's own.

What is published is a repository of data files in the hub's layout, as ms-swift's registered
datasets are: ``swift/TextCaps`` (HuggingFaceM4/TextCaps' columns, the pictures embedded in
parquet files under ``data/``), and one whose README declares its subsets. The rows expected
are read here from the published files themselves (pyarrow), not from mmembed."""

from __future__ import annotations

import io
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fixtures.modelscope_server import modelscope_pointed_at
from PIL import Image

from mmembed.data import DatasetHubOptions, Sample, SpecError, load_samples

COLORS = ["red", "green", "blue", "yellow", "white"]


def _png(color: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(out, "PNG")
    return out.getvalue()


def _textcaps_parquet(path, colors: list[str], offset: int) -> str:
    """HuggingFaceM4/TextCaps' columns as the hub stores them: the image embedded (its bytes,
    in the struct ``datasets`` writes for an ``Image`` feature), its id, its reference captions."""
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({
        "image": pa.array([{"bytes": _png(c), "path": None} for c in colors], type=image),
        "image_id": [str(offset + i) for i in range(len(colors))],
        "reference_strs": [[f"a {c} picture", f"{c}"] for c in colors],
    })
    # "Sequence": the name datasets 3 writes (the floor reads no other; datasets 4 and 5 read it too)
    features = {"image": {"_type": "Image"}, "image_id": {"dtype": "string", "_type": "Value"},
                "reference_strs": {"feature": {"dtype": "string", "_type": "Value"}, "_type": "Sequence"}}
    table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    pq.write_table(table, path)
    return str(path)


@pytest.fixture(scope="module")
def ms_datasets(modelscope_server, tmp_path_factory):
    """``swift/TextCaps`` (train: 3 pictures, validation: 2) and ``mstest/subsets`` (README
    configs ``first`` and ``second``, one JSONL file each) published on the loopback ModelScope."""
    root = tmp_path_factory.mktemp("ms_datasets")
    modelscope_server.add_files("swift/TextCaps", {
        "README.md": _write(root / "textcaps" / "README.md", "# TextCaps\n"),
        "data/train-00000-of-00001.parquet": _textcaps_parquet(root / "textcaps" / "train.parquet", COLORS[:3], 0),
        "data/validation-00000-of-00001.parquet": _textcaps_parquet(root / "textcaps" / "val.parquet", COLORS[3:], 3),
    }, repo_type="dataset")
    card = ("---\nconfigs:\n- config_name: first\n  data_files:\n  - split: train\n    path: first/*.jsonl\n"
            "- config_name: second\n  data_files:\n  - split: train\n    path: second/*.jsonl\n---\n# two subsets\n")
    modelscope_server.add_files("mstest/subsets", {
        "README.md": _write(root / "subsets" / "README.md", card),
        "first/rows.jsonl": _write(root / "subsets" / "first.jsonl",
                                   '{"query": "q1", "response": "one"}\n{"query": "q2", "response": "two"}\n'),
        "second/rows.jsonl": _write(root / "subsets" / "second.jsonl", '{"query": "q3", "response": "three"}\n'),
    }, repo_type="dataset")
    return modelscope_server


def _write(path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return str(path)


def _load(specs, folder, **options):
    return load_samples(specs, cache_dir=str(folder / "arrow"),
                        hub=DatasetHubOptions(cache=str(folder / "rows"), **options))


def _samples(loaded) -> list[Sample]:
    return [Sample.from_json(s) for s in loaded.dataset["sample"]]


def test_textcaps_emb_by_the_default_hub(ms_datasets, tmp_path):
    """``swift/TextCaps:emb`` with no --use_hf: modelscope's client downloads the repository's
    files from the hub's dataset routes, and its train and validation splits become ms-swift's
    rows (the picture as the query, the first reference caption as the positive), each picture
    written as a file with the bytes the parquet file holds."""
    cache = tmp_path / "ms_cache"
    ms_datasets.clear_requests()
    with modelscope_pointed_at(ms_datasets.url, str(cache), str(tmp_path / "ms_home")):
        loaded = _load(["swift/TextCaps:emb"], tmp_path)
    got = _samples(loaded)
    assert [(s.source, s.line, s.anchor.text, s.positives[0].text) for s in got] == [
        ("ms::swift/TextCaps:emb[train]", 1, "<image>", "a red picture"),
        ("ms::swift/TextCaps:emb[train]", 2, "<image>", "a green picture"),
        ("ms::swift/TextCaps:emb[train]", 3, "<image>", "a blue picture"),
        ("ms::swift/TextCaps:emb[validation]", 1, "<image>", "a yellow picture"),
        ("ms::swift/TextCaps:emb[validation]", 2, "<image>", "a white picture")]
    for sample, color in zip(got, COLORS):
        with open(sample.anchor.images[0], "rb") as f:
            assert f.read() == _png(color)
    # the client's own requests: the dataset's file list, once for both splits, then each file (parquet: LFS,
    # from the storage)
    paths = [target.split("?")[0] for method, target, _ in ms_datasets.requests if method == "GET"]
    assert paths.count("/api/v1/datasets/swift/TextCaps/repo/tree") == 1
    fetched = sorted(target.split("FilePath=")[1].replace("%2F", "/") for _, target, _ in ms_datasets.requests
                     if target.startswith("/api/v1/datasets/swift/TextCaps/repo?"))
    assert fetched == ["README.md", "data/train-00000-of-00001.parquet", "data/validation-00000-of-00001.parquet"]
    snapshot = cache / "datasets" / "swift--TextCaps" / "snapshots" / "master" / "data"
    assert sorted(os.listdir(snapshot)) == ["train-00000-of-00001.parquet", "validation-00000-of-00001.parquet"]


def test_offline_the_same_rows_come_from_the_cache_with_no_request(ms_datasets, tmp_path):
    with modelscope_pointed_at(ms_datasets.url, str(tmp_path / "ms_cache"), str(tmp_path / "ms_home")):
        online = _samples(_load(["swift/TextCaps:emb"], tmp_path / "a"))
        ms_datasets.clear_requests()
        offline = _samples(_load(["swift/TextCaps:emb"], tmp_path / "b", offline=True))
        with pytest.raises(SpecError) as e:  # never downloaded: one line naming the id and the switches
            _load(["mstest/subsets:first"], tmp_path / "c", offline=True)
    assert ms_datasets.requests == []
    assert [(s.source, s.line, s.positives[0].text) for s in offline] == [
        (s.source, s.line, s.positives[0].text) for s in online]
    message = str(e.value)
    assert "\n" not in message and message.startswith("dataset mstest/subsets:first: ")
    assert "not in the ModelScope cache (MODELSCOPE_CACHE)" in message and "HF_HUB_OFFLINE" in message


def test_subsets_are_the_readmes_configs(ms_datasets, tmp_path):
    """A subset is a config of the dataset's README, as MsDataset's ``subset_name`` is: the
    spec's order kept; one the README does not declare is one line naming it."""
    with modelscope_pointed_at(ms_datasets.url, str(tmp_path / "ms_cache"), str(tmp_path / "ms_home")):
        got = _samples(_load(["mstest/subsets:second/first"], tmp_path))
        with pytest.raises(SpecError) as e:
            _load(["mstest/subsets:third"], tmp_path)
    assert [(s.source, s.line, s.anchor.text, s.positives[0].text) for s in got] == [
        ("ms::mstest/subsets:second[train]", 1, "q3", "three"),
        ("ms::mstest/subsets:first[train]", 1, "q1", "one"),
        ("ms::mstest/subsets:first[train]", 2, "q2", "two")]
    assert str(e.value).startswith("dataset mstest/subsets:third: not a local file or folder, so ModelScope dataset "
                                   "mstest/subsets (subset 'third', split 'train') could not be loaded: ValueError: "
                                   "BuilderConfig 'third' not found. Available: ['first', 'second']")


def test_an_unknown_id_is_one_line(ms_datasets, tmp_path):
    ms_datasets.clear_requests()
    with modelscope_pointed_at(ms_datasets.url, str(tmp_path / "ms_cache"), str(tmp_path / "ms_home")):
        with pytest.raises(SpecError) as e:
            _load(["mstest/absent"], tmp_path)
    assert str(e.value) == (
        f"dataset mstest/absent: not a local file or folder, so mstest/absent is no dataset of ModelScope "
        f"({ms_datasets.url}): check the id (ModelScope is the default hub, as in ms-swift: --use_hf true or "
        "USE_HF=1 loads from Hugging Face); if it is private, pass --hub_token or set MODELSCOPE_API_TOKEN")
    assert [target.split("?")[0] for _, target, _ in ms_datasets.requests] == [
        "/api/v1/datasets/mstest/absent/repo/tree"]
