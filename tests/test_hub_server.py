"""The loopback hub (tests/fixtures/hub_server.py) serves what the clients ask for: a model
repo and a dataset repo download whole with ``huggingface_hub.snapshot_download``, a dataset
loads with ``datasets.load_dataset("org/name")`` (HfFileSystem's tree, paths-info and ranged
reads), a download cut in the middle is resumed with a Range request, and the hub's errors
carry the codes the client turns into its exceptions."""

import filecmp
import json
import os

import pytest
from fixtures.hub_server import clients_pointed_at

# huggingface_hub keeps what it received in 10 MiB chunks: a cut after 12 MiB leaves one to resume from
MODEL_FILES = {"config.json": b'{"model_type": "bert"}', "sub/weights.safetensors": os.urandom(24 << 20)}


@pytest.fixture(scope="module")
def repos(hub_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("hub_repos")
    model = root / "model"
    for name, data in MODEL_FILES.items():
        (model / name).parent.mkdir(parents=True, exist_ok=True)
        (model / name).write_bytes(data)
    data = root / "data"
    (data / "train").mkdir(parents=True)
    rows = [{"query": f"q{i}", "response": f"r{i}"} for i in range(5)]
    (data / "train" / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "README.md").write_text("---\nlicense: mit\n---\n# rows\n")
    return {"model": str(model), "data": str(data), "rows": rows,
            "model_repo": hub_server.add_folder("server-test/model", str(model)),
            "data_repo": hub_server.add_folder("server-test/data", str(data), repo_type="dataset"),
            "gated": hub_server.add_folder("server-test/gated", str(model), gated=True, token="hf_open_sesame")}


def test_snapshot_download_of_a_model_and_a_dataset(hub_server, repos, tmp_path):
    with clients_pointed_at(hub_server.url, str(tmp_path / "hf")):
        from huggingface_hub import snapshot_download

        folder = snapshot_download("server-test/model")
        assert os.path.basename(folder) == repos["model_repo"].sha  # the cache's snapshots/COMMIT
        for name in MODEL_FILES:
            assert filecmp.cmp(os.path.join(folder, name), os.path.join(repos["model"], name), shallow=False)
        folder = snapshot_download("server-test/data", repo_type="dataset")
        assert filecmp.cmp(os.path.join(folder, "train", "rows.jsonl"), os.path.join(repos["data"], "train",
                                                                                      "rows.jsonl"), shallow=False)
    assert "/hub/datasets--server-test--data/snapshots/" in folder


def test_load_dataset_by_id(hub_server, repos, tmp_path):
    with clients_pointed_at(hub_server.url, str(tmp_path / "hf")):
        import datasets

        ds = datasets.load_dataset("server-test/data", split="train")
    assert ds.to_list() == repos["rows"]


def test_a_cut_download_resumes_with_a_range_request(hub_server, repos, tmp_path):
    hub_server.cut_once("server-test/model", "sub/weights.safetensors")
    hub_server.clear_requests()
    with clients_pointed_at(hub_server.url, str(tmp_path / "hf")):
        from huggingface_hub import snapshot_download

        folder = snapshot_download("server-test/model")
    assert filecmp.cmp(os.path.join(folder, "sub", "weights.safetensors"),
                       os.path.join(repos["model"], "sub", "weights.safetensors"), shallow=False)
    gets = [(path, rng) for method, path, rng in hub_server.requests
            if method == "GET" and path.endswith("/weights.safetensors")]
    url = f"/server-test/model/resolve/{repos['model_repo'].sha}/sub/weights.safetensors"
    assert [path for path, _ in gets] == [url, url]
    assert gets[0][1] is None and gets[1][1] == "bytes=10485760-"  # the second asks for the rest only


def test_errors_carry_the_hub_codes(hub_server, repos, tmp_path):
    with clients_pointed_at(hub_server.url, str(tmp_path / "hf")):
        from huggingface_hub import hf_hub_download, snapshot_download
        from huggingface_hub.errors import (
            EntryNotFoundError,
            GatedRepoError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        with pytest.raises(RepositoryNotFoundError):
            snapshot_download("server-test/nothing")
        with pytest.raises(RepositoryNotFoundError):
            snapshot_download("server-test/model", repo_type="dataset")  # a model is no dataset
        with pytest.raises(RevisionNotFoundError):
            snapshot_download("server-test/model", revision="v9")
        with pytest.raises(EntryNotFoundError):
            hf_hub_download("server-test/model", "absent.json")
        with pytest.raises(GatedRepoError):
            snapshot_download("server-test/gated")
        with pytest.raises(GatedRepoError):
            snapshot_download("server-test/gated", token="hf_wrong")
        folder = snapshot_download("server-test/gated", token="hf_open_sesame")
    assert os.path.isfile(os.path.join(folder, "config.json"))
