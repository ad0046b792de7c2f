"""`mmembed sft` flags: ms-swift's names and defaults, and clear errors."""

import re

import pytest
from forked_cli import run_cli

from mmembed.errors import UsageError
from mmembed.training.arguments import default_gradient_accumulation, parse_sft_args

BASE = ["--model", "/m", "--dataset", "d.jsonl", "--output_dir", "/tmp/mmembed-args-test"]


def test_ms_swift_defaults():
    a = parse_sft_args(BASE)
    assert a.tuner_type == a.train_type == "lora"
    assert a.learning_rate == 1e-4
    assert a.weight_decay == 0.1 and a.adam_beta2 == 0.95
    assert getattr(a.lr_scheduler_type, "value", a.lr_scheduler_type) == "cosine"
    assert a.checkpointing is True
    assert a.per_device_train_batch_size == 1 and a.gradient_accumulation_steps == 16
    assert (a.lora_rank, a.lora_alpha, a.lora_dropout, a.target_modules) == (8, 32, 0.05, ["all-linear"])
    assert a.truncation_strategy == "delete" and a.split_dataset_ratio == 0.0
    assert getattr(a.eval_strategy, "value", a.eval_strategy) == "no"  # no validation data, no evaluation
    assert a.loss_type == "infonce" and a.task_type == "embedding"


def test_full_training_defaults_and_global_batch():
    a = parse_sft_args(BASE + ["--train_type", "full", "--per_device_train_batch_size", "4", "--val_dataset", "v.jsonl"])
    assert a.tuner_type == "full" and a.learning_rate == 1e-5
    assert a.gradient_accumulation_steps == 4  # a global batch of 16 on one process
    assert default_gradient_accumulation(4, 2) == 2  # ceil(16 / 4 / 2)
    assert default_gradient_accumulation(32, 1) == 1 and default_gradient_accumulation(5, 1) == 4
    assert getattr(a.eval_strategy, "value", a.eval_strategy) == "steps" and a.eval_steps == a.save_steps


def test_ms_swift_script_flags_are_accepted():
    a = parse_sft_args(BASE + [
        "--task_type", "embedding", "--loss_type", "infonce", "--tuner_type", "lora", "--lora_rank", "16",
        "--lora_alpha", "64", "--target_modules", "query", "value", "--dataset", "a.jsonl", "b.jsonl#100",
        "--split_dataset_ratio", "0.05", "--torch_dtype", "float32", "--max_length", "128", "--num_train_epochs", "2",
        "--per_device_eval_batch_size", "8", "--learning_rate", "3e-5", "--warmup_ratio", "0.05",
        "--eval_steps", "10", "--save_steps", "20", "--save_total_limit", "2", "--logging_steps", "5",
        "--dataloader_num_workers", "0", "--dataloader_drop_last", "true", "--lazy_tokenize", "true",
        "--load_from_cache_file", "false", "--dataset_num_proc", "2", "--attn_impl", "sdpa",
        "--padding_side", "left", "--gradient_checkpointing", "false", "--seed", "7", "--strict", "false",
    ])
    assert a.dataset == ["a.jsonl", "b.jsonl#100"] and a.target_modules == ["query", "value"]
    assert a.warmup_steps == 0.05 and a.learning_rate == 3e-5
    assert a.checkpointing is False and a.strict is False and a.load_from_cache_file is False
    assert a.padding_side == "left" and a.dataset_num_proc == 2


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--task_type", "causal_lm"], "--task_type must be one of embedding, reranker, generative_reranker"),
        (["--tuner_type", "qlora"], "--tuner_type must be one of"),
        (["--tuner_type", "lora", "--train_type", "full"], "disagree"),
        (["--truncation_strategy", "middle"], "--truncation_strategy must be one of"),
        (["--warmup_ratio", "1.5"], "--warmup_ratio must be in"),
        (["--split_dataset_ratio", "1.0"], "--split_dataset_ratio must be in"),
    ],
)
def test_bad_values_are_named(extra, message):
    with pytest.raises(ValueError, match=message):
        parse_sft_args(BASE + extra)


def test_unknown_flag_is_an_error_naming_it():
    proc = run_cli(["sft", *BASE, "--no_such_flag", "3"])  # a forked process: its exit code and stderr
    assert proc.returncode != 0
    assert "unknown flag(s): --no_such_flag" in proc.stderr
    # no abbreviations: a prefix of a real flag is not silently taken for it
    proc = run_cli(["sft", *BASE, "--lora_r", "3"])
    assert proc.returncode != 0 and "--lora_r" in proc.stderr


