"""Distillation with the teacher taken from the data: teacher_scores / teacher_embeddings row
fields, and .npy files aligned with a data file's rows (--teacher_scores_file,
--teacher_embeddings_file)."""

import json
import os
import re

import numpy as np
import pytest
import torch
from conftest import DATA
from safetensors.torch import load_file

TRAIN = os.path.join(DATA, "stsb_train_hardneg.jsonl")


def _rows(n=3):
    return [
        {"query": "q0", "response": "p0", "rejected_response": ["n00", "n01"]},
        {"query": "q1", "response": "p1"},
        {"query": "q2", "response": "p2", "rejected_response": ["n20"]},
    ][:n]


def _write_jsonl(path, rows, blank_after=()):
    with open(path, "w") as f:
        for i, r in enumerate(rows):
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
            if i in blank_after:
                f.write("\n")
    return str(path)


# ---- row fields --------------------------------------------------------------------


def test_row_fields_reach_the_sample(tmp_path):
    from mmembed.data import read_file

    rows = _rows()
    rows[0]["teacher_scores"] = [3, 1.5, -2]
    rows[2]["teacher_embeddings"] = [[1, 0], [0, 1], [0.5, 0.5]]
    samples = read_file(_write_jsonl(tmp_path / "d.jsonl", rows))
    assert samples[0].teacher_scores == [3.0, 1.5, -2.0] and samples[0].teacher_embeddings is None
    assert samples[1].teacher_scores is None
    assert samples[2].teacher_embeddings == [[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]]


def test_csv_cells_hold_teacher_scores(tmp_path):
    from mmembed.data import read_file

    path = tmp_path / "d.csv"
    path.write_text('query,response,rejected_response,teacher_scores\nq,p,"[""n""]","[2.0, -1.0]"\n')
    assert read_file(str(path))[0].teacher_scores == [2.0, -1.0]


@pytest.mark.parametrize("field,value,message", [
    ("teacher_scores", [1.0, 2.0], "has 2 scores but the row has 1 positive and 2 negatives"),
    ("teacher_scores", [1.0, "x", 2.0], "list of numbers"),
    ("teacher_scores", [1.0, float("nan"), 2.0], "score 1 is nan"),
    ("teacher_embeddings", [[1.0], [2.0]], "must hold 4 vectors"),
    ("teacher_embeddings", [[1.0], [2.0], [3.0, 4.0], [5.0]], "teacher_embeddings[2]': has 2 numbers"),
    ("teacher_embeddings", [[1.0], [2.0], [], [5.0]], "teacher_embeddings[2]': must be a non-empty list"),
], ids=["count", "type", "nan", "vectors", "width", "empty"])
def test_bad_row_fields_name_file_line_and_field(tmp_path, field, value, message):
    from mmembed.data import DataError, read_file

    rows = _rows()
    rows[0][field] = value
    path = tmp_path / "d.jsonl"
    with open(path, "w") as f:  # allow_nan: the reader must reject the NaN, not json
        f.write("\n".join(json.dumps(r, allow_nan=True) for r in rows) + "\n")
    with pytest.raises(DataError) as e:
        read_file(str(path))
    assert e.value.source == str(path) and e.value.line == 1 and e.value.field.startswith(field)
    assert message in str(e.value)


# ---- rows of a file and .npy alignment ---------------------------------------------


def test_row_numbers_count_every_row_of_each_file(tmp_path):
    """`row` is the row's index in its own file: blank JSONL lines do not count, a bad row
    skipped with strict=False does (the .npy has a slot for it)."""
    from mmembed.data import load_samples

    a = _write_jsonl(tmp_path / "a.jsonl", [_rows()[0], "{not json", _rows()[1], _rows()[2]], blank_after=(0,))
    b = _write_jsonl(tmp_path / "b.jsonl", _rows(2))
    res = load_samples([a, b], strict=False, load_from_cache_file=False)
    got = [(r["source"], r["line"], r["row"]) for r in res.dataset]
    assert got == [(a, 1, 0), (a, 4, 2), (a, 5, 3), (b, 1, 0), (b, 2, 1)]
    assert res.records == {a: 4, b: 2} and res.rows_read == 6
    assert res.files == [[a], [b]]


