"""Reading data at scale: the plain-row fast path, the table-writing parse, the default
--dataset_num_proc, data read once for several processes, a corrupt medium found at batch
time, and a stream with too few rows."""

import json
import os

import pytest
from conftest import REPO, launch, write_jsonl

from mmembed.data import rows as rows_module
from mmembed.data.dataset import load_samples
from mmembed.data.sample import DataError

WORKER = os.path.join(REPO, "tests", "data_once_worker.py")

PLAIN = [
    {"query": "q", "response": "p"},
    {"query": "q", "response": "p", "rejected_response": ["n1", "n2", "n3"]},
    {"query": "q", "response": "p", "rejected_response": "one negative"},
    {"query": "q", "response": "p", "rejected_response": [], "label": 1},
    {"query": "q", "response": "p", "label": 0.25, "system": "Be brief."},
    {"query": "q", "response": "p", "system": ""},
    {"query": " spaced ", "response": "p\nq", "rejected_response": None, "label": None, "system": None},
    {"query": "naïve ☃ \u00a3", "response": "p"},
]
# rows the fast path hands to the general reader (which reads or refuses them)
OTHER = [
    {"query": "<image>", "response": "p", "images": []},
    {"query": "a < b", "response": "p"},
    {"query": "q", "response": "p", "label": True},
    {"query": "q", "response": "p", "label": float("nan")},
    {"query": "q", "response": "p", "rejected_response": ["", "n"]},
    {"query": "q", "response": "   "},
    {"query": "q", "response": ["p"]},
    {"query": "q", "response": "p", "rejected_response": [3]},
    {"query": "q", "response": "p", "system": 5},
    {"anchor": "q", "positive": "p"},
    {"query": "q", "response": "p", "negative_1": "n"},
    ["not", "a", "row"],
]


def general(raw, line=1, label_rule=None):
    """The general reader alone (the reference the fast path must agree with)."""
    return rows_module._parse_row(raw, "/d/f.jsonl", line, "/d", True, None, None, label_rule, None)


@pytest.mark.parametrize("raw", PLAIN)
def test_fast_path_gives_the_general_readers_sample(raw):
    fast = rows_module._plain_text_row(raw, "/d/f.jsonl", 7)
    assert fast is not None
    assert fast == general(raw, 7)
    assert fast.to_json() == general(raw, 7).to_json()  # what the Arrow cache stores


@pytest.mark.parametrize("raw", OTHER)
def test_rows_off_the_fast_path_are_read_or_refused_by_the_general_reader(raw):
    assert rows_module._plain_text_row(raw, "/d/f.jsonl", 1) is None
    try:
        expected = general(raw)
    except DataError as e:
        with pytest.raises(DataError) as got:
            rows_module.parse_row(raw, "/d/f.jsonl", 1, "/d")
        assert str(got.value) == str(e)
    else:
        assert rows_module.parse_row(raw, "/d/f.jsonl", 1, "/d") == expected


def test_fast_path_row_with_a_label_the_loss_refuses_names_the_field():
    from mmembed.losses import build_loss

    rule = build_loss("contrastive").label_rule
    with pytest.raises(DataError) as e:
        rows_module.parse_row({"query": "q", "response": "p", "label": 0.5}, "/d/f.jsonl", 3, "/d", label_rule=rule)
    assert e.value.line == 3 and e.value.field == "label"


def test_parse_in_several_processes_keeps_rows_lines_and_bad_rows(tmp_path, monkeypatch):
    """Byte ranges of one .jsonl parsed by 2 processes (tables of 2,048 rows): the same rows,
    lines, row numbers and skipped rows as one process, in order."""
    from mmembed.data import dataset

    lines = []
    for i in range(5000):
        if i % 997 == 5:
            lines.append("{broken")
        elif i % 1500 == 7:
            lines.append("")
        else:
            lines.append(json.dumps({"query": f"q{i}", "response": f"p{i}", "rejected_response": [f"n{i}"]}))
    path = write_jsonl(tmp_path / "big.jsonl", lines)
    one = load_samples(path, strict=False, cache_dir=str(tmp_path / "c1"), num_proc=1)
    monkeypatch.setattr(dataset, "_MIN_SHARD_BYTES", 1024)
    two = load_samples(path, strict=False, cache_dir=str(tmp_path / "c2"), num_proc=2)
    assert two.parsed and one.parsed
    assert two.dataset["sample"] == one.dataset["sample"] and two.dataset["line"] == one.dataset["line"]
    assert two.dataset["row"] == one.dataset["row"]
    expected_bad = [n + 1 for n, text in enumerate(lines) if text == "{broken"]
    assert [e.line for e in two.skipped] == [e.line for e in one.skipped] == expected_bad
    assert len(one.dataset) == sum(1 for text in lines if text and text != "{broken")
    again = load_samples(path, strict=False, cache_dir=str(tmp_path / "c2"), num_proc=2)
    assert not again.parsed and again.dataset["sample"] == one.dataset["sample"]


