"""`mmembed sft` on the real all-MiniLM-L6-v2, then export, embed, resume; checked against
sentence-transformers and transformers as independent loaders."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import DATA, stsb_pairs, write_jsonl
from forked_cli import run_cli

from mmembed.training.arguments import parse_sft_args
from mmembed.training.checkpoints import COMPLETE_MARKER, find_last_complete_checkpoint
from mmembed.training.guards import NonFiniteLossError
from mmembed.training.sft import run_sft

TEXTS = ["A man is playing a flute.", "Two dogs run through the snow after a red ball.", "The stock market fell today."]


@pytest.fixture(scope="module")
def group_data(tmp_path_factory):
    """STS-B pairs in ms-swift's query form, with 0, 1 or 2 hard negatives per row."""
    d = tmp_path_factory.mktemp("data")
    pairs = stsb_pairs(40)
    rows = []
    for i, p in enumerate(pairs[:24]):
        negs = [pairs[(i + k + 7) % len(pairs)]["response"] for k in range(i % 3)]
        rows.append({"query": p["query"], "response": p["response"], "rejected_response": negs})
    train = write_jsonl(d / "train.jsonl", rows[:16])
    val = write_jsonl(d / "val.jsonl", rows[16:24])
    return train, val


def _args(model, data, out, *extra):
    train, val = data
    return parse_sft_args([
        "--model", model, "--task_type", "embedding", "--dataset", train, "--val_dataset", val,
        "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4", "--gradient_accumulation_steps", "1",
        "--max_length", "48", "--logging_steps", "1", "--output_dir", str(out), "--disable_tqdm", "true",
        "--dataloader_num_workers", "0", *extra,
    ])


def _adapter_state(ckpt):
    from safetensors.torch import load_file

    return load_file(os.path.join(ckpt, "adapter_model.safetensors"))


def test_lora_sft_export_loads_in_sentence_transformers_and_transformers(minilm_path, group_data, tmp_path):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    from mmembed.model.embedder import Embedder
    from mmembed.tools.export import export_checkpoint

    out = tmp_path / "run"
    metrics = run_sft(_args(minilm_path, group_data, out, "--tuner_type", "lora", "--max_steps", "3",
                            "--save_steps", "2", "--eval_steps", "2", "--learning_rate", "5e-4"))
    ckpt = metrics["last_checkpoint"]
    assert os.path.basename(ckpt) == "checkpoint-3"
    for name in ("adapter_model.safetensors", "adapter_config.json", "mmembed.json", COMPLETE_MARKER, "tokenizer.json"):
        assert os.path.isfile(os.path.join(ckpt, name)), name
    for key in ("eval_loss", "eval_margin", "eval_mean_pos", "eval_mean_neg", "eval_recall_at_1", "eval_mrr_at_10", "eval_ndcg_at_10"):
        assert key in metrics and np.isfinite(metrics[key]), key
    state = json.load(open(os.path.join(ckpt, "trainer_state.json")))
    assert [h["step"] for h in state["log_history"] if "loss" in h] == [1, 2, 3]

    trained = Embedder.from_pretrained(ckpt).encode(TEXTS)
    base = Embedder.from_pretrained(minilm_path).encode(TEXTS)
    assert np.abs(trained - base).max() > 1e-4  # training changed the model

    merged = export_checkpoint(ckpt, str(tmp_path / "merged"))
    st = SentenceTransformer(merged, device="cpu").encode(TEXTS, normalize_embeddings=False)
    np.testing.assert_allclose(st, trained, atol=1e-5)

    # transformers alone: AutoModel + mean pooling over the mask + L2 normalization
    tok = AutoTokenizer.from_pretrained(merged)
    model = AutoModel.from_pretrained(merged).eval()
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**enc).last_hidden_state
    m = enc["attention_mask"].unsqueeze(-1).float()
    ref = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1).numpy()
    np.testing.assert_allclose(ref, trained, atol=1e-5)

    with pytest.raises(FileExistsError):
        export_checkpoint(ckpt, merged)


def test_full_training_checkpoint_loads_directly_in_sentence_transformers(minilm_path, group_data, tmp_path):
    from sentence_transformers import SentenceTransformer

    from mmembed.model.embedder import Embedder

    metrics = run_sft(_args(minilm_path, group_data, tmp_path / "run", "--tuner_type", "full", "--max_steps", "2",
                            "--save_steps", "2", "--eval_strategy", "no", "--gradient_checkpointing", "true"))
    ckpt = metrics["last_checkpoint"]
    assert os.path.isfile(os.path.join(ckpt, "model.safetensors"))
    ours = Embedder.from_pretrained(ckpt).encode(TEXTS)
    st = SentenceTransformer(ckpt, device="cpu").encode(TEXTS)
    np.testing.assert_allclose(st, ours, atol=1e-5)