def _scores_npy(path, rows_scores, width):
    arr = np.full((len(rows_scores), width), np.nan, dtype=np.float32)
    for i, s in enumerate(rows_scores):
        arr[i, : len(s)] = s
    np.save(path, arr)
    return str(path)


def test_npy_rows_attach_to_their_samples(tmp_path):
    from mmembed.data import EmbeddingDataset, load_samples
    from mmembed.data.teacher import TeacherFiles

    data = _write_jsonl(tmp_path / "d.jsonl", _rows())
    scores = _scores_npy(tmp_path / "s.npy", [[5, 4, 3], [2], [1, 0]], 4)
    emb = np.full((3, 4, 2), np.nan, dtype=np.float32)
    for i, k in enumerate((2, 0, 1)):
        emb[i, : 2 + k] = np.arange(2 * (2 + k)).reshape(-1, 2) + 10 * i
    np.save(tmp_path / "e.npy", emb)
    res = load_samples(data, load_from_cache_file=False)
    files = TeacherFiles.open(res.files, res.records, [scores], [str(tmp_path / "e.npy")])
    ds = EmbeddingDataset(res.dataset, files)
    assert [ds[i].teacher_scores for i in range(3)] == [[5, 4, 3], [2], [1, 0]]
    assert ds[2].teacher_embeddings == [[20, 21], [22, 23], [24, 25]]
    assert ds[1].teacher_embeddings == [[10, 11], [12, 13]]
    # the teacher files travel to DataLoader workers as paths, not copies
    import pickle

    assert pickle.loads(pickle.dumps(ds))[0].teacher_scores == [5, 4, 3]


def test_an_array_off_by_one_row_is_caught(tmp_path):
    """The NaN padding pins each array row to its row's number of negatives: an array whose
    rows are shifted fails at the first row where the counts differ."""
    from mmembed.data import DataError, EmbeddingDataset, load_samples
    from mmembed.data.teacher import TeacherFiles

    data = _write_jsonl(tmp_path / "d.jsonl", _rows())
    shifted = _scores_npy(tmp_path / "s.npy", [[2], [1, 0], [5, 4, 3]], 3)  # rows 1, 2, 0
    res = load_samples(data, load_from_cache_file=False)
    ds = EmbeddingDataset(res.dataset, TeacherFiles.open(res.files, res.records, [shifted]))
    with pytest.raises(DataError) as e:
        ds[0]
    assert (e.value.source, e.value.line, e.value.field) == (data, 1, "s.npy[0]")
    assert "needs 3" in str(e.value)
    with pytest.raises(DataError, match="pad with NaN"):
        ds[1]


@pytest.mark.parametrize("case,message", [
    ("rows", "2 rows, but"), ("count", "1 file(s) for 2 --dataset"), ("ndim", "expected a float array"),
    ("folder", "folder of 2 files"),
])
def test_npy_that_does_not_fit_the_data_is_refused(tmp_path, case, message):
    from mmembed.data import load_samples
    from mmembed.data.teacher import TeacherFiles

    os.makedirs(tmp_path / "d")
    a = _write_jsonl(tmp_path / "d" / "a.jsonl", _rows())
    b = _write_jsonl(tmp_path / "d" / "b.jsonl", _rows(1))
    good = _scores_npy(tmp_path / "s.npy", [[5, 4, 3], [2], [1, 0]], 3)
    specs, npys = [a], [good]
    if case == "rows":
        npys = [_scores_npy(tmp_path / "short.npy", [[5, 4, 3], [2]], 3)]
    elif case == "count":
        specs = [a, b]
    elif case == "ndim":
        np.save(tmp_path / "flat.npy", np.zeros(3))
        npys = [str(tmp_path / "flat.npy")]
    else:
        specs = [str(tmp_path / "d")]
    res = load_samples(specs, load_from_cache_file=False)
    with pytest.raises(ValueError, match=re.escape(message)):
        TeacherFiles.open(res.files, res.records, npys)