def test_dataset_num_proc_defaults_to_the_cores_at_most_8(tmp_path):
    from mmembed.training.arguments import SftArguments

    args = SftArguments(model="m", dataset=["d.jsonl"], output_dir=str(tmp_path / "o"), report_to=[])
    assert args.dataset_num_proc == max(1, min(len(os.sched_getaffinity(0)), 8))
    assert SftArguments(model="m", dataset=["d.jsonl"], output_dir=str(tmp_path / "o"), report_to=[],
                        dataset_num_proc=3).dataset_num_proc == 3


def test_two_processes_read_the_data_once_and_train_on_the_rows_of_one(tmp_path, minilm_path):
    """Under torchrun (2 processes, gloo) rank 0 parses and checks the data, rank 1 waits and
    reuses its cache; both train on the rows one process reading the data itself trains on
    (shuffled, over-long rows deleted)."""
    rows = []
    for i in range(120):
        long = " ".join(["word"] * 60) if i % 9 == 4 else "short"
        rows.append({"query": f"query {i} {long}", "response": f"answer {i}", "rejected_response": [f"neg {i}"]})
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    flags = dict(model=minilm_path, dataset=[data], max_steps=1, per_device_train_batch_size=2, max_length=24,
                 dataset_shuffle=True, save_strategy="no", dataset_num_proc=1)

    def run(nproc, name, forked):
        out = str(tmp_path / name)
        env = {"HF_DATASETS_CACHE": str(tmp_path / f"cache-{name}")}
        f = dict(flags, output_dir=str(tmp_path / f"run-{name}"))
        proc = launch([WORKER, "--out", out, "--flags", json.dumps(f)], nproc=nproc, env=env, torchrun=True, timeout=600,
                      forked=forked)
        return proc.stdout + proc.stderr, [json.load(open(f"{out}.{r}")) for r in range(nproc)]

    logs, (rank0, rank1) = run(2, "two", forked=False)  # torchrun itself, as the issue asks
    _, (alone,) = run(1, "one", forked=True)  # the reference: one process forked with torchrun's variables
    assert rank0 == rank1 == alone
    assert len(alone) == 120 - len(range(4, 120, 9))  # the over-long rows deleted
    assert sorted(alone) != alone  # shuffled (the same shuffle everywhere)
    mine = [line for line in logs.splitlines() if "data:" in line]
    assert any(line.startswith("[rank0]") and "parse: 120 rows" in line and "(parsed)" in line for line in mine), mine
    assert any(line.startswith("[rank1]") and "process 1 reused" in line and "nothing parsed again" in line
               for line in mine), mine
    assert not any(line.startswith("[rank1]") and "parse:" in line for line in mine), mine


def _jpeg(path, size, seed, truncate=False) -> str:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, format="JPEG", quality=90)
    if truncate:  # the header (and size) intact, the pixels cut short
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
    return str(path)


@pytest.fixture(scope="module")
def corrupt_rows(tmp_path_factory):
    """Six image rows whose third image is a real JPEG truncated halfway (its header opens)."""
    d = tmp_path_factory.mktemp("corrupt")
    rows = []
    for i in range(6):
        img = _jpeg(d / f"img{i}.jpg", (56 + 28 * (i % 2), 56), i, truncate=i == 2)
        rows.append({"query": f"<image>picture {i}", "response": f"caption {i}", "images": [img]})
    return write_jsonl(d / "rows.jsonl", rows), str(d / "cache")


def test_corrupt_pixels_are_found_when_the_batch_is_built(corrupt_rows, tiny_model):
    from PIL import Image

    from mmembed.data import EmbeddingDataset
    from mmembed.encoding.collator import EmbeddingCollator
    from mmembed.encoding.layout import Layout
    from mmembed.encoding.templates import get_template

    path, cache = corrupt_rows
    with Image.open(path.replace("rows.jsonl", "img2.jpg")) as im:  # what the reader checks: the header opens
        assert im.size == (56, 56)
    ds = EmbeddingDataset(load_samples(path, cache_dir=cache))  # read: the header is fine
    assert len(ds) == 6
    collator = EmbeddingCollator(get_template("qwen2_gme"), processing(tiny_model("qwen2_vl")), Layout.GROUP)
    with pytest.raises(DataError) as e:
        collator([ds[i] for i in range(4)])
    assert (e.value.source, e.value.line) == (path, 3) and e.value.field == "query images[0]"
    assert "img2.jpg" in str(e.value) and "truncated" in str(e.value)


