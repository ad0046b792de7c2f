"""Checkpoints are whole or absent whatever is killed when, resuming equals the uninterrupted
run, and a rerun into the same --output_dir continues, replaces or is refused.

Each run is the real command line in a child process (tests/forked_cli.py) that
``MMEMBED_TEST_KILL_AT=POINT:N`` kills with SIGKILL the N-th time it reaches a point of saving
or rotation (mmembed/training/checkpoints.py). The reference is an uninterrupted run that keeps
every checkpoint; weights are compared exactly (one CPU thread, the same order of operations)."""

import json
import os
import shutil

import pytest
import torch
from conftest import stsb_pairs
from forked_cli import run_cli
from safetensors.torch import load_file

from mmembed.training.charts import CHARTS_DIR
from mmembed.training.checkpoints import (
    COMPLETE_MARKER,
    TEST_POINTS,
    find_last_complete_checkpoint,
    is_complete,
    is_model_only,
)

# every file a LoRA checkpoint needs to embed with it and to resume training from it
REQUIRED = ("adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "tokenizer_config.json",
            "mmembed.json", "training_args.bin", "rng_state.pth", "optimizer.pt", "scheduler.pt", "trainer_state.json")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, minilm_path):
    """8 STS-B pairs (4 steps of 2 rows) and the uninterrupted reference run, all checkpoints kept."""
    d = tmp_path_factory.mktemp("ckpt")
    rows = stsb_pairs(8)
    data = d / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["sft", "--model", minilm_path, "--dataset", str(data), "--per_device_train_batch_size", "2",
              "--gradient_accumulation_steps", "1", "--max_steps", "4", "--save_steps", "1", "--max_length", "32",
              "--learning_rate", "5e-4", "--dataloader_num_workers", "0", "--disable_tqdm", "true",
              "--report_to", "none", "--logging_steps", "1"]
    ref = d / "reference"
    r = run_cli(common + ["--output_dir", str(ref)])
    assert r.returncode == 0, r.stderr[-3000:]
    return d, common, ref


def _folders(out):
    """What a run left in its --output_dir beside its charts."""
    return sorted(n for n in os.listdir(out) if n != CHARTS_DIR)


def _reported(result):
    """The metrics JSON ``mmembed sft`` prints at the end (the Trainer's log lines are one-line dicts)."""
    return json.loads(result.stdout[result.stdout.index("{\n"):])


def _weights(ckpt):
    return load_file(os.path.join(ckpt, "adapter_model.safetensors"))


def _assert_same_weights(ckpt, ref_ckpt):
    ours, ref = _weights(ckpt), _weights(ref_ckpt)
    assert ours.keys() == ref.keys()
    different = [k for k in ref if not torch.equal(ours[k], ref[k])]
    assert not different, f"{ckpt} differs from {ref_ckpt} in {different[:3]}"


def _assert_marked_ones_are_whole(out, ref):
    """Every folder that carries the marker holds every file and the reference's weights of its step."""
    for name in _folders(out):
        path = out / name
        if not (path / COMPLETE_MARKER).exists():
            continue
        # a staging folder is marked just before its rename; resuming never looks at it, but it is whole too
        assert name.startswith(("checkpoint-", ".partial-checkpoint-")), f"{name} is marked but not a checkpoint"
        missing = [f for f in REQUIRED if not (path / f).is_file()]
        assert not missing, f"{name} is marked complete but lacks {missing}"
        manifest = json.loads((path / COMPLETE_MARKER).read_text())
        assert set(REQUIRED) <= set(manifest["files"])
        for f, size in manifest["files"].items():
            assert (path / f).stat().st_size == size, f"{name}/{f}"
        assert json.loads((path / "trainer_state.json").read_text())["global_step"] == manifest["step"]
        _assert_same_weights(path, ref / name.removeprefix(".partial-"))