def test_a_row_field_and_an_array_for_the_same_signal_conflict(tmp_path):
    from mmembed.data import DataError, EmbeddingDataset, load_samples
    from mmembed.data.teacher import TeacherFiles

    rows = _rows()
    rows[1]["teacher_scores"] = [7.0]
    data = _write_jsonl(tmp_path / "d.jsonl", rows)
    res = load_samples(data, load_from_cache_file=False)
    ds = EmbeddingDataset(res.dataset, TeacherFiles.open(res.files, res.records,
                                                         [_scores_npy(tmp_path / "s.npy", [[5, 4, 3], [2], [1, 0]], 3)]))
    with pytest.raises(DataError, match="keep one source") as e:
        ds[1]
    assert e.value.line == 2


# ---- collation -----------------------------------------------------------------------


def test_collator_pads_scores_and_lines_up_embeddings_with_the_batch_rows(minilm_path, tmp_path):
    from mmembed.data import DataError, read_file
    from mmembed.encoding.collator import EmbeddingCollator
    from mmembed.encoding.layout import Layout
    from mmembed.training.model_assembly import load_processing, resolve_template

    rows = _rows()
    for r, k in zip(rows, (2, 0, 1)):
        r["teacher_scores"] = [float(10 * k + j) for j in range(1 + k)]
        r["teacher_embeddings"] = [[float(k), float(j)] for j in range(2 + k)]
    samples = read_file(_write_jsonl(tmp_path / "d.jsonl", rows))
    template = resolve_template(minilm_path, None, None, None)
    processing = load_processing(minilm_path, template)
    batch = EmbeddingCollator(template, processing, Layout.GROUP, 32, teacher_signal="teacher_scores")(samples)
    nan = float("nan")
    torch.testing.assert_close(batch["side"].teacher_scores, torch.tensor(
        [[20.0, 21.0, 22.0], [0.0, nan, nan], [10.0, 11.0, nan]]), equal_nan=True)
    assert batch["side"].teacher_embeddings is None
    collator = EmbeddingCollator(template, processing, Layout.GROUP, 32, teacher_signal="teacher_embeddings")
    batch = collator(samples)
    n = batch["input_ids"].shape[0]
    emb = batch["side"].teacher_embeddings
    assert emb.shape == (n, 2) == (2 + 2 + 2 + 0 + 2 + 1, 2)
    assert emb[:, 0].tolist() == [2, 2, 2, 2, 0, 0, 1, 1, 1]  # a0 p0 n00 n01 | a1 p1 | a2 p2 n20
    assert emb[:, 1].tolist() == [0, 1, 2, 3, 0, 1, 0, 1, 2]

    samples[1].teacher_embeddings = None
    with pytest.raises(DataError, match="teacher_embeddings.*missing") as e:
        collator(samples)
    assert e.value.line == 2
    for s in samples:
        s.teacher_scores = s.teacher_embeddings = None
    assert "side" not in collator(samples)  # eval rows without a teacher: no side inputs, no loss


# ---- training: the data's teacher gives the run the teacher model gives ----------------


