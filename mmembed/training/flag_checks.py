"""mmembed's own validation of ``mmembed sft``'s flags (:class:`~mmembed.training.sft_flags.SftFlags`
is the table of the flags; :class:`~mmembed.training.arguments.SftArguments`' ``__post_init__``
calls these): what each value allows
(:data:`LIMITS` and the name tables), the combinations that cannot work, ms-swift's flags
with a changed meaning, the dataset config file's presence, the device defaults (what a GPU
changes), and the DeepSpeed configs by ms-swift's names. Each failure is one
:class:`~mmembed.errors.UsageError` naming the flag and its value.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re

from transformers.trainer_utils import IntervalStrategy, SchedulerType

from ..environment import read as read_environment
from ..errors import UsageError, one_line
from .sft_flags import SftFlags

TUNER_TYPES = ("lora", "full")
DEEPSPEED_CONFIGS = ("zero2", "zero2_offload", "zero3", "zero3_offload")
TRUNCATION_STRATEGIES = ("delete", "left", "right")
# ms-swift's --attn_impl names (flash_attn: FlashAttention 2) and transformers' own
# and mmembed's varlen (PyTorch's own FlashAttention kernel for packed batches: model/varlen_attention.py)
ATTN_IMPLS = ("sdpa", "eager", "flash_attn", "flash_attention_2", "flash_attention_3", "flex_attention", "varlen")
# --packing_strategy values (ms-swift's; mmembed.training.sample_packs)
PACKING_STRATEGIES = ("binpack", "sequential")
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


def check_prefetch(args: SftFlags) -> None:
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


def check_values(args: SftFlags) -> None:
    """Every numeric flag against :data:`LIMITS`, and the settings that would train nothing."""
    for flag, (ok, allowed) in LIMITS.items():
        value = getattr(args, flag)
        if value is not None and not ok(value):
            raise UsageError(f"--{flag} must be {allowed}, got {value!r}")
    if not (args.max_steps >= 1 or (math.isfinite(args.num_train_epochs) and args.num_train_epochs > 0)):
        raise UsageError(f"--num_train_epochs must be a number > 0 (or give --max_steps), got {args.num_train_epochs!r}")
    check_prefetch(args)
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
    check_scheduler_kwargs(args)


def check_scheduler_kwargs(args: SftFlags) -> None:
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


def check_streaming(args: SftFlags) -> None:
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


def check_packing(args: SftFlags) -> None:
    """``--packing`` (mmembed.training.sample_packs): its settings' values, and what cannot go with it."""
    if args.packing_length is not None and args.packing_length < 1:
        raise UsageError(f"--packing_length must be a positive number of tokens, got {args.packing_length}")
    if args.packing_strategy not in PACKING_STRATEGIES:
        raise UsageError(f"--packing_strategy must be one of {', '.join(PACKING_STRATEGIES)}, got {args.packing_strategy!r}")
    if args.packing_num_proc < 1:
        raise UsageError(f"--packing_num_proc must be >= 1, got {args.packing_num_proc}")
    if not args.packing:
        return
    if args.streaming:
        raise UsageError("--packing true packs the rows by their lengths, measured before training; --streaming true "
                         "reads them as training consumes them: leave out one of the two")
    if args.interleave_prob is not None:
        raise UsageError("--packing true packs the rows of the datasets concatenated; --interleave_prob draws each "
                         "row from a dataset by chance: leave out one of the two")
    if str(args.multi_dataset_sampler) != "mixed" or str(args.batch_sampler) != "default":
        raise UsageError("--packing true draws packs of rows in ms-swift's order; --multi_dataset_sampler "
                         f"{args.multi_dataset_sampler} / --batch_sampler {args.batch_sampler} draw rows one by one: use "
                         "--multi_dataset_sampler mixed --batch_sampler default with it")


def check_names(args: SftFlags) -> None:
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
        if has_accelerator():
            # PyTorch's own FlashAttention kernel does the work flash-attn would: packed batches by
            # spans (torch.nn.attention.varlen), SDPA for the rest
            logging.getLogger("mmembed").warning("--attn_impl %s: the flash-attn package is not installed; training with "
                                                 "--attn_impl varlen (PyTorch's own FlashAttention kernel)", args.attn_impl)
            args.attn_impl = "varlen"
        else:
            # FlashAttention runs on CUDA GPUs only: a script written for GPUs (ms-swift's examples
            # pass --attn_impl flash_attn) runs on a machine without one under SDPA, the same attention
            logging.getLogger("mmembed").warning("--attn_impl %s: no GPU here (FlashAttention runs on CUDA GPUs only); "
                                                 "training with --attn_impl sdpa, the same attention", args.attn_impl)
            args.attn_impl = "sdpa"
    if args.attn_impl == "flex_attention" and not has_accelerator():
        raise UsageError("--attn_impl flex_attention trains on a GPU only: torch's FlexAttention has no "
                         "backward pass on the CPU; use --attn_impl sdpa here")
    if args.use_liger_kernel and importlib.util.find_spec("liger_kernel") is None:
        raise UsageError("--use_liger_kernel true needs the liger-kernel package, which is not installed "
                         "(pip install liger-kernel)")
    if args.template or args.model_type:
        # a name that is neither shipped nor a .toml file; a reranker run's names are searched
        # among the reranker templates (ms-swift's `--model_type qwen3_reranker --task_type
        # generative_reranker`)
        from ..task import get_task

        get_template(args.template, args.model_type, task=get_task(args.task_type).template_task)
    if not args.output_dir:
        raise UsageError("--output_dir must name a folder, got ''")


