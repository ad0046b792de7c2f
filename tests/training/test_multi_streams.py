"""--streaming true with --dataset_config: each dataset a stream (mmembed/data/streaming.py,
mmembed/training/stream_samplers.py). Every global batch from one dataset under proportional /
round_robin / weighted, the loaded rules' order, each process's share, data-loader workers,
ms-swift's mixed order (concatenated or interleaved), the datasets' sizes, each dataset's checks
and losses, bad rows, resuming, and what is refused. Which dataset a row belongs to is fixed by
its text (``<dataset> <row>: ...``), never read back from the code under test."""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import shutil

import numpy as np
import pytest
import torch
from conftest import launch, stsb_pairs, write_jsonl

from mmembed.data.sample import DataError
from mmembed.data.specs import draw_seed
from mmembed.data.streaming import mix_streams, stream_samples
from mmembed.errors import UsageError
from mmembed.training.arguments import parse_sft_args
from mmembed.training.batch_samplers import Part
from mmembed.training.samplers import HOMOGENEOUS_SAMPLERS
from mmembed.training.stream_samplers import StreamBatches, stream_sizes

ROWS = {"a": 12, "b": 20, "c": 8}
PAIRS = stsb_pairs(sum(ROWS.values()))


def _rows(name: str, n: int, start: int = 0) -> list[dict]:
    return [{**p, "query": f"{name} {i}: {p['query']}"} for i, p in zip(range(n), PAIRS[start:])]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("multi_streams")
    return {name: write_jsonl(d / f"{name}.jsonl", _rows(name, n)) for name, n in ROWS.items()}


def _key(sample) -> str:
    return sample.anchor.text.split(":", 1)[0]


def _streams(files, shuffle=False, seed=42):
    return [stream_samples([files[n]], strict=True, seed=seed + i, shuffle=shuffle, buffer_size=4, dataset_id=i,
                           name=n) for i, n in enumerate(ROWS)]


def _homogeneous(files, rule, batch=2, accumulation=2, world=2, shuffle=False, seed=5, weights=(1.0, 3.0, 1.0)):
    sizes = [(n, "counted") if rule != "round_robin" else (None, "not needed") for n in ROWS.values()]
    return StreamBatches.homogeneous(_streams(files, shuffle), rule, sizes, list(weights), batch, accumulation, world,
                                    seed)


def _global_batches(stream, steps: int) -> list[list[str]]:
    rows = [_key(s) for s in itertools.islice(iter(stream), steps * stream.size)]
    return [rows[i:i + stream.size] for i in range(0, len(rows), stream.size)]


def _loaded(rule, steps: int, size_args=(2, 2, 2), seed=5, weights=(1.0, 3.0, 1.0)) -> list[list[str]]:
    """The loaded path's global batches for the same rule over the same rows (one training set
    of the three files in order, each dataset's rows unshuffled)."""
    names = [f"{n} {i}" for n, k in ROWS.items() for i in range(k)]
    parts, start = [], 0
    for (name, n), w in zip(ROWS.items(), weights):
        parts.append(Part(name, w, np.arange(start, start + n)))
        start += n
    batch, accumulation, world = size_args
    sampler = HOMOGENEOUS_SAMPLERS[rule](parts, batch, accumulation, seed, 0, world, shuffle=False)
    out = []
    for epoch in itertools.count():
        for _, rows in sampler.global_batches(epoch):
            out.append([names[i] for i in rows])
            if len(out) == steps:
                return out


# ----------------------------------------------------------------------------- the rules


@pytest.mark.parametrize("rule", ["proportional", "round_robin", "weighted"])
def test_every_global_batch_is_one_datasets_in_the_loaded_rules_order(files, rule):
    """Per-device batch 2, 2 processes, 2 accumulation steps: each of 16 global batches (several
    passes over every dataset) is 8 different rows of one dataset, and with the rows unshuffled
    they are the loaded path's global batches of the same rule, row for row (the same draws, each
    dataset's passes cut into whole global batches, the rest of a pass sitting it out)."""
    got = _global_batches(_homogeneous(files, rule), 16)
    for batch in got:
        assert len(batch) == 8 == len(set(batch)) and len({k.split()[0] for k in batch}) == 1, batch
    assert got == _loaded(rule, 16)