def _teacher_views(teacher_path, data_path, n_rows):
    """Embeddings of every row member by the teacher (anchor, positive, negatives) and the
    own-group dot products, as the .npy arrays a user would precompute."""
    from mmembed import Embedder
    from mmembed.data import read_file
    from mmembed.encoding.collator import sample_items
    from mmembed.encoding.layout import Layout

    samples = read_file(data_path)[:n_rows]
    items = [sample_items(s, Layout.GROUP)[0] for s in samples]
    width_items = max(len(i) for i in items)
    flat = Embedder.from_pretrained(teacher_path).encode([it.text for its in items for it in its])
    emb = np.full((len(samples), width_items, flat.shape[1]), np.nan, dtype=np.float32)
    scores = np.full((len(samples), width_items - 1), np.nan, dtype=np.float32)
    at = 0
    for i, its in enumerate(items):
        e = flat[at: at + len(its)]
        at += len(its)
        emb[i, : len(its)] = e
        scores[i, : len(its) - 1] = e[1:] @ e[0]
    return emb, scores


def _final_weights(out):
    return load_file(os.path.join(out, "checkpoint-2", "model.safetensors"))


@pytest.mark.parametrize("use_batch", [True, False], ids=["embeddings-use_batch", "scores-own-group"])
def test_teacher_from_the_data_trains_like_the_teacher_model(minilm_no_dropout, tmp_path, use_batch):
    """Two steps of distill_kl (dropout off, so every run draws the same nothing) with the teacher's embeddings (use_batch) or its own-group
    scores (use_batch false) read from a .npy end with the weights of the same two steps with
    --teacher_model computing them on the fly; the row-field form gives the same again."""
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.sft import run_sft

    n = 8
    data = _write_jsonl(tmp_path / "train.jsonl", [json.loads(line) for line in open(TRAIN)][:n])
    emb, scores = _teacher_views(minilm_no_dropout, data, n)
    np.save(tmp_path / "emb.npy", emb)
    np.save(tmp_path / "scores.npy", scores)
    kwargs = json.dumps({"temperature": 0.1, "teacher_temperature": 0.05, "use_batch": use_batch})

    def run(name, *flags, dataset=data):
        out = str(tmp_path / name)
        run.metrics = run_sft(parse_sft_args([
            "--model", minilm_no_dropout, "--dataset", dataset, "--tuner_type", "full", "--loss_type", "distill_kl",
            "--loss_kwargs", kwargs, "--max_steps", "2", "--per_device_train_batch_size", "4",
            "--gradient_accumulation_steps", "1", "--learning_rate", "1e-4", "--output_dir", out,
            "--report_to", "none", "--save_steps", "2", "--attn_impl", "eager", *flags]))
        return _final_weights(out)

    model_run = run("model", "--teacher_model", minilm_no_dropout)
    assert "eval_loss" not in run.metrics  # no eval data
    file_flag = ["--teacher_embeddings_file", str(tmp_path / "emb.npy")] if use_batch else [
        "--teacher_scores_file", str(tmp_path / "scores.npy")]
    # eval rows from another file have no teacher: retrieval metrics, no eval loss
    val = _write_jsonl(tmp_path / "val.jsonl", [json.loads(line) for line in open(TRAIN)][n: n + 4])
    data_run = run("npy", *file_flag, "--val_dataset", val)
    assert "eval_recall_at_1" in run.metrics and "eval_loss" not in run.metrics
    base = load_file(os.path.join(minilm_no_dropout, "model.safetensors"))
    moved = [k for k in model_run if k in base and not torch.equal(model_run[k], base[k])]
    assert moved  # the runs trained
    for k in model_run:
        torch.testing.assert_close(data_run[k], model_run[k], atol=2e-5, rtol=1e-4, msg=k)

    # the same signal as row fields
    rows = [json.loads(line) for line in open(data)]
    for r, e, s in zip(rows, emb, scores):
        k = 1 + len(r.get("rejected_response") or [])
        if use_batch:
            r["teacher_embeddings"] = e[: 1 + k].tolist()
        else:
            r["teacher_scores"] = s[:k].tolist()
    field_run = run("field", dataset=_write_jsonl(tmp_path / "with_teacher.jsonl", rows))
    for k in model_run:
        torch.testing.assert_close(field_run[k], data_run[k], atol=1e-6, rtol=1e-5, msg=k)
    if not use_batch:  # the gradient cache hands the data's teacher to the loss the same way
        cached = run("gradcache", *file_flag, "--gradcache_mini_batch_size", "3")
        for k in model_run:
            torch.testing.assert_close(cached[k], data_run[k], atol=2e-5, rtol=1e-4, msg=k)


