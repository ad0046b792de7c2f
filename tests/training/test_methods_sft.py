"""The methods from `mmembed sft` flags: --loss_type gist --guide_model, distillation with
--teacher_model, --mrl_dims, and their start-up checks."""

import json
import os

import numpy as np
import pytest
import torch
from conftest import DATA
from forked_cli import run_cli

TRAIN = os.path.join(DATA, "stsb_train_hardneg.jsonl")


def sft(args, tmp_path):
    """``mmembed sft`` in a child forked from a process that imported everything once (tests/forked_cli.py)."""
    return run_cli(["sft", "--dataset", f"{TRAIN}#16", "--max_steps", "2", "--per_device_train_batch_size", "4",
                    "--gradient_accumulation_steps", "1", "--output_dir", str(tmp_path / "out"), "--report_to", "none",
                    *args])


def test_guide_and_teacher_embed_the_same_rows_as_the_student(minilm_path, tiny_model):
    """The collator renders the guide's inputs from the items with the guide's own template
    (here a Qwen2 decoder with another tokenizer): its embeddings equal the guide model
    embedding the same texts alone, so GIST sees the right guide row for every student row."""
    from mmembed import Embedder
    from mmembed.data import read_file
    from mmembed.encoding.collator import EmbeddingCollator, sample_items
    from mmembed.encoding.layout import Layout
    from mmembed.losses import build_loss
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.model_assembly import SideModels, build_model, load_processing, make_loss, resolve_template

    guide_dir = tiny_model("qwen2")
    args = parse_sft_args(["--model", minilm_path, "--dataset", TRAIN, "--loss_type", "gist", "--guide_model", guide_dir,
                           "--loss_kwargs", '{"margin": 0.05, "temperature": 0.05}', "--tuner_type", "full"])
    template = resolve_template(minilm_path, None, None, None)
    side_models = SideModels.load(args)
    collator = EmbeddingCollator(template, load_processing(minilm_path, template), Layout.GROUP, 128,
                                 guide=side_models.builders["guide"])
    samples = read_file(TRAIN)[:5]
    batch = collator(samples)
    labels = batch.pop("labels")
    model = build_model(args, template, template.resolve_pooling(minilm_path)).eval()
    with torch.no_grad():
        guide = side_models.models["guide"](**batch.pop("side").guide_inputs)["last_hidden_state"]
        student = model(**batch)["last_hidden_state"]
        loss = make_loss(args)({"last_hidden_state": student, "guide_hidden_state": guide}, labels)

    texts = [it.text for s in samples for it in sample_items(s, Layout.GROUP)[0]]
    want_guide = Embedder.from_pretrained(guide_dir).encode(texts)
    want_student = Embedder.from_pretrained(minilm_path).encode(texts)
    np.testing.assert_allclose(guide.numpy(), want_guide, atol=1e-5)
    np.testing.assert_allclose(student.numpy(), want_student, atol=1e-5)
    want = build_loss("gist", margin=0.05, temperature=0.05)(
        {"last_hidden_state": torch.from_numpy(want_student), "guide_hidden_state": torch.from_numpy(want_guide)}, labels)
    assert loss.item() == pytest.approx(want.item(), abs=1e-5)


@pytest.mark.parametrize("flags", [
    ["--loss_type", "gist", "--guide_model", "{minilm}", "--loss_kwargs", '{"margin": 0.1}'],
    ["--loss_type", "distill_kl", "--teacher_model", "{minilm}"],
    ["--loss_type", "distill_marginal", "--teacher_model", "{minilm}", "--loss_kwargs", '{"lam": 0.2}'],
    ["--loss_type", "infonce", "--mrl_dims", '{"64": 1.0, "384": 1.0}'],
], ids=["gist", "distill_kl", "distill_marginal", "mrl"])
def test_method_trains_from_flags(minilm_path, tmp_path, flags):
    flags = [f.replace("{minilm}", minilm_path) for f in flags]
    r = sft(["--model", minilm_path, "--tuner_type", "full", *flags], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = json.loads(r.stdout[r.stdout.rindex("{\n"):])
    assert np.isfinite(metrics["train_loss"])  # distill_marginal may be negative: -lambda x the distance to other rows


@pytest.mark.parametrize("flags,message", [
    (["--mrl_dims", '{"64": 1.0, "512": 1.0}'], "512"),
    (["--loss_type", "gist"], "--guide_model"),
    (["--loss_type", "distill_cosine", "--teacher_model", "{qwen2}"], "width"),
    (["--loss_kwargs", "{not json"], "--loss_kwargs"),
    (["--loss_type", "matryoshka"], "--mrl_dims"),
    (["--mrl_dims", '{"64": 1.0, "x": 1.0}'], "mrl_dims width 'x' must be an integer"),
], ids=["mrl-too-wide", "gist-no-guide", "teacher-width", "bad-json", "matryoshka-name", "mrl-bad-width"])
def test_method_misconfiguration_fails_before_training(minilm_path, tiny_model, tmp_path, flags, message):
    from mmembed.training.arguments import UsageError, parse_sft_args
    from mmembed.training.sft import run_sft

    flags = [f.replace("{qwen2}", tiny_model("qwen2")) for f in flags]
    argv = ["--model", minilm_path, "--dataset", f"{TRAIN}#8", "--output_dir", str(tmp_path / "out"), "--report_to", "none", *flags]
    with pytest.raises((ValueError, UsageError), match=message.replace("-", "\\-")):
        run_sft(parse_sft_args(argv))
    assert not any((tmp_path / "out").glob("checkpoint-*"))


def test_a_width_error_is_one_line_from_the_command(minilm_path, tmp_path):
    r = sft(["--model", minilm_path, "--mrl_dims", '{"64": 1.0, "512": 1.0}'], tmp_path)
    assert r.returncode == 2  # a usage error (a setting), not a data error
    assert "512" in r.stderr and "Traceback" not in r.stderr