def bundled_deepspeed_config(name: str) -> str:
    """The file of a bundled DeepSpeed config named as ms-swift names them (:data:`DEEPSPEED_CONFIGS`)."""
    from importlib.resources import files

    return str(files("mmembed.training").joinpath("ds_configs", f"{name}.json"))


def check_deepspeed_json(value: str) -> None:
    """``--deepspeed`` as a JSON file or inline JSON: it must parse to an object, so a typo is
    reported with the file's name and the place, not by DeepSpeed's loader."""
    read_deepspeed_json(value)


def read_deepspeed_json(value: str) -> dict:
    """The config of ``--deepspeed`` given as a JSON file or inline JSON; a UsageError naming
    the file and the place when it is neither, does not parse, or holds no JSON object."""
    config, where = read_json_flag("deepspeed", value, f"--deepspeed {value!r} is not one of "
                                    f"{', '.join(DEEPSPEED_CONFIGS)} and not a JSON file")
    if not isinstance(config, dict):
        raise UsageError(f"{where} must hold a JSON object (DeepSpeed's config), got {type(config).__name__}")
    return config


def check_json_config(flag: str, value: str) -> None:
    """A flag transformers takes as a JSON file or inline JSON (``--accelerator_config``,
    ``--fsdp_config``) and opens with errors that name no flag: it must hold a JSON object
    (for ``--accelerator_config``, of transformers' AcceleratorConfig settings)."""
    config, where = read_json_flag(flag, value, f"--{flag} must be a JSON file or inline JSON "
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


def read_json_flag(flag: str, value: str, missing: str):
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


def naming_the_flag(args: SftFlags, error: BaseException) -> str:
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


def check_report_to(report_to) -> None:
    """``--report_to`` names transformers' integrations; an unknown one would fail only when the
    Trainer is built, after the model loaded."""
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    for name in names:
        if name not in INTEGRATION_TO_CALLBACK and name not in ("all", "none"):
            raise UsageError(f"--report_to must name integrations among {', '.join(INTEGRATION_TO_CALLBACK)} "
                             f"(or all, none), got {name!r}")


def check_swift_flags(args: SftFlags) -> None:
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
                             "decides itself when an epoch ends (see docs/datasets.md): leave it out")
        logging.getLogger("mmembed").info("--stopping_strategy %s has no effect without --interleave_prob (the "
                                          "datasets are concatenated)", args.stopping_strategy)
    if args.streaming and args.batch_sampler != "default":
        raise UsageError(f"--streaming true reads the rows as training consumes them; --batch_sampler "
                         f"{args.batch_sampler} needs every row's texts up front: leave out --streaming (or it)")
    if args.streaming and args.multi_dataset_sampler != "mixed" and not args.dataset_config:
        raise UsageError(f"--multi_dataset_sampler {args.multi_dataset_sampler} with --streaming true draws each "
                         "global batch from one of --dataset_config's datasets (each a stream): list the datasets in "
                         "a --dataset_config file, or leave out --streaming")


def check_dataset_config(args: SftFlags) -> None:
    """``--dataset_config``: read and checked now (:func:`~mmembed.data.dataset_config.read_dataset_config`),
    its datasets kept as ``args.dataset_entries`` (empty without it); the flags it replaces
    are refused beside it. ``--eval_beir`` is checked here too (its ``name=folder`` pairs)."""
    from ..data.dataset_config import ConfigError, read_dataset_config
    from ..losses.config import infonce_keys

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
    files = [f"--{f}" for f in ("teacher_scores_file", "teacher_embeddings_file") if getattr(args, f)]
    if files:
        raise UsageError(f"{' '.join(files)} cannot be used with --dataset_config (they align with --dataset's "
                         "files); give the teacher's signals in the rows, or use --dataset")
    try:
        args.dataset_entries = read_dataset_config(args.dataset_config, check_infonce=infonce_keys)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    declared = [e.name for e in args.dataset_entries if e.rows is not None]
    if declared and not args.streaming:
        logging.getLogger("mmembed").info("--dataset_config: the 'rows' of %s serve --streaming only; the rows read "
                                          "whole are counted", ", ".join(declared))
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


def check_loss_args(args: SftFlags) -> None:
    """What can be checked of the loss flags before anything loads; what depends on the
    loss's declarations is checked by :func:`check_side_flags` once it is built."""
    import json

    from ..losses import loss_class
    from ..task import get_task

    if get_task(args.task_type).builds_own_losses:  # losses outside the registry: checked by the task
        return
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


def check_side_flags(args: SftFlags, side) -> None:
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


def has_accelerator() -> bool:
    import torch

    return torch.cuda.is_available()