@pytest.mark.parametrize("case,message", [
    ("none", "needs teacher_embeddings"),
    ("scores-with-use_batch", "use_batch false"),
    ("width", "width is 2 and the student's 384"),
    ("file-and-model", "keep one"),
    ("file-with-infonce", "feeds the distillation losses"),
], ids=lambda v: v if isinstance(v, str) and " " not in v else None)
def test_a_data_teacher_that_cannot_serve_fails_before_training(minilm_path, tmp_path, case, message):
    from mmembed.data import DataError
    from mmembed.training.arguments import UsageError, parse_sft_args
    from mmembed.training.sft import run_sft

    rows = _rows()
    loss = ["--loss_type", "distill_cosine"]
    extra = []
    if case == "scores-with-use_batch":
        for r in rows:
            r["teacher_scores"] = [0.0] * (1 + len(r.get("rejected_response", [])))
        loss = ["--loss_type", "distill_kl"]
    elif case == "width":
        for r in rows:
            r["teacher_embeddings"] = [[0.0, 1.0]] * (2 + len(r.get("rejected_response", [])))
    elif case == "file-and-model":
        extra = ["--teacher_model", minilm_path, "--teacher_scores_file", "x.npy"]
    elif case == "file-with-infonce":
        loss, extra = ["--loss_type", "infonce"], ["--teacher_scores_file", "x.npy"]
    data = _write_jsonl(tmp_path / "d.jsonl", rows)
    out = tmp_path / "out"
    with pytest.raises((ValueError, UsageError, DataError), match=message):
        run_sft(parse_sft_args(["--model", minilm_path, "--dataset", data, *loss, *extra, "--output_dir", str(out),
                                "--report_to", "none", "--max_steps", "1"]))
    assert not out.exists() or not any(out.glob("checkpoint-*"))


# ---- the Python API ----------------------------------------------------------------------


def test_python_api_takes_the_flags_as_keywords(minilm_path, tmp_path):
    """mmembed.train(**options) parses exactly what the command line with the same flags parses,
    and trains: here distill_kl with the teacher's scores from a .npy."""
    import dataclasses

    import mmembed
    from mmembed.tools.api import to_argv
    from mmembed.training.arguments import parse_sft_args

    data = _write_jsonl(tmp_path / "d.jsonl", _rows())
    scores = _scores_npy(tmp_path / "s.npy", [[5, 4, 3], [2], [1, 0]], 3)
    options = dict(model=minilm_path, dataset=[data], loss_type="distill_kl", teacher_scores_file=[scores],
                   loss_kwargs={"use_batch": False, "teacher_temperature": 1.0}, mrl_dims={64: 1.0, 384: 0.5},
                   strict=True, max_steps=1, per_device_train_batch_size=3, output_dir=str(tmp_path / "out"),
                   report_to="none", eval_strategy=None)
    argv = ["--model", minilm_path, "--dataset", data, "--loss_type", "distill_kl", "--teacher_scores_file", scores,
            "--loss_kwargs", '{"use_batch": false, "teacher_temperature": 1.0}', "--mrl_dims", '{"64": 1.0, "384": 0.5}',
            "--strict", "true", "--max_steps", "1", "--per_device_train_batch_size", "3",
            "--output_dir", str(tmp_path / "out"), "--report_to", "none"]
    assert to_argv(options) == argv
    from_api, from_cli = parse_sft_args(to_argv(options)), parse_sft_args(argv)
    for f in dataclasses.fields(from_cli):
        if f.name not in ("logging_dir",):
            assert getattr(from_api, f.name) == getattr(from_cli, f.name), f.name

    metrics = mmembed.train(**options)
    assert os.path.isfile(os.path.join(metrics["last_checkpoint"], "adapter_model.safetensors"))  # LoRA by default
    assert np.isfinite(metrics["train_loss"]) and metrics["train_loss"] > 0
    with pytest.raises(ValueError, match="unknown flag"):
        mmembed.train(model=minilm_path, dataset=[data], no_such_flag=1)