def test_offloaded_optimizer_keeps_a_non_adam_choice():
    """DeepSpeed swaps the optimizer for its CPU Adam when the optimizer is offloaded: kept for
    AdamW (same algorithm), switched off for any other --optim (which would be ignored)."""
    from importlib.resources import files

    from mmembed.training.device_flags import honour_optimizer_under_offload

    offload = str(files("mmembed.training").joinpath("ds_configs", "zero3_offload.json"))
    plain = str(files("mmembed.training").joinpath("ds_configs", "zero3.json"))
    assert honour_optimizer_under_offload(offload, "adamw_torch") == offload
    assert honour_optimizer_under_offload(plain, "sgd") == plain
    config = honour_optimizer_under_offload(offload, "sgd")
    assert config["zero_force_ds_cpu_optimizer"] is False
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_scheduler_kwargs_are_checked_against_the_named_schedule(caplog):
    """--lr_scheduler_kwargs keys are the schedule's own settings (transformers' schedule
    functions, torch's ReduceLROnPlateau); the steps and warmup are not among them; the
    constant schedules take none, which the log says."""
    import inspect

    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

    def parsed(kind, kwargs, *extra):
        return parse_sft_args(BASE + ["--lr_scheduler_type", kind, "--lr_scheduler_kwargs", kwargs, *extra])

    assert parsed("cosine", '{"num_cycles": 0.25}').lr_scheduler_kwargs == {"num_cycles": 0.25}
    assert "min_lr" in inspect.signature(get_cosine_with_min_lr_schedule_with_warmup).parameters
    assert parsed("cosine_with_min_lr", '{"min_lr": 1e-6}').lr_scheduler_kwargs == {"min_lr": 1e-6}
    plateau = ["--split_dataset_ratio", "0.1"]  # evaluates: the plateau schedule follows the eval loss
    assert parsed("reduce_lr_on_plateau", '{"patience": 2}', *plateau).lr_scheduler_kwargs == {"patience": 2}
    with pytest.raises(UsageError, match=r"'patiense' is not a setting of the reduce_lr_on_plateau schedule"):
        parsed("reduce_lr_on_plateau", '{"patiense": 2}', *plateau)
    with pytest.raises(UsageError, match=r"'num_training_steps', 'power' are not settings of the linear schedule"):
        parsed("linear", '{"num_training_steps": 9, "power": 2}')
    with caplog.at_level("INFO", logger="mmembed"):
        parsed("constant", '{"num_cycles": 2}')
    assert "has no effect: the constant schedule takes no settings" in caplog.text


def test_flex_attention_is_refused_for_training_on_the_cpu():
    """torch's FlexAttention has no backward on the CPU: the run would load, then fail at the
    first backward; it is refused before anything loads."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.randn(1, 1, 16, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        flex_attention(q, q, q).sum().backward()  # the fact the check rests on
    with pytest.raises(UsageError, match=r"--attn_impl flex_attention trains on a GPU only"):
        parse_sft_args(BASE + ["--attn_impl", "flex_attention"])
    assert parse_sft_args(BASE + ["--attn_impl", "sdpa"]).attn_impl == "sdpa"


def test_flash_attn_without_a_gpu_trains_with_sdpa_and_says_so(monkeypatch, caplog):
    """ms-swift's example scripts pass --attn_impl flash_attn: on a machine without a GPU (where
    FlashAttention cannot run) the run takes SDPA, the same attention, with a warning; on a GPU
    without the flash-attn package PyTorch's own FlashAttention kernel (--attn_impl varlen)."""
    import importlib.util

    from mmembed.training import flag_checks

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else real_find_spec(name, *a))
    with caplog.at_level("WARNING", logger="mmembed"):
        args = parse_sft_args(BASE + ["--attn_impl", "flash_attn", "--padding_free", "true"])
    assert args.attn_impl == "sdpa"
    assert "--attn_impl flash_attn: no GPU here" in caplog.text
    monkeypatch.setattr(flag_checks, "has_accelerator", lambda: True)
    caplog.clear()
    with caplog.at_level("WARNING", logger="mmembed"):
        args = parse_sft_args(BASE + ["--attn_impl", "flash_attn"])
    assert args.attn_impl == "varlen"
    assert "the flash-attn package is not installed; training with --attn_impl varlen" in caplog.text


