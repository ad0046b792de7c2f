"""A resume runs nothing planted in a checkpoint: every file it unpickles is read weights-only
(DeepSpeed's engine files too, with exactly the DeepSpeed types they hold allowed), and a file
changed since it was saved is refused by its sha256 in the manifest, by name, in one line.

The payload in every test is a pickle whose ``__reduce__`` calls ``open(MARKER, "w")``: loaded
as DeepSpeed loads its files (``torch.load(weights_only=False)``) it creates the marker file. It
is padded to the size of the file it replaces, so that the manifest's sizes accept it."""

import glob
import hashlib
import json
import os
import pickle
import shutil
import zipfile

import pytest
import torch
from conftest import REPO, stsb_pairs, write_jsonl
from forked_cli import run_cli
from safetensors.torch import load_file

from mmembed.training.checkpoints import COMPLETE_MARKER, DEEPSPEED_GLOBALS, UnsafeCheckpointError


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant(path, marker, rehash: bool) -> None:
    """Replace ``path`` with the payload, padded to the original size; with ``rehash`` the
    manifest's sha256 of it is rewritten too (as someone who can write the folder could)."""
    size = os.path.getsize(path)
    data = pickle.dumps(_Payload(marker), protocol=2)
    assert len(data) <= size
    with open(path, "wb") as f:
        f.write(data + b"\0" * (size - len(data)))
    assert os.path.getsize(path) == size
    with pytest.raises(Exception):  # noqa: B017  (what DeepSpeed's own load would do: run it)
        torch.load(path, weights_only=False)
    assert os.path.exists(marker)  # the payload is live
    os.remove(marker)
    if rehash:
        folder = _checkpoint_of(path)
        manifest_path = os.path.join(folder, COMPLETE_MARKER)
        manifest = json.load(open(manifest_path))
        rel = os.path.relpath(path, folder)
        manifest["sha256"][rel] = hashlib.sha256(open(path, "rb").read()).hexdigest()
        json.dump(manifest, open(manifest_path, "w"))


def _checkpoint_of(path):
    folder = os.path.dirname(path)
    return os.path.dirname(folder) if os.path.basename(folder).startswith("global_step") else folder


def _error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("mmembed sft: error:")]


# ---- without DeepSpeed: the Trainer's own state files -------------------------------------

@pytest.fixture(scope="module")
def setup(tmp_path_factory, minilm_no_dropout):
    """A LoRA run of 2 steps saving each, the uninterrupted reference."""
    d = tmp_path_factory.mktemp("resume-safety")
    data = write_jsonl(d / "train.jsonl", stsb_pairs(4))
    common = ["sft", "--model", minilm_no_dropout, "--dataset", data, "--per_device_train_batch_size", "2",
              "--max_steps", "2", "--save_steps", "1", "--max_length", "32", "--learning_rate", "5e-4",
              "--dataloader_num_workers", "0", "--disable_tqdm", "true", "--report_to", "none", "--lora_dropout", "0"]
    ref = d / "reference"
    r = run_cli(common + ["--output_dir", str(ref)])
    assert r.returncode == 0, r.stderr[-3000:]
    return d, common, ref


def test_the_manifest_holds_each_files_sha256(setup):
    _, _, ref = setup
    for ckpt in ("checkpoint-1", "checkpoint-2"):
        folder = ref / ckpt
        manifest = json.loads((folder / COMPLETE_MARKER).read_text())
        assert set(manifest["sha256"]) == set(manifest["files"])
        for name, digest in manifest["sha256"].items():
            assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest, name
        for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"):  # hashed as written
            assert zipfile.ZipFile(folder / name).namelist()[0].startswith("archive/"), name


FILES = ["rng_state.pth", "optimizer.pt", "scheduler.pt"]


@pytest.mark.parametrize("rehash", [False, True], ids=["hash-checked", "hash-rewritten"])
@pytest.mark.parametrize("name", FILES)
def test_a_planted_pickle_in_a_resume_file_is_refused_in_one_line(setup, tmp_path, name, rehash):
    _, common, ref = setup
    out = tmp_path / "out"
    shutil.copytree(ref / "checkpoint-1", out / "checkpoint-1")
    marker = tmp_path / "payload-ran"
    plant(str(out / "checkpoint-1" / name), marker, rehash)
    r = run_cli(common + ["--output_dir", str(out), "--resume_from_checkpoint", "true"])
    assert r.returncode == 1, r.stderr[-3000:]
    assert not marker.exists()
    lines = _error_lines(r.stderr)
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"{out / 'checkpoint-1' / name}: refused:" in lines[0]
    assert ("io.open" if rehash else "sha256 differs") in lines[0], lines[0]
    assert sorted(os.listdir(out)) == ["checkpoint-1"]  # refused before anything trained or saved


