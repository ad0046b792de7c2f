"""Charts of a run (mmembed/training/charts.py) and ``--report_to tensorboard``, from a tiny
``mmembed sft`` of the real all-MiniLM-L6-v2: the PNGs exist and are images, what they plot
is the Trainer's log_history, and the TensorBoard event files hold the same training loss."""

import glob
import json
import logging
import os

import numpy as np
import pytest
from conftest import stsb_pairs, write_jsonl
from PIL import Image

from mmembed.encoding.layout import Layout
from mmembed.training.arguments import parse_sft_args
from mmembed.training.charts import (
    CHARTS_DIR,
    HISTOGRAM_FILE,
    TrainingCharts,
    chart_series,
    draw_series,
    pair_similarities,
    plot_histogram,
    plot_series,
)
from mmembed.training.sft import run_sft


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """STS-B pairs in ms-swift's query form, every other row with a hard negative."""
    d = tmp_path_factory.mktemp("data")
    pairs = stsb_pairs(24)
    rows = [{"query": p["query"], "response": p["response"],
             "rejected_response": [pairs[(i + 5) % len(pairs)]["response"]] * (i % 2)} for i, p in enumerate(pairs)]
    return write_jsonl(d / "train.jsonl", rows[:16]), write_jsonl(d / "val.jsonl", rows[16:])


def _sft(model, train, out, *extra):
    return run_sft(parse_sft_args([
        "--model", model, "--task_type", "embedding", "--dataset", train, "--tuner_type", "full",
        "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4", "--gradient_accumulation_steps", "1",
        "--max_length", "32", "--logging_steps", "1", "--output_dir", str(out), "--disable_tqdm", "true",
        "--dataloader_num_workers", "0", "--learning_rate", "1e-4", *extra,
    ]))


@pytest.fixture(scope="module")
def run(minilm_path, data, tmp_path_factory):
    """4 steps with an eval set, saving and evaluating every 2 steps, logging to TensorBoard."""
    out = tmp_path_factory.mktemp("run")
    metrics = _sft(minilm_path, data[0], out, "--val_dataset", data[1], "--max_steps", "4", "--save_steps", "2",
                   "--eval_strategy", "steps", "--eval_steps", "2", "--report_to", "tensorboard")
    state = json.load(open(os.path.join(metrics["last_checkpoint"], "trainer_state.json")))
    return str(out), state["log_history"]


def _expected_series(log_history):
    """The series written out plainly: per key, the (step, value) of each log entry holding it."""
    want = {}
    for entry in log_history:
        for key, value in entry.items():
            if key == "loss":
                want.setdefault("train_loss", []).append((entry["step"], value))
            elif key in ("learning_rate", "grad_norm") or (
                    key.startswith("eval_") and not key.endswith(("_runtime", "_per_second"))):
                want.setdefault(key, []).append((entry["step"], value))
    return want


def test_charts_plot_the_log_history(run):
    out, log_history = run
    want = _expected_series(log_history)
    assert {"train_loss", "learning_rate", "grad_norm", "eval_loss", "eval_margin", "eval_mean_pos",
            "eval_recall_at_1", "eval_ndcg_at_10"} <= set(want)
    assert [s for s, _ in want["train_loss"]] == [1, 2, 3, 4] and [s for s, _ in want["eval_loss"]] == [2, 4]
    series = chart_series(log_history)
    assert set(series) == set(want)
    for name, points in want.items():
        steps, values = series[name]
        assert list(zip(steps, values)) == points, name
        # what the chart draws is exactly that series
        line = plot_series(name, steps, values).axes[0].lines[0]
        np.testing.assert_array_equal(line.get_xydata(), np.array(points, dtype=float))


def test_charts_are_png_images_in_the_output_folder(run):
    out, log_history = run
    folder = os.path.join(out, CHARTS_DIR)
    names = set(_expected_series(log_history)) | {HISTOGRAM_FILE[:-4]}
    assert {f[:-4] for f in os.listdir(folder)} == names
    for name in names:
        with Image.open(os.path.join(folder, name + ".png")) as im:
            assert im.format == "PNG" and im.size[0] >= 300 and im.size[1] >= 200
            im.verify()
    with Image.open(os.path.join(folder, HISTOGRAM_FILE)) as im:
        assert im.size[0] > im.size[1]  # two panels side by side: before and after


