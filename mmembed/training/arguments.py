"""Command-line arguments, parsed once into dataclasses (ms-swift's flag names and defaults).

``SftArguments`` extends ``transformers.TrainingArguments`` with ms-swift's embedding flags.
Flags left out take ms-swift 4.x's ``sft`` defaults, so the same script trains the same
way: cosine schedule, weight decay 0.1, Adam beta2 0.95, learning rate 1e-4 for LoRA and
1e-5 for full training, gradient checkpointing on, a global batch of 16 through gradient
accumulation when ``--gradient_accumulation_steps`` is not given, and over-long rows
deleted (``--truncation_strategy delete``).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from importlib.resources import files

from transformers import HfArgumentParser, TrainingArguments

TUNER_TYPES = ("lora", "full")
DEEPSPEED_CONFIGS = ("zero2", "zero2_offload", "zero3", "zero3_offload")
# transformers >= 5.23 calls gradient checkpointing "activation checkpointing"
RENAMED_CHECKPOINTING = "activation_checkpointing" in TrainingArguments.__dataclass_fields__
TRUNCATION_STRATEGIES = ("delete", "left", "right")


class UsageError(ValueError):
    """Flags that cannot work together, found once the model is known (e.g. a Matryoshka width
    above the model's): reported as one line before training starts."""


@dataclass
class SftArguments(TrainingArguments):
    # model and template
    model: str | None = field(default=None, metadata={"help": "local model folder"})
    model_type: str | None = field(default=None, metadata={"help": "ms-swift model type (picks the template)"})
    template: str | None = field(default=None, metadata={"help": "template name from templates/"})
    task_type: str = field(default="embedding", metadata={"help": "must be 'embedding'"})
    torch_dtype: str | None = field(default=None, metadata={"help": "float32 | bfloat16 | float16 (default float32)"})
    attn_impl: str | None = field(default=None, metadata={"help": "sdpa | eager | flash_attn"})
    padding_side: str | None = field(default=None, metadata={"help": "left | right (default: the template's)"})
    pooling: str | None = field(default=None, metadata={"help": "override the template's pooling: last | mean | cls | max"})
    length_chunks: int | None = field(default=None, metadata={"help": "embed text batches in up to N length-sorted chunks, each padded to its own longest row (1: off; default 4 on a CPU, 1 on a GPU)"})
    gradcache_mini_batch_size: int = field(default=0, metadata={"help": "embed each batch in chunks of N rows with a gradient cache (0: off)"})
    system: str | None = field(default=None, metadata={"help": "system prompt for rows that give none"})
    max_length: int | None = field(default=None, metadata={"help": "maximum tokens per input (default: the model's)"})
    truncation_strategy: str = field(default="delete", metadata={"help": "delete | left | right"})
    # tuning
    tuner_type: str | None = field(default=None, metadata={"help": "lora | full (ms-swift >= 3.9 spelling)"})
    train_type: str | None = field(default=None, metadata={"help": "lora | full (older ms-swift spelling)"})
    lora_rank: int = 8
    lora_alpha: int = 32
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
    padding_free: bool = field(default=False, metadata={"help": "accepted for ms-swift scripts; text batches are cut to their length chunks instead"})
    # data
    dataset: list[str] = field(default_factory=list, metadata={"help": "data files / folders, path#N samples N rows"})
    columns: str | None = field(default=None, metadata={"help": "rename row fields before reading, as JSON: '{\"text1\": \"query\", \"text2\": \"response\"}'"})
    val_dataset: list[str] = field(default_factory=list)
    split_dataset_ratio: float = 0.0
    dataset_shuffle: bool = field(default=True, metadata={"help": "shuffle the training rows once after loading (ms-swift's); the sampler shuffles each epoch too"})
    val_dataset_shuffle: bool = field(default=False, metadata={"help": "shuffle the --val_dataset rows"})
    data_seed: int | None = field(default=42, metadata={"help": "seed of the split, #N sampling, --dataset_shuffle and the sampler (ms-swift's default 42; not --seed)"})
    strict: bool = field(default=True, metadata={"help": "false: skip broken rows and report them"})
    offline: bool = field(default=False, metadata={"help": "fetch no http(s) media (as MMEMBED_OFFLINE=1 or HF_HUB_OFFLINE=1): a URL not in the media cache is an error"})
    lazy_tokenize: bool = True
    load_from_cache_file: bool = True
    dataset_num_proc: int = 1
    loss_type: str = "infonce"
    loss_kwargs: str | None = field(default=None, metadata={"help": "options of the loss as JSON, e.g. '{\"margin\": 0.05}'"})
    mrl_dims: str | None = field(default=None, metadata={"help": "Matryoshka: '{\"64\": 1.0, \"128\": 1.0}' (width: weight)"})
    eval_beir: str | None = field(default=None, metadata={"help": "also evaluate retrieval on this BEIR folder at every evaluation"})
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
    gradient_accumulation_steps: int | None = None  # type: ignore[assignment]
    remove_unused_columns: bool = False

    @property
    def checkpointing(self) -> bool:
        """Whether activation (gradient) checkpointing is on, whichever name this transformers uses."""
        return bool(self.activation_checkpointing if RENAMED_CHECKPOINTING else self.gradient_checkpointing)

    def __post_init__(self):
        if self.task_type != "embedding":
            raise ValueError(f"--task_type {self.task_type!r}: mmembed trains embedding models only (--task_type embedding)")
        if not self.model:
            raise ValueError("--model is required (a local model folder)")
        if self.tuner_type and self.train_type and self.tuner_type != self.train_type:
            raise ValueError(f"--tuner_type {self.tuner_type} and --train_type {self.train_type} disagree")
        self.tuner_type = self.tuner_type or self.train_type or "lora"
        self.train_type = self.tuner_type
        if self.tuner_type not in TUNER_TYPES:
            raise ValueError(f"--tuner_type must be one of {TUNER_TYPES}, got {self.tuner_type!r}")
        _check_loss_args(self)
        _check_swift_flags(self)
        if self.gradcache_mini_batch_size < 0:
            raise ValueError(f"--gradcache_mini_batch_size must be >= 0, got {self.gradcache_mini_batch_size}")
        if self.truncation_strategy not in TRUNCATION_STRATEGIES:
            raise ValueError(f"--truncation_strategy must be one of {TRUNCATION_STRATEGIES}, got {self.truncation_strategy!r}")
        if self.padding_side not in (None, "left", "right"):
            raise ValueError(f"--padding_side must be left or right, got {self.padding_side!r}")
        if not 0.0 <= self.split_dataset_ratio < 1.0:
            raise ValueError(f"--split_dataset_ratio must be in [0, 1), got {self.split_dataset_ratio}")
        if self.learning_rate is None:
            self.learning_rate = 1e-4 if self.tuner_type == "lora" else 1e-5
        if self.gradient_accumulation_steps is None:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            self.gradient_accumulation_steps = default_gradient_accumulation(self.per_device_train_batch_size, world)
        if self.warmup_ratio is not None:  # transformers 5 folded warmup_ratio into a fractional warmup_steps
            if not 0.0 <= self.warmup_ratio < 1.0:
                raise ValueError(f"--warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
            if self.warmup_steps:
                raise ValueError("pass --warmup_ratio or --warmup_steps, not both")
            self.warmup_steps = self.warmup_ratio
        has_val = bool(self.val_dataset) or self.split_dataset_ratio > 0 or bool(self.eval_beir) or bool(self.eval_sts)
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
        elif isinstance(self.deepspeed, str) and not self.deepspeed.lstrip().startswith("{") and not os.path.isfile(self.deepspeed):
            raise ValueError(f"--deepspeed {self.deepspeed!r}: not one of {DEEPSPEED_CONFIGS} and not a JSON file")
        self.deepspeed = _honour_optimizer_under_offload(self.deepspeed, str(getattr(self.optim, "value", self.optim)))
        if self.deepspeed:
            one_process_group_env(os.environ)
        if not _has_accelerator():
            # without use_cpu, accelerate starts the process group under torchrun but then treats
            # the run as single-process (no DDP, no data sharding); with it, CPU runs use gloo
            self.use_cpu = True
            self.dataloader_pin_memory = False  # pinning needs a GPU; on CPU it only warns
        if self.label_names is None:
            self.label_names = ["labels"]
        super().__post_init__()


def _check_swift_flags(args: "SftArguments") -> None:
    """ms-swift's tuning, data and media flags that mmembed implements, checked at start."""
    import json

    if args.sequence_parallel_size != 1:
        raise ValueError(f"--sequence_parallel_size {args.sequence_parallel_size}: sequence parallelism is not offered "
                         "(embedding inputs are short); cut memory with --gradcache_mini_batch_size, --max_length or "
                         "--deepspeed zero3 instead")
    if args.columns is not None:
        try:
            mapping = json.loads(args.columns)
        except json.JSONDecodeError as e:
            raise ValueError(f"--columns is not valid JSON ({e.msg}): {args.columns!r}") from None
        if not isinstance(mapping, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()):
            raise ValueError(f"--columns must be a JSON object of field names, old -> new, got {args.columns!r}")
    if args.lora_bias not in ("none", "all", "lora_only"):
        raise ValueError(f"--lora_bias must be none, all or lora_only, got {args.lora_bias!r}")
    if args.adapters and args.tuner_type != "lora":
        raise ValueError("--adapters continues a LoRA adapter (--tuner_type lora); for full training merge it first "
                         "(mmembed export --adapters CKPT) and pass the merged folder as --model")
    if len(args.adapters) > 1:
        raise ValueError(f"--adapters takes one adapter to train on, got {len(args.adapters)}")
    if args.resume_only_model and not args.resume_from_checkpoint:
        raise ValueError("--resume_only_model needs --resume_from_checkpoint (the checkpoint whose weights to load)")
    for flag in ("vit_lr", "aligner_lr"):
        value = getattr(args, flag)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"--{flag} must be a finite number >= 0, got {value}")
    if args.max_pixels is not None:
        if args.max_pixels <= 0:
            raise ValueError(f"--max_pixels must be > 0, got {args.max_pixels}")
        env = os.environ.get("MAX_PIXELS")
        if env is not None and env.strip() and env.strip() != str(args.max_pixels):
            logging.getLogger("mmembed").warning("--max_pixels %d wins over MAX_PIXELS=%s", args.max_pixels, env)
        # the media loader reads the budget where ms-swift's contract puts it: the variable
        os.environ["MAX_PIXELS"] = str(args.max_pixels)


def _check_loss_args(args: "SftArguments") -> None:
    """What can be checked of the loss flags before anything loads; what depends on the
    loss's declarations is checked by :func:`check_side_flags` once it is built."""
    import json

    from ..losses import loss_class

    loss_class(args.loss_type)  # an unknown name, or a module:Class that does not import
    files = [f for f in ("teacher_scores_file", "teacher_embeddings_file") if getattr(args, f)]
    if files and args.teacher_model:
        raise ValueError(f"--teacher_model and --{files[0]} both give the teacher; keep one")
    if args.loss_kwargs is not None:
        try:
            parsed = json.loads(args.loss_kwargs)
        except json.JSONDecodeError as e:
            raise ValueError(f"--loss_kwargs is not valid JSON ({e.msg}): {args.loss_kwargs!r}") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"--loss_kwargs must be a JSON object, got {args.loss_kwargs!r}")
    if args.mrl_dims is not None:
        from ..losses.matryoshka import parse_dims

        parse_dims(args.mrl_dims)  # the parser the loss uses: its errors, at start


