"""ms-swift's own embedding example scripts, as ms-swift ships them (tests/fixtures/swift/scripts,
see its SOURCE.md), run with one edit, ``swift sft`` -> ``mmembed sft``, and without ``USE_HF``:
the scripts name ModelScope ids, ms-swift's default hub, and modelscope's own client downloads
them (models and datasets) from the loopback ModelScope of tests/fixtures/modelscope_server.py
(``MODELSCOPE_ENDPOINT``). The hub serves tiny random models and a few rows under the ids the
scripts name, so each script trains end to end as written: its process count, DeepSpeed stage, epochs,
dtype, ``--attn_impl flash_attn`` (no GPU here: SDPA, said in a warning), dataset subsets and
split. Each run's last checkpoint is complete, records the hub snapshot it started from, and
embeds. The script's ``mmembed`` forks its NPROC_PER_NODE processes from one server
(tests/forked_mmembed.py) instead of relaunching them under torchrun, which the relaunch tests
of tests/training/test_distributed.py run (``MMEMBED_TEST_TORCHRUN=1``: torchrun here too)."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import DATA, REPO, stsb_pairs, write_jsonl
from fixtures.modelscope_server import modelscope_env

from mmembed.training.checkpoints import find_last_complete_checkpoint

MM = os.path.join(DATA, "mm")
SCRIPTS = os.path.join(REPO, "tests", "fixtures", "swift", "scripts")
SHAPES = [f"{c}_{s}" for c in ("red", "green", "blue", "yellow") for s in ("circle", "square", "triangle")]


def _stsb_rows() -> list[dict]:
    """sentence-transformers/stsb's columns (scores in 0..1); 40 pairs scored >= 0.75, which
    ms-swift's ``:positive`` subset keeps, and 8 below it, which it drops."""
    pairs = stsb_pairs(48)
    return [{"sentence1": p["query"], "sentence2": p["response"], "score": 0.9 if i % 6 else 0.3}
            for i, p in enumerate(pairs)]


def _textcaps(path: str, n: int, offset: int) -> str:
    """HuggingFaceM4/TextCaps' columns (the image embedded in the parquet file, as the hub
    stores it; its reference captions) for ``n`` rows of the shape pictures."""
    import datasets

    features = datasets.Features({"image": datasets.Image(), "image_id": datasets.Value("string"),
                                  "reference_strs": datasets.List(datasets.Value("string"))})
    shapes = [SHAPES[(offset + i) % len(SHAPES)] for i in range(n)]
    images = [{"bytes": open(os.path.join(MM, f"{s}.png"), "rb").read(), "path": None} for s in shapes]
    datasets.Dataset.from_dict({"image": images, "image_id": [f"{offset + i}" for i in range(n)],
                                "reference_strs": [[f"a {s.replace('_', ' ')}", f"the {s.split('_')[1]}"] for s in shapes]},
                               features=features).to_parquet(path)
    return path


@pytest.fixture(scope="module")
def swift_hub(modelscope_server, tiny_model, tmp_path_factory):
    """The loopback ModelScope with the scripts' models (tiny random ones of the same
    architecture) and datasets."""
    hub_server = modelscope_server
    root = tmp_path_factory.mktemp("swift_hub")
    hub_server.add_folder("Qwen/Qwen3-Embedding-4B", tiny_model("qwen3"))
    hub_server.add_folder("Qwen/Qwen3-VL-Embedding-8B", tiny_model("qwen3_vl"))
    hub_server.add_folder("iic/gme-Qwen2-VL-2B-Instruct", tiny_model("qwen2_vl"))
    stsb = write_jsonl(root / "stsb" / "train.jsonl", _stsb_rows())
    hub_server.add_files("sentence-transformers/stsb", {"train.jsonl": stsb}, repo_type="dataset")
    # train_gme.sh's global batch: 2 rows x 8 processes x 8 accumulation steps = 128 rows a step
    (root / "textcaps").mkdir()
    # ms-swift loads a registered dataset's id as the script writes it (swift/TextCaps), with the
    # mapping of the registered dataset of the same name (HuggingFaceM4/TextCaps' columns)
    hub_server.add_files("swift/TextCaps", {
        "data/train-00000-of-00001.parquet": _textcaps(str(root / "textcaps" / "train.parquet"), 136, 0),
        "data/validation-00000-of-00001.parquet": _textcaps(str(root / "textcaps" / "validation.parquet"), 8, 136),
    }, repo_type="dataset")
    return hub_server


