"""The GPU speed options as ``mmembed sft`` wires them (the numbers themselves are in
tests/model/test_packing.py; which batches are packed, --padding_free, is
tests/training/test_model_assembly.py's): bucketed widths from the collator
(--length_buckets), liger-kernel on the backbone (--use_liger_kernel), and the device
defaults in the log."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import DATA, stsb_pairs, write_jsonl

from mmembed.data.sample import Item
from mmembed.encoding.buckets import bucket_width
from mmembed.encoding.inputs import InputBuilder
from mmembed.encoding.templates import get_template
from mmembed.model.embedding import EmbeddingModel
from mmembed.training.arguments import parse_sft_args


def test_bucketed_collation_gives_the_same_embeddings(minilm_no_dropout):
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_no_dropout)
    template = get_template("bert", None)
    items = [Item(text=r["query"]) for r in stsb_pairs(12)]
    plain = InputBuilder(template, tok, max_length=100)(items)
    bucketed = InputBuilder(template, tok, max_length=100, bucket=True)(items)
    width = plain["input_ids"].shape[1]
    assert bucketed["input_ids"].shape[1] == min(-(-width // 16) * 16, 100) > width
    assert torch.equal(bucketed["input_ids"][:, :width], plain["input_ids"])
    assert int(bucketed["attention_mask"][:, width:].sum()) == 0
    capped = InputBuilder(template, tok, max_length=width + 1, bucket=True)(items)
    assert capped["input_ids"].shape[1] == width + 1  # never past --max_length
    model = EmbeddingModel(AutoModel.from_pretrained(minilm_no_dropout).eval(), "mean", length_chunks=1)
    with torch.no_grad():
        torch.testing.assert_close(model(**bucketed)["last_hidden_state"], model(**plain)["last_hidden_state"],
                                   atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind,name", [("qwen2_vl", "qwen2_gme"), ("qwen3_vl", "qwen3_vl_emb")])
def test_bucketed_media_batches_give_the_same_embeddings(tiny_model, kind, name):
    """Media batches (pictures, a video, text-only rows) widen to the bucket too: the token
    tensors gain padding on the template's side, the media tensors are untouched, and the
    rows embed as before (the rope positions and last-token pooling read the mask)."""
    from transformers import AutoProcessor

    from mmembed.encoding.inputs import MEDIA_COUNTS
    from mmembed.model.embedding import load_backbone

    mm = os.path.join(DATA, "mm")
    items = [Item("<image> a red circle", images=[os.path.join(mm, "red_circle.png")]),
             Item("a somewhat longer caption about a small yellow square on white"),
             Item("<video>", videos=[os.path.join(mm, "clip.mp4")])]
    folder = tiny_model(kind)
    template = get_template(name)
    processor = AutoProcessor.from_pretrained(folder)
    plain = InputBuilder(template, processor, max_length=4096)(items)
    bucketed = InputBuilder(template, processor, max_length=4096, bucket=True)(items)
    width, wide = plain["input_ids"].shape[1], bucketed["input_ids"].shape[1]
    assert wide == bucket_width(width) > width
    cut = slice(wide - width, None) if template.padding_side == "left" else slice(0, width)
    for key, value in plain.items():
        if value.shape == plain["input_ids"].shape and key != MEDIA_COUNTS:
            assert torch.equal(bucketed[key][:, cut], value), key
            assert int(bucketed[key].count_nonzero()) == int(value.count_nonzero()) or key == "input_ids", key
        else:
            assert torch.equal(bucketed[key], value), key
    model = EmbeddingModel(load_backbone(folder), template.resolve_pooling(folder), tower=template.tower,
                           length_chunks=1).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(**bucketed)["last_hidden_state"], model(**plain)["last_hidden_state"],
                                   atol=2e-5, rtol=1e-4)


LIGER_CHECK = r"""
import sys, torch
from mmembed.training.arguments import parse_sft_args
from mmembed.training.model_assembly import build_model, resolve_template
args = parse_sft_args(sys.argv[1:])
template = resolve_template(args.model, args.template, args.model_type, args.system)
model = build_model(args, template, "last")
base = model.backbone.get_base_model()
layer = base.layers[0]
print(*(m.forward.__func__.__module__.split(".")[0] for m in (base.norm, layer.input_layernorm, layer.mlp)))
"""


def test_use_liger_kernel_patches_the_backbone(tiny_model, tmp_path):
    """liger-kernel's kernels need a GPU to run, so the check is that they are in place (in a
    child process: liger also patches transformers' Qwen3 module for the whole process)."""
    from forked_cli import run_ranks  # a process forked from the test server: liger's patches stay in it

    data = write_jsonl(tmp_path / "d.jsonl", stsb_pairs(4))
    check = tmp_path / "liger_check.py"
    check.write_text(LIGER_CHECK)
    flags = [str(check), "--model", tiny_model("qwen3"), "--dataset", data, "--output_dir", str(tmp_path / "o")]
    out = run_ranks([*flags, "--use_liger_kernel", "true"], 1, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    norm, layer_norm, mlp = out.stdout.split()
    assert (norm, layer_norm, mlp) == ("liger_kernel",) * 3
    out = run_ranks(flags, 1, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["transformers"] * 3


def test_use_liger_kernel_is_applied_once_to_the_backbone(tiny_model, tmp_path, monkeypatch, caplog):
    """A whole run with --use_liger_kernel: liger-kernel is applied once, to the backbone
    (a PreTrainedModel, before LoRA wraps it) when the model is built, and the Trainer's own
    attempt on the EmbeddingModel wrapper (which would warn that nothing was applied) never
    happens. The kernels themselves need a GPU, so the application is recorded, not run."""
    import transformers.integrations.liger as hf_liger
    import transformers.trainer as hf_trainer
    from transformers import PreTrainedModel

    from mmembed.training.sft import run_sft

    applied = []
    monkeypatch.setattr(hf_liger, "apply_liger_kernel", lambda model, config: applied.append(model))
    monkeypatch.setattr(hf_trainer, "apply_liger_kernel", lambda model, config: applied.append(model))
    data = write_jsonl(tmp_path / "d.jsonl", stsb_pairs(4))
    args = parse_sft_args(["--model", tiny_model("qwen3"), "--dataset", data, "--output_dir", str(tmp_path / "o"),
                           "--use_liger_kernel", "true", "--max_steps", "1", "--per_device_train_batch_size", "2",
                           "--save_strategy", "no", "--report_to", "none"])
    with caplog.at_level("WARNING"):
        run_sft(args)
    assert len(applied) == 1
    assert isinstance(applied[0], PreTrainedModel)
    assert args.use_liger_kernel  # handed back to the arguments after training
    assert not [r for r in caplog.records if "liger" in r.getMessage().lower()]


def test_use_liger_kernel_without_the_package_is_a_usage_error(monkeypatch, tmp_path):
    import importlib.util

    from mmembed.errors import UsageError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real(name, *a))
    with pytest.raises(UsageError, match="--use_liger_kernel true needs the liger-kernel package"):
        parse_sft_args(["--model", str(tmp_path), "--dataset", "x.jsonl", "--use_liger_kernel", "true"])


def test_the_device_defaults_are_logged(minilm_no_dropout, tmp_path, caplog):
    from mmembed.training.model_assembly import build_model, resolve_template

    args = parse_sft_args(["--model", minilm_no_dropout, "--dataset", "x.jsonl", "--output_dir", str(tmp_path)])
    template = resolve_template(args.model, None, None, None)
    with caplog.at_level("INFO", logger="mmembed"):
        model = build_model(args, template, "mean")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("on cpu:"))
    for part in ("--length_chunks 4", "--length_buckets false", "--dataloader_num_workers 0", "--padding_free false",
                 "--attn_impl sdpa"):
        assert part in line
    assert (model.length_chunks, model.padding_free, model.bucket) == (4, False, False)


