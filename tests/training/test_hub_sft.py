"""`mmembed sft --use_hf true --dataset org/name` against a Hugging Face hub on the loopback
interface (tests/fixtures/hub_server.py): the dataset repo's JSONL file is loaded by
``datasets.load_dataset`` as from huggingface.co, written as rows once, and trained on; a bad
row stops the run before the model loads with the reader's error naming the hub id and the
row's number in the split, online and then offline from the clients' caches.

The command runs in this process (``mmembed.tools.cli.main``): huggingface_hub and datasets
read ``HF_ENDPOINT`` when imported, which ``clients_pointed_at`` redoes for the test.
"""

import json
import logging
import os
import sys

import pytest
from conftest import stsb_pairs, write_jsonl
from fixtures.hub_server import HubServer, clients_pointed_at

from mmembed.tools.cli import main


def test_a_modelscope_id_without_modelscope_is_one_line_before_the_model_loads(hub, sft, monkeypatch):
    monkeypatch.setitem(sys.modules, "modelscope", None)  # not installed (it is not, here; this makes sure)
    status, err = sft(hub.url)("--dataset", "org/tiny-data")
    assert status == 2, err[-3000:]
    assert ("mmembed sft: error: dataset org/tiny-data: not a local file or folder, so a ModelScope id (the default "
            "hub, as in ms-swift), and the optional modelscope package is not installed: pip install "
            "'mmembed[modelscope]' (or pip install modelscope), or pass --use_hf true (or USE_HF=1)") in err
    assert not hub.requests or all("tiny-data" not in path for _, path, _ in hub.requests)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """Two dataset repos: org/tiny-data (8 STS-B pairs in data/train.jsonl, with the README a
    repo made by the hub's uploader has) and org/tiny-bad (the same, its 5th response empty)."""
    root = tmp_path_factory.mktemp("hub_repos")
    rows = stsb_pairs(8)
    server = HubServer()
    for name, data in (("tiny-data", rows), ("tiny-bad", rows[:4] + [dict(rows[4], response="")] + rows[5:])):
        write_jsonl(root / name / "data" / "train.jsonl", data)
        (root / name / "README.md").write_text("---\nlicense: mit\n---\n# pairs\n")
        server.add_folder(f"org/{name}", str(root / name), repo_type="dataset")
    yield server
    server.stop()


@pytest.fixture
def sft(minilm_path, tmp_path, monkeypatch, capsys):
    """``mmembed sft`` with the clients pointed at the hub, the rows' cache in ``tmp_path``;
    returns (exit status, stderr)."""
    saved = dict(os.environ)  # parsing may set variables
    monkeypatch.setenv("MMEMBED_HUB_CACHE", str(tmp_path / "rows"))

    def run(*flags, offline=False):
        for handler in logging.getLogger("datasets").handlers:  # datasets' own, made in an earlier test's stderr
            handler.stream = sys.stderr
        with clients_pointed_at(hub_url, str(tmp_path / "hf"), offline=offline):
            status = main(["sft", "--model", minilm_path, "--output_dir", str(tmp_path / "out"), "--max_steps", "1",
                           "--per_device_train_batch_size", "2", "--max_length", "32", "--report_to", "none",
                           "--dataloader_num_workers", "0", "--disable_tqdm", "true", *flags])
        return status, capsys.readouterr().err

    hub_url = None

    def bind(url):
        nonlocal hub_url
        hub_url = url
        return run

    yield bind
    os.environ.clear()
    os.environ.update(saved)


def test_sft_trains_a_step_on_a_hub_dataset(hub, sft, tmp_path):
    status, err = sft(hub.url)("--use_hf", "true", "--dataset", "org/tiny-data#6")
    assert status == 0, err[-3000:]
    card = json.load(open(tmp_path / "out" / "checkpoint-1" / "mmembed.json"))
    assert card["data"]["train"] == [{"file": "hf::org/tiny-data[train]", "rows": 8}]
    assert card["data"]["train_rows"] == 6
    assert any(path.startswith("/datasets/org/tiny-data/resolve/") and path.endswith("/data/train.jsonl")
               for method, path, _ in hub.requests if method == "GET")


def test_a_bad_hub_row_is_named_by_hub_id_and_row_online_and_offline(hub, sft, tmp_path):
    run = sft(hub.url)
    want = "mmembed sft: error: hf::org/tiny-bad[train]:5 field 'response': empty text and no media"
    for offline in (False, True):  # offline: datasets' cache and the rows written online
        hub.clear_requests()
        status, err = run("--dataset", "hf::org/tiny-bad", offline=offline)
        assert status == 1 and want in err.splitlines(), err[-3000:]
        assert "Traceback" not in err
        assert bool(hub.requests) != offline
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