def test_strict_false_skips_a_corrupt_row_and_keeps_the_batch_size(corrupt_rows, tiny_model, caplog):
    from mmembed.data import EmbeddingDataset
    from mmembed.encoding.collator import EmbeddingCollator
    from mmembed.encoding.layout import Layout
    from mmembed.encoding.templates import get_template

    path, cache = corrupt_rows
    ds = EmbeddingDataset(load_samples(path, cache_dir=cache))
    proc = processing(tiny_model("qwen2_vl"))
    lenient = EmbeddingCollator(get_template("qwen2_gme"), proc, Layout.GROUP, strict=False)
    strict = EmbeddingCollator(get_template("qwen2_gme"), proc, Layout.GROUP)
    batch_rows = [ds[i] for i in range(4)]
    with caplog.at_level("INFO", logger="mmembed"):
        batch = lenient(batch_rows)
    skipped = [r.getMessage() for r in caplog.records if "skipped a row" in r.getMessage()]
    assert len(skipped) == 1 and f"{path}:3" in skipped[0] and "img2.jpg" in skipped[0]
    (stand_in,) = [r.getMessage().split(" by ")[1] for r in caplog.records if "replaced in its batch" in r.getMessage()]
    line = int(stand_in.rsplit(":", 1)[1])
    assert line in (5, 6)  # another good row, not one already in the batch
    reference = strict([ds[0], ds[1], ds[line - 1], ds[3]])  # the batch built by hand with the stand-in in place
    assert batch["labels"].shape == reference["labels"].shape == (4,) and batch["input_ids"].shape[0] == 8
    for key in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw"):
        assert torch_equal(batch[key], reference[key]), key
    # the same stand-in again: in another epoch, and in another process's collator
    again = EmbeddingCollator(get_template("qwen2_gme"), proc, Layout.GROUP, strict=False)([ds[i] for i in range(4)])
    assert torch_equal(again["input_ids"], batch["input_ids"])
    # a row that is not from an EmbeddingDataset has no stand-in: its error is raised
    from mmembed.data.reader import read_file

    with pytest.raises(DataError):
        lenient(read_file(path)[:4])


def processing(folder: str):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(folder)


def torch_equal(a, b) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a, b))


def test_stream_with_fewer_usable_rows_than_a_batch_is_an_error_not_an_endless_loop(tmp_path, minilm_path):
    import subprocess
    import sys

    rows = [{"query": "a", "response": "b"}, {"query": "c", "response": "d"}, {"bad": 1}, {"bad": 2}]
    data = write_jsonl(tmp_path / "few.jsonl", rows)
    cmd = [sys.executable, "-m", "mmembed", "sft", "--model", minilm_path, "--dataset", data, "--streaming", "true",
           "--strict", "false", "--max_steps", "2", "--per_device_train_batch_size", "4", "--output_dir",
           str(tmp_path / "out"), "--report_to", "none", "--save_strategy", "no"]
    env = dict(os.environ, HF_DATASETS_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO, env=env)  # it looped forever
    assert proc.returncode != 0
    assert "only 2 usable row(s) in a whole pass over the stream (2 bad, 0 over --max_length)" in proc.stderr
    assert "fewer than one batch of every process (4)" in proc.stderr


def test_a_stand_in_comes_from_the_rows_own_dataset():
    """With several datasets (--dataset_config's dataset_id column) a skipped row's stand-in is
    a row of the same dataset (a one-dataset-per-batch sampler's batch stays one dataset's),
    and the same for the same row and attempt."""
    import datasets

    from mmembed.data.dataset import DATASET_ID, EmbeddingDataset
    from mmembed.data.sample import Item, Sample

    ids = [i % 3 for i in range(60)]
    rows = [Sample(Item(f"q{i}"), [Item(f"d{i}")], source="f.jsonl", line=i + 1).to_json() for i in range(60)]
    ds = EmbeddingDataset(datasets.Dataset.from_dict({"sample": rows, "row": list(range(60)), DATASET_ID: ids}))
    picked = set()
    for index in range(60):
        for attempt in range(3):
            stand_in = ds.replacement(index, attempt)
            assert stand_in.dataset_id == ids[index], (index, attempt)
            assert stand_in.anchor.text == ds.replacement(index, attempt).anchor.text
            picked.add(stand_in.anchor.text)
    assert len(picked) > 30  # drawn over the dataset, not one fixed row
    one = EmbeddingDataset(datasets.Dataset.from_dict({"sample": rows, "row": list(range(60))}))
    assert {one.replacement(0, a).anchor.text for a in range(40)} - {f"q{i}" for i in range(0, 60, 3)}  # any row