def test_a_gpu_pads_training_batches_right_where_the_template_pads_left():
    from mmembed.training.device_flags import training_padding

    for name in ("qwen3_emb", "gte_qwen2"):
        left = get_template(name, None)
        assert left.padding_side == "left"
        assert training_padding(left, None, cuda=True).padding_side == "right"
        assert training_padding(left, None, cuda=False) is left  # a CPU run pads as the template says
        assert training_padding(left, "left", cuda=True) is left  # --padding_side left is kept
    right = get_template("bert", None)
    assert training_padding(right, None, cuda=True) is right


def test_left_and_right_padded_batches_give_the_same_embeddings_and_gradients(tiny_model):
    """Why a GPU may pad qwen3_emb's training batches on the right: a tiny Qwen3 decoder with
    last-token pooling gives the same embeddings and parameter gradients for the same rows padded
    on either side (the collator's InputBuilder, the model as mmembed wraps it)."""
    import dataclasses

    from transformers import AutoTokenizer

    from mmembed.model.embedding import load_backbone

    folder = tiny_model("qwen3")
    tok = AutoTokenizer.from_pretrained(folder)
    left = get_template("qwen3_emb", None)
    items = [Item(text=r["query"]) for r in stsb_pairs(10)]
    results = []
    for template in (left, dataclasses.replace(left, padding_side="right")):
        batch = InputBuilder(template, tok, max_length=64, bucket=True)(items)
        mask = batch["attention_mask"]
        assert (mask[:, 0] if template.padding_side == "right" else mask[:, -1]).all()  # padded on that side
        assert not mask.all()  # and there is padding
        torch.manual_seed(0)
        model = EmbeddingModel(load_backbone(folder, attn_impl="sdpa"), "last", length_chunks=1)
        emb = model(**batch)["last_hidden_state"]
        (emb @ emb.T).logsumexp(1).sum().backward()
        results.append((emb.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (e_left, g_left), (e_right, g_right) = results
    torch.testing.assert_close(e_right, e_left, atol=1e-5, rtol=1e-4)
    assert g_left.keys() == g_right.keys() and len(g_left) > 10
    for name in g_left:
        torch.testing.assert_close(g_right[name], g_left[name], atol=1e-5, rtol=1e-3, msg=name)