def test_resume_after_kill_matches_an_uninterrupted_run(minilm_path, group_data, tmp_path):
    common = ("--tuner_type", "lora", "--max_steps", "4", "--save_steps", "2", "--eval_strategy", "no", "--learning_rate", "5e-4")
    ref_out = tmp_path / "ref"
    run_sft(_args(minilm_path, group_data, ref_out, *common))
    reference = _adapter_state(ref_out / "checkpoint-4")

    # the killed run: checkpoint-2 is complete, checkpoint-4 was being written when the process died
    out = tmp_path / "killed"
    out.mkdir()
    shutil.copytree(ref_out / "checkpoint-2", out / "checkpoint-2")
    (out / "checkpoint-4").mkdir()
    (out / "checkpoint-4" / "adapter_model.safetensors").write_bytes(b"half written")
    assert find_last_complete_checkpoint(str(out)).endswith("checkpoint-2")
    with pytest.raises(ValueError, match="not a complete mmembed checkpoint"):
        run_sft(_args(minilm_path, group_data, out, *common, "--resume_from_checkpoint", str(out / "checkpoint-4")))

    run_sft(_args(minilm_path, group_data, out, *common, "--resume_from_checkpoint", "true"))
    resumed = _adapter_state(out / "checkpoint-4")
    assert reference.keys() == resumed.keys()
    for k in reference:
        torch.testing.assert_close(resumed[k], reference[k], atol=1e-6, rtol=1e-5)
    start = _adapter_state(ref_out / "checkpoint-2")
    assert any(not torch.equal(start[k], resumed[k]) for k in start)  # it did train from step 2 to 4


def test_non_finite_loss_stops_the_run(minilm_path, group_data, tmp_path, monkeypatch):
    import mmembed.training.model_assembly as model_assembly
    from mmembed.losses import EmbeddingLoss

    class NanLoss(EmbeddingLoss):
        def forward(self, outputs, labels):
            return outputs["last_hidden_state"].sum() * float("nan")

    monkeypatch.setattr(model_assembly, "build_loss", lambda name, **options: NanLoss())
    with pytest.raises(NonFiniteLossError, match="loss is nan at step 1"):
        run_sft(_args(minilm_path, group_data, tmp_path / "run", "--max_steps", "2", "--eval_strategy", "no"))
    assert find_last_complete_checkpoint(str(tmp_path / "run")) is None