def run_swift_script(name: str, hub, tmp_path) -> tuple[subprocess.CompletedProcess, str]:
    """ms-swift's script ``name`` with ``swift sft`` -> ``mmembed sft``, run by bash in an empty
    folder (its ``--output_dir output`` lands there); (the finished process, that folder)."""
    text = open(os.path.join(SCRIPTS, name), encoding="utf-8").read()
    assert text.count("swift sft") == 1
    work = tmp_path / "run"
    work.mkdir()
    script = work / name
    script.write_text(text.replace("swift sft", "mmembed sft"))
    # the script's `mmembed`: tests/forked_mmembed.py, which forks NPROC_PER_NODE's processes from one
    # server rather than relaunching them under torchrun (MMEMBED_TEST_TORCHRUN=1: mmembed's own)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "tmp").mkdir()
    (bin_dir / "mmembed").write_text(f"#!/bin/sh\nexec {sys.executable} {os.path.join(REPO, 'tests', 'forked_mmembed.py')} \"$@\"\n")
    (bin_dir / "mmembed").chmod(0o755)
    # online (the suite runs with HF_HUB_OFFLINE=1, which mmembed applies to both hubs); Hugging Face's
    # endpoint a closed loopback port, so that nothing reaches for it
    env = dict(os.environ, **modelscope_env(hub.url, str(tmp_path / "ms_cache"), str(tmp_path / "ms_home")),
               HF_HUB_OFFLINE="0", HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf_home"),
               OMP_NUM_THREADS="1", MMEMBED_HUB_CACHE=str(tmp_path / "rows"), TMPDIR=str(tmp_path / "tmp"),
               PATH=os.pathsep.join([str(bin_dir), os.path.dirname(sys.executable), os.environ["PATH"]]))
    proc = subprocess.run(["bash", str(script)], cwd=work, env=env, capture_output=True, text=True, timeout=900)
    return proc, str(work / "output")


@pytest.mark.parametrize("name, model, dataset, steps, warning", [
    # 40 positive pairs, 1 held out (0.02), 39 in batches of 8 x 2 processes (last dropped): 2 steps x 5 epochs
    ("qwen3_emb.sh", "Qwen--Qwen3-Embedding-4B", "ms::sentence-transformers/stsb:positive[train]", 10, True),
    # 144 captioned pictures, 3 held out (0.02), 141 in batches of 16: 8 steps, 1 epoch
    ("qwen3_vl_emb.sh", "Qwen--Qwen3-VL-Embedding-8B", "ms::swift/TextCaps:emb[train]", 8, True),
    # 8 processes under ZeRO-3, 2 rows each x 8 accumulation steps: 1 step of 128 rows
    ("train_gme.sh", "iic--gme-Qwen2-VL-2B-Instruct", "ms::swift/TextCaps:emb[train]", 1, False),
], ids=["qwen3_emb", "qwen3_vl_emb", "train_gme"])
def test_ms_swifts_script_runs_with_only_the_command_renamed(swift_hub, tmp_path, name, model, dataset, steps, warning):
    from mmembed import Embedder

    proc, output = run_swift_script(name, swift_hub, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ckpt = find_last_complete_checkpoint(output)  # the newest checkpoint with its completion marker
    assert ckpt is not None and ckpt.endswith(f"checkpoint-{steps}"), os.listdir(output)
    assert os.path.isfile(os.path.join(ckpt, "adapter_model.safetensors"))  # --tuner_type lora
    saved = json.loads(open(os.path.join(ckpt, "mmembed.json"), encoding="utf-8").read())
    assert f"/ms_cache/models/{model}/snapshots/master" in saved["base_model"]  # modelscope's cache
    assert dataset in open(os.path.join(ckpt, "README.md"), encoding="utf-8").read()
    metrics = json.loads(proc.stdout[proc.stdout.rindex("{\n"):])  # what mmembed sft prints last
    assert np.isfinite(metrics["train_loss"])
    assert ("--attn_impl flash_attn: no GPU here" in proc.stderr) == warning
    # the file each node's waiting processes polled for (the model's hub id) is gone after the run
    assert not [n for n in os.listdir(tmp_path / "tmp") if n.startswith("mmembed-hub-")]
    inputs = ["a red circle"]
    if "VL" in model:
        inputs.append({"query": "<image>", "images": [os.path.join(MM, "red_circle.png")]})
    vec = Embedder.from_pretrained(ckpt).encode(inputs)
    assert vec.shape[0] == len(inputs) and np.allclose(np.linalg.norm(vec, axis=1), 1, atol=1e-3)


def test_the_scripts_are_ms_swifts_as_published():
    """The fixtures are the files SOURCE.md names, byte for byte: a script edited to make a test
    pass would no longer be ms-swift's (the digests are those of ms-swift's commit)."""
    import hashlib

    source = open(os.path.join(SCRIPTS, "SOURCE.md"), encoding="utf-8").read()
    listed = dict(re.findall(r"^\| `([\w./]+)` \| `([0-9a-f]{64})` \|$", source, re.M))
    assert sorted(os.path.basename(p) for p in listed) == sorted(f for f in os.listdir(SCRIPTS) if f.endswith(".sh"))
    for path, digest in listed.items():
        data = open(os.path.join(SCRIPTS, os.path.basename(path)), "rb").read()
        assert hashlib.sha256(data).hexdigest() == digest, path
        assert b"swift sft" in data and b"mmembed" not in data
