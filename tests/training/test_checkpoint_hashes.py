"""The checkpoint manifest's sha256 of each file is computed as ``torch.save`` writes it (the
bulk of a checkpoint: optimizer, scheduler, RNG state, DeepSpeed's engine files), each process
hashing what it wrote; only what other writers wrote is read back. The digests are checked
against hashlib reading the finished files."""

import hashlib
import io
import json
import os
import zipfile

import torch
import torch.multiprocessing as mp

from mmembed.files import HashingWriter
from mmembed.training.checkpoints import COMPLETE_MARKER, hashed_torch_saves, prepare_staging, publish
from mmembed.training.guards import merged_dicts


def _sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_torch_saves_under_the_folder_are_hashed_as_written(tmp_path):
    root, elsewhere = tmp_path / "staging", tmp_path / "elsewhere"
    (root / "global_step1").mkdir(parents=True)
    elsewhere.mkdir()
    state = {"w": torch.arange(100_000, dtype=torch.float32), "step": 3, "nested": [torch.ones(3, 4), {"lr": 0.1}]}
    save = torch.save
    written: dict[str, str] = {}
    with hashed_torch_saves(str(root), written):
        torch.save(state, str(root / "optimizer.pt"))
        torch.save(state, root / "global_step1" / "mp_rank_00_model_states.pt")  # a PathLike
        torch.save(state, str(elsewhere / "outside.pt"))
        torch.save(state, io.BytesIO())
    assert torch.save is save  # put back
    assert set(written) == {"optimizer.pt", os.path.join("global_step1", "mp_rank_00_model_states.pt")}
    for rel, digest in written.items():
        path = root / rel
        assert digest == _sha256(path), rel
        loaded = torch.load(path, weights_only=True)
        assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3
        assert torch.equal(loaded["nested"][0], state["nested"][0]) and loaded["nested"][1] == {"lr": 0.1}
        # written through a file object (torch names the records "archive/"), not by torch's own path writer
        assert zipfile.ZipFile(path).namelist()[0].startswith("archive/")
    assert zipfile.ZipFile(elsewhere / "outside.pt").namelist()[0].startswith("outside/")


def test_a_failed_save_puts_torch_save_back(tmp_path):
    save = torch.save
    try:
        with hashed_torch_saves(str(tmp_path), {}):
            torch.save(lambda: None, str(tmp_path / "x.pt"))  # a lambda cannot be pickled
    except Exception:  # noqa: BLE001  (whatever torch raises for it)
        pass
    assert torch.save is save


def test_hashing_writer_digest_equals_the_file(tmp_path):
    path = tmp_path / "f.bin"
    chunks = [b"abc", bytearray(b"x" * 100_000), memoryview(b"tail")]
    with HashingWriter(str(path)) as out:
        for chunk in chunks:
            assert out.write(chunk) == len(chunk)
    assert out.hexdigest() == _sha256(path) == hashlib.sha256(b"".join(bytes(c) for c in chunks)).hexdigest()


def test_publish_takes_the_written_digests_and_reads_the_rest(tmp_path):
    final = str(tmp_path / "checkpoint-7")
    staging = prepare_staging(final)
    with hashed_torch_saves(staging, written := {}):
        torch.save({"a": torch.ones(5)}, os.path.join(staging, "optimizer.pt"))
    with open(os.path.join(staging, "config.json"), "w") as f:
        f.write('{"x": 1}')
    # a digest given for a file is taken as it is: a wrong one shows that the file was not read back
    written["optimizer.pt"] = "0" * 64
    written["not-there.pt"] = "1" * 64  # another node's file, not in this folder: not listed
    publish(final, 7, written=written)
    manifest = json.load(open(os.path.join(final, COMPLETE_MARKER)))
    assert manifest["sha256"] == {"optimizer.pt": "0" * 64, "config.json": _sha256(os.path.join(final, "config.json"))}
    assert set(manifest["files"]) == set(manifest["sha256"])


def _merge_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        merged = merged_dicts({f"zero_pp_rank_{rank}_optim_states.pt": f"digest-{rank}", "shared.json": "same"})
        with open(f"{out}.{rank}", "w") as f:
            json.dump(merged, f)
    finally:
        dist.destroy_process_group()


def test_every_process_gets_the_digests_of_all(tmp_path):
    from conftest import free_port

    out = str(tmp_path / "merged")
    # forked, not spawned: two fresh interpreters importing torch cost ~15 s of CPU
    mp.start_processes(_merge_worker, args=(free_port(), out), nprocs=2, join=True, start_method="fork")
    expected = {"zero_pp_rank_0_optim_states.pt": "digest-0", "zero_pp_rank_1_optim_states.pt": "digest-1",
                "shared.json": "same"}
    for rank in range(2):
        assert json.load(open(f"{out}.{rank}")) == expected