def test_tensorboard_event_files_hold_the_training_loss(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, log_history = run
    files = glob.glob(os.path.join(out, "runs", "*", "events.out.tfevents.*"))
    assert files, os.listdir(out)
    acc = EventAccumulator(os.path.dirname(files[0]))
    acc.Reload()
    loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    want = [(h["step"], h["loss"]) for h in log_history if "loss" in h]
    assert [s for s, _ in loss] == [s for s, _ in want]
    np.testing.assert_allclose([v for _, v in loss], [v for _, v in want], rtol=1e-6)
    assert "eval/loss" in acc.Tags()["scalars"]


def test_no_eval_set_skips_only_the_histogram(minilm_path, data, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="mmembed"):
        _sft(minilm_path, data[0], tmp_path, "--max_steps", "1")
    assert "no eval set" in caplog.text and "histogram is skipped" in caplog.text
    charts = sorted(os.listdir(tmp_path / CHARTS_DIR))
    assert charts == ["grad_norm.png", "learning_rate.png", "train_loss.png"]


def test_chart_series_leaves_out_the_run_summary(tmp_path):
    log = [{"loss": 1.5, "grad_norm": 2.0, "learning_rate": 1e-4, "epoch": 0.5, "step": 1},
           {"eval_loss": 0.7, "eval_runtime": 0.2, "eval_samples_per_second": 9.0, "epoch": 0.5, "step": 1},
           {"train_runtime": 3.0, "train_loss": 1.4, "total_flos": 10.0, "epoch": 1.0, "step": 2}]
    assert chart_series(log) == {"train_loss": ([1], [1.5]), "grad_norm": ([1], [2.0]),
                                 "learning_rate": ([1], [1e-4]), "eval_loss": ([1], [0.7])}
    assert draw_series(log, str(tmp_path)) == [str(tmp_path / f"{n}.png") for n in chart_series(log)]


def test_a_chart_is_redrawn_only_when_its_series_changed(tmp_path, monkeypatch):
    """The end of training usually follows a save at the same step: charts already drawn
    with the same points are not drawn again, changed or missing ones are."""
    from mmembed.training import charts

    drawn_names = []
    real = charts.plot_series
    monkeypatch.setattr(charts, "plot_series", lambda name, *a: drawn_names.append(name) or real(name, *a))
    log = [{"loss": 1.5, "grad_norm": 2.0, "step": 1}]
    drawn: dict = {}
    draw_series(log, str(tmp_path), drawn)
    assert sorted(drawn_names) == ["grad_norm", "train_loss"]
    drawn_names.clear()
    assert draw_series(log, str(tmp_path), drawn) == [str(tmp_path / "train_loss.png"), str(tmp_path / "grad_norm.png")]
    assert drawn_names == []
    log.append({"loss": 1.2, "step": 2})
    os.remove(tmp_path / "grad_norm.png")
    draw_series(log, str(tmp_path), drawn)
    assert sorted(drawn_names) == ["grad_norm", "train_loss"]  # one changed, one missing
    with Image.open(tmp_path / "grad_norm.png") as im:
        assert im.format == "PNG"


def _cosine(emb, i, j):
    return float(emb[i] @ emb[j] / np.linalg.norm(emb[i]) / np.linalg.norm(emb[j]))


def test_pair_similarities_of_groups():
    emb = np.random.default_rng(0).normal(size=(9, 5))
    # rows a0 p0 n0_0 n0_1 | a1 p1 | a2 p2 n2_0, labeled as ms-swift does: 1.0 per positive, 0.0 per negative
    sims = pair_similarities(emb, np.array([1.0, 0.0, 0.0, 1.0, 1.0, 0.0]), Layout.GROUP)
    groups = {0: (1, [2, 3]), 4: (5, []), 6: (7, [8])}  # anchor row: (positive row, negative rows)
    np.testing.assert_allclose(sims["positive"], [_cosine(emb, a, p) for a, (p, _) in groups.items()])
    np.testing.assert_allclose(sims["hard negative"], [_cosine(emb, a, n) for a, (_, ns) in groups.items() for n in ns])
    other = [_cosine(emb, a, d) for a in groups for b, (p, ns) in groups.items() if b != a for d in [p, *ns]]
    np.testing.assert_allclose(np.sort(sims["other documents"]), np.sort(other))
    assert len(plot_histogram(sims, sims).axes) == 2


def test_pair_similarities_of_scored_pairs():
    emb = np.random.default_rng(1).normal(size=(6, 5))
    sims = pair_similarities(emb, np.array([0.9, 0.2, 1.0]), Layout.PAIR)  # rows s1 s2 | s1 s2 | s1 s2
    np.testing.assert_allclose(sims["positive"], [_cosine(emb, 0, 1), _cosine(emb, 4, 5)])
    np.testing.assert_allclose(sims["negative"], [_cosine(emb, 2, 3)])
    assert len(plot_histogram(sims, None).axes) == 1


def test_measuring_leaves_the_random_generators_as_they_were(tmp_path):
    """The before/after pass must not change training: a DataLoader draws its seed from the
    global torch generator, so the callback restores every generator it may touch."""
    import random

    import torch
    from transformers import TrainerControl, TrainerState, TrainingArguments

    def consuming():
        torch.utils.data.DataLoader(range(4), shuffle=True).__iter__()
        torch.rand(3), np.random.rand(), random.random()
        return {"positive": np.array([0.9]), "negative": np.array([0.1])}

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[])
    state = TrainerState()
    charts = TrainingCharts(consuming)
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    charts.on_train_begin(args, state, TrainerControl())
    charts.on_train_end(args, state, TrainerControl())
    got = (torch.rand(2), np.random.rand(), random.random())
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    want = (torch.rand(2), np.random.rand(), random.random())
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]
    assert os.path.isfile(tmp_path / CHARTS_DIR / HISTOGRAM_FILE)


