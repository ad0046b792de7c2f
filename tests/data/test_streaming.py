"""--streaming true: rows read as training consumes them (mmembed.data.streaming)."""

import json
import logging
import os

import numpy as np
import pytest
import torch
from conftest import DATA

from mmembed.data.sample import DataError


def _rows(n: int) -> list[str]:
    with open(os.path.join(DATA, "stsb_train_pairs.jsonl"), encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    return [lines[i % len(lines)] if lines[i % len(lines)].endswith("\n") else lines[i % len(lines)] + "\n"
            for i in range(n)]


def _anchor(sample) -> str:
    return sample.anchor.text


def test_the_shuffle_is_datasets_buffer_shuffle_with_ms_swifts_seed(tmp_path):
    """The reference: datasets' own buffer shuffle of the same rows, seeded as ms-swift seeds it
    (one draw of numpy's RandomState(data_seed) per spec, then the shuffle's), epoch by epoch."""
    import datasets

    from mmembed.data.specs import draw_seed
    from mmembed.data.streaming import stream_samples

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(_rows(40)))
    stream = stream_samples([str(path)], strict=True, seed=7, shuffle=True, buffer_size=8)
    rng = np.random.RandomState(7)
    draw_seed(rng)
    texts = [json.loads(line)["query"] for line in _rows(40)]
    reference = datasets.Dataset.from_dict({"t": texts}).to_iterable_dataset().shuffle(seed=draw_seed(rng),
                                                                                        buffer_size=8)
    for epoch in (0, 1):
        stream.set_epoch(epoch)
        reference.set_epoch(epoch)
        assert [_anchor(s) for s in stream] == [r["t"] for r in reference]
    unshuffled = stream_samples([str(path)], strict=True, seed=7, shuffle=False, buffer_size=8)
    assert [_anchor(s) for s in unshuffled] == texts
    assert sorted(texts) == sorted(_anchor(s) for s in stream)  # every row once an epoch


def test_file_n_takes_the_first_n_rows_and_specs_follow_each_other(tmp_path):
    from mmembed.data.streaming import stream_samples

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(_rows(10)))
    b.write_text("".join(_rows(15)[10:]))
    got = [_anchor(s) for s in stream_samples([f"{a}#3", str(b)], strict=True, seed=42, shuffle=False, buffer_size=4)]
    texts = [json.loads(line)["query"] for line in _rows(15)]
    assert got == texts[:3] + texts[10:15]


def test_rows_are_read_lazily_and_bad_rows_follow_strict(tmp_path, caplog):
    """A bad row far down the file is never read when training stops before it; one that is
    read stops the stream naming file and line (--strict true) or is skipped and logged."""
    import mmembed.data.dataset as dataset_module
    from mmembed.data.streaming import stream_samples

    path = tmp_path / "rows.jsonl"
    rows = _rows(600)
    rows[500] = "{not json\n"
    path.write_text("".join(rows))
    stream = stream_samples([str(path)], strict=True, seed=42, shuffle=False, buffer_size=4)
    first = []
    for sample in stream:
        first.append(sample)
        if len(first) == 8:
            break
    assert len(first) == 8
    with pytest.raises(DataError) as e:
        list(stream)
    assert str(path) in str(e.value) and e.value.line == 501
    with caplog.at_level(logging.WARNING, logger="mmembed"):
        kept = list(stream_samples([str(path)], strict=False, seed=42, shuffle=False, buffer_size=4))
    assert len(kept) == 599 and "skipped a bad row" in caplog.text and ":501" in caplog.text
    # the non-streamed path reads the whole file before training: it refuses the file
    with pytest.raises(DataError):
        dataset_module.load_samples([str(path)], strict=True, seed=42)