def test_shuffled_streams_pass_by_pass(files):
    """--dataset_shuffle: each dataset's pass p is its buffer shuffle with the epoch set to p, cut
    into whole global batches; the datasets are still drawn by the rule (the loaded draws)."""
    stream = _homogeneous(files, "proportional", shuffle=True)
    got = _global_batches(stream, 20)
    reference = {}
    for s in _streams(files, shuffle=True):
        rows = []
        for p in range(12):
            s.set_epoch(p)
            keys = [_key(x) for x in s]
            rows += keys[:len(keys) // 8 * 8]
        reference[s.name] = [rows[k:k + 8] for k in range(0, len(rows), 8)]
    order = [b[0][0] for b in _loaded("proportional", 20)]
    assert [b[0].split()[0] for b in got] == order
    taken = {n: 0 for n in ROWS}
    for batch, name in zip(got, order):
        assert batch == reference[name][taken[name]]
        taken[name] += 1
    assert got != _loaded("proportional", 20)  # shuffled within each dataset


def test_each_process_gets_its_micro_batches_of_the_global_batch(files):
    """accelerate's IterableDatasetShard (the streamed run's sharding): process r's micro-batch k
    of a step is rows (k * 2 + r) * 2 to + 2 of that step's global batch."""
    from accelerate.data_loader import IterableDatasetShard

    whole = _global_batches(_homogeneous(files, "weighted"), 6)
    for r in range(2):
        shard = IterableDatasetShard(_homogeneous(files, "weighted"), batch_size=2, num_processes=2, process_index=r)
        rows = [_key(s) for s in itertools.islice(iter(shard), 6 * 4)]
        for step in range(6):
            for k in range(2):
                micro = rows[(step * 2 + k) * 2:(step * 2 + k + 1) * 2]
                assert micro == whole[step][(k * 2 + r) * 2:(k * 2 + r + 1) * 2]


def _mixed(files, world=2, accumulation=2, interleave=None):
    return StreamBatches.mixed(mix_streams(_streams(files), seed=42, shuffle=True, buffer_size=8,
                                           interleave=interleave), 2, accumulation, world, 42)


@pytest.mark.parametrize("rule", ["weighted", "mixed"])
def test_data_loader_workers_give_the_same_batches_in_the_same_order(files, rule):
    """Two data-loader workers (each reading every row, each yielding every other micro-batch):
    the loader's batches are those of no workers, in order, one process and two."""
    from accelerate.data_loader import IterableDatasetShard

    def batches(workers: int, world: int):
        stream = _homogeneous(files, rule, shuffle=True, world=world) if rule != "mixed" else _mixed(files, world)
        dataset = stream if world == 1 else IterableDatasetShard(stream, batch_size=2, num_processes=2,
                                                                 process_index=1)
        loader = torch.utils.data.DataLoader(dataset, batch_size=2, num_workers=workers,
                                             collate_fn=lambda b: [_key(s) for s in b])
        return list(itertools.islice(iter(loader), 24))

    for world in (1, 2):
        plain = batches(0, world)
        assert batches(2, world) == plain
        assert rule == "mixed" or all(len({k.split()[0] for k in b}) == 1 for b in plain)


def test_the_recorded_position_counts_each_datasets_global_batches(files):
    stream = _homogeneous(files, "weighted")
    got = _global_batches(stream, 9)
    state = stream.state(9)
    drawn = {d["name"]: d["global_batches_drawn"] for d in state["datasets"]}
    assert drawn == {n: sum(b[0].startswith(n + " ") for b in got) for n in ROWS}
    assert state["streaming"] and state["sampler"] == "weighted" and state["global_batch_size"] == 8
    assert [(d["rows"], d["weight"]) for d in state["datasets"]] == [(12, 1.0), (20, 3.0), (8, 1.0)]


# ----------------------------------------------------------------------------- mixed: ms-swift's order


def test_mixed_is_the_stream_of_the_same_specs_with_each_rows_dataset(files):
    """Concatenated then buffer-shuffled, seeds drawn as for --dataset a b c: the same rows in the
    same order as that stream, each with its dataset's index."""
    mixed = mix_streams(_streams(files), seed=42, shuffle=True, buffer_size=8)
    plain = stream_samples(list(files.values()), strict=True, seed=42, shuffle=True, buffer_size=8)
    for epoch in (0, 1):
        mixed.set_epoch(epoch)
        plain.set_epoch(epoch)
        got = [(_key(s), s.dataset_id) for s in mixed]
        assert [k for k, _ in got] == [_key(s) for s in plain]
        assert all(list(ROWS).index(k.split()[0]) == d for k, d in got)
    assert sorted(k for k, _ in got) == sorted(f"{n} {i}" for n, k in ROWS.items() for i in range(k))
    # the run's global batches (2 x 2 processes x 2): each pass's rows cut into whole ones, the rest sitting out
    passes = []
    for p in range(3):
        plain.set_epoch(p)
        keys = [_key(s) for s in plain]
        passes += [keys[i:i + 8] for i in range(0, len(keys) // 8 * 8, 8)]
    assert _global_batches(_mixed(files), len(passes)) == passes


@pytest.mark.parametrize("stopping", ["first_exhausted", "all_exhausted"])
def test_mixed_with_interleave_prob_is_datasets_interleaving(files, stopping):
    """--interleave_prob 1 2 1: datasets.interleave_datasets of the three streams with the
    probabilities normalised, seeded with the draw after the specs' (as ms-swift seeds it), then
    the buffer shuffle with the next draw."""
    import datasets

    rng = np.random.RandomState(42)
    for _ in ROWS:
        draw_seed(rng)
    columns = [datasets.Dataset.from_dict({"k": [f"{n} {i}" for i in range(k)]}).to_iterable_dataset()
               for n, k in ROWS.items()]
    reference = datasets.interleave_datasets(columns, probabilities=[0.25, 0.5, 0.25], seed=draw_seed(rng),
                                             stopping_strategy=stopping).shuffle(seed=draw_seed(rng), buffer_size=8)
    mixed = mix_streams(_streams(files), seed=42, shuffle=True, buffer_size=8, interleave=[1, 2, 1],
                        stopping=stopping)
    got = [_key(s) for s in mixed]
    assert got == [r["k"] for r in reference]
    plain = stream_samples(list(files.values()), strict=True, seed=42, shuffle=True, buffer_size=8,
                           interleave=[1, 2, 1], stopping=stopping)  # --dataset a b c --interleave_prob 1 2 1
    assert [_key(s) for s in plain] == got
    counts = {n: sum(k.startswith(n + " ") for k in got) for n in ROWS}
    if stopping == "all_exhausted":
        assert all(counts[n] >= k for n, k in ROWS.items())
    else:
        assert any(counts[n] == k for n, k in ROWS.items()) and sum(counts.values()) < sum(ROWS.values())


# ----------------------------------------------------------------------------- sizes


def test_sizes_declared_or_counted(files, tmp_path):
    from mmembed.data.dataset_config import DatasetEntry

    other = tmp_path / "rows.json"
    other.write_text(json.dumps(_rows("x", 3)))
    entries = [DatasetEntry("a", [files["a"]], rows=500), DatasetEntry("b", [files["b"]], sample=7),
               DatasetEntry("c", [files["c"], files["a"] + "#5"])]
    assert stream_sizes(entries, "proportional", "cfg") == [(500, "declared: rows"), (7, "declared: sample"),
                                                           (8 + 5, "counted: its files' lines")]
    assert stream_sizes(entries, "round_robin", "cfg") == [(None, "not needed")] * 3
    with pytest.raises(UsageError, match=r"cfg: dataset x: .*weighted.*cannot be counted.*'rows: N'"):
        stream_sizes([DatasetEntry("x", [str(other)])], "weighted", "cfg")
    # a declared size sets the draws: the loaded rule's over those sizes
    sizes = [(24, "declared"), (12, "declared"), (24, "declared")]
    stream = StreamBatches.homogeneous(_streams(files), "proportional", sizes, [1.0] * 3, 2, 2, 2, 5)
    loaded = HOMOGENEOUS_SAMPLERS["proportional"]([Part(n, 1.0, np.arange(k)) for n, (k, _) in zip(ROWS, sizes)],
                                                  2, 2, 5, 0, 2)
    assert [b[0].split()[0] for b in _global_batches(stream, 7)] == [list(ROWS)[d] for d in loaded.draws(0)]
    with pytest.raises(UsageError, match="dataset 'c' has 6 training row.*fewer than one global batch of 8"):
        StreamBatches.homogeneous(_streams(files), "proportional", [(12, ""), (20, ""), (6, "")], [1.0] * 3, 2, 2, 2, 5)


# ----------------------------------------------------------------------------- the run's data


def _config(tmp_path, datasets) -> str:
    path = tmp_path / "datasets.json"
    path.write_text(json.dumps(datasets))
    return str(path)


def _argv(model, cfg, *extra):
    return ["--model", model, "--dataset_config", cfg, "--streaming", "true", "--max_steps", "4",
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1", "--max_length", "64",
            "--disable_tqdm", "true", "--dataloader_num_workers", "0", "--report_to", "none", *extra]


def _load(args):
    from mmembed.training.data_assembly import TrainingData
    from mmembed.training.model_assembly import Encoding, make_loss
    from mmembed.training.preflight import media_settings

    return TrainingData.load(args, Encoding.resolve(args), make_loss(args), media_settings(args))


def test_each_dataset_is_checked_against_its_own_loss_and_instructions(minilm_path, files, tmp_path, caplog):
    """Dataset b's own hard_negatives needs negatives: its row without one is a data error naming
    file and line when read (a's rows, under the run's loss, need none); with --strict false it is
    skipped and logged. Dataset a's long instruction counts toward its rows' length: with
    --truncation_strategy delete its rows over --max_length go (exactly those). a's val rows are
    read whole, with a's index."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_path)
    long = "Given a question about the scene described, find the sentence that describes the same scene"
    rows = [{"query": f"b {i}: a question", "response": "an answer", "rejected_response": ["another"]}
            for i in range(8)]
    del rows[5]["rejected_response"]
    b = write_jsonl(tmp_path / "b.jsonl", rows)
    a = write_jsonl(tmp_path / "a.jsonl", PAIRS[:8])
    with_long = [len(tok(f"{long} {p['query']}")["input_ids"]) for p in PAIRS[:8]]
    limit = sorted(with_long)[4]
    alone = [max(len(tok(p["query"])["input_ids"]), len(tok(p["response"])["input_ids"])) for p in PAIRS[:8]]
    assert max(alone) <= limit < max(with_long)
    val = write_jsonl(tmp_path / "a_val.jsonl", PAIRS[20:23])
    cfg = _config(tmp_path, [{"name": "a", "path": a, "query_system": long, "val": val},
                             {"name": "b", "path": b, "infonce": {"hard_negatives": 1}}])
    argv = _argv(minilm_path, cfg, "--output_dir", str(tmp_path / "out"), "--multi_dataset_sampler", "round_robin",
                 "--dataset_shuffle", "false", "--max_length", str(limit))
    data = _load(parse_sft_args(argv))
    a_stream, b_stream = data.train.streams
    assert [s.anchor.text for s in a_stream] == [p["query"] for p, n in zip(PAIRS, with_long) if n <= limit]
    with pytest.raises(DataError, match=r"b\.jsonl:6: .*no negatives"):
        list(b_stream)
    assert data.losses[1].config.hard_negatives == 1 and 0 not in data.losses
    assert list(data.val.dataset_ids) == [0, 0, 0] and [d.val_rows for d in data.datasets] == [3, 0]
    with caplog.at_level(logging.WARNING, logger="mmembed"):
        kept = list(_load(parse_sft_args(argv + ["--strict", "false"])).train.streams[1])
    assert len(kept) == 7 and re.search(r"skipped a bad row .*b\.jsonl:6", caplog.text)


def test_a_mixed_run_streams_the_datasets_in_ms_swifts_order(minilm_path, files, tmp_path):
    """The run's data under mixed: global batches of the stream --dataset a b c would read (the
    same seeds), each row with its dataset's index; the datasets' sizes are not needed."""
    cfg = _config(tmp_path, [{"name": n, "path": files[n]} for n in ROWS])
    data = _load(parse_sft_args(_argv(minilm_path, cfg, "--output_dir", str(tmp_path / "out"),
                                      "--shuffle_buffer_size", "8")))
    assert data.train.rule is None and [d.rows for d in data.datasets] == [None] * 3
    plain = stream_samples(list(files.values()), strict=True, seed=42, shuffle=True, buffer_size=8)
    keys = [_key(s) for s in plain]
    rows = list(itertools.islice(iter(data.train), 2 * (len(keys) // 2)))
    assert [_key(s) for s in rows] == keys[:len(rows)]
    assert all(list(ROWS).index(_key(s).split()[0]) == s.dataset_id for s in rows)


def test_a_bad_row_stops_the_stream_naming_file_and_line_or_is_skipped(minilm_path, files, tmp_path, caplog):
    rows = [json.dumps(r) for r in _rows("b", 20)]
    rows[13] = "{not json"
    b = write_jsonl(tmp_path / "b.jsonl", rows)
    cfg = _config(tmp_path, [{"name": "a", "path": files["a"]}, {"name": "b", "path": b}])
    argv = _argv(minilm_path, cfg, "--output_dir", str(tmp_path / "out"), "--multi_dataset_sampler", "proportional",
                 "--dataset_shuffle", "false")
    stream = _load(parse_sft_args(argv)).train
    with pytest.raises(DataError) as e:
        list(itertools.islice(iter(stream), 40))
    assert e.value.source == b and e.value.line == 14
    with caplog.at_level(logging.WARNING, logger="mmembed"):
        got = [_key(s) for s in itertools.islice(iter(_load(parse_sft_args(argv + ["--strict", "false"])).train), 40)]
    assert "b 13" not in got and "b 14" in got and f"{b}:14" in caplog.text


def test_refusals(minilm_path, files, tmp_path):
    cfg = _config(tmp_path, [{"name": "a", "path": files["a"]}, {"name": "b", "path": files["b"]}])
    base = _argv(minilm_path, cfg, "--output_dir", str(tmp_path / "out"))
    with pytest.raises(UsageError, match="--batch_sampler no_duplicates needs every row's texts up front"):
        parse_sft_args(base + ["--batch_sampler", "no_duplicates"])
    plain = ["--model", minilm_path, "--dataset", files["a"], "--streaming", "true", "--max_steps", "2"]
    with pytest.raises(UsageError, match="--multi_dataset_sampler proportional with --streaming true draws .* "
                                         "--dataset_config"):
        parse_sft_args(plain + ["--multi_dataset_sampler", "proportional"])
    with pytest.raises(UsageError, match="--interleave_prob draws each row"):
        parse_sft_args(base + ["--multi_dataset_sampler", "weighted", "--interleave_prob", "1", "2"])
    with pytest.raises(UsageError, match=r"--interleave_prob gives 3 probabilities for 2 dataset\(s\) \(dataset a, "):
        _load(parse_sft_args(base + ["--interleave_prob", "1", "2", "3"]))
    losses = _config(tmp_path, [{"name": "a", "path": files["a"], "infonce": {"temperature": 0.05}}])
    with pytest.raises(UsageError, match="dataset.s. a have loss settings of their own"):
        _load(parse_sft_args(_argv(minilm_path, losses, "--output_dir", str(tmp_path / "out"))))
    small = _argv(minilm_path, cfg, "--output_dir", str(tmp_path / "out"), "--multi_dataset_sampler", "proportional",
                  "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2")
    with pytest.raises(UsageError, match="dataset 'a' has 12 training row.*fewer than one global batch of 16"):
        _load(parse_sft_args(small))
    assert parse_sft_args(plain + ["--interleave_prob", "1"]).interleave_prob == [1.0]  # with mixed: ms-swift's


# ----------------------------------------------------------------------------- runs


@pytest.fixture(scope="module")
def runs(minilm_no_dropout, files, tmp_path_factory):
    """Short LoRA runs of MiniLM (dropout off) on the three datasets, dataset a with an instruction
    and dataset b with its own temperature, c with weight 3, every global batch (4 rows) from one
    dataset by the weighted rule, the rows unshuffled; each run records the rows of every step:
    ``loaded`` (the datasets read whole), ``streamed`` (6 steps, a checkpoint at 3), ``resumed``
    (a copy of the streamed run resumed from its checkpoint-3)."""
    import mmembed.training.charts as charts
    import mmembed.training.sft as sft
    from mmembed.training.sft import run_sft

    work = tmp_path_factory.mktemp("multi_stream_runs")
    cfg = _config(work, [{"name": "a", "path": files["a"], "query_system": "Find the paraphrase", "weight": 1},
                         {"name": "b", "path": files["b"], "infonce": {"temperature": 0.05}, "weight": 1},
                         {"name": "c", "path": files["c"], "weight": 3}])
    common = ["--model", minilm_no_dropout, "--dataset_config", cfg, "--lora_rank", "4", "--learning_rate", "1e-3",
              "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--max_length", "64",
              "--report_to", "none", "--disable_tqdm", "true", "--dataloader_num_workers", "0", "--logging_steps", "1",
              "--seed", "3", "--multi_dataset_sampler", "weighted", "--dataset_shuffle", "false", "--max_steps", "6",
              "--save_steps", "3"]
    build, draw = sft.build_trainer, charts.draw_series

    def run(*flags):
        seen, trainers = [], []

        def hooked(args, setup=None):
            trainer = build(args, setup)
            collate = trainer.data_collator

            def recording(samples):
                seen.append([_key(s) for s in samples])
                return collate(samples)

            trainer.data_collator = recording
            trainers.append(trainer)
            return trainer

        sft.build_trainer = hooked
        try:
            run_sft(parse_sft_args(common + list(flags)))
        finally:
            sft.build_trainer = build
        losses = {h["step"]: h for h in trainers[0].state.log_history if "loss" in h}
        return {"rows": seen, "losses": losses}

    charts.draw_series = lambda *a, **k: []  # (the charts are tested elsewhere)
    try:
        out = {"work": work, "files": files}
        out["loaded"] = run("--train_dataloader_shuffle", "false", "--save_strategy", "no",
                            "--output_dir", str(work / "loaded"))
        out["streamed"] = run("--streaming", "true", "--output_dir", str(work / "streamed"))
        shutil.copytree(work / "streamed", work / "resumed", ignore=shutil.ignore_patterns("checkpoint-6"))
        out["resumed"] = run("--streaming", "true", "--output_dir", str(work / "resumed"),
                             "--resume_from_checkpoint", str(work / "resumed" / "checkpoint-3"))
    finally:
        charts.draw_series = draw
    return out


def _per_dataset(losses: dict, key: str) -> dict[int, float]:
    return {step: h[key] for step, h in losses.items() if key in h}


def test_a_streamed_run_trains_as_the_same_datasets_read_whole(runs):
    """Unshuffled: the streamed run's steps are the loaded run's, row for row (passes over each
    dataset included), and so are its losses (dataset a's instruction, b's temperature), per
    dataset too."""
    assert runs["streamed"]["rows"][:6] == runs["loaded"]["rows"][:6]
    assert all(len({k.split()[0] for k in batch}) == 1 for batch in runs["streamed"]["rows"])
    assert any(runs["streamed"]["rows"][:6].count(b) > 1 for b in runs["streamed"]["rows"][:6])  # c's second pass
    for key in ("loss", "loss_a", "loss_b", "loss_c"):
        got, want = _per_dataset(runs["streamed"]["losses"], key), _per_dataset(runs["loaded"]["losses"], key)
        assert got.keys() == want.keys() and list(got.values()) == pytest.approx(list(want.values()), rel=1e-5), key
    assert 0 < len(_per_dataset(runs["streamed"]["losses"], "loss_b")) < 6


def test_a_resumed_run_trains_on_the_same_rows(runs):
    """Resumed from checkpoint-3, the streamed run trains steps 4-6 on the rows the uninterrupted
    run trained on, with the same losses; checkpoint-3 recorded the position, which a stream of
    another --data_seed does not reach (refused)."""
    from mmembed.training.samplers import check_resumed_state

    full, resumed = runs["streamed"], runs["resumed"]
    assert resumed["rows"][3:6] == full["rows"][3:6]  # (the skipped steps' batches are collated too)
    for step in range(4, 7):
        assert resumed["losses"][step]["loss"] == pytest.approx(full["losses"][step]["loss"], rel=1e-5)
    checkpoint = str(runs["work"] / "streamed" / "checkpoint-3")
    with open(os.path.join(checkpoint, "sampler_state.json")) as f:
        state = json.load(f)
    assert state["streaming"] and state["global_step"] == 3
    drawn = {d["name"]: d["global_batches_drawn"] for d in state["datasets"]}
    assert drawn == {n: sum(b[0].startswith(n + " ") for b in full["rows"][:3]) for n in ROWS}
    sizes = [(n, "counted: its files' lines") for n in ROWS.values()]
    same = StreamBatches.homogeneous(_streams(runs["files"]), "weighted", sizes, [1.0, 1.0, 3.0], 4, 1, 1, 42)
    check_resumed_state(same, checkpoint)
    other = StreamBatches.homogeneous(_streams(runs["files"]), "weighted", sizes, [1.0, 1.0, 3.0], 4, 1, 1, 7)
    with pytest.raises(UsageError, match="sampler_state.json records the sampler's position after step 3"):
        check_resumed_state(other, checkpoint)


def test_two_processes_train_on_their_shares_of_the_same_global_batches(minilm_path, files, tmp_path):
    """torchrun, 2 processes (gloo), per-device batch 2, 2 accumulation steps, weighted, shuffled
    streams: each process reads every stream and keeps its share, so every step's 8 rows, put
    together from both processes' micro-batches, are the global batch one process computes."""
    weights = {"a": 1.0, "b": 1.0, "c": 3.0}
    cfg = _config(tmp_path, [{"name": n, "path": files[n], "weight": w} for n, w in weights.items()])
    flags = dict(model=minilm_path, dataset_config=cfg, output_dir=str(tmp_path / "out"), streaming=True,
                 multi_dataset_sampler="weighted", shuffle_buffer_size=4, per_device_train_batch_size=2,
                 gradient_accumulation_steps=2, max_steps=4, max_length=32, save_strategy="no", report_to=[],
                 dataloader_num_workers=0, disable_tqdm=True, logging_steps=1)
    launch(["tests/sampler_worker.py", "--out", str(tmp_path / "rows"), "--weights", json.dumps(weights),
            "--flags", json.dumps(flags)], nproc=2, timeout=300)
    recorded = [json.loads((tmp_path / f"rows.{r}").read_text()) for r in range(2)]
    steps = [[row for k in range(2) for r in range(2) for row in recorded[r][s * 2 + k]] for s in range(4)]
    sizes = [(n, "counted: its files' lines") for n in ROWS.values()]
    reference = StreamBatches.homogeneous(_streams(files, shuffle=True), "weighted", sizes, list(weights.values()),
                                          2, 2, 2, 42)
    assert steps == _global_batches(reference, 4)
    assert all(len(set(step)) == 8 and len({k.split()[0] for k in step}) == 1 for step in steps)
