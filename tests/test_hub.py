"""Models by hub id (mmembed/hub.py), against the loopback hub of tests/fixtures/hub_server.py
serving all-MiniLM-L6-v2's files as Hugging Face serves a repository: ``mmembed sft --use_hf
true --model ORG/NAME`` downloads it (a download cut in the middle resumes) and trains; later
commands find it in the cache with ``HF_HUB_OFFLINE=1``; a local folder of the same spelling
wins; an unknown, gated or unreachable model, or one not cached when offline, is one line
naming the id and what to do. ModelScope here: its cache layout read offline, and the line that
asks for the package when it is not installed (its downloads, from a loopback ModelScope:
tests/test_hub_modelscope.py)."""

import json
import os
import shutil
import sys

import pytest
from conftest import free_port, hub_error_line, stsb_pairs, write_jsonl
from fixtures.hub_server import client_env, clients_pointed_at
from forked_cli import run_cli

from mmembed.hub import HubOptions, is_hub_id, resolve_model

HF = HubOptions(use_hf=True)
MINILM = "hubtest/minilm"
DATA = "hubtest/tiny-data"  # a dataset repository: one JSONL file of 4 rows


@pytest.fixture(scope="module")
def hub(hub_server, minilm_path, tmp_path_factory):
    """The hub with MiniLM as ``hubtest/minilm`` and as the gated ``hubtest/gated`` (opened
    by the token ``hf_gate_key``)."""
    # MiniLM's files and, beside them, one for each of ms-swift's ignore patterns (none downloaded)
    skipped = tmp_path_factory.mktemp("hf_skipped")
    files = {os.path.relpath(os.path.join(root, n), minilm_path): os.path.join(root, n)
             for root, _, names in os.walk(minilm_path) for n in names}
    for name in ("model.onnx", "onnx/model.onnx", "flax_model.msgpack", "tf_model.h5", "pytorch_model.pt", "weights.zip"):
        (skipped / name).parent.mkdir(parents=True, exist_ok=True)
        (skipped / name).write_text(f"not downloaded: {name}\n")
        files[name] = str(skipped / name)
    hub_server.add_files(MINILM, files)
    hub_server.add_folder("hubtest/gated", minilm_path, gated=True, token="hf_gate_key")
    rows = tmp_path_factory.mktemp("hub_data") / "train.jsonl"
    write_jsonl(rows, stsb_pairs(4))
    hub_server.add_files(DATA, {"train.jsonl": str(rows)}, repo_type="dataset")
    return hub_server


@pytest.fixture(scope="module")
def trained(hub, tmp_path_factory):
    """``mmembed sft --use_hf true --model hubtest/minilm --dataset hubtest/tiny-data``, one step,
    into an empty HF_HOME, with the weights' download cut in the middle once."""
    root = tmp_path_factory.mktemp("hub_sft")
    home = str(root / "hf_home")
    data = write_jsonl(root / "train.jsonl", stsb_pairs(4))
    hub.cut_once(MINILM, "model.safetensors")
    hub.clear_requests()
    env = {**client_env(hub.url, home), "MMEMBED_HUB_CACHE": str(root / "rows")}
    r = run_cli(["sft", "--use_hf", "true", "--model", MINILM, "--dataset", DATA, "--output_dir", str(root / "out"),
                 "--max_steps", "1", "--save_steps", "1", "--per_device_train_batch_size", "2", "--max_length", "32",
                 "--report_to", "none", "--disable_tqdm", "true"], env=env)
    return {"result": r, "home": home, "out": root / "out", "requests": hub.requests, "data": data}


def test_sft_trains_a_hugging_face_id_whose_download_was_cut(trained, hub):
    r = trained["result"]
    assert r.returncode == 0, r.stderr[-3000:]
    assert (trained["out"] / "checkpoint-1" / "adapter_model.safetensors").is_file()
    saved = json.loads((trained["out"] / "checkpoint-1" / "mmembed.json").read_text())
    assert "/hub/models--hubtest--minilm/snapshots/" in saved["base_model"]
    weights = [rng for method, path, rng in trained["requests"] if method == "GET" and path.endswith("/model.safetensors")]
    assert weights[0] is None and weights[1].startswith("bytes=") and len(weights) == 2  # resumed, not restarted
    assert "Trying to resume download" in r.stderr  # huggingface_hub's own report and progress bars
    assert "Fetching" in r.stderr
    skipped = [path for method, path, _ in trained["requests"] if "/resolve/" in path and
               path.endswith((".onnx", ".h5", ".msgpack", ".pt", ".zip"))]
    assert not skipped  # ms-swift's ignore patterns: published, never fetched
    assert any(path.startswith(f"/datasets/{DATA}/resolve/") for _, path, _ in trained["requests"])  # the rows too
    assert "hf::hubtest/tiny-data[train]" in (trained["out"] / "checkpoint-1" / "README.md").read_text()