def test_a_checkpoint_from_before_hashes_resumes_to_the_uninterrupted_weights(setup, tmp_path):
    _, common, ref = setup
    out = tmp_path / "out"
    shutil.copytree(ref / "checkpoint-1", out / "checkpoint-1")
    manifest_path = out / "checkpoint-1" / COMPLETE_MARKER
    manifest = json.loads(manifest_path.read_text())
    del manifest["sha256"]  # as mmembed wrote it before content hashes
    manifest_path.write_text(json.dumps(manifest))
    r = run_cli(common + ["--output_dir", str(out), "--resume_from_checkpoint", "true"])
    assert r.returncode == 0, r.stderr[-3000:]
    a = load_file(str(ref / "checkpoint-2" / "adapter_model.safetensors"))
    b = load_file(str(out / "checkpoint-2" / "adapter_model.safetensors"))
    first = load_file(str(ref / "checkpoint-1" / "adapter_model.safetensors"))
    assert any(not torch.equal(a[k], first[k]) for k in a)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_trainers_own_loaders_name_a_refused_file(tmp_path):
    """Past the checks at start (a file swapped between them and the load), the Trainer's
    weights-only loaders' error names the file."""
    from mmembed.training.saving import refused_files_named

    path, marker = tmp_path / "rng_state.pth", tmp_path / "payload-ran"
    path.write_bytes(b"\0" * 4096)
    plant(str(path), marker, rehash=False)
    with refused_files_named(), pytest.raises(UnsafeCheckpointError, match=f"^{path}: refused: it needs io.open"):
        torch.load(str(path), weights_only=True)
    assert not marker.exists()
    assert torch.load.__module__ == "torch.serialization"  # put back


# ---- under DeepSpeed: the engine's model-states and optimizer files -------------------------

def _ds_sft(model, out, data, stage, nproc, *extra, check=True):
    """``mmembed sft`` under DeepSpeed ``stage``: one process forked from the test session's
    server (``NPROC_PER_NODE=1``: DeepSpeed in the process itself), or ``nproc`` processes
    forked with torchrun's variables (``forked_cli.run_ranks``)."""
    from forked_cli import run_ranks

    args = ["sft", "--model", model, "--dataset", data,
            "--tuner_type", "lora", "--lora_dropout", "0", "--per_device_train_batch_size", "2",
            "--gradient_accumulation_steps", "1", "--max_steps", "2", "--save_steps", "1", "--learning_rate", "1e-3",
            "--max_length", "32", "--deepspeed", stage, "--output_dir", str(out), "--disable_tqdm", "true",
            "--report_to", "none", "--dataloader_num_workers", "0", "--seed", "3", *extra]
    if nproc > 1:
        proc = run_ranks(["-m", "mmembed.tools.cli", *args], nproc, timeout=900, cwd=REPO)
    else:
        proc = run_cli(args, env={"OMP_NUM_THREADS": "1", "NPROC_PER_NODE": "1"}, timeout=900)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.mark.parametrize("stage", ["zero2", "zero3", "zero2_offload", "zero3_offload"])