def test_a_bad_array_row_in_the_split_off_eval_rows_fails_before_training(minilm_path, tmp_path, monkeypatch):
    from mmembed.data import DataError, load_samples, split_dataset
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.sft import run_sft
    from mmembed.training.trainer import EmbeddingTrainer

    # before the Trainer starts (its first callbacks would read the eval rows too, the model loaded)
    monkeypatch.setattr(EmbeddingTrainer, "train", lambda *a, **k: pytest.fail("training started"))

    rows = [dict(r, rejected_response=[f"n{i}"]) for i, r in enumerate(_rows(2) * 4)]
    data = _write_jsonl(tmp_path / "d.jsonl", rows)
    _, val = split_dataset(load_samples(data, load_from_cache_file=False).dataset, 0.25, 42)
    bad = val[0]["row"]
    scores = [[1.0, 0.0] for _ in rows]
    scores[bad] = [1.0]  # NaN where the row's negative needs a score
    npy = _scores_npy(tmp_path / "s.npy", scores, 2)
    out = tmp_path / "out"
    with pytest.raises(DataError) as e:
        run_sft(parse_sft_args(["--model", minilm_path, "--dataset", data, "--split_dataset_ratio", "0.25",
                                "--loss_type", "distill_kl", "--loss_kwargs", '{"use_batch": false}',
                                "--teacher_scores_file", npy, "--output_dir", str(out), "--report_to", "none"]))
    assert e.value.line == bad + 1 and e.value.field == f"s.npy[{bad}]"
    assert not out.exists() or not any(out.glob("checkpoint-*"))


def test_embed_writes_the_teacher_arrays_training_reads(minilm_path, tmp_path):
    """`mmembed embed --teacher_arrays` on a training file writes, per row, the teacher's
    embeddings of its members and the anchor's scores, NaN-padded: the same numbers as
    embedding each row's texts directly, and arrays `--teacher_*_file` accepts."""
    from mmembed.data import EmbeddingDataset, load_samples
    from mmembed.data.teacher import TeacherFiles
    from mmembed.tools.cli import main

    rows = [json.loads(line) for line in open(TRAIN)][:6]
    for i, r in enumerate(rows):  # 0, 1 or 2 negatives
        r["rejected_response"] = [rows[(i + 1) % 6]["response"], rows[(i + 2) % 6]["query"]][: i % 3]
    data = _write_jsonl(tmp_path / "train.jsonl", rows)
    assert main(["embed", "--model", minilm_path, "--input", data, "--output", str(tmp_path / "teacher.npy"),
                 "--teacher_arrays", "--batch_size", "4"]) == 0
    emb, scores = np.load(tmp_path / "teacher_embeddings.npy"), np.load(tmp_path / "teacher_scores.npy")
    want_emb, want_scores = _teacher_views(minilm_path, data, 6)
    assert emb.shape == (6, 4, 384) and scores.shape == (6, 3)
    np.testing.assert_allclose(emb, want_emb, atol=1e-5)  # NaN where NaN
    np.testing.assert_allclose(scores, want_scores, atol=1e-5)
    res = load_samples(data, load_from_cache_file=False)
    ds = EmbeddingDataset(res.dataset, TeacherFiles.open(res.files, res.records, [str(tmp_path / "teacher_scores.npy")],
                                                         [str(tmp_path / "teacher_embeddings.npy")]))
    assert [len(ds[i].teacher_scores) for i in range(6)] == [1, 2, 3, 1, 2, 3]
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary file left beside them
