"""Command-line arguments, parsed once into dataclasses (ms-swift's flag names and defaults).

``SftArguments`` extends ``transformers.TrainingArguments`` with ms-swift's embedding flags.
Flags left out take ms-swift 4.x's ``sft`` defaults, so the same script trains the same
way: cosine schedule, weight decay 0.1, Adam beta2 0.95, learning rate 1e-4 for LoRA and
1e-5 for full training, gradient checkpointing on, a global batch of 16 through gradient
accumulation when ``--gradient_accumulation_steps`` is not given, and over-long rows
deleted (``--truncation_strategy delete``).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from importlib.resources import files

from transformers import HfArgumentParser, TrainingArguments
from transformers.trainer_utils import IntervalStrategy, SchedulerType

from ..environment import export
from ..environment import read as read_environment
from ..errors import ArgumentParser, UsageError, one_line

__all__ = ["SftArguments", "UsageError", "parse_sft_args"]

TUNER_TYPES = ("lora", "full")
DEEPSPEED_CONFIGS = ("zero2", "zero2_offload", "zero3", "zero3_offload")
# transformers >= 5.23 calls gradient checkpointing "activation checkpointing"
RENAMED_CHECKPOINTING = "activation_checkpointing" in TrainingArguments.__dataclass_fields__
TRUNCATION_STRATEGIES = ("delete", "left", "right")
# ms-swift's --attn_impl names (flash_attn: FlashAttention 2) and transformers' own
ATTN_IMPLS = ("sdpa", "eager", "flash_attn", "flash_attention_2", "flash_attention_3", "flex_attention")
# torch.compile's modes (--torch_compile_mode)
TORCH_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# PEFT's init_lora_weights besides true/false ("pissa_niter_N" too)
LORA_INITS = ("true", "false", "gaussian", "eva", "olora", "pissa", "corda", "loftq", "orthogonal")


def _finite(v) -> bool:
    return math.isfinite(v)


# What each numeric flag allows: (test, the words for it). A flag left unset (None) is not
# tested; NaN fails every test. Checked before anything is derived from the values (a batch
# of 0 rows would divide by zero in the default gradient accumulation) or loaded.
LIMITS: dict[str, tuple] = {
    "per_device_train_batch_size": (lambda v: v >= 1, "an integer >= 1"),
    "per_device_eval_batch_size": (lambda v: v >= 1, "an integer >= 1"),
    "gradient_accumulation_steps": (lambda v: v >= 1, "an integer >= 1"),
    "eval_accumulation_steps": (lambda v: v >= 1, "an integer >= 1"),
    "max_steps": (lambda v: v == -1 or v >= 1, "an integer >= 1, or -1 to train --num_train_epochs"),
    "learning_rate": (lambda v: _finite(v) and v >= 0, "a finite number >= 0"),
    "vit_lr": (lambda v: _finite(v) and v >= 0, "a finite number >= 0"),
    "aligner_lr": (lambda v: _finite(v) and v >= 0, "a finite number >= 0"),
    "weight_decay": (lambda v: _finite(v) and v >= 0, "a finite number >= 0"),
    "adam_beta1": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "adam_beta2": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "adam_epsilon": (lambda v: _finite(v) and v >= 0, "a finite number >= 0"),
    "max_grad_norm": (lambda v: _finite(v) and v >= 0, "a finite number >= 0 (0: no clipping)"),
    "warmup_ratio": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "warmup_steps": (lambda v: _finite(v) and v >= 0, "a finite number >= 0"),
    "logging_steps": (lambda v: _finite(v) and v > 0, "a number > 0 (below 1: a fraction of the total steps)"),
    "save_steps": (lambda v: _finite(v) and v > 0, "a number > 0 (below 1: a fraction of the total steps)"),
    "eval_steps": (lambda v: _finite(v) and v > 0, "a number > 0 (below 1: a fraction of the total steps)"),
    "save_total_limit": (lambda v: v >= 1, "an integer >= 1 (or leave it out to keep every checkpoint)"),
    "seed": (lambda v: 0 <= v < 2**32, "an integer from 0 to 2**32 - 1"),
    "data_seed": (lambda v: 0 <= v < 2**32, "an integer from 0 to 2**32 - 1"),
    "dataloader_num_workers": (lambda v: v >= 0, "an integer >= 0"),
    "dataloader_prefetch_factor": (lambda v: v >= 1, "an integer >= 1 (batches each worker loads ahead)"),
    "lora_rank": (lambda v: v >= 1, "an integer >= 1"),
    "lora_alpha": (lambda v: _finite(v) and v > 0, "a finite number > 0"),
    "lora_dropout": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "max_length": (lambda v: v >= 1, "an integer >= 1 (tokens per input)"),
    "length_chunks": (lambda v: v >= 1, "an integer >= 1 (1: one padded call)"),
    "gradcache_mini_batch_size": (lambda v: v >= 0, "an integer >= 0 (0: off)"),
    "dataset_num_proc": (lambda v: v >= 1, "an integer >= 1"),
    "shuffle_buffer_size": (lambda v: v >= 1, "an integer >= 1 (rows)"),
    "split_dataset_ratio": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "max_pixels": (lambda v: v >= 1, "> 0 (pixels per image)"),
    "zero_loss_patience": (lambda v: v >= 0, "an integer >= 0 (0: off)"),
}


@dataclass
class SftArguments(TrainingArguments):
    # model and template
    model: str | None = field(default=None, metadata={"help": "local model folder"})
    model_type: str | None = field(default=None, metadata={"help": "ms-swift model type (picks the template)"})
    template: str | None = field(default=None, metadata={"help": "template name from templates/"})
    task_type: str = field(default="embedding", metadata={"help": "must be 'embedding'"})
    torch_dtype: str | None = field(default=None, metadata={"help": "float32 | bfloat16 | float16 | auto (default: float32 on a CPU; on a GPU bfloat16 for LoRA's frozen base, float32 for full training, under --bf16 autocast)"})
    attn_impl: str | None = field(default=None, metadata={"help": "sdpa | eager | flash_attn"})
    padding_side: str | None = field(default=None, metadata={"help": "left | right (default: the template's)"})
    pooling: str | None = field(default=None, metadata={"help": "override the template's pooling: last | mean | cls | max"})
    length_chunks: int | None = field(default=None, metadata={"help": "embed text batches in up to N length-sorted chunks, each padded to its own longest row (1: off; default 4 on a CPU, 1 on a GPU)"})
    gradcache_mini_batch_size: int = field(default=0, metadata={"help": "embed each batch in chunks of N rows with a gradient cache (0: off)"})
    zero_loss_patience: int = field(default=10, metadata={"help": "stop when the loss and the gradient are exactly 0 for N optimizer steps in a row: nothing is being learned (0: off)"})
    system: str | None = field(default=None, metadata={"help": "system prompt for rows that give none"})
    query_system: str | None = field(default=None, metadata={"help": "the instruction of the query side (the anchor), for rows that give no system; over --system"})
    document_system: str | None = field(default=None, metadata={"help": "the instruction of the document side (positives, negatives), for rows that give no system; over --system"})
    max_length: int | None = field(default=None, metadata={"help": "maximum tokens per input (default: the model's)"})
    truncation_strategy: str = field(default="delete", metadata={"help": "delete | left | right"})
    check_media: str = field(default="header", metadata={"choices": ["header", "full"], "help": "how the length check counts media tokens: header (the default) reads each file's header (image size, video frames, audio length) and applies the processor's rules, the same counts as decoding; full decodes every image, video and audio and runs the processor, so pixels that do not decode are found before training rather than when their batch is built"})
    # tuning
    tuner_type: str | None = field(default=None, metadata={"help": "lora | full (ms-swift >= 3.9 spelling)"})
    train_type: str | None = field(default=None, metadata={"help": "lora | full (older ms-swift spelling)"})
    lora_rank: int = 8
    # a float as in ms-swift 4.x (PEFT scales the update by alpha / rank); an integral value is
    # kept an int, so adapter_config.json says 32, as before, not 32.0
    lora_alpha: float = field(default=32, metadata={"help": "LoRA alpha: the update is scaled by alpha / rank (a number > 0, e.g. 16 or 8.5)"})
    lora_dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    freeze_vit: bool = field(default=True, metadata={"help": "multimodal models: keep the vision/audio tower fixed (no LoRA on it)"})
    freeze_aligner: bool = field(default=True, metadata={"help": "multimodal models: keep the aligner (projector) fixed"})
    freeze_llm: bool = field(default=False, metadata={"help": "multimodal models: keep the language model fixed"})
    use_dora: bool = field(default=False, metadata={"help": "LoRA: PEFT's DoRA (weight-decomposed LoRA)"})
    use_rslora: bool = field(default=False, metadata={"help": "LoRA: rank-stabilised scaling alpha / sqrt(rank)"})
    lora_bias: str = field(default="none", metadata={"help": "LoRA: which biases train: none | all | lora_only"})
    init_weights: str = field(default="true", metadata={"help": "LoRA: PEFT's init_lora_weights (true, false, gaussian, pissa, olora, ...)"})
    target_regex: str | None = field(default=None, metadata={"help": "LoRA: a regular expression of module names (instead of --target_modules)"})
    modules_to_save: list[str] = field(default_factory=list, metadata={"help": "LoRA: modules trained and saved whole"})
    adapters: list[str] = field(default_factory=list, metadata={"help": "LoRA: start from this adapter (a checkpoint folder) instead of a new one"})
    resume_only_model: bool = field(default=False, metadata={"help": "with --resume_from_checkpoint: load the weights only (optimizer, scheduler and step start afresh)"})
    vit_lr: float | None = field(default=None, metadata={"help": "learning rate of the vision/audio tower (its parts trained: --freeze_vit false)"})
    aligner_lr: float | None = field(default=None, metadata={"help": "learning rate of the aligner (trained: --freeze_aligner false)"})
    max_pixels: int | None = field(default=None, metadata={"help": "image pixel budget, as the MAX_PIXELS variable"})
    sequence_parallel_size: int = field(default=1, metadata={"help": "must be 1 (sequence parallelism is not offered)"})
    use_chat_template: bool = field(default=True, metadata={"help": "accepted for ms-swift scripts; the template decides the rendering"})
    padding_free: bool | None = field(default=None, metadata={"help": "text batches packed into one sequence of real tokens (default: on with --attn_impl flash_attn / flex_attention for bert, qwen2, qwen3)"})
    length_buckets: bool | None = field(default=None, metadata={"help": "pad text batches to a bounded set of widths (default: on a GPU, off on a CPU)"})
    # data
    dataset: list[str] = field(default_factory=list, metadata={"help": "data files / folders, path#N samples N rows"})
    dataset_config: str | None = field(default=None, metadata={"help": "several datasets in a YAML or JSON file, each with its name, path, weight, query_system / document_system, loss settings and val rows (instead of --dataset; README: Several datasets and instructions)"})
    columns: str | None = field(default=None, metadata={"help": "rename row fields before reading, as JSON: '{\"text1\": \"query\", \"text2\": \"response\"}'"})
    val_dataset: list[str] = field(default_factory=list)
    split_dataset_ratio: float = 0.0
    dataset_shuffle: bool = field(default=True, metadata={"help": "shuffle the training rows once after loading (ms-swift's); the sampler shuffles each epoch too"})
    train_dataloader_shuffle: bool = field(default=True, metadata={"help": "false: the sampler takes the rows in their loaded order each epoch (ms-swift's)"})
    val_dataset_shuffle: bool = field(default=False, metadata={"help": "shuffle the --val_dataset rows"})
    data_seed: int | None = field(default=42, metadata={"help": "seed of the split, #N sampling, --dataset_shuffle and the sampler (ms-swift's default 42; not --seed)"})
    streaming: bool = field(default=False, metadata={"help": "read the training rows as training consumes them (no up-front pass, no Arrow copy); needs --max_steps; shuffles with a buffer"})
    shuffle_buffer_size: int = field(default=1000, metadata={"help": "--streaming with --dataset_shuffle: rows held in the shuffle buffer"})
    multi_dataset_sampler: str = field(default="mixed", metadata={"help": "mixed (ms-swift's: all datasets' rows shuffled together) | proportional | round_robin | weighted: every global batch from one dataset, datasets drawn by size, in turn, or by weight"})
    batch_sampler: str = field(default="default", metadata={"help": "default | no_duplicates: no text (with its media) twice in one global batch, as anchor, positive or negative"})
    interleave_prob: list[float] | None = field(default=None, metadata={"help": "with --multi_dataset_sampler mixed: draw the training rows from the datasets with these probabilities, one per dataset (ms-swift's; normalised to sum 1)"})
    stopping_strategy: str = field(default="first_exhausted", metadata={"help": "with --interleave_prob: first_exhausted (stop when one dataset has given all its rows) | all_exhausted (when all have; the others start over)"})
    strict: bool = field(default=True, metadata={"help": "false: skip broken rows and report them"})
    offline: bool = field(default=False, metadata={"help": "fetch no http(s) media (as MMEMBED_OFFLINE=1 or HF_HUB_OFFLINE=1): a URL not in the media cache is an error"})
    lazy_tokenize: bool = True
    load_from_cache_file: bool = True
    dataset_num_proc: int | None = field(default=None, metadata={"help": "processes that parse the data and run the length check (default: the machine's cores, at most 8; ms-swift's default is 1)"})
    loss_type: str = "infonce"
    loss_kwargs: str | None = field(default=None, metadata={"help": "options of the loss as JSON, e.g. '{\"margin\": 0.05}'"})
    mrl_dims: str | None = field(default=None, metadata={"help": "Matryoshka: '{\"64\": 1.0, \"128\": 1.0}' (width: weight)"})
    eval_beir: list[str] = field(default_factory=list, metadata={"help": "also evaluate retrieval on this BEIR folder at every evaluation; several as name=folder pairs (with --dataset_config, a dataset's name gives its instructions)"})
    eval_beir_split: str = field(default="test", metadata={"help": "the qrels split of --eval_beir"})
    eval_sts: str | None = field(default=None, metadata={"help": "also evaluate STS (Spearman, Pearson) and pair retrieval on these scored pairs at every evaluation"})
    guide_model: str | None = field(default=None, metadata={"help": "gist: the guide model (checkpoint, exported or base folder)"})
    teacher_model: str | None = field(default=None, metadata={"help": "distill_*: the teacher model (checkpoint, exported or base folder); without it the teacher's signals come from the data"})
    teacher_scores_file: list[str] = field(default_factory=list, metadata={"help": "distill_kl: one .npy [rows, 1 + negatives] per --dataset, aligned with its rows, NaN-padded"})
    teacher_embeddings_file: list[str] = field(default_factory=list, metadata={"help": "distill_*: one .npy [rows, 2 + negatives, width] per --dataset, aligned with its rows, NaN-padded"})
    # ms-swift defaults that differ from transformers'
    output_dir: str | None = "output"
    overwrite_output_dir: bool = field(default=False, metadata={"help": "delete the checkpoints an earlier run left in --output_dir before training (without it, such a folder is refused unless resumed)"})
    learning_rate: float | None = None  # type: ignore[assignment]
    weight_decay: float = 0.1
    adam_beta2: float = 0.95
    lr_scheduler_type: str = "cosine"  # type: ignore[assignment]
    gradient_checkpointing: bool | None = None  # ms-swift's name; default on (as ms-swift)
    logging_steps: float = 5
    logging_first_step: bool = True
    eval_strategy: str | None = None  # type: ignore[assignment]
    warmup_ratio: float | None = field(default=None, metadata={"help": "warmup as a fraction of the total steps"})
    per_device_train_batch_size: int = 1
    per_device_eval_batch_size: int = 1
    dataloader_num_workers: int | None = field(default=None, metadata={"help": "data-loader processes (default: 0 on a CPU; on a GPU up to 4, one core per process kept for the trainer)"})  # type: ignore[assignment]
    gradient_accumulation_steps: int | None = None  # type: ignore[assignment]
    remove_unused_columns: bool = False

    @property
    def checkpointing(self) -> bool:
        """Whether activation (gradient) checkpointing is on, whichever name this transformers uses."""
        return bool(self.activation_checkpointing if RENAMED_CHECKPOINTING else self.gradient_checkpointing)

    def __post_init__(self):
        if self.task_type != "embedding":
            raise UsageError(f"--task_type {self.task_type!r}: mmembed trains embedding models only (--task_type embedding)")
        if not self.model:
            raise UsageError("--model is required (a local model folder)")
        if self.tuner_type and self.train_type and self.tuner_type != self.train_type:
            raise UsageError(f"--tuner_type {self.tuner_type} and --train_type {self.train_type} disagree")
        flag = "--tuner_type" if self.tuner_type or not self.train_type else "--train_type"
        self.tuner_type = self.tuner_type or self.train_type or "lora"
        self.train_type = self.tuner_type
        if self.tuner_type not in TUNER_TYPES:
            raise UsageError(f"{flag} must be one of {', '.join(TUNER_TYPES)}, got {self.tuner_type!r}")
        _check_values(self)
        if self.dataset_num_proc is None:
            self.dataset_num_proc = default_dataset_num_proc()
        if float(self.lora_alpha).is_integer():
            self.lora_alpha = int(self.lora_alpha)
        _check_names(self)
        _check_streaming(self)
        _check_loss_args(self)
        _check_swift_flags(self)
        _check_dataset_config(self)
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
            self.deepspeed = str(files("mmembed.training").joinpath("ds_configs", f"{self.deepspeed}.json"))
        elif isinstance(self.deepspeed, str):
            _check_deepspeed_json(self.deepspeed)
        self.deepspeed = _honour_optimizer_under_offload(self.deepspeed, str(getattr(self.optim, "value", self.optim)))
        if self.deepspeed:
            one_process_group_env()
        self.device_defaults = device_defaults(self, _has_accelerator())
        if not _has_accelerator():
            # without use_cpu, accelerate starts the process group under torchrun but then treats
            # the run as single-process (no DDP, no data sharding); with it, CPU runs use gloo
            self.use_cpu = True
            self.dataloader_pin_memory = False  # pinning needs a GPU; on CPU it only warns
        if self.label_names is None:
            self.label_names = ["labels"]
        for flag in ("accelerator_config", "fsdp_config"):  # transformers opens them with errors that name no flag
            if isinstance(getattr(self, flag), str):
                _check_json_config(flag, getattr(self, flag))
        try:
            super().__post_init__()
        except (ValueError, TypeError, OSError, KeyError) as e:  # transformers' checks of its own flags
            raise UsageError(_naming_the_flag(self, e)) from e
        if _has_accelerator() and self.dataloader_pin_memory:
            self.accelerator_config.non_blocking = True  # pinned batches copy to the GPU while it computes
        if self.streaming:
            # each process reads the stream and keeps its share of every global batch
            # (accelerate's IterableDatasetShard): the collated batches are not sent from rank 0
            self.accelerator_config.dispatch_batches = False
        _check_report_to(self.report_to)


def _check_prefetch(args: SftArguments) -> None:
    """A prefetch needs workers; unset workers are decided by :func:`device_defaults`, which
    calls this again once they are known."""
    if args.dataloader_prefetch_factor is not None and args.dataloader_num_workers == 0:
        raise UsageError(f"--dataloader_prefetch_factor {args.dataloader_prefetch_factor} needs data-loader workers "
                         f"(--dataloader_num_workers > 0), got --dataloader_num_workers {args.dataloader_num_workers}")


def default_dataset_num_proc() -> int:
    """``--dataset_num_proc``'s default: the cores this process may run on, at most 8 (ms-swift's
    default is 1). Only one process per node reads the data (the others reuse its cache), so
    it may take them all."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, 8))