def check_side_flags(args: "SftArguments", side) -> None:
    """The side-input flags against what the loss takes (its ``side``, a
    :class:`mmembed.losses.SideNeeds`), before any model loads."""
    name = args.loss_type
    if side.guide and not args.guide_model:
        raise UsageError(f"--loss_type {name} needs --guide_model (the model whose similarities filter the negatives)")
    if args.guide_model and not side.guide:
        raise UsageError(f"--guide_model is for losses that take a guide (gist), but --loss_type {name} takes none")
    files = [f for f in ("teacher_scores_file", "teacher_embeddings_file") if getattr(args, f)]
    if (files or args.teacher_model) and not side.teacher:
        flag = files[0] if files else "teacher_model"
        raise UsageError(f"--{flag} feeds the distillation losses (those that take a teacher), "
                         f"but --loss_type {name} takes none")
    if args.teacher_scores_file and "scores" not in side.teacher:
        raise UsageError(f"--teacher_scores_file: --loss_type {name} takes the teacher's "
                         f"{' or '.join(sorted(side.teacher))}, not scores (distill_kl takes scores with "
                         "--loss_kwargs '{\"use_batch\": false}')")


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


def one_process_group_env(environ) -> bool:
    """A single process under DeepSpeed (no torchrun) gets the variables torchrun would give
    it (rank 0 of 1, a free local port). Without them DeepSpeed looks for an MPI launcher and
    fails with "No module named 'mpi4py'"; ms-swift starts torchrun even for one process.
    Returns whether anything was set; a process started by a launcher is left alone."""
    if any(k in environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return False
    import socket

    with socket.socket() as s:  # the port is picked here and bound by the process group moments later
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    environ.setdefault("MASTER_ADDR", "127.0.0.1")
    environ.setdefault("MASTER_PORT", str(port))
    return True


def default_gradient_accumulation(per_device_batch: int, world_size: int) -> int:
    """ms-swift's default: accumulate up to a global batch of 16 rows."""
    return max(1, math.ceil(16 / per_device_batch / world_size))


def _has_accelerator() -> bool:
    import torch

    return torch.cuda.is_available()


def parse_sft_args(argv: list[str]) -> SftArguments:
    """Parse ``mmembed sft`` flags; an unknown flag is an error that names it. ms-swift flags
    with no effect here are dropped with a logged line; refused ones raise
    :class:`~mmembed.training.swift_flags.RefusedFlag` (see ``swift_flags``)."""
    import dataclasses

    from .swift_flags import take_swift_flags

    argv = take_swift_flags(list(argv), {f.name for f in dataclasses.fields(SftArguments)})
    parser = HfArgumentParser(SftArguments, allow_abbrev=False, prog="mmembed sft")
    args, rest = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if rest:
        unknown = [r for r in rest if r.startswith("-")] or rest
        raise SystemExit(f"mmembed sft: unknown flag(s): {' '.join(unknown)} (see `mmembed sft --help`)")
    if not args.dataset:
        raise SystemExit("mmembed sft: --dataset is required")
    return args
