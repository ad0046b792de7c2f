"""QLoRA as ms-swift takes it (``--quant_method bnb --quant_bits 4``, swift/arguments/base_args/
quant_args.py): the frozen base quantized by bitsandbytes (its CPU backend here), a LoRA adapter
in full precision that trains on it, a checkpoint that records the quantization and resumes on
it, and an export that merges the adapter into the original full-precision weights (as
``swift export --merge_lora true`` does for a quantized model)."""

import json
import os
import shutil

import bitsandbytes as bnb  # the dev extra installs it (the quant extra for users)
import numpy as np
import pytest
import torch
from conftest import DATA, stsb_pairs, write_jsonl

from mmembed.errors import UsageError
from mmembed.model.embedder import Embedder, load_embedding_model
from mmembed.tools.export import export_checkpoint
from mmembed.training.arguments import parse_sft_args
from mmembed.training.sft import run_sft

TEXTS = ["A man is playing a flute.", "Two dogs run through the snow after a red ball.", "The stock market fell today."]
QLORA = ["--tuner_type", "lora", "--quant_method", "bnb", "--quant_bits", "4"]


def _flags(model, data, out, *extra):
    return ["--model", model, "--dataset", data, "--per_device_train_batch_size", "4",
            "--gradient_accumulation_steps", "1", "--max_length", "48", "--logging_steps", "1", "--output_dir", str(out),
            "--disable_tqdm", "true", "--dataloader_num_workers", "0", "--report_to", "none", "--eval_strategy", "no",
            *extra]


def _losses(ckpt):
    state = json.load(open(os.path.join(ckpt, "trainer_state.json")))
    return [h["loss"] for h in state["log_history"] if "loss" in h]