# (point, N-th time it is reached, the newest checkpoint that must be whole after the kill).
# With --save_total_limit 2 the save of step 3 rotates checkpoint-1 out, that of step 4 checkpoint-2.
KILLS = [
    ("save:begin", 2, 1),        # before anything of checkpoint-2 is written
    ("save:model", 3, 2),        # weights written, optimizer / RNG / trainer state not yet
    ("save:written", 4, 3),      # the final save: every file written, not yet flushed and marked
    ("save:marked", 2, 1),       # marked but not yet renamed to checkpoint-2
    ("save:renamed", 4, 4),      # the final checkpoint renamed, rotation not yet begun
    ("rotate:unmarked", 1, 3),   # checkpoint-1's marker removed, its files not yet deleted
    ("rotate:deleting", 2, 4),   # checkpoint-2 half deleted
    ("rotate:done", 3, 3),       # reached after every save (step 3: checkpoint-1 gone)
]


def test_every_kill_point_is_tested():
    assert {p for p, _, _ in KILLS} == set(TEST_POINTS)


@pytest.mark.parametrize("point,hit,newest", KILLS, ids=[f"{p}:{n}" for p, n, _ in KILLS])
def test_killed_anywhere_in_save_or_rotation_resumes_to_the_uninterrupted_result(setup, point, hit, newest):
    d, common, ref = setup
    out = d / f"killed-{point.replace(':', '-')}-{hit}"
    args = common + ["--output_dir", str(out), "--save_total_limit", "2"]
    killed = run_cli(args, env={"MMEMBED_TEST_KILL_AT": f"{point}:{hit}"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    _assert_marked_ones_are_whole(out, ref)
    assert find_last_complete_checkpoint(str(out)) == str(out / f"checkpoint-{newest}")

    refused = run_cli(args)  # the same command without --resume_from_checkpoint: not silently a new run
    assert refused.returncode == 2
    assert "--resume_from_checkpoint true" in refused.stderr and "Traceback" not in refused.stderr

    resumed = run_cli(args + ["--resume_from_checkpoint", "true"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _reported(resumed)["last_checkpoint"] == str(out / "checkpoint-4")
    _assert_marked_ones_are_whole(out, ref)
    _assert_same_weights(out / "checkpoint-4", ref / "checkpoint-4")
    assert not [n for n in _folders(out) if not n.startswith("checkpoint-")]  # no staging or half-deleted folder left
    if newest < 4:  # it saved again, so rotated: two checkpoints, both whole
        assert _folders(out) == ["checkpoint-3", "checkpoint-4"]


def test_resuming_refuses_what_is_not_whole(setup):
    d, common, ref = setup
    out = d / "not-whole"
    killed = run_cli(common + ["--output_dir", str(out)], env={"MMEMBED_TEST_KILL_AT": "save:marked:1"})
    assert killed.returncode == -9
    assert _folders(out) == [".partial-checkpoint-1"]  # marked, never renamed: not a checkpoint
    r = run_cli(common + ["--output_dir", str(out), "--resume_from_checkpoint", "true"])
    assert r.returncode == 1 and "no complete checkpoint" in r.stderr and "Traceback" not in r.stderr

    half = d / "half" / "checkpoint-2"
    shutil.copytree(ref / "checkpoint-2", half)
    os.remove(half / "rng_state.pth")  # e.g. deleted by hand: the manifest says it belongs there
    r = run_cli(common + ["--output_dir", str(half.parent), "--resume_from_checkpoint", str(half)])
    assert r.returncode == 1 and "not a complete mmembed checkpoint" in r.stderr and "Traceback" not in r.stderr


def test_rerun_with_overwrite_output_dir_replaces_the_old_checkpoints(setup):
    """Even with --save_strategy no the run saves its last step, and reports that, never the
    first run's checkpoint of the same name."""
    d, common, ref = setup
    out = d / "rerun"
    shutil.copytree(ref, out)
    before = {n: os.path.getmtime(out / n) for n in os.listdir(out)}
    args = common + ["--output_dir", str(out), "--save_strategy", "no", "--max_steps", "2", "--learning_rate", "1e-3"]
    refused = run_cli(args)
    assert refused.returncode == 2
    message = [line for line in refused.stderr.splitlines() if line.startswith("mmembed sft: error:")]
    assert len(message) == 1 and "already holds checkpoints of another run" in message[0] and str(out) in message[0]
    assert {n: os.path.getmtime(out / n) for n in os.listdir(out)} == before  # nothing touched

    r = run_cli(args + ["--overwrite_output_dir", "true"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert _reported(r)["last_checkpoint"] == str(out / "checkpoint-2")
    assert _folders(out) == ["checkpoint-2"]
    ours, first = _weights(out / "checkpoint-2"), _weights(ref / "checkpoint-2")
    assert any(not torch.equal(ours[k], first[k]) for k in first)  # this run's weights, not the first run's
    # --save_strategy no: the final model alone, no optimizer or trainer state to resume from
    assert not {"optimizer.pt", "scheduler.pt", "trainer_state.json"} & set(os.listdir(out / "checkpoint-2"))


@pytest.mark.parametrize("point", ["save:model", "save:written", "save:marked"])
def test_save_strategy_no_final_model_is_whole_or_absent(setup, point):
    """--save_strategy no saves the last step's model alone the way a checkpoint is saved:
    killed while writing it, nothing is left under checkpoint-N (only the staging folder,
    which a rerun refuses or --overwrite_output_dir deletes); the model it writes is marked
    as the model alone, so resuming does not take it for a training checkpoint."""
    d, common, ref = setup
    out = d / f"final-{point.replace(':', '-')}"
    args = common + ["--output_dir", str(out), "--save_strategy", "no", "--max_steps", "2"]
    killed = run_cli(args, env={"MMEMBED_TEST_KILL_AT": f"{point}:1"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert _folders(out) == [".partial-checkpoint-2"]
    assert find_last_complete_checkpoint(str(out)) is None

    refused = run_cli(args)
    assert refused.returncode == 2 and ".partial-checkpoint-2" in refused.stderr, refused.stderr[-3000:]
    r = run_cli(args + ["--overwrite_output_dir", "true"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert _folders(out) == ["checkpoint-2"]
    final = str(out / "checkpoint-2")
    assert is_complete(final) and is_model_only(final)
    assert {"adapter_model.safetensors", "mmembed.json", "tokenizer.json"} <= set(os.listdir(final))

    r = run_cli(args + ["--resume_from_checkpoint", "true"])
    assert r.returncode == 1 and "no complete checkpoint" in r.stderr and "Traceback" not in r.stderr
    r = run_cli(args + ["--resume_from_checkpoint", final])
    assert r.returncode == 2 and "--resume_only_model true" in r.stderr and "Traceback" not in r.stderr


def test_resuming_an_earlier_checkpoint_sets_the_later_ones_aside(setup):
    """Going back to checkpoint-2 of a run that reached checkpoint-4: the later checkpoints of
    the abandoned run are moved (whole) out of the way, so that a crash followed by
    --resume_from_checkpoint true resumes this run's newest, not the old run's checkpoint-4;
    --overwrite_output_dir deletes them instead."""
    d, common, ref = setup
    out = d / "rollback"
    shutil.copytree(ref, out)
    # this run stops at step 3: before, checkpoint-4 of the first run stayed the newest
    r = run_cli(common + ["--output_dir", str(out), "--resume_from_checkpoint", str(out / "checkpoint-2"),
                          "--max_steps", "3"])
    assert r.returncode == 0, r.stderr[-3000:]
    aside = [n for n in os.listdir(out) if n.startswith("superseded-2-")]
    assert len(aside) == 1 and sorted(os.listdir(out / aside[0])) == ["checkpoint-3", "checkpoint-4"]
    assert "goes back to an earlier step" in r.stderr and "checkpoint-3, checkpoint-4" in r.stderr
    _assert_same_weights(out / aside[0] / "checkpoint-4", ref / "checkpoint-4")  # moved whole, not rewritten
    assert find_last_complete_checkpoint(str(out)) == str(out / "checkpoint-3")
    assert _folders(out) == sorted(["checkpoint-1", "checkpoint-2", "checkpoint-3", aside[0]])

    again = d / "rollback_overwrite"
    shutil.copytree(ref, again)
    r = run_cli(common + ["--output_dir", str(again), "--resume_from_checkpoint", str(again / "checkpoint-2"),
                          "--max_steps", "3", "--overwrite_output_dir", "true"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "deleted (--overwrite_output_dir)" in r.stderr
    assert _folders(again) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