def test_deepspeed_resume_loads_only_allowed_types_and_equals_the_uninterrupted_run(minilm_no_dropout, tmp_path,
                                                                                     stage):
    data = write_jsonl(tmp_path / "train.jsonl", stsb_pairs(4))
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    _ds_sft(minilm_no_dropout, whole, data, stage, 1)
    engine_files = glob.glob(str(whole / "checkpoint-1" / "global_step1" / "*.pt"))
    assert engine_files
    allowed = set(DEEPSPEED_GLOBALS)
    for path in engine_files:  # what DeepSpeed writes, beside tensors and containers: inside the allowlist
        found = set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
        assert found <= allowed, (stage, path, found - allowed)
    shutil.copytree(whole / "checkpoint-1", resumed / "checkpoint-1")
    _ds_sft(minilm_no_dropout, resumed, data, stage, 1, "--resume_from_checkpoint", "true")
    a = load_file(str(whole / "checkpoint-2" / "adapter_model.safetensors"))
    b = load_file(str(resumed / "checkpoint-2" / "adapter_model.safetensors"))
    first = load_file(str(whole / "checkpoint-1" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and any(not torch.equal(a[k], first[k]) for k in a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-6, rtol=1e-5, msg=k)


@pytest.fixture(scope="module")
def zero2_two_processes(minilm_no_dropout, tmp_path_factory):
    d = tmp_path_factory.mktemp("zero2-two")
    data = write_jsonl(d / "train.jsonl", stsb_pairs(8))
    _ds_sft(minilm_no_dropout, d / "whole", data, "zero2", 2, "--max_steps", "1")
    return d, data


def test_the_manifest_of_a_two_process_deepspeed_checkpoint_holds_every_files_sha256(zero2_two_processes):
    """Each process hashes the engine files it writes (rank 1: its optimizer shard); the
    publisher's manifest holds them all, equal to the finished files."""
    d, _ = zero2_two_processes
    folder = d / "whole" / "checkpoint-1"
    manifest = json.loads((folder / COMPLETE_MARKER).read_text())
    assert set(manifest["sha256"]) == set(manifest["files"])
    shards = [name for name in manifest["sha256"] if name.startswith("global_step1") and name.endswith(".pt")]
    assert os.path.join("global_step1", "zero_pp_rank_1_mp_rank_00_optim_states.pt") in shards
    for name, digest in manifest["sha256"].items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest, name
    for name in shards:
        assert zipfile.ZipFile(folder / name).namelist()[0].startswith("archive/"), name


def test_deepspeed_engine_files_load_weights_only(zero2_two_processes, tmp_path):
    """The engine's own load, as mmembed replaces it during a resume: a real optimizer shard
    loads (its DeepSpeed types allowed), the payload is refused by name and never runs."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from mmembed.training.saving import deepspeed_safe_loads

    d, _ = zero2_two_processes
    shard = sorted(glob.glob(str(d / "whole" / "checkpoint-1" / "global_step1" / "*optim_states.pt")))[0]
    engine = type("Engine", (), {})()
    engine.checkpoint_engine = TorchCheckpointEngine()
    payload, marker = tmp_path / "x.pt", tmp_path / "payload-ran"
    payload.write_bytes(b"\0" * 4096)
    plant(str(payload), marker, rehash=False)
    with deepspeed_safe_loads(engine):
        state = engine.checkpoint_engine.load(shard, map_location="cpu")
        with pytest.raises(UnsafeCheckpointError, match=f"^{payload}: refused: it needs io.open"):
            engine.checkpoint_engine.load(str(payload), map_location="cpu")
    assert not marker.exists()
    reference = torch.load(shard, map_location="cpu", weights_only=False)  # DeepSpeed's own load, on a clean file
    assert state.keys() == reference.keys()
    assert type(state["optimizer_state_dict"]["loss_scaler"]) is type(reference["optimizer_state_dict"]["loss_scaler"])
    assert engine.checkpoint_engine.load.__func__ is TorchCheckpointEngine.load  # put back


@pytest.mark.parametrize("rehash", [False, True], ids=["hash-checked", "hash-rewritten"])
@pytest.mark.parametrize("which", ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                   "zero_pp_rank_1_mp_rank_00_optim_states.pt"])
def test_a_planted_pickle_in_a_deepspeed_file_never_runs(minilm_no_dropout, zero2_two_processes, tmp_path, which,
                                                         rehash):
    d, data = zero2_two_processes
    out = tmp_path / "out"
    shutil.copytree(d / "whole" / "checkpoint-1", out / "checkpoint-1")
    target = out / "checkpoint-1" / "global_step1" / which
    marker = tmp_path / "payload-ran"
    plant(str(target), marker, rehash)
    proc = _ds_sft(minilm_no_dropout, out, data, "zero2", 2, "--resume_from_checkpoint", "true", check=False)
    assert proc.returncode != 0
    assert not marker.exists()
    lines = _error_lines(proc.stderr)
    assert lines and all(line == lines[0] for line in lines), proc.stderr[-4000:]  # every process: the same line
    assert f"{target}: refused:" in lines[0]
    assert ("io.open" if rehash else "sha256 differs") in lines[0], lines[0]
    assert sorted(os.listdir(out)) == ["checkpoint-1"]
