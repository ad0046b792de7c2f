"""bench_gpu's mmembed and ms-swift sides: the flags both get (shared_flags, ms-swift's names, which
mmembed takes), ``mmembed sft`` run in-process (train_mmembed) and ms-swift 4.6's own sft entry
point (train_swift, what ``swift sft --task_type embedding`` runs) in the ms-swift python."""

from __future__ import annotations

from benchmarks.gpu.specs import LORA, TEXT


def shared_flags(spec: dict) -> list[str]:
    """The flags mmembed's and ms-swift's sides both get (ms-swift's names, which mmembed takes):
    the same model folder and model type, rows, batch, steps, learning rate and optimizer settings,
    precision, attention, LoRA settings (frozen vision tower and aligner), DeepSpeed stage."""
    argv = [
        "--model", spec["model"], "--dataset", spec["data"], "--tuner_type", spec["tuner"], "--loss_type", "infonce",
        "--per_device_train_batch_size", str(spec["batch"]), "--gradient_accumulation_steps", "1",
        "--max_steps", str(spec["steps"]), "--learning_rate", str(spec["lr"]), "--seed", str(TEXT["seed"]),
        "--torch_dtype", spec["dtype"], "--gradient_checkpointing", str(spec["checkpointing"]).lower(),
        "--dataloader_drop_last", "true", "--save_strategy", "no", "--logging_steps", "1000",
        "--report_to", "none", "--disable_tqdm", "true", "--output_dir", spec["out"],
    ]
    if spec.get("model_type"):
        argv += ["--model_type", spec["model_type"]]
    if spec["kind"] == "text":  # the same recipe as the s-t side
        argv += ["--max_length", str(TEXT["max_length"]), "--truncation_strategy", "right",
                 "--weight_decay", str(TEXT["weight_decay"]), "--adam_beta2", str(TEXT["adam_beta2"]),
                 "--lr_scheduler_type", "linear"]
    if spec["tuner"] == "lora":
        argv += ["--lora_rank", str(LORA["lora_rank"]), "--lora_alpha", str(LORA["lora_alpha"]),
                 "--lora_dropout", str(LORA["lora_dropout"]), "--target_modules", "all-linear",
                 "--freeze_vit", "true", "--freeze_aligner", "true"]
    if spec.get("workers") is not None:
        argv += ["--dataloader_num_workers", str(spec["workers"])]
    if spec.get("attn_impl"):
        argv += ["--attn_impl", spec["attn_impl"]]
    if spec.get("deepspeed"):
        argv += ["--deepspeed", spec["deepspeed"]]
    return argv


def train_mmembed(spec: dict) -> None:
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.sft import run_sft

    argv = shared_flags(spec) + ["--logging_first_step", "false", "--overwrite_output_dir", "true"]
    if spec["amp"]:
        argv += ["--bf16", "true"]
    if spec.get("gradcache"):
        argv += ["--gradcache_mini_batch_size", str(spec["gradcache"])]
    run_sft(parse_sft_args(argv + list(spec.get("extra", []))))


def swift_flags(spec: dict) -> list[str]:
    """``swift sft --task_type embedding`` with mmembed's side's settings (shared_flags). ms-swift
    derives autocast from --torch_dtype (bfloat16 -> bf16; float32 -> fp16 autocast): the dry
    run's float32 turns both off, ``--precision amp`` asks for bf16 as mmembed's side does."""
    argv = shared_flags(spec) + ["--task_type", "embedding", "--add_version", "false", "--eval_strategy", "no",
                                 "--split_dataset_ratio", "0", "--dataset_num_proc", "1"]
    if spec["amp"]:
        argv += ["--bf16", "true", "--fp16", "false"]
    elif spec["dtype"] == "float32":
        argv += ["--bf16", "false", "--fp16", "false"]
    return argv + list(spec.get("extra", []))


def train_swift(spec: dict) -> None:
    """In the ms-swift python (--swift_python): its own sft entry point, as ``swift sft`` runs it
    (swift/cli/sft.py), with child()'s timing hooks on transformers.Trainer, which ms-swift's
    trainers subclass."""
    from swift.pipelines import sft_main

    sft_main(swift_flags(spec))