def _check_values(args: SftArguments) -> None:
    """Every numeric flag against :data:`LIMITS`, and the settings that would train nothing."""
    for flag, (ok, allowed) in LIMITS.items():
        value = getattr(args, flag)
        if value is not None and not ok(value):
            raise UsageError(f"--{flag} must be {allowed}, got {value!r}")
    if not (args.max_steps >= 1 or (math.isfinite(args.num_train_epochs) and args.num_train_epochs > 0)):
        raise UsageError(f"--num_train_epochs must be a number > 0 (or give --max_steps), got {args.num_train_epochs!r}")
    _check_prefetch(args)
    for flag in ("lr_scheduler_kwargs", "gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"):
        value = getattr(args, flag, None)
        if isinstance(value, str):  # transformers parses it later, with an error that names no flag
            try:
                value = json.loads(value)
            except ValueError as e:
                raise UsageError(f"--{flag} must be a JSON object, got {getattr(args, flag)!r} ({e})") from None
            if not isinstance(value, dict):
                raise UsageError(f"--{flag} must be a JSON object ({{\"name\": value, ...}}), got "
                                 f"{getattr(args, flag)!r}")
            setattr(args, flag, value)
    _check_scheduler_kwargs(args)


def _check_scheduler_kwargs(args: SftArguments) -> None:
    """The keys of ``--lr_scheduler_kwargs`` against the settings of the schedule
    ``--lr_scheduler_type`` names (transformers' ``get_scheduler`` passes them on): a wrong key
    would fail only when the scheduler is built, after the model loads; for the constant
    schedules, which take none, the log says they have no effect."""
    import inspect

    from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION
    from transformers.trainer_utils import SchedulerType

    given = args.lr_scheduler_kwargs
    if not given or not isinstance(given, dict):
        return
    name = SchedulerType(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    if name in (SchedulerType.CONSTANT, SchedulerType.CONSTANT_WITH_WARMUP):
        logging.getLogger("mmembed").info("--lr_scheduler_kwargs %s has no effect: the %s schedule takes no settings",
                                          json.dumps(given), name.value)
        return
    target = TYPE_TO_SCHEDULER_FUNCTION[name]
    if name == SchedulerType.REDUCE_ON_PLATEAU:
        import torch

        target = torch.optim.lr_scheduler.ReduceLROnPlateau
    params = inspect.signature(target).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return  # passed on again: nothing to check them against here
    settings = [k for k in params if k not in ("self", "optimizer", "num_warmup_steps", "num_training_steps")]
    wrong = [k for k in given if k not in settings]
    if wrong:
        raise UsageError(f"--lr_scheduler_kwargs: {', '.join(repr(k) for k in wrong)} "
                         f"{'is not a setting' if len(wrong) == 1 else 'are not settings'} of the {name.value} "
                         f"schedule (its settings: {', '.join(settings) or 'none'}; the warmup and the number of "
                         "steps come from --warmup_steps / --warmup_ratio and the run's length)")


def _check_streaming(args: SftArguments) -> None:
    """``--streaming``: the number of rows is unknown until they are read, so ``--max_steps``
    sets the length; the split and the row-aligned teacher files need every row up front."""
    if not args.streaming:
        return
    if args.max_steps < 1:
        raise UsageError("--streaming true needs --max_steps: the rows are read as training goes, so their number "
                         "(and the length of an epoch) is not known in advance")
    files = [f"--{f}" for f in ("teacher_scores_file", "teacher_embeddings_file") if getattr(args, f)]
    if files:
        raise UsageError(f"{' '.join(files)} cannot be used with --streaming true: the teacher's arrays are aligned "
                         "with the rows of the whole file; leave out --streaming, or give the signals in the rows")
    if args.split_dataset_ratio > 0:
        # ms-swift's rule: a stream cannot be split; --val_dataset evaluates instead
        logging.getLogger("mmembed").info("--streaming true: --split_dataset_ratio %s set to 0 (use --val_dataset)",
                                          args.split_dataset_ratio)
        args.split_dataset_ratio = 0.0


def _check_names(args: SftArguments) -> None:
    """The flags that take one of a set of names, and the template, before the model's config is read."""
    from ..encoding.templates import POOLINGS, get_template
    from ..model.embedding import check_torch_dtype

    check_torch_dtype(args.torch_dtype)
    choices = {
        "truncation_strategy": TRUNCATION_STRATEGIES,
        "padding_side": ("left", "right"),
        "pooling": POOLINGS,
        "attn_impl": ATTN_IMPLS,
        "lr_scheduler_type": tuple(s.value for s in SchedulerType),
        "eval_strategy": tuple(s.value for s in IntervalStrategy),
        # transformers passes it on when the compiled model is built, after the model loads
        "torch_compile_mode": TORCH_COMPILE_MODES,
    }
    for flag, allowed in choices.items():
        value = getattr(args, flag)
        value = getattr(value, "value", value)  # transformers' enums
        if value is not None and value not in allowed:
            raise UsageError(f"--{flag} must be one of {', '.join(allowed)}, got {value!r}")
    if args.torch_compile_backend is not None:
        from torch._dynamo import list_backends

        backends = list_backends(exclude_tags=())
        if args.torch_compile_backend not in backends:
            raise UsageError(f"--torch_compile_backend must be one of torch.compile's backends ({', '.join(backends)}), "
                             f"got {args.torch_compile_backend!r}")
    if args.attn_impl in ("flash_attn", "flash_attention_2") and importlib.util.find_spec("flash_attn") is None:
        raise UsageError(f"--attn_impl {args.attn_impl} needs the flash-attn package, which is not installed "
                         "(pip install flash-attn), or use --attn_impl sdpa")
    if args.attn_impl == "flex_attention" and not _has_accelerator():
        raise UsageError("--attn_impl flex_attention trains on a GPU only: torch's FlexAttention has no "
                         "backward pass on the CPU; use --attn_impl sdpa here")
    if args.use_liger_kernel and importlib.util.find_spec("liger_kernel") is None:
        raise UsageError("--use_liger_kernel true needs the liger-kernel package, which is not installed "
                         "(pip install liger-kernel)")
    if args.template or args.model_type:
        get_template(args.template, args.model_type)  # a name that is neither shipped nor a .toml file
    if not args.output_dir:
        raise UsageError("--output_dir must name a folder, got ''")


def _check_deepspeed_json(value: str) -> None:
    """``--deepspeed`` as a JSON file or inline JSON: it must parse to an object, so a typo is
    reported with the file's name and the place, not by DeepSpeed's loader."""
    config, where = _read_json_flag("deepspeed", value, f"--deepspeed {value!r} is not one of "
                                    f"{', '.join(DEEPSPEED_CONFIGS)} and not a JSON file")
    if not isinstance(config, dict):
        raise UsageError(f"{where} must hold a JSON object (DeepSpeed's config), got {type(config).__name__}")


def _check_json_config(flag: str, value: str) -> None:
    """A flag transformers takes as a JSON file or inline JSON (``--accelerator_config``,
    ``--fsdp_config``) and opens with errors that name no flag: it must hold a JSON object
    (for ``--accelerator_config``, of transformers' AcceleratorConfig settings)."""
    config, where = _read_json_flag(flag, value, f"--{flag} must be a JSON file or inline JSON "
                                    f"('{{\"name\": value, ...}}'), got {value!r}")
    if not isinstance(config, dict):
        raise UsageError(f"{where} must hold a JSON object, got {type(config).__name__}")
    if flag == "accelerator_config":
        from transformers.trainer_pt_utils import AcceleratorConfig

        known = AcceleratorConfig.__dataclass_fields__
        wrong = [k for k in config if k not in known]
        if wrong:
            raise UsageError(f"{where}: {', '.join(map(repr, wrong))} {'is not a setting' if len(wrong) == 1 else 'are not settings'} "
                             f"of transformers' AcceleratorConfig (its settings: {', '.join(known)})")


def _read_json_flag(flag: str, value: str, missing: str):
    """The JSON a flag gives inline (``{...}``) or in a file, and the words naming it for an
    error; ``missing`` is the error when it is neither inline JSON nor a file."""
    inline = value.lstrip().startswith("{")
    if not inline and not os.path.isfile(value):
        raise UsageError(missing)
    where = f"--{flag} {value!r}" if inline else f"--{flag} {value}"
    try:
        if inline:
            return json.loads(value), where
        with open(value, encoding="utf-8") as f:
            return json.load(f), where
    except json.JSONDecodeError as e:
        raise UsageError(f"{where} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{where} cannot be read ({e})") from None


def _naming_the_flag(args: SftArguments, error: BaseException) -> str:
    """transformers' error about one of its own flags, as one line that names the flag: its
    message as it is when it names one (``--logging_steps``), else prefixed by the flag it
    speaks of (a field's name in its words, or the value it refused: the word, the file)."""
    import dataclasses

    text = one_line(error)
    fields = [f for f in dataclasses.fields(args) if f.init]
    names = sorted((f.name for f in fields), key=len, reverse=True)
    if any(f"--{name}" in text for name in names):
        return text
    for name in names:  # `debug`, or a field name with an underscore in plain words (not "seed" in a sentence)
        if f"`{name}`" in text or ("_" in name and re.search(rf"(?<![\w-]){re.escape(name)}(?!\w)", text)):
            return f"--{name}: {text}"
    for f in fields:
        value = getattr(args, f.name)
        if not isinstance(value, str) or not value or value == f.default:
            continue
        words = [value, *value.split()]
        if getattr(error, "filename", None) == value or any(repr(w) in text for w in words):
            return f"--{f.name} {value!r}: {text}"
    return f"a training flag's value is refused by transformers: {text}"


def _check_report_to(report_to) -> None:
    """``--report_to`` names transformers' integrations; an unknown one would fail only when the
    Trainer is built, after the model loaded."""
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    for name in names:
        if name not in INTEGRATION_TO_CALLBACK and name not in ("all", "none"):
            raise UsageError(f"--report_to must name integrations among {', '.join(INTEGRATION_TO_CALLBACK)} "
                             f"(or all, none), got {name!r}")


def _check_swift_flags(args: SftArguments) -> None:
    """ms-swift's tuning, data and media flags that mmembed implements, checked at start."""
    import json

    from .swift_flags import log_no_effect_fields

    log_no_effect_fields(args)

    if args.sequence_parallel_size != 1:
        raise UsageError(f"--sequence_parallel_size {args.sequence_parallel_size}: sequence parallelism is not offered "
                         "(embedding inputs are short); cut memory with --gradcache_mini_batch_size, --max_length or "
                         "--deepspeed zero3 instead")
    if args.columns is not None:
        try:
            mapping = json.loads(args.columns)
        except json.JSONDecodeError as e:
            raise UsageError(f"--columns is not valid JSON ({e.msg}): {args.columns!r}") from None
        if not isinstance(mapping, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()):
            raise UsageError(f"--columns must be a JSON object of field names, old -> new, got {args.columns!r}")
    if args.lora_bias not in ("none", "all", "lora_only"):
        raise UsageError(f"--lora_bias must be none, all or lora_only, got {args.lora_bias!r}")
    if args.adapters and args.tuner_type != "lora":
        raise UsageError("--adapters continues a LoRA adapter (--tuner_type lora); for full training merge it first "
                         "(mmembed export --adapters CKPT) and pass the merged folder as --model")
    if len(args.adapters) > 1:
        raise UsageError(f"--adapters takes one adapter to train on, got {len(args.adapters)}")
    if args.resume_only_model and not args.resume_from_checkpoint:
        raise UsageError("--resume_only_model true needs --resume_from_checkpoint (the checkpoint whose weights to load)")
    init = args.init_weights.lower()
    if init not in LORA_INITS and not re.fullmatch(r"pissa_niter_\d+", init):
        raise UsageError(f"--init_weights must be one of {', '.join(LORA_INITS)} or pissa_niter_N, "
                         f"got {args.init_weights!r}")
    if args.target_regex is not None:
        try:
            re.compile(args.target_regex)
        except re.error as e:
            raise UsageError(f"--target_regex {args.target_regex!r} is not a regular expression ({e})") from None
    if args.max_pixels is not None:
        # the run's media settings take the flag for MAX_PIXELS (mmembed.training.preflight.media_settings)
        env = read_environment().get("MAX_PIXELS")
        if env is not None and env.strip() and env.strip() != str(args.max_pixels):
            logging.getLogger("mmembed").warning("--max_pixels %d wins over MAX_PIXELS=%s", args.max_pixels, env)
    # the training rows' sampler (mmembed.training.samplers); its checks against the data come when the data is read
    from .samplers import BATCH_SAMPLERS, MULTI_DATASET_SAMPLERS

    if args.multi_dataset_sampler not in MULTI_DATASET_SAMPLERS:
        raise UsageError(f"--multi_dataset_sampler must be one of {', '.join(MULTI_DATASET_SAMPLERS)}, "
                         f"got {args.multi_dataset_sampler!r}")
    if args.batch_sampler not in BATCH_SAMPLERS:
        raise UsageError(f"--batch_sampler must be one of {', '.join(BATCH_SAMPLERS)}, got {args.batch_sampler!r}")
    if args.stopping_strategy not in ("first_exhausted", "all_exhausted"):
        raise UsageError(f"--stopping_strategy must be first_exhausted or all_exhausted, got {args.stopping_strategy!r}")
    if args.interleave_prob is not None:
        probs = list(args.interleave_prob)
        if not probs or not all(math.isfinite(p) and p >= 0 for p in probs) or sum(probs) <= 0:
            raise UsageError(f"--interleave_prob takes one probability >= 0 per dataset, with a positive sum, "
                             f"got {' '.join(str(p) for p in probs)}")
        if args.multi_dataset_sampler != "mixed":
            raise UsageError(f"--interleave_prob draws each row from a dataset (ms-swift's mixed order); with "
                             f"--multi_dataset_sampler {args.multi_dataset_sampler} each global batch comes from one "
                             "dataset, drawn by the sampler's rule (weighted: by each dataset's weight): leave out "
                             "--interleave_prob, or use --multi_dataset_sampler mixed")
    elif args.stopping_strategy != "first_exhausted":
        if args.multi_dataset_sampler != "mixed":
            raise UsageError(f"--stopping_strategy {args.stopping_strategy} applies to --interleave_prob under "
                             f"--multi_dataset_sampler mixed; --multi_dataset_sampler {args.multi_dataset_sampler} "
                             "decides itself when an epoch ends (see the README): leave it out")
        logging.getLogger("mmembed").info("--stopping_strategy %s has no effect without --interleave_prob (the "
                                          "datasets are concatenated)", args.stopping_strategy)
    if args.streaming and (args.multi_dataset_sampler != "mixed" or args.batch_sampler != "default"
                           or args.interleave_prob is not None):
        raise UsageError("--streaming true reads the rows as training consumes them; --multi_dataset_sampler "
                         f"{args.multi_dataset_sampler}, --batch_sampler {args.batch_sampler} and --interleave_prob "
                         "need every dataset's rows up front: leave out --streaming (or these flags)")


def _check_dataset_config(args: SftArguments) -> None:
    """``--dataset_config``: read and checked now (:func:`~mmembed.data.dataset_config.read_dataset_config`),
    its datasets kept as ``args.dataset_entries`` (empty without it); the flags it replaces
    are refused beside it. ``--eval_beir`` is checked here too (its ``name=folder`` pairs)."""
    from ..data.dataset_config import ConfigError, read_dataset_config

    args.dataset_entries = []
    beir_pairs(args.eval_beir)
    if not args.dataset_config:
        return
    if args.dataset:
        raise UsageError(f"--dataset and --dataset_config {args.dataset_config} both give training data: use one. "
                         "With --dataset_config every dataset is listed in the file (its 'path'); leave out --dataset")
    if args.val_dataset:
        raise UsageError("--val_dataset cannot be used with --dataset_config: give each dataset its validation rows "
                         "in the file ('val'), which also makes its eval_<name>_* metrics")
    if args.streaming:
        raise UsageError("--streaming true cannot be used with --dataset_config: its datasets are read whole "
                         "(their sizes set the samplers' shares); leave out --streaming")
    files = [f"--{f}" for f in ("teacher_scores_file", "teacher_embeddings_file") if getattr(args, f)]
    if files:
        raise UsageError(f"{' '.join(files)} cannot be used with --dataset_config (they align with --dataset's "
                         "files); give the teacher's signals in the rows, or use --dataset")
    try:
        args.dataset_entries = read_dataset_config(args.dataset_config)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    for flag, task in (("--eval_sts", "sts"), ("--eval_beir", "beir")):  # eval_<task>_* would mean both
        if getattr(args, flag[2:]) and any(e.name == task for e in args.dataset_entries):
            raise UsageError(str(ConfigError(os.path.abspath(args.dataset_config), task, "name",
                                             f"with {flag} the dataset's eval_{task}_* metrics would mix with the "
                                             f"task's: name the dataset otherwise")))


def beir_pairs(values: list[str]) -> list[tuple[str | None, str]]:
    """``--eval_beir``'s values as ``(name, folder)``: ``name=folder`` pairs, or one folder
    alone (name None). A folder whose own name holds '=' is taken whole when it exists."""
    pairs: list[tuple[str | None, str]] = []
    values = [values] if isinstance(values, str) else list(values or [])
    for value in values:
        name, sep, folder = value.partition("=")
        if not sep or os.path.isdir(value):
            pairs.append((None, value))
        elif not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", name) or not folder:
            raise UsageError(f"--eval_beir {value!r}: expected name=folder (a name of letters, digits, '_' and '-')")
        else:
            pairs.append((name, folder))
    names = [n for n, _ in pairs]
    if len(pairs) > 1 and None in names:
        raise UsageError(f"--eval_beir {' '.join(values)}: with several folders name each one (name=folder)")
    if len(set(names)) < len(names):
        raise UsageError(f"--eval_beir {' '.join(values)}: a name is given twice")
    return pairs


def _check_loss_args(args: SftArguments) -> None:
    """What can be checked of the loss flags before anything loads; what depends on the
    loss's declarations is checked by :func:`check_side_flags` once it is built."""
    import json

    from ..losses import loss_class

    try:
        loss_class(args.loss_type)  # an unknown name, or a module:Class that does not import
    except ValueError as e:
        raise UsageError(f"--loss_type {args.loss_type!r}: {e}") from None
    files = [f for f in ("teacher_scores_file", "teacher_embeddings_file") if getattr(args, f)]
    if files and args.teacher_model:
        raise UsageError(f"--teacher_model and --{files[0]} both give the teacher; keep one")
    if args.loss_kwargs is not None:
        try:
            parsed = json.loads(args.loss_kwargs)
        except json.JSONDecodeError as e:
            raise UsageError(f"--loss_kwargs is not valid JSON ({e.msg}): {args.loss_kwargs!r}") from None
        if not isinstance(parsed, dict):
            raise UsageError(f"--loss_kwargs must be a JSON object, got {args.loss_kwargs!r}")
    if args.mrl_dims is not None:
        from ..losses.matryoshka import parse_dims

        try:
            parse_dims(args.mrl_dims)  # the parser the loss uses: its errors, at start
        except ValueError as e:
            raise UsageError(f"--{e}" if str(e).startswith("mrl_dims") else f"--mrl_dims {args.mrl_dims!r}: {e}") from None


def check_side_flags(args: SftArguments, side) -> None:
    """The side-input flags against what the loss takes (its ``side``, a
    :class:`mmembed.losses.SideNeeds`), before any model loads: the rule is
    :meth:`SideNeeds.mismatch <mmembed.losses.SideNeeds.mismatch>` (the one the loss's own
    start-up check uses), worded here in flags. A teacher the loss needs may still come with
    the data's rows, so its absence is not checked here."""
    from ..losses.base import SideMismatch

    name = args.loss_type
    files = [f for f in ("teacher_scores_file", "teacher_embeddings_file") if getattr(args, f)]
    signal = "scores" if args.teacher_scores_file else "embeddings" if files or args.teacher_model else None
    problem = side.mismatch(bool(args.guide_model), signal, teacher_known=False)
    if problem is SideMismatch.NEEDS_GUIDE:
        raise UsageError(f"--loss_type {name} needs --guide_model (the model whose similarities filter the negatives)")
    if problem is SideMismatch.TAKES_NO_GUIDE:
        raise UsageError(f"--guide_model is for losses that take a guide (gist), but --loss_type {name} takes none")
    flag = files[0] if files else "teacher_model"
    if problem is SideMismatch.TAKES_NO_TEACHER:
        raise UsageError(f"--{flag} feeds the distillation losses (those that take a teacher), "
                         f"but --loss_type {name} takes none")
    if problem is SideMismatch.OTHER_TEACHER_SIGNAL:
        takes = " or ".join(sorted(side.teacher))
        if signal == "scores":
            raise UsageError(f"--teacher_scores_file: --loss_type {name} takes the teacher's {takes}, not scores "
                             "(distill_kl takes scores with --loss_kwargs '{\"use_batch\": false}')")
        raise UsageError(f"--{flag}: --loss_type {name} takes the teacher's {takes}, not embeddings")


def _honour_optimizer_under_offload(deepspeed, optim: str):
    """With the optimizer offloaded to the CPU, DeepSpeed replaces the chosen optimizer by its
    own CPU Adam. That is the same algorithm for AdamW (and faster), so it stays; for any
    other ``--optim`` the config is told to keep the chosen one."""
    import json

    if not deepspeed or optim.startswith("adamw"):
        return deepspeed
    config = deepspeed
    if isinstance(deepspeed, str):
        if deepspeed.lstrip().startswith("{"):
            config = json.loads(deepspeed)
        else:
            with open(deepspeed, encoding="utf-8") as f:
                config = json.load(f)
    offload = (config.get("zero_optimization") or {}).get("offload_optimizer") or {}
    if offload.get("device") not in ("cpu", "nvme") or "zero_force_ds_cpu_optimizer" in config:
        return deepspeed
    return {**config, "zero_force_ds_cpu_optimizer": False}


def one_process_group_env() -> bool:
    """A single process under DeepSpeed (no torchrun) gets the variables torchrun would give
    it (rank 0 of 1, a free local port). Without them DeepSpeed looks for an MPI launcher and
    fails with "No module named 'mpi4py'"; ms-swift starts torchrun even for one process.
    Returns whether anything was set; a process started by a launcher is left alone."""
    if read_environment().launch.in_process_group:
        return False
    import socket

    with socket.socket() as s:  # the port is picked here and bound by the process group moments later
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    export({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"},
           defaults={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    return True


def device_defaults(args: SftArguments, cuda: bool) -> list[str]:
    """Fill the flags left unset whose best value depends on the device, and return them as
    ``--flag value`` for the log. What helps on a few CPU cores does not on a GPU: there the
    padding cut by length chunks costs more in host syncs, launches and new shapes than it
    saves, data preparation must overlap the GPU's work, and bf16 is ms-swift's default.

    - ``--torch_dtype``: float32 on a CPU. On a GPU, LoRA loads the frozen base in half
      precision (the model's float16, else bfloat16, as ms-swift); full training keeps
      float32 weights. Both then compute under ``--bf16`` autocast (``--fp16`` without bf16).
    - ``--length_chunks``: 4 on a CPU, 1 on a GPU; ``--length_buckets``: on a GPU only.
    - ``--dataloader_num_workers``: 0 on a CPU (no spare core); on a GPU up to 4, leaving
      one core per process to the trainer, with ``--dataloader_persistent_workers`` and a
      prefetch of 4 batches.
    """
    chosen: list[str] = []

    def choose(flag: str, value) -> None:
        setattr(args, flag, value)
        chosen.append(f"--{flag} {str(value).lower() if isinstance(value, bool) else value}")

    if args.length_chunks is None:
        choose("length_chunks", 1 if cuda else 4)
    if args.length_buckets is None:
        choose("length_buckets", cuda)
    if args.dataloader_num_workers is None:
        workers = 0
        if cuda:
            local = read_environment().launch.local_processes
            workers = max(0, min(4, (os.cpu_count() or 1) // max(local, 1) - 1))
        choose("dataloader_num_workers", workers)
        if workers and args.dataloader_prefetch_factor is None:
            choose("dataloader_prefetch_factor", 4)
        if workers and not args.dataloader_persistent_workers:
            choose("dataloader_persistent_workers", True)
        _check_prefetch(args)
    if cuda and args.torch_dtype is None:
        # LoRA: the frozen base in the model's half precision (ms-swift's default); full
        # training keeps float32 master weights under bf16 autocast, since AdamW steps of a
        # small learning rate round away in bfloat16 weights (ms-swift trains them in bf16)
        choose("torch_dtype", _gpu_dtype(args.model) if args.tuner_type == "lora" else "float32")
    if cuda and not (args.bf16 or args.fp16) and args.torch_dtype in ("bfloat16", "float32", None):
        import torch

        if torch.cuda.is_bf16_supported():
            choose("bf16", True)
        elif args.torch_dtype == "float32":
            choose("fp16", True)
    return chosen


def _gpu_dtype(model_dir: str | None) -> str:
    """ms-swift's default dtype on a GPU: the half precision the model was saved in, else
    bfloat16 (float16 where the GPU has no bfloat16)."""
    import json

    import torch

    try:
        with open(os.path.join(model_dir or "", "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        config = {}
    saved = config.get("dtype") or config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
    if saved == "float16" or not torch.cuda.is_bf16_supported():
        return "float16"
    return "bfloat16"


def default_gradient_accumulation(per_device_batch: int, world_size: int) -> int:
    """ms-swift's default: accumulate up to a global batch of 16 rows."""
    return max(1, math.ceil(16 / per_device_batch / world_size))


def _has_accelerator() -> bool:
    import torch

    return torch.cuda.is_available()


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
