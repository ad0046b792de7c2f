"""A full disk or a read-only folder: one line naming the path (no traceback), exit code 1,
nothing partial under a final name (checkpoints, exported folders, embeddings, metrics, mined
rows), the last whole checkpoint and an earlier output intact.

A full disk is real: the command runs in a child process (tests/forked_cli.py) whose files
cannot grow past a few bytes (``RLIMIT_FSIZE``, so every write fails with EFBIG as it would with
ENOSPC), either from the start or from a named point of a checkpoint save
(``MMEMBED_TEST_FULL_AT``). A read-only folder is ``chmod 0o555``, or for root (whom modes do
not stop) the immutable attribute."""

import contextlib
import json
import os
import shutil
import subprocess

import numpy as np
import pytest
from conftest import DATA, stsb_pairs
from forked_cli import run_cli

from mmembed.training.charts import CHARTS_DIR
from mmembed.training.checkpoints import find_last_complete_checkpoint, is_complete


@contextlib.contextmanager
def read_only(folder):
    """``folder`` made read-only for this process's user, or a skip where that cannot be done."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        os.chmod(folder, 0o555)
        undo = lambda: os.chmod(folder, 0o755)  # noqa: E731
    elif shutil.which("chattr") and subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0:
        undo = lambda: subprocess.run(["chattr", "-i", str(folder)], check=True)  # noqa: E731
    else:
        pytest.skip("no way to make a folder read-only for root here (chattr +i refused)")
    try:
        try:
            (folder / "probe").write_text("x")
            pytest.skip(f"{folder} is still writable")
        except PermissionError:
            pass
        yield folder
    finally:
        undo()


def _one_error_line(result, command, path):
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith(f"mmembed {command}: error:")]
    assert len(lines) == 1 and f"cannot write {path}" in lines[0], result.stderr[-3000:]
    return lines[0]


def _names(folder):
    return sorted(n for n in os.listdir(folder) if n != CHARTS_DIR)  # a run's charts beside its checkpoints


@pytest.fixture(scope="module")
def run(tmp_path_factory, minilm_path):
    """A LoRA run whose disk fills up as its third checkpoint is saved."""
    d = tmp_path_factory.mktemp("full")
    rows = stsb_pairs(8)
    data = d / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "texts.txt").write_text("".join(r["query"] + "\n" for r in rows))
    argv = ["sft", "--model", minilm_path, "--dataset", str(data), "--per_device_train_batch_size", "2",
            "--gradient_accumulation_steps", "1", "--max_steps", "4", "--save_steps", "1", "--save_total_limit", "2",
            "--max_length", "32", "--dataloader_num_workers", "0", "--disable_tqdm", "true", "--report_to", "none"]
    return d, argv


@pytest.mark.parametrize("point", ["save:begin", "save:written"])
def test_checkpoint_on_a_full_disk(run, point):
    """Full before the third checkpoint's first file, or after its last file and before its
    marker: either way checkpoint-3 does not exist, checkpoint-1 and -2 are whole."""
    d, argv = run
    out = d / f"out-{point.replace(':', '-')}"
    r = run_cli(argv + ["--output_dir", str(out)], env={"MMEMBED_TEST_FULL_AT": f"{point}:3"})
    line = _one_error_line(r, "sft", out / "checkpoint-3")
    assert "File too large" in line and f"the last whole checkpoint is {out / 'checkpoint-2'}" in line
    assert _names(out) == ["checkpoint-1", "checkpoint-2"]
    assert find_last_complete_checkpoint(str(out)) == str(out / "checkpoint-2")
    assert is_complete(str(out / "checkpoint-1"))


@pytest.mark.parametrize("point", ["save:begin", "save:model"])
def test_save_strategy_no_final_model_on_a_full_disk(run, point):
    """--save_strategy no: the disk fills before the last step's model is written, or after
    its weights and before its marker: one line naming checkpoint-4, nothing under that name
    (nor a staging folder)."""
    d, argv = run
    out = d / f"out-final-{point.replace(':', '-')}"
    r = run_cli(argv + ["--output_dir", str(out), "--save_strategy", "no"], env={"MMEMBED_TEST_FULL_AT": f"{point}:1"})
    line = _one_error_line(r, "sft", out / "checkpoint-4")
    assert "File too large" in line and "nothing was left under that name" in line
    assert _names(out) == []


def test_charts_on_a_full_disk_warn_and_the_checkpoint_stays_whole(run):
    """The disk fills just after checkpoint-1 is published, before the charts are drawn: each
    chart that cannot be written is one warning line naming it (no traceback, no temporary
    file), the run ends normally and checkpoint-1 is whole."""
    d, argv = run
    out = d / "out-charts"
    argv = list(argv)
    argv[argv.index("--max_steps") + 1] = "1"
    r = run_cli(argv + ["--output_dir", str(out)], env={"MMEMBED_TEST_FULL_AT": "save:renamed:1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    warned = [line for line in r.stderr.splitlines() if "charts: cannot write" in line]
    assert warned and all(str(out / CHARTS_DIR) in line and "File too large" in line for line in warned), r.stderr
    assert any(f"cannot write {out / CHARTS_DIR / 'train_loss.png'}:" in line for line in warned)
    assert os.listdir(out / CHARTS_DIR) == []  # nothing partial, no temporary file
    assert _names(out) == ["checkpoint-1"] and is_complete(str(out / "checkpoint-1"))


def test_read_only_output_dir_is_refused_before_training(run, tmp_path):
    d, argv = run
    with read_only(tmp_path / "ro") as out:
        r = run_cli(argv + ["--output_dir", str(out)])
        _one_error_line(r, "sft", out)
        assert "Loading weights" not in r.stderr  # refused before the model loads
        assert _names(out) == []


def test_embed_eval_mine_on_a_full_disk_leave_nothing_partial(run, minilm_path):
    d, _ = run
    folder = d / "outputs"
    folder.mkdir()
    old = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.save(folder / "emb.npy", old)  # an earlier result, to be kept whole rather than half overwritten
    r = run_cli(["embed", "--model", minilm_path, "--input", str(d / "texts.txt"), "--output", str(folder / "emb.npy")],
                file_size_limit=1024)  # 8 x 384 float32 do not fit
    _one_error_line(r, "embed", folder / "emb.npy")
    np.testing.assert_array_equal(np.load(folder / "emb.npy"), old)

    sts = d / "sts.jsonl"
    with open(os.path.join(DATA, "stsb_test_scored.jsonl"), encoding="utf-8") as f:
        sts.write_text("".join(next(f) for _ in range(12)))
    r = run_cli(["eval", "--model", minilm_path, "--sts", str(sts), "--json", str(folder / "metrics.json")],
                file_size_limit=16)
    _one_error_line(r, "eval", folder / "metrics.json")
    assert json.loads(r.stdout[r.stdout.index("{"):])["spearman_cosine"]  # the metrics still reach the screen

    r = run_cli(["mine", "--dataset", str(d / "train.jsonl"), "--output", str(folder / "mined.jsonl")],
                file_size_limit=64)
    _one_error_line(r, "mine", folder / "mined.jsonl")
    assert _names(folder) == ["emb.npy"]  # no metrics.json, no mined.jsonl, no temporary file


def test_export_on_a_full_disk_and_into_a_read_only_folder(run, tmp_path):
    d, _ = run
    ckpt = find_last_complete_checkpoint(str(d / "out-save-begin"))
    assert ckpt, "test_checkpoint_on_a_full_disk runs first and leaves checkpoint-2"
    target = tmp_path / "merged"
    r = run_cli(["export", "--adapters", ckpt, "--merge_lora", "true", "--output_dir", str(target)],
                file_size_limit=1 << 20)  # the merged weights (90 MB) do not fit
    _one_error_line(r, "export", target)
    assert _names(tmp_path) == []
    with read_only(tmp_path / "ro") as ro:
        r = run_cli(["export", "--adapters", ckpt, "--output_dir", str(ro / "merged")])
        _one_error_line(r, "export", ro / "merged")
        assert _names(ro) == []
    with read_only(tmp_path / "ro2") as ro:
        r = run_cli(["embed", "--model", ckpt, "--input", str(d / "texts.txt"), "--output", str(ro / "emb.npy")])
        _one_error_line(r, "embed", ro / "emb.npy")
