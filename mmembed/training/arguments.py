"""Command-line arguments, parsed once into dataclasses (ms-swift's flag names and defaults).

``SftArguments`` extends ``transformers.TrainingArguments`` with ms-swift's embedding flags
(their table: :class:`~mmembed.training.sft_flags.SftFlags`), checked when made. Flags left out take ms-swift 4.x's ``sft`` defaults, so the same script trains the same
way: cosine schedule, weight decay 0.1, Adam beta2 0.95, learning rate 1e-4 for LoRA and
1e-5 for full training, gradient checkpointing on, a global batch of 16 through gradient
accumulation when ``--gradient_accumulation_steps`` is not given, and over-long rows
deleted (``--truncation_strategy delete``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from transformers import HfArgumentParser

from ..environment import read as read_environment
from ..errors import ArgumentParser, UsageError, one_line

__all__ = ["SftArguments", "UsageError", "parse_sft_args"]
from .device_flags import (
    default_gradient_accumulation,
    device_defaults,
    honour_optimizer_under_offload,
    one_process_group_env,
    skip_cpu_shared_memory_op,
)
from .flag_checks import (
    DEEPSPEED_CONFIGS,
    TUNER_TYPES,
    bundled_deepspeed_config,
    check_dataset_config,
    check_deepspeed_json,
    check_json_config,
    check_loss_args,
    check_names,
    check_packing,
    check_report_to,
    check_streaming,
    check_swift_flags,
    check_values,
    default_dataset_num_proc,
    has_accelerator,
    naming_the_flag,
)
from .quant_flags import check_quantization
from .sft_flags import RENAMED_CHECKPOINTING, SftFlags
from .task_flags import check_task


@dataclass
class SftArguments(SftFlags):
    """``mmembed sft``'s flags (:class:`~mmembed.training.sft_flags.SftFlags`), checked and
    completed when made: each bad value a :class:`UsageError` naming its flag, and the
    defaults that follow from other values (learning rate, gradient accumulation, evaluation,
    checkpointing, DeepSpeed configs by ms-swift's names, the device's defaults) filled in."""

    def __post_init__(self):
        check_task(self)  # and --loss_type's default, which follows the task
        if not self.model:
            raise UsageError("--model is required (a model folder or hub id)")
        if self.tuner_type and self.train_type and self.tuner_type != self.train_type:
            raise UsageError(f"--tuner_type {self.tuner_type} and --train_type {self.train_type} disagree")
        flag = "--tuner_type" if self.tuner_type or not self.train_type else "--train_type"
        self.tuner_type = self.tuner_type or self.train_type or "lora"
        self.train_type = self.tuner_type
        if self.tuner_type not in TUNER_TYPES:
            raise UsageError(f"{flag} must be one of {', '.join(TUNER_TYPES)}, got {self.tuner_type!r}")
        check_values(self)
        if self.dataset_num_proc is None:
            self.dataset_num_proc = default_dataset_num_proc()
        if float(self.lora_alpha).is_integer():
            self.lora_alpha = int(self.lora_alpha)
        check_names(self)
        check_streaming(self)
        check_packing(self)
        check_loss_args(self)
        check_swift_flags(self)
        check_quantization(self)
        check_dataset_config(self)
        if self.learning_rate is None:
            self.learning_rate = 1e-4 if self.tuner_type == "lora" else 1e-5
        if self.gradient_accumulation_steps is None:
            world = read_environment().launch.processes
            self.gradient_accumulation_steps = default_gradient_accumulation(self.per_device_train_batch_size, world)
        if self.warmup_ratio is not None:  # transformers 5 folded warmup_ratio into a fractional warmup_steps
            if self.warmup_steps:
                raise UsageError("pass --warmup_ratio or --warmup_steps, not both")
            self.warmup_steps = self.warmup_ratio
        has_val = bool(self.val_dataset) or self.split_dataset_ratio > 0 or bool(self.eval_beir) or bool(self.eval_sts) \
            or any(entry.val for entry in self.dataset_entries)
        if self.eval_strategy is None:
            self.eval_strategy = "steps" if has_val else "no"
        elif str(self.eval_strategy) != "no" and not has_val:
            # scripts copied from ms-swift ask for evaluation without eval data; there is nothing to evaluate
            logging.getLogger("mmembed").warning(
                "--eval_strategy %s without --val_dataset or --split_dataset_ratio: no evaluation", self.eval_strategy
            )
            self.eval_strategy = "no"
        if self.eval_steps is None and self.eval_strategy == "steps":
            self.eval_steps = self.save_steps
        # ms-swift's --gradient_checkpointing, default on as there. transformers 5.23 renamed it
        # activation_checkpointing (the old name a deprecated alias); older 5.x know only the old one.
        wanted = True if self.gradient_checkpointing is None else self.gradient_checkpointing
        kwargs = self.gradient_checkpointing_kwargs or {"use_reentrant": False}
        if RENAMED_CHECKPOINTING:
            if self.activation_checkpointing is None:
                self.activation_checkpointing = wanted
            if self.activation_checkpointing_kwargs is None:
                self.activation_checkpointing_kwargs = kwargs
            self.gradient_checkpointing = self.gradient_checkpointing_kwargs = None
        else:
            self.gradient_checkpointing, self.gradient_checkpointing_kwargs = wanted, kwargs
        if isinstance(self.deepspeed, str) and self.deepspeed in DEEPSPEED_CONFIGS:
            # ms-swift's names for the bundled configs; their "auto" values are filled from these flags
            self.deepspeed = bundled_deepspeed_config(self.deepspeed)
        elif isinstance(self.deepspeed, str):
            check_deepspeed_json(self.deepspeed)
        self.deepspeed = honour_optimizer_under_offload(self.deepspeed, str(getattr(self.optim, "value", self.optim)))
        if self.deepspeed:
            one_process_group_env()
            if not has_accelerator():
                skip_cpu_shared_memory_op()
        self.device_defaults = device_defaults(self, has_accelerator())
        if not has_accelerator():
            # without use_cpu, accelerate starts the process group under torchrun but then treats
            # the run as single-process (no DDP, no data sharding); with it, CPU runs use gloo
            self.use_cpu = True
            self.dataloader_pin_memory = False  # pinning needs a GPU; on CPU it only warns
        if self.label_names is None:
            self.label_names = ["labels"]
        for flag in ("accelerator_config", "fsdp_config"):  # transformers opens them with errors that name no flag
            if isinstance(getattr(self, flag), str):
                check_json_config(flag, getattr(self, flag))
        try:
            super().__post_init__()
        except (ValueError, TypeError, OSError, KeyError) as e:  # transformers' checks of its own flags
            raise UsageError(naming_the_flag(self, e)) from e
        if has_accelerator() and self.dataloader_pin_memory:
            self.accelerator_config.non_blocking = True  # pinned batches copy to the GPU while it computes
        if self.streaming:
            # each process reads the stream and keeps its share of every global batch
            # (accelerate's IterableDatasetShard): the collated batches are not sent from rank 0
            self.accelerator_config.dispatch_batches = False
        check_report_to(self.report_to)

class _Parser(HfArgumentParser, ArgumentParser):
    """transformers' parser whose own errors (a bad int, an unknown choice) are a
    :class:`UsageError` (``errors.ArgumentParser.error``): one line, not the usage of all 300 flags."""


def parse_sft_args(argv: list[str]) -> SftArguments:
    """Parse ``mmembed sft`` flags; an unknown flag is an error that names it. ms-swift flags
    with no effect here are dropped with a logged line; refused ones raise
    :class:`~mmembed.training.swift_flags.RefusedFlag` (see ``swift_flags``).

    Raises:
        UsageError: a flag that is unknown, does not parse, or has a value that cannot work
            (transformers' own checks of its flags included), naming it and its value.
    """
    import dataclasses

    from .swift_flags import take_swift_flags

    argv = take_swift_flags(list(argv), {f.name for f in dataclasses.fields(SftArguments)})
    parser = _Parser(SftArguments, allow_abbrev=False, prog="mmembed sft")
    try:
        args, rest = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    except UsageError:
        raise
    except ValueError as e:  # transformers' checks of its own flags
        raise UsageError(one_line(e)) from e
    if rest:
        unknown = [r for r in rest if r.startswith("-")] or rest
        raise UsageError(f"unknown flag(s): {' '.join(unknown)} (see `mmembed sft --help`)")
    if not args.dataset and not args.dataset_config:
        raise UsageError("--dataset is required (data files or folders), or --dataset_config FILE")
    return args
