"""Models by ModelScope id (mmembed/hub.py; ModelScope is ms-swift's default hub), against the
loopback ModelScope of tests/fixtures/modelscope_server.py serving all-MiniLM-L6-v2's files (and
one file of each format ms-swift skips) as modelscope.cn serves a model: ``resolve_model``
downloads it with modelscope's own client through ``MODELSCOPE_ENDPOINT`` into an empty
``MODELSCOPE_CACHE`` (the weights' download cut in the middle once, and resumed); offline, a
second resolve finds it in the cache with no request; an unknown id or revision is one line;
``mmembed sft --model ORG/NAME`` with the variables set trains one step from the same cache.
One download for the file: the tests share it (the module fixture ``downloaded``)."""

import filecmp
import fnmatch
import json
import os

import pytest
from conftest import hub_error_line, stsb_pairs, write_jsonl
from fixtures.modelscope_server import modelscope_env, modelscope_pointed_at
from forked_cli import run_cli

from mmembed.hub import IGNORE_PATTERNS, HubOptions, resolve_model

MINILM = "mstest/minilm"
# a file for each of ms-swift's ignore patterns (mmembed.hub.IGNORE_PATTERNS), published beside MiniLM's
SKIPPED = ["archive.zip", "model-q4_k_m.gguf", "model.pth", "model.pt", "consolidated.00.bin", "onnx/config.json",
           "model.safetensors.md", "flax_model.msgpack", "model.onnx", "rust_model.ot", "tf_model.h5"]


def _files(folder: str) -> dict[str, str]:
    """Every file under ``folder`` (hidden ones too): path relative to it, with / -> path."""
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            out[os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")] = os.path.join(root, name)
    return out


@pytest.fixture(scope="module")
def ms(modelscope_server, minilm_path, tmp_path_factory):
    """The loopback ModelScope with MiniLM's files and the SKIPPED ones as ``mstest/minilm``."""
    extra = tmp_path_factory.mktemp("ms_skipped")
    files = _files(minilm_path)
    for name in SKIPPED:
        (extra / name).parent.mkdir(parents=True, exist_ok=True)
        (extra / name).write_bytes(f"not downloaded: {name}\n".encode())
        files[name] = str(extra / name)
    modelscope_server.add_files(MINILM, files)
    return modelscope_server


@pytest.fixture(scope="module")
def downloaded(ms, tmp_path_factory):
    """``resolve_model("mstest/minilm", "--model", HubOptions())`` (ModelScope, the default) into
    an empty MODELSCOPE_CACHE, the weights' download cut after half its bytes once."""
    root = tmp_path_factory.mktemp("ms_download")
    cache, home = str(root / "cache"), str(root / "home")
    ms.cut_once(MINILM, "model.safetensors")
    ms.clear_requests()
    with modelscope_pointed_at(ms.url, cache, home):
        folder = resolve_model(MINILM, "--model", HubOptions())
    return {"folder": folder, "cache": cache, "home": home, "requests": ms.requests, "fetched": ms.fetched(MINILM)}


def test_a_modelscope_id_downloads_through_modelscope_endpoint(downloaded, minilm_path):
    folder = downloaded["folder"]
    assert folder == os.path.join(os.path.realpath(downloaded["cache"]), "models", "mstest--minilm", "snapshots", "master")
    want = _files(minilm_path)
    assert sorted(_files(folder)) == sorted(want)  # MiniLM's files, and nothing of SKIPPED (nor partial files)
    for name, source in want.items():
        assert filecmp.cmp(os.path.join(folder, name), source, shallow=False), name
    assert all(any(fnmatch.fnmatch(name, p) for p in IGNORE_PATTERNS) for name in SKIPPED)  # each one is skipped...
    fetched = downloaded["fetched"]
    assert not {name for name, _ in fetched} & set(SKIPPED)  # ... by the client, which never asks for it
    listings = [target for method, target, _ in downloaded["requests"] if "/repo/files?" in target]
    assert listings == [f"/api/v1/models/{MINILM}/repo/files?Revision=master&Recursive=True"]
    # the weights (an LFS file: redirected to the storage) cut once, then asked for from where the cut left them
    weights = [rng for name, rng in fetched if name == "model.safetensors"]
    assert len(weights) == 2 and weights[0] is None
    size = os.path.getsize(want["model.safetensors"])
    assert weights[1].startswith("bytes=") and 0 < int(weights[1][len("bytes="):].rstrip("-")) < size
    assert sorted(name for name, _ in fetched if name != "model.safetensors") == sorted(set(want) - {"model.safetensors"})


def test_offline_a_second_resolve_reads_the_cache_with_no_request(downloaded, ms):
    ms.clear_requests()
    with modelscope_pointed_at(ms.url, downloaded["cache"], downloaded["home"]):
        assert resolve_model(MINILM, "--model", HubOptions(offline=True)) == downloaded["folder"]
        assert resolve_model(MINILM, "--model", HubOptions(), cached_only=True) == downloaded["folder"]  # a node's others
    assert ms.requests == []


def test_what_modelscope_refuses_is_one_line_naming_the_id(ms, tmp_path):
    ms.clear_requests()
    with modelscope_pointed_at(ms.url, str(tmp_path / "cache"), str(tmp_path / "home")):
        absent = hub_error_line("mstest/absent", HubOptions())
        assert f"is no local folder and no model of ModelScope ({ms.url}): check the id" in absent
        assert "MODELSCOPE_API_TOKEN" in absent
        revision = hub_error_line(MINILM, HubOptions(revision="v9"))  # the hub lists no files at an unknown revision
        assert f"ModelScope ({ms.url}) has no files of {MINILM} to download at revision v9" in revision
        offline = hub_error_line(MINILM, HubOptions(offline=True))  # an empty cache
        assert "not in the ModelScope cache" in offline and "HF_HUB_OFFLINE" in offline
    assert [target.split("?")[0] for _, target, _ in ms.requests] == [
        "/api/v1/models/mstest/absent/repo/files", f"/api/v1/models/{MINILM}/repo/files"]  # offline: none
    assert ms.fetched() == []


def test_sft_trains_a_modelscope_id(downloaded, ms, tmp_path):
    """``mmembed sft --model mstest/minilm`` (no --use_hf) in a new process with MODELSCOPE_ENDPOINT
    and MODELSCOPE_CACHE set: the client there asks the loopback hub (its file list) and finds
    every file in the cache, checked against the list; one training step."""
    data = write_jsonl(tmp_path / "train.jsonl", stsb_pairs(4))
    ms.clear_requests()
    env = {**modelscope_env(ms.url, downloaded["cache"], downloaded["home"]), "HF_HUB_OFFLINE": "0"}  # online
    r = run_cli(["sft", "--model", MINILM, "--dataset", data, "--output_dir", str(tmp_path / "out"),
                 "--max_steps", "1", "--save_steps", "1", "--per_device_train_batch_size", "2", "--max_length", "32",
                 "--report_to", "none", "--disable_tqdm", "true"], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "out" / "checkpoint-1" / "adapter_model.safetensors").is_file()
    saved = json.loads((tmp_path / "out" / "checkpoint-1" / "mmembed.json").read_text())
    assert saved["base_model"] == downloaded["folder"]
    assert [target.split("?")[0] for _, target, _ in ms.requests] == [f"/api/v1/models/{MINILM}/repo/files"]
    assert ms.fetched() == []  # nothing downloaded again