def _adapter(ckpt):
    from safetensors.torch import load_file

    return load_file(os.path.join(ckpt, "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def text_run(tmp_path_factory, minilm_no_dropout):
    """all-MiniLM-L6-v2 (no dropout: runs repeat exactly) trained 4 steps with QLoRA, saved at 2 and 4."""
    d = tmp_path_factory.mktemp("qlora")
    pairs = stsb_pairs(24)
    rows = [{"query": p["query"], "response": p["response"], "rejected_response": [pairs[(i + 5) % 24]["response"]]}
            for i, p in enumerate(pairs[:16])]
    data = write_jsonl(d / "train.jsonl", rows)
    common = ("--max_steps", "4", "--save_steps", "2", "--learning_rate", "2e-3", *QLORA)
    metrics = run_sft(parse_sft_args(_flags(minilm_no_dropout, data, d / "run", *common)))
    return {"dir": d, "data": data, "ckpt": metrics["last_checkpoint"], "common": common, "base": minilm_no_dropout}


def test_the_flags_take_ms_swifts_defaults():
    """--bnb_4bit_quant_type nf4 and --bnb_4bit_use_double_quant true by default; the compute
    dtype follows --torch_dtype as in ms-swift (bfloat16 -> bfloat16, float16 / float32 -> float32)."""
    from mmembed.training.quant_flags import quantization

    base = ["--model", "/m", "--dataset", "d.jsonl", *QLORA]
    q = quantization(parse_sft_args(base))
    assert (q.bits, q.quant_type, q.double_quant, q.compute_dtype, q.storage) == (4, "nf4", True, "float32", None)
    for dtype, compute in (("bfloat16", "bfloat16"), ("float16", "float32"), ("float32", "float32")):
        assert quantization(parse_sft_args(base + ["--torch_dtype", dtype])).compute_dtype == compute
    q = quantization(parse_sft_args(base + ["--bnb_4bit_quant_type", "fp4", "--bnb_4bit_use_double_quant", "false",
                                            "--bnb_4bit_compute_dtype", "bfloat16", "--bnb_4bit_quant_storage", "bfloat16"]))
    config = q.config()
    assert (config.load_in_4bit, config.bnb_4bit_quant_type, config.bnb_4bit_use_double_quant) == (True, "fp4", False)
    assert (config.bnb_4bit_compute_dtype, config.bnb_4bit_quant_storage) == (torch.bfloat16, torch.bfloat16)
    assert quantization(parse_sft_args(["--model", "/m", "--dataset", "d.jsonl"])) is None
    eight = quantization(parse_sft_args(base[:-1] + ["8"])).config()
    assert eight.load_in_8bit and not eight.load_in_4bit


def test_a_missing_bitsandbytes_is_one_line_naming_the_install(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else find_spec(name, *a))
    with pytest.raises(UsageError, match=r"--quant_method bnb: bitsandbytes is not installed: pip install 'bitsandbytes>=0\.50\.2'"):
        parse_sft_args(["--model", "/m", "--dataset", "d.jsonl", *QLORA])


def test_the_base_is_quantized_the_towers_are_not(tiny_model):
    """The language model's linear layers load as bitsandbytes 4-bit layers under LoRA; the vision
    tower and aligner stay in full precision (ms-swift's get_modules_to_not_convert)."""
    from mmembed.training.model_assembly import Encoding, build_model

    args = parse_sft_args(["--model", tiny_model("qwen2_vl"), "--dataset", "d.jsonl", *QLORA])
    encoding = Encoding.resolve(args)
    model = build_model(args, encoding.template, encoding.pooling)
    kinds = {}
    for name, module in model.backbone.get_base_model().named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith(("lora_A.default", "lora_B.default")):
            kinds.setdefault(encoding.template.module_part(name), set()).add(type(module).__name__)
    assert kinds["llm"] == {"Linear4bit"}, kinds  # the base layers under PEFT's lora.Linear4bit
    assert kinds["vit"] == kinds["aligner"] == {"Linear"}, kinds
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_qlora_trains_and_records_the_quantization(text_run):
    ckpt = text_run["ckpt"]
    assert os.path.basename(ckpt) == "checkpoint-4"
    losses = _losses(ckpt)
    assert len(losses) == 4 and all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    start, end = _adapter(os.path.join(os.path.dirname(ckpt), "checkpoint-2")), _adapter(ckpt)
    assert any(not torch.equal(start[k], end[k]) for k in start)  # the adapter trained from step 2 to 4
    assert all(v.dtype == torch.float32 for v in end.values())  # the adapter is saved in full precision
    record = json.load(open(os.path.join(ckpt, "mmembed.json")))["quantization"]
    assert record == {"quant_method": "bnb", "quant_bits": 4, "bnb_4bit_quant_type": "nf4",
                      "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "float32",
                      "bnb_4bit_quant_storage": None}
    assert "quantized by bitsandbytes (4-bit nf4: QLoRA)" in open(os.path.join(ckpt, "README.md")).read()  # the card
    adapter_config = json.load(open(os.path.join(ckpt, "adapter_config.json")))
    assert adapter_config["base_model_name_or_path"] == text_run["base"]


def test_export_merges_into_the_full_precision_base(text_run, tmp_path):
    """The export equals the full-precision base with the adapter unmerged (to 1e-5), and
    Embedder on the checkpoint gives the export's embeddings; the 4-bit training model is within
    the quantization error of them (measured on MiniLM: max |diff| about 0.04, cosine > 0.95)."""
    from transformers import AutoConfig

    ckpt = text_run["ckpt"]
    merged = export_checkpoint(ckpt, str(tmp_path / "merged"))
    assert "quantization_config" not in AutoConfig.from_pretrained(merged).to_dict()  # loads unquantized
    saved = json.load(open(os.path.join(merged, "mmembed.json")))
    assert "quantization" not in saved and saved["trained_with_quantization"]["quant_bits"] == 4
    assert "merged here into the full-precision base weights" in open(os.path.join(merged, "README.md")).read()
    exported = Embedder.from_pretrained(merged, device="cpu").encode(TEXTS)

    model, tokenizer, template, info = load_embedding_model(ckpt, merge=False)  # full-precision base + adapter
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    unmerged = Embedder(model, tokenizer, template, info["max_length"], "cpu").encode(TEXTS)
    np.testing.assert_allclose(exported, unmerged, atol=1e-5)
    np.testing.assert_allclose(Embedder.from_pretrained(ckpt, device="cpu").encode(TEXTS), exported, atol=1e-5)

    quantized = Embedder.from_pretrained(ckpt, device="cpu", quantized=True)
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in quantized.model.modules())
    as_trained = quantized.encode(TEXTS)
    cosine = (as_trained * exported).sum(1)
    assert np.abs(as_trained - exported).max() < 0.15 and cosine.min() > 0.9, (np.abs(as_trained - exported).max(), cosine)
    with pytest.raises(ValueError, match="not trained on a quantized base"):
        Embedder.from_pretrained(merged, device="cpu", quantized=True)
    base = Embedder.from_pretrained(text_run["base"], device="cpu").encode(TEXTS)
    assert np.abs(exported - base).max() > 1e-4  # the merge carried the training


def test_resume_equals_an_uninterrupted_run_and_needs_the_same_quantization(text_run, tmp_path):
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(os.path.join(text_run["dir"], "run", "checkpoint-2"), out / "checkpoint-2")
    flags = _flags(text_run["base"], text_run["data"], out, *text_run["common"])
    unquantized = _flags(text_run["base"], text_run["data"], out, *text_run["common"][:-len(QLORA)], "--tuner_type", "lora")
    with pytest.raises(UsageError, match="trained on --quant_method bnb --quant_bits 4"):
        run_sft(parse_sft_args(unquantized + ["--resume_from_checkpoint", "true"]))
    run_sft(parse_sft_args(flags + ["--resume_from_checkpoint", "true"]))
    reference, resumed = _adapter(text_run["ckpt"]), _adapter(out / "checkpoint-4")
    assert reference.keys() == resumed.keys()
    for k in reference:
        torch.testing.assert_close(resumed[k], reference[k], atol=1e-6, rtol=1e-5)


def test_gme_qlora_on_image_rows_trains_and_exports(tiny_model, tmp_path):
    """A tiny Qwen2-VL (GME template) on image rows: QLoRA trains, and the export embeds an image
    row as the full-precision base with the adapter does."""
    rows = os.path.join(DATA, "mm", "gme_train.jsonl")
    model = tiny_model("qwen2_vl")
    metrics = run_sft(parse_sft_args(_flags(model, rows, tmp_path / "run", "--max_steps", "3", "--save_steps", "3",
                                            "--learning_rate", "1e-2", "--max_length", "256",
                                            "--per_device_train_batch_size", "16", *QLORA)))  # every row, each step
    ckpt = metrics["last_checkpoint"]
    losses = _losses(ckpt)
    assert len(losses) == 3 and all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    merged = export_checkpoint(ckpt, str(tmp_path / "merged"))
    inputs = [{"query": "<image>", "images": [os.path.join(DATA, "mm", "red_circle.png")]}, "a red circle"]
    exported = Embedder.from_pretrained(merged, device="cpu").encode(inputs)
    m, processing, template, info = load_embedding_model(ckpt, merge=False)
    unmerged = Embedder(m, processing, template, info["max_length"], "cpu").encode(inputs)
    np.testing.assert_allclose(exported, unmerged, atol=1e-5)


def test_eight_bits_train_too(text_run, tmp_path):
    """--quant_bits 8: the base in bitsandbytes' int8 layers, the adapter trains on it."""
    metrics = run_sft(parse_sft_args(_flags(text_run["base"], text_run["data"], tmp_path / "run", "--max_steps", "2",
                                            "--save_steps", "2", "--learning_rate", "2e-3",
                                            "--per_device_train_batch_size", "16", *QLORA[:-1], "8")))
    ckpt = metrics["last_checkpoint"]
    losses = _losses(ckpt)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    assert json.load(open(os.path.join(ckpt, "mmembed.json")))["quantization"]["quant_bits"] == 8
    assert any(isinstance(m, bnb.nn.Linear8bitLt)
               for m in Embedder.from_pretrained(ckpt, device="cpu", quantized=True).model.modules())
