"""Several processes of one node resolve a hub id once (mmembed/training/hub_models.py): the
node's first process downloads, the other waits and then finds the same folder in the cache
without a request; when the first cannot resolve it, both stop with its line. The file the
waiting process polls for is removed once both have passed the final barrier."""

import json
import os
import re
from types import SimpleNamespace

from conftest import REPO, launch
from fixtures.hub_server import client_env

WORKER = os.path.join(REPO, "tests", "hub_once_worker.py")


def _run(tmp_path, hub_server, model: str) -> list[dict]:
    out = tmp_path / "result"
    flags = {"model": model, "use_hf": True, "dataset": ["unused.jsonl"], "output_dir": str(tmp_path / "run")}
    (tmp_path / "tmp").mkdir()
    launch([WORKER, "--out", str(out), "--flags", json.dumps(flags)], nproc=2,
           env={**client_env(hub_server.url, str(tmp_path / "hf_home")), "TMPDIR": str(tmp_path / "tmp")})
    assert os.listdir(tmp_path / "tmp") == []  # the hub marker removed after the last barrier
    return [json.loads((tmp_path / f"result.{rank}").read_text()) for rank in range(2)]


def test_two_processes_download_once(hub_server, minilm_path, tmp_path):
    repo = hub_server.add_folder("hubtest/once", minilm_path)
    hub_server.clear_requests()
    first, second = _run(tmp_path, hub_server, "hubtest/once")
    assert first == second and first["model"].endswith(f"/models--hubtest--once/snapshots/{repo.sha}")
    # the node's marker (node 0) was in the run's temporary folder until the final barrier
    assert len(first["markers"]) == 1 and re.fullmatch(r"mmembed-hub-[0-9a-f]{32}-0\.json", first["markers"][0])
    assert first["markers_after"] == []
    requests = [(method, path) for method, path, _ in hub_server.requests]
    assert requests.count(("GET", "/api/models/hubtest/once/revision/main")) == 1  # the waiting process asked nothing
    assert requests.count(("GET", f"/hubtest/once/resolve/{repo.sha}/model.safetensors")) == 1


def test_the_first_processs_error_stops_both(hub_server, tmp_path):
    first, second = _run(tmp_path, hub_server, "hubtest/nowhere")
    assert first == second and "'hubtest/nowhere' is no local folder and no model of Hugging Face" in first["error"]


def test_on_a_gpu_a_hub_ids_lora_dtype_waits_for_its_config(tmp_path, monkeypatch):
    """LoRA's frozen base takes the half precision of the model's config.json (ms-swift's
    default): for a hub id, once it is downloaded; the autocast is chosen with the flags."""
    import torch

    from mmembed.training.device_flags import device_defaults, dtype_after_download

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    args = SimpleNamespace(model="org/name", tuner_type="lora", torch_dtype=None, bf16=False, fp16=False,
                           length_chunks=1, length_buckets=True, dataloader_num_workers=0)
    device_defaults(args, cuda=True)
    assert args.torch_dtype is None and args.bf16
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    args.model = str(tmp_path)  # downloaded
    assert dtype_after_download(args, cuda=True) == ["--torch_dtype float16"] and args.torch_dtype == "float16"
    assert dtype_after_download(args, cuda=True) == []  # chosen once
