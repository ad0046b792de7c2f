"""What mmembed does for safety: a --hub_token never reaches a checkpoint's files, a
symlinked checkpoint is removed as a link (its target untouched), exported folders get the
umask's mode like files, and media URLs are redacted (tests/encoding/test_remote_media.py)."""

import json
import os

import pytest
import torch
from conftest import stsb_pairs, write_jsonl
from forked_cli import run_cli

from mmembed.files import folder_replaced_when_done, replaced_when_done
from mmembed.training.checkpoints import COMPLETE_MARKER, clear_output_dir, rotate


def test_hub_token_is_not_saved_in_a_checkpoint(minilm_path, tmp_path):
    token = "hf_mmembedTESTtoken0123456789"
    data = write_jsonl(tmp_path / "train.jsonl", stsb_pairs(4))
    out = tmp_path / "out"
    r = run_cli(["sft", "--model", minilm_path, "--dataset", data, "--output_dir", str(out), "--max_steps", "1",
                 "--save_steps", "1", "--per_device_train_batch_size", "2", "--max_length", "32",
                 "--hub_token", token, "--report_to", "none", "--disable_tqdm", "true"])
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = out / "checkpoint-1"
    files = [p for p in ckpt.rglob("*") if p.is_file()]
    assert any(p.name == "training_args.bin" for p in files)
    for p in files:
        assert token.encode() not in p.read_bytes(), p
    args = torch.load(ckpt / "training_args.bin", weights_only=False)
    assert args.hub_token is None and args.max_steps == 1  # the other settings are kept


def _checkpoint(folder, step):
    folder.mkdir(parents=True)
    (folder / "weights.bin").write_bytes(b"w" * 10)
    (folder / COMPLETE_MARKER).write_text(json.dumps({"step": step, "files": {"weights.bin": 10}}))
    return folder


@pytest.mark.parametrize("how", ["overwrite_output_dir", "rotation"])
def test_a_symlinked_checkpoint_is_removed_as_a_link(tmp_path, how):
    target = _checkpoint(tmp_path / "elsewhere" / "kept", 3)
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(target, out / "checkpoint-3")
    _checkpoint(out / "checkpoint-5", 5)
    if how == "rotation":
        deleted = rotate(str(out), 1, keep=[str(out / "checkpoint-5")])
        assert deleted == [str(out / "checkpoint-3")]
        assert sorted(os.listdir(out)) == ["checkpoint-5"]
    else:
        clear_output_dir(str(out))
        assert os.listdir(out) == []
    assert sorted(os.listdir(target)) == [COMPLETE_MARKER, "weights.bin"]  # the link's target is untouched


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_output_folders_and_files_get_the_umask_mode(tmp_path, umask):
    old = os.umask(umask)
    try:
        os.mkdir(tmp_path / "plain")
        with open(tmp_path / "plain.txt", "w") as f:
            f.write("x")
        with folder_replaced_when_done(str(tmp_path / "exported")) as tmp:
            with open(os.path.join(tmp, "f"), "w") as f:
                f.write("x")
        with replaced_when_done(str(tmp_path / "written.txt")) as f:
            f.write("x")
    finally:
        os.umask(old)
    mode = lambda p: os.stat(tmp_path / p).st_mode & 0o777  # noqa: E731
    assert mode("exported") == mode("plain") == 0o777 & ~umask
    assert mode("written.txt") == mode("plain.txt") == 0o666 & ~umask