def test_saves_redraw_the_charts_at_most_once_per_interval(tmp_path, monkeypatch):
    """At a save the charts are drawn only when REDRAW_SECONDS have passed since training
    began or since they were last drawn; the end of training always draws them."""
    from types import SimpleNamespace

    from mmembed.training import charts

    calls = []
    monkeypatch.setattr(charts, "draw_series", lambda log, folder, drawn: calls.append(len(log)) or [])
    now = [100.0]
    cb = charts.TrainingCharts(redraw_seconds=60.0, clock=lambda: now[0])
    args = SimpleNamespace(output_dir=str(tmp_path))
    state = SimpleNamespace(is_world_process_zero=True, log_history=[{"loss": 1.0, "step": 1}], global_step=1)
    cb.on_train_begin(args, state, None)
    for t, drawn in [(130.0, 0), (159.9, 0), (160.0, 1), (200.0, 1), (221.0, 2)]:
        now[0] = t
        cb.on_save(args, state, None)
        assert len(calls) == drawn, t
    cb.on_train_end(args, state, None)
    assert len(calls) == 3
    other = SimpleNamespace(is_world_process_zero=False, log_history=state.log_history, global_step=1)
    now[0] = 1000.0
    cb.on_save(args, other, None)  # only the first process draws
    assert len(calls) == 3


def test_the_end_histogram_takes_the_last_steps_eval_embeddings(minilm_path, data, tmp_path, monkeypatch):
    """The evaluation at a step keeps a small eval set's embeddings; the histogram measured at
    that step takes them instead of embedding the set again, and they give what embedding it
    again gives. Another step's, or after --load_best_model_at_end, are not taken."""
    import mmembed.training.charts as charts
    from mmembed.training.sft import build_trainer

    args = ["--model", minilm_path, "--dataset", data[0], "--val_dataset", data[1], "--output_dir", str(tmp_path),
            "--per_device_eval_batch_size", "4", "--max_length", "32", "--dataloader_num_workers", "0"]
    trainer = build_trainer(parse_sft_args(args))
    embedded = []
    embed = charts.embed_eval_set
    monkeypatch.setattr(charts, "embed_eval_set", lambda *a, **k: embedded.append(1) or embed(*a, **k))

    trainer.evaluate()
    kept = charts.eval_similarities(trainer)
    assert embedded == []
    trainer.eval_embedded = None
    fresh = charts.eval_similarities(trainer)
    assert embedded == [1]
    assert set(kept) == set(fresh) == {"positive", "hard negative", "other documents"}
    for kind in kept:
        np.testing.assert_allclose(kept[kind], fresh[kind], atol=1e-6)

    trainer.evaluate()
    trainer.state.global_step += 1  # trained since
    charts.eval_similarities(trainer)
    assert embedded == [1, 1]
    trainer.evaluate()
    trainer.args.load_best_model_at_end = True
    charts.eval_similarities(trainer)
    assert embedded == [1, 1, 1]