def test_device_defaults_differ_between_cpu_and_gpu(monkeypatch, tmp_path):
    """Flags left unset take the device's defaults (and are listed for the log); flags given
    are kept. The GPU side is checked by calling the rule with cuda=True on a namespace."""
    import types

    import torch

    from mmembed.training.device_flags import device_defaults, dtype_after_download

    args = parse_sft_args(BASE)
    assert (args.length_chunks, args.length_buckets, args.dataloader_num_workers) == (4, False, 0)
    assert args.torch_dtype is None and not args.bf16
    assert "--length_chunks 4" in args.device_defaults and "--dataloader_num_workers 0" in args.device_defaults
    given = parse_sft_args(BASE + ["--length_chunks", "2", "--length_buckets", "true", "--dataloader_num_workers", "1"])
    assert (given.length_chunks, given.length_buckets, given.dataloader_num_workers) == (2, True, 1)
    assert not any(d.startswith(("--length_chunks", "--length_buckets", "--dataloader_num_workers"))
                   for d in given.device_defaults)

    def gpu(**kw):
        ns = dict(length_chunks=None, length_buckets=None, dataloader_num_workers=None, dataloader_prefetch_factor=None,
                  dataloader_persistent_workers=False, torch_dtype=None, bf16=False, fp16=False,
                  tuner_type="lora", model=str(tmp_path))
        ns.update(kw)
        ns = types.SimpleNamespace(**ns)
        return ns, device_defaults(ns, cuda=True)

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    lora, chosen = gpu()
    assert (lora.length_chunks, lora.length_buckets, lora.dataloader_num_workers) == (1, True, 4)
    assert (lora.dataloader_prefetch_factor, lora.dataloader_persistent_workers) == (4, True)
    assert (lora.torch_dtype, lora.bf16, lora.fp16) == ("bfloat16", True, False)
    assert "--torch_dtype bfloat16" in chosen and "--bf16 true" in chosen
    full, _ = gpu(tuner_type="full")
    assert (full.torch_dtype, full.bf16) == ("float32", True)  # float32 master weights under bf16 autocast
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    eight, _ = gpu()
    assert eight.dataloader_num_workers == 1  # 16 cores over 8 processes, one kept for each trainer
    kept, chosen = gpu(torch_dtype="float32", fp16=True, dataloader_num_workers=0, length_chunks=3)
    assert (kept.torch_dtype, kept.bf16, kept.fp16, kept.dataloader_num_workers, kept.length_chunks) == \
        ("float32", False, True, 0, 3)
    assert kept.dataloader_prefetch_factor is None and chosen == ["--length_buckets true"]
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    old, _ = gpu()
    assert (old.torch_dtype, old.bf16, old.fp16) == ("float16", False, False)
    old_full, _ = gpu(tuner_type="full")
    assert (old_full.torch_dtype, old_full.bf16, old_full.fp16) == ("float32", False, True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    (tmp_path / "config.json").write_text('{"torch_dtype": "float16"}')
    saved_half, _ = gpu()
    assert saved_half.torch_dtype == "float16"  # the half precision the model was saved in
    # A hub id: LoRA's dtype waits for the download (its config.json), the autocast does not.
    hub, chosen = gpu(model="org/not-downloaded")
    assert (hub.torch_dtype, hub.bf16) == (None, True) and not any("torch_dtype" in c for c in chosen)
    (tmp_path / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    hub.model = str(tmp_path)
    assert dtype_after_download(hub, cuda=True) == ["--torch_dtype bfloat16"] and hub.torch_dtype == "bfloat16"


@pytest.mark.parametrize(
    "extra, loss",
    [
        ([], "infonce"),
        (["--task_type", "reranker"], "pointwise_reranker"),
        (["--task_type", "generative_reranker"], "pointwise_reranker"),
        (["--task_type", "reranker", "--loss_type", "listwise_reranker"], "listwise_reranker"),
        (["--task_type", "generative_reranker", "--loss_type", "listwise_generative_reranker"], "listwise_generative_reranker"),
    ],
)
def test_the_loss_follows_the_task(extra, loss):
    assert parse_sft_args(BASE + extra).loss_type == loss


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--loss_type", "listwise_reranker"], "--loss_type listwise_reranker is a reranker loss; add --task_type reranker"),
        (["--task_type", "reranker", "--loss_type", "infonce"], "--task_type reranker trains with a reranker loss"),
        (["--task_type", "reranker", "--loss_type", "generative_reranker"],
         "use it with --task_type generative_reranker, or --loss_type pointwise_reranker with --task_type reranker"),
        (["--task_type", "reranker", "--mrl_dims", '{"8": 1}'], "--mrl_dims (Matryoshka widths) is for embedding runs"),
        (["--task_type", "generative_reranker", "--pooling", "mean"], "--pooling (an embedding pooling) is for embedding runs"),
    ],
)
def test_the_task_and_its_flags_must_agree(extra, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_sft_args(BASE + extra)
