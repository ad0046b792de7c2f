"""The one data pipeline (mmembed/training/row_checks.py): each source of rows (--dataset,
--dataset_config, --streaming) goes through the same phases, in one order (trainable check,
remote media, length check), run by check_rows; any phase can stop the run."""

from __future__ import annotations

import logging
import re

import pytest
from conftest import stsb_pairs, write_jsonl

from mmembed.errors import UsageError
from mmembed.training import row_checks
from mmembed.training.arguments import parse_sft_args
from mmembed.training.row_checks import PHASES, Phase

PAIRS = stsb_pairs(40)
NAMES = ["trainable check", "remote media", "length check"]
SOURCES = ["files", "config", "stream"]


def rows(start: int, n: int, negatives: int = 1) -> list[dict]:
    return [{"query": PAIRS[i]["query"], "response": PAIRS[i]["response"],
             "rejected_response": [PAIRS[(i + 7 + k) % len(PAIRS)]["response"] for k in range(negatives)]}
            for i in range(start, start + n)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    import yaml

    d = tmp_path_factory.mktemp("row_checks")
    out = {"train": write_jsonl(d / "train.jsonl", rows(0, 8)), "val": write_jsonl(d / "val.jsonl", rows(20, 4)),
           "bare": write_jsonl(d / "bare.jsonl", rows(30, 4, negatives=0))}
    (d / "config.yaml").write_text(yaml.safe_dump({"datasets": [
        {"name": "a", "path": "train.jsonl", "val": "val.jsonl"}, {"name": "b", "path": "val.jsonl"}]}))
    (d / "config_bare.yaml").write_text(yaml.safe_dump({"datasets": [
        {"name": "a", "path": "train.jsonl"}, {"name": "b", "path": "bare.jsonl"}]}))
    out["config"], out["config_bare"] = str(d / "config.yaml"), str(d / "config_bare.yaml")
    return out


def _args(model, files, source, tmp_path, bare=False):
    argv = ["--model", model, "--per_device_train_batch_size", "2", "--max_length", "64",
            "--output_dir", str(tmp_path), "--dataloader_num_workers", "0"]
    if source == "config":
        argv += ["--dataset_config", files["config_bare" if bare else "config"]]
    else:
        argv += ["--dataset", files["train"], "--val_dataset", files["bare" if bare else "val"]]
    if source == "stream":
        argv += ["--streaming", "true", "--max_steps", "2"]
    return parse_sft_args(argv)


def _load(args):
    from mmembed.training.data_assembly import TrainingData
    from mmembed.training.model_assembly import Encoding, make_loss
    from mmembed.training.preflight import media_settings

    return TrainingData.load(args, Encoding.resolve(args), make_loss(args), media_settings(args))


def _recorded(seen: list, fail_at: int | None = None) -> tuple[Phase, ...]:
    """The real phases, each noting its name and the rows it took in (and the one at
    ``fail_at`` failing instead)."""
    def wrap(i: int, phase: Phase) -> Phase:
        def run(rows, checks):
            train = rows.whole()[0] if rows.join is None else None
            seen.append((phase.name, rows.count(), type(train).__name__))
            if i == fail_at:
                raise RuntimeError(f"phase {phase.name} failed")
            return phase.run(rows, checks)

        return Phase(phase.name, run, phase.applies)

    return tuple(wrap(i, p) for i, p in enumerate(PHASES))


def test_the_phases_are_the_three_checks_in_order():
    assert [p.name for p in PHASES] == NAMES


@pytest.mark.parametrize("source", SOURCES)
def test_every_source_goes_through_the_same_phases_in_order(minilm_path, files, tmp_path, monkeypatch, caplog,
                                                             source):
    """INFONCE_HARD_NEGATIVES gives the loss a rule, so every phase applies: each source's rows
    meet the trainable check, then the remote media, then the length check; each logs its bar
    (a stream: its eval rows only, its own checked as read)."""
    monkeypatch.setenv("INFONCE_HARD_NEGATIVES", "1")
    seen: list = []
    monkeypatch.setattr(row_checks, "PHASES", _recorded(seen))
    with caplog.at_level(logging.INFO, logger="mmembed"):
        data = _load(_args(minilm_path, files, source, tmp_path))
    assert [name for name, _, _ in seen] == NAMES
    up_front = {"files": 8 + 4, "config": 8 + 4 + 4, "stream": 4}[source]  # (config: dataset b's 4 rows, a's 4 val)
    assert [count for _, count, _ in seen] == [up_front] * 3
    bars = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: ") and " rows" in r.getMessage()]
    assert [b.split(":")[1].strip() for b in bars if b.split(":")[1].strip() in NAMES] == NAMES
    assert all(f"{up_front:,} rows" in b for b in bars if b.split(":")[1].strip() in NAMES)
    if source == "stream":
        assert seen[0][2] == "StreamingSamples" and data.train.keep is not None  # the checks as its rows are read
        assert len(list(iter(data.train))) == 8
    else:
        assert len(data.train) == (8 if source == "files" else 12)
    assert len(data.val) == 4


@pytest.mark.parametrize("source", SOURCES)
def test_any_phase_can_stop_the_run_and_the_later_ones_do_not_run(minilm_path, files, tmp_path, monkeypatch,
                                                                  source):
    monkeypatch.setenv("INFONCE_HARD_NEGATIVES", "1")
    args = _args(minilm_path, files, source, tmp_path)
    for fail_at, name in enumerate(NAMES):
        seen: list = []
        monkeypatch.setattr(row_checks, "PHASES", _recorded(seen, fail_at))
        with pytest.raises(RuntimeError, match=f"phase {name} failed"):
            _load(args)
        assert [n for n, _, _ in seen] == NAMES[:fail_at + 1]


@pytest.mark.parametrize("source", SOURCES)
def test_the_real_trainable_check_fails_on_each_source(minilm_path, files, tmp_path, monkeypatch, source):
    """Rows without negatives under INFONCE_HARD_NEGATIVES: a usage error naming them, before
    the later phases, whatever the source (a stream's own rows: a data error when read)."""
    from mmembed.data.sample import DataError

    monkeypatch.setenv("INFONCE_HARD_NEGATIVES", "2")
    seen: list = []
    monkeypatch.setattr(row_checks, "PHASES", _recorded(seen))
    what = "train (b) row" if source == "config" else "val row"
    with pytest.raises(UsageError, match=re.escape(f"no {what} can train: every one of the 4 has no negatives")):
        _load(_args(minilm_path, files, source, tmp_path, bare=True))
    assert [n for n, _, _ in seen] == NAMES[:1]
    if source == "stream":  # the stream's own rows: checked as they are read
        monkeypatch.setattr(row_checks, "PHASES", PHASES)
        args = _args(minilm_path, files, "stream", tmp_path)
        args.dataset = [files["bare"]]
        data = _load(args)
        with pytest.raises(DataError, match="bare.jsonl.*no negatives"):
            list(iter(data.train))