def test_pair_loss_training_reports_correlations(minilm_path, tmp_path):
    with open(os.path.join(DATA, "stsb_train_scored.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f][:24]
    data = (write_jsonl(tmp_path / "t.jsonl", rows[:16]), write_jsonl(tmp_path / "v.jsonl", rows[16:]))
    metrics = run_sft(_args(minilm_path, data, tmp_path / "run", "--loss_type", "cosine_similarity", "--max_steps", "2",
                            "--save_steps", "2", "--eval_steps", "2"))
    assert -1.0 <= metrics["eval_spearman_cosine"] <= 1.0
    assert "eval_pearson_euclidean" in metrics


def test_overlong_rows_are_deleted_and_counted(minilm_path, tmp_path, caplog):
    long_text = " ".join(["word"] * 80)
    rows = [{"query": f"short query {i}", "response": "short answer"} for i in range(6)]
    rows[2]["response"] = long_text
    rows[4]["query"] = long_text
    data = (write_jsonl(tmp_path / "t.jsonl", rows), write_jsonl(tmp_path / "v.jsonl", rows[:2]))
    with caplog.at_level("WARNING", logger="mmembed"):
        run_sft(_args(minilm_path, data, tmp_path / "run", "--max_steps", "1", "--eval_strategy", "no", "--max_length", "32"))
    assert any("2 of 6 rows are longer than --max_length 32" in r.getMessage() for r in caplog.records)


def test_cli_embed_writes_the_same_vectors_as_embedder(minilm_path, tmp_path):
    from mmembed.model.embedder import Embedder

    inp = tmp_path / "texts.txt"
    inp.write_text("\n".join(TEXTS) + "\n")
    out = tmp_path / "emb.npy"
    r = run_cli(["embed", "--model", minilm_path, "--input", str(inp), "--output", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    np.testing.assert_allclose(np.load(out), Embedder.from_pretrained(minilm_path).encode(TEXTS), atol=1e-6)


def test_cli_reports_a_broken_row_by_file_line_and_field(minilm_path, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query": "a", "response": "b"}\n{"query": "c", "response": "d", "rejected_response": 5}\n')
    proc = run_cli(["sft", "--model", minilm_path, "--dataset", str(bad), "--output_dir", str(tmp_path / "out")])
    assert proc.returncode == 1
    assert f"mmembed sft: error: {bad}:2 field 'rejected_response'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("env", [{"INFONCE_USE_BATCH": "false"}, {"INFONCE_HARD_NEGATIVES": "2"},
                                 {"INFONCE_USE_BATCH": "false", "INFONCE_HARD_NEGATIVES": "1"}],
                         ids=["use_batch=false", "hard_negatives=2", "both"])
def test_trainer_evaluation_uses_the_losss_infonce_settings(minilm_path, tmp_path, monkeypatch, env):
    """`evaluate()` during training reports margin / mean_neg / mean_pos over what the loss
    weighs with the user's INFONCE_* settings (ms-swift's metric reads the same variables),
    checked against the naive reference on embeddings made by the Embedder, independently."""
    from reference_losses import reference_rows

    from mmembed.losses.infonce import select_hard_negatives
    from mmembed.model.embedder import Embedder
    from mmembed.training.sft import build_trainer

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    pairs = stsb_pairs(20)
    rows = [{"query": p["query"], "response": p["response"],
             "rejected_response": [pairs[(i + k + 5) % 20]["response"] for k in range(1 + i % 3)]}
            for i, p in enumerate(pairs[:6])]
    val = write_jsonl(tmp_path / "val.jsonl", rows)
    trainer = build_trainer(_args(minilm_path, (val, val), tmp_path / "out", "--tuner_type", "full", "--seed", "7",
                                  "--per_device_eval_batch_size", "4"))
    got = trainer.evaluate()

    texts, labels = [], []
    for r in rows:
        texts += [r["query"], r["response"], *r["rejected_response"]]
        labels += [1.0] + [0.0] * len(r["rejected_response"])
    emb = torch.from_numpy(Embedder.from_pretrained(minilm_path).encode(texts)).double()
    hard = int(env.get("INFONCE_HARD_NEGATIVES", 0)) or None
    sizes = torch.tensor([len(r["rejected_response"]) for r in rows])
    picks = select_hard_negatives(sizes, hard, torch.Generator().manual_seed(7)).tolist() if hard else None
    ref_rows = reference_rows(emb, labels, use_batch=env.get("INFONCE_USE_BATCH") != "false", picks=picks)
    pos = [row[t].item() for row, t in ref_rows]
    others = [[v for j, v in enumerate(row.tolist()) if j != t] for row, t in ref_rows]
    assert got["eval_mean_pos"] == pytest.approx(np.mean(pos), abs=1e-5)
    assert got["eval_mean_neg"] == pytest.approx(np.mean(sum(others, [])), abs=1e-5)
    assert got["eval_margin"] == pytest.approx(np.mean([p - max(o) for p, o in zip(pos, others)]), abs=1e-5)


@pytest.mark.parametrize("tuner", ["lora", "full"])
def test_save_strategy_no_writes_the_final_model_only(minilm_path, group_data, tmp_path, tuner):
    """`--save_strategy no`: no intermediate checkpoint and no optimizer, scheduler, RNG or
    trainer state; the final model alone, which embeds as the trained model."""
    from mmembed.model.embedder import Embedder

    out = tmp_path / "run"
    metrics = run_sft(_args(minilm_path, group_data, out, "--tuner_type", tuner, "--max_steps", "3", "--save_steps", "1",
                            "--save_strategy", "no", "--eval_strategy", "no", "--learning_rate", "5e-4"))
    final = out / "checkpoint-3"
    assert metrics["last_checkpoint"] == str(final)
    assert sorted(p.name for p in out.iterdir()) == ["charts", "checkpoint-3"]  # the run's charts (docs/charts.md)
    names = {p.name for p in final.iterdir()}
    weights = "adapter_model.safetensors" if tuner == "lora" else "model.safetensors"
    assert {weights, "mmembed.json", "tokenizer.json"} <= names
    for state in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"):
        assert state not in names, state
    # written whole like a checkpoint (staged, marked, renamed), marked as the model alone
    manifest = json.loads((final / COMPLETE_MARKER).read_text())
    assert manifest["model_only"] is True and manifest["step"] == 3
    files = {str(p.relative_to(final)) for p in final.rglob("*") if p.is_file()}
    assert set(manifest["files"]) == files - {COMPLETE_MARKER}
    assert find_last_complete_checkpoint(str(out)) is None  # nothing to resume training from
    base = Embedder.from_pretrained(minilm_path).encode(TEXTS)
    trained = Embedder.from_pretrained(str(final)).encode(TEXTS)
    assert np.abs(trained - base).max() > 1e-4


def test_eval_loss_is_the_mean_over_groups_whatever_their_negatives(minilm_path, tmp_path, monkeypatch):
    """eval_loss weights each batch's loss by the groups (anchors) it averages, so it is the
    loss's mean over every eval group: with INFONCE_USE_BATCH=false each group's term does not
    depend on its batch, and the result equals the per-group cross-entropy computed by hand
    on the Embedder's embeddings, averaged. Batches of 4 and 2 groups with 1-3 negatives each:
    weighting by rows (positives + negatives) gives another number."""
    from mmembed.model.embedder import Embedder
    from mmembed.training.sft import build_trainer

    monkeypatch.setenv("INFONCE_USE_BATCH", "false")
    pairs = stsb_pairs(20)
    negatives = [1, 3, 3, 3, 1, 1]
    rows = [{"query": p["query"], "response": p["response"],
             "rejected_response": [pairs[(i + k + 5) % 20]["response"] for k in range(negatives[i])]}
            for i, p in enumerate(pairs[:6])]
    val = write_jsonl(tmp_path / "val.jsonl", rows)
    trainer = build_trainer(_args(minilm_path, (val, val), tmp_path / "out", "--tuner_type", "full",
                                  "--per_device_eval_batch_size", "4"))
    got = trainer.evaluate()["eval_loss"]

    embedder = Embedder.from_pretrained(minilm_path)
    per_group = []
    for r in rows:
        e = torch.from_numpy(embedder.encode([r["query"], r["response"], *r["rejected_response"]])).double()
        logits = (e[1:] @ e[0]) / 0.1  # INFONCE_TEMPERATURE's default
        per_group.append(float(-torch.log_softmax(logits, 0)[0]))
    assert got == pytest.approx(np.mean(per_group), rel=1e-4)
    by_rows = [(np.mean(per_group[s:s + 4]), sum(1 + negatives[i] for i in range(s, min(s + 4, 6)))) for s in (0, 4)]
    assert abs(sum(v * w for v, w in by_rows) / sum(w for _, w in by_rows) - np.mean(per_group)) > 1e-3


@pytest.mark.parametrize("best_at_end", [False, True], ids=["last-step", "load-best-at-end"])
def test_the_closing_evaluation_is_the_last_steps_without_embedding_the_set_again(minilm_path, group_data, tmp_path,
                                                                                  monkeypatch, best_at_end):
    """transformers evaluates at a run's last step (here 3, after step 2); `mmembed sft` reports
    those metrics instead of embedding the eval set a third time with the same weights, and
    they equal a fresh evaluation of the last checkpoint's weights. With
    --load_best_model_at_end the model may hold other weights by then: evaluated again."""
    import mmembed.training.evaluation as evaluation
    from mmembed.training.sft import build_trainer

    embedded = []
    measure = evaluation.dataset_metrics
    monkeypatch.setattr(evaluation, "dataset_metrics",
                        lambda trainer, *a, **k: embedded.append(trainer.state.global_step) or measure(trainer, *a, **k))
    best = ["--load_best_model_at_end", "true", "--metric_for_best_model", "eval_loss"] if best_at_end else []
    metrics = run_sft(_args(minilm_path, group_data, tmp_path / "run", "--tuner_type", "full", "--max_steps", "3",
                            "--save_steps", "2", "--eval_steps", "2", "--learning_rate", "5e-4", *best))
    assert embedded == ([2, 3, 3] if best_at_end else [2, 3])
    reported = {k: v for k, v in metrics.items() if k.startswith("eval_")}
    assert "eval_loss" in reported and "eval_recall_at_1" in reported
    if best_at_end:
        return
    state = json.load(open(os.path.join(metrics["last_checkpoint"], "trainer_state.json")))
    logged = [h for h in state["log_history"] if h["step"] == 3 and "eval_loss" in h]
    assert len(logged) == 1 and {k: v for k, v in logged[0].items() if k.startswith("eval_")} == reported
    fresh = build_trainer(_args(metrics["last_checkpoint"], group_data, tmp_path / "fresh", "--tuner_type", "full"))
    again = {k: v for k, v in fresh.evaluate().items() if k.startswith("eval_")}
    assert set(again) == set(reported)
    for key, value in reported.items():
        assert again[key] == pytest.approx(value, abs=1e-5), key