@pytest.fixture(scope="module")
def two_runs(minilm_path, tmp_path_factory):
    """The same 3 steps, streamed and not (both in file order), and a streamed run whose file
    has a bad row past the rows it trains on, with the Arrow reader made to fail if used."""
    from safetensors.torch import load_file

    import mmembed.data.dataset as dataset_module
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.sft import run_sft

    work = tmp_path_factory.mktemp("streaming")
    path = work / "rows.jsonl"
    rows = _rows(400)
    rows[300] = "{not json\n"
    path.write_text("".join(rows))
    common = ["--model", minilm_path, "--dataset", str(path), "--tuner_type", "full", "--per_device_train_batch_size",
              "4", "--gradient_accumulation_steps", "1", "--max_steps", "3", "--max_length", "32", "--report_to", "none",
              "--disable_tqdm", "true", "--dataloader_num_workers", "0", "--learning_rate", "1e-4",
              "--dataset_shuffle", "false", "--logging_steps", "1", "--seed", "3"]
    original = dataset_module._build

    def no_arrow(*a, **k):
        raise AssertionError("the training rows were read into Arrow")

    dataset_module._build = no_arrow
    try:
        streamed = run_sft(parse_sft_args(common + ["--streaming", "true", "--output_dir", str(work / "s")]))
    finally:
        dataset_module._build = original
    # the reference run reads the same first rows whole (the bad row cut off: it refuses it)
    (work / "head.jsonl").write_text("".join(rows[:300]))
    common[common.index(str(path))] = str(work / "head.jsonl")
    plain = run_sft(parse_sft_args(common + ["--train_dataloader_shuffle", "false", "--output_dir", str(work / "p")]))
    weights = {k: load_file(os.path.join(r["last_checkpoint"], "model.safetensors")) for k, r in
               (("streamed", streamed), ("plain", plain))}
    logs = {k: json.load(open(os.path.join(r["last_checkpoint"], "trainer_state.json")))["log_history"]
            for k, r in (("streamed", streamed), ("plain", plain))}
    return weights, logs, minilm_path


def test_a_streamed_run_trains_as_the_same_rows_read_whole(two_runs):
    from safetensors.torch import load_file

    weights, logs, base_path = two_runs
    losses = {k: [h["loss"] for h in v if "loss" in h] for k, v in logs.items()}
    assert len(losses["streamed"]) == 3
    np.testing.assert_allclose(losses["streamed"], losses["plain"], rtol=1e-6)
    base = load_file(os.path.join(base_path, "model.safetensors"))
    key = next(k for k in base if "query.weight" in k)
    assert (weights["streamed"][key] - base[key]).abs().max() > 1e-6  # it trained
    for k in weights["plain"]:
        torch.testing.assert_close(weights["streamed"][k], weights["plain"][k], atol=1e-6, rtol=1e-5)


def test_streaming_settings_that_cannot_work_are_refused():
    from mmembed.training.arguments import parse_sft_args

    base = ["--model", "m", "--dataset", "d.jsonl"]
    with pytest.raises(ValueError, match="--streaming true needs --max_steps"):
        parse_sft_args(base + ["--streaming", "true"])
    args = parse_sft_args(base + ["--streaming", "true", "--max_steps", "5", "--split_dataset_ratio", "0.1"])
    assert args.split_dataset_ratio == 0.0  # ms-swift's rule: a stream is not split (--val_dataset evaluates)
    assert args.accelerator_config.dispatch_batches is False


@pytest.mark.parametrize("files", [1, 3])
def test_data_loader_workers_share_the_rows_without_repeats(tmp_path, files):
    """Two workers: each row once an epoch (a worker takes whole files; with one file the
    second worker has nothing to read)."""
    from mmembed.data.streaming import stream_samples

    folder = tmp_path / "rows"
    folder.mkdir()
    rows = _rows(30)
    for i in range(files):
        (folder / f"part{i}.jsonl").write_text("".join(rows[i * 30 // files:(i + 1) * 30 // files]))
    stream = stream_samples([str(folder)], strict=True, seed=42, shuffle=False, buffer_size=4)
    loader = torch.utils.data.DataLoader(stream, batch_size=4, num_workers=2, collate_fn=lambda b: [_anchor(s) for s in b])
    got = [t for batch in loader for t in batch]
    texts = [json.loads(line)["query"] for line in _rows(30)]
    assert sorted(got) == sorted(texts) and len(got) == 30