def test_offline_a_later_command_reads_the_cache(trained, hub, tmp_path):
    texts = tmp_path / "in.txt"
    texts.write_text("a flute\na violin\n")
    hub.clear_requests()
    r = run_cli(["embed", "--use_hf", "--model", MINILM, "--input", str(texts), "--output", str(tmp_path / "e.npy")],
                env=client_env(hub.url, trained["home"], offline=True))
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "e.npy").is_file() and hub.requests == []


def test_a_local_folder_wins_over_an_id_of_the_same_spelling(hub, minilm_path, tmp_path, monkeypatch):
    shutil.copytree(minilm_path, tmp_path / "hubtest" / "minilm", symlinks=True)
    monkeypatch.chdir(tmp_path)
    hub.clear_requests()
    with clients_pointed_at(hub.url, str(tmp_path / "hf")):
        assert resolve_model(MINILM, "--model", HF) == MINILM
        assert resolve_model("hubtest:minilm", "--model", HF) == "hubtest/minilm"  # ms-swift's ORG/NAME:SUB rule
    assert hub.requests == []


def test_what_the_hub_refuses_is_one_line_naming_the_id(hub, tmp_path):
    with clients_pointed_at(hub.url, str(tmp_path / "hf")):
        assert "no model of Hugging Face" in hub_error_line("hubtest/absent", HF)
        assert "gated model" in hub_error_line("hubtest/gated", HF)
        assert "gated model" in hub_error_line("hubtest/gated", HubOptions(use_hf=True, token="hf_wrong"))
        opened = resolve_model("hubtest/gated", "--model", HubOptions(use_hf=True, token="hf_gate_key"))
        assert os.path.isfile(os.path.join(opened, "model.safetensors"))
        assert "--model_revision v9 is not a branch" in hub_error_line(MINILM, HubOptions(use_hf=True, revision="v9"))
        offline = hub_error_line(MINILM, HubOptions(use_hf=True, offline=True))  # an empty cache
        assert "not in the Hugging Face cache" in offline and "HF_HUB_OFFLINE" in offline
    with clients_pointed_at(f"http://127.0.0.1:{free_port()}", str(tmp_path / "hf2")):  # nothing listens there
        assert "could not be reached" in hub_error_line(MINILM, HF)
    assert "nor a hub id" in hub_error_line("/no/such/model", HF)
    assert "nor a hub id" in hub_error_line("./relative/missing", HF)
    assert [is_hub_id(s) for s in ("org/name", "gpt2", "org/name:sub/dir", "a/b/c", "/abs", "~/m")] == [
        True, True, True, False, False, False]


def test_a_command_stops_with_the_line_and_status_2(hub, tmp_path):
    r = run_cli(["embed", "--use_hf", "true", "--model", "hubtest/absent", "--input", "x.txt", "--output", "y.npy"],
                env=client_env(hub.url, str(tmp_path / "hf")))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("mmembed embed: error: --model 'hubtest/absent' is no local")


def test_modelscope_without_its_package_asks_for_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "modelscope", None)  # import modelscope raises ImportError
    message = hub_error_line(MINILM, HubOptions())
    assert "pip install 'mmembed[modelscope]'" in message and "--use_hf true" in message


def test_modelscope_ids_resolve_offline_from_its_cache_layout(minilm_path, tmp_path, monkeypatch):
    pytest.importorskip("modelscope")
    # modelscope >= 1.38 (modelscope-hub) keeps MODELSCOPE_CACHE/models/ORG--NAME/snapshots/REVISION
    snapshot = tmp_path / "ms" / "models" / "hubtest--minilm" / "snapshots" / "master"
    shutil.copytree(minilm_path, snapshot, symlinks=True)
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "ms"))
    from modelscope_hub import config

    monkeypatch.setattr(config, "_default_config", None, raising=False)  # read MODELSCOPE_CACHE again
    assert resolve_model(MINILM, "--model", HubOptions(offline=True)) == str(snapshot)
    assert "not in the ModelScope cache" in hub_error_line("hubtest/absent", HubOptions(offline=True))
