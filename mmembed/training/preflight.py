"""What ``mmembed sft`` checks before anything loads: the flags against each other, the model
folders and the model's config, the environment variables, the loss and its options, and
the data paths. Each failure is one line (a :class:`~mmembed.errors.UsageError`, exit
status 2, or for the user's data a :class:`~mmembed.data.SpecError`, exit status 1) before
a weight is read and before ``--output_dir`` is touched.

The flags' own values were checked when they were parsed (:mod:`mmembed.training.arguments`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any

from torch import nn

from ..data import SpecError
from ..data.hub import DatasetHubOptions, check_hub_client
from ..data.specs import HubDataset, parse_spec
from ..encoding.templates import Template
from ..environment import Environment
from ..environment import read as read_environment
from ..losses import EmbeddingLoss, Setup
from ..model.embedding import check_model_folder, hidden_size
from ..task import get_task
from .arguments import SftArguments, UsageError
from .evaluation import eval_metric_names
from .flag_checks import beir_pairs, check_side_flags
from .hub_models import resolve_model_flags
from .model_assembly import lora_target_modules, parts_to_freeze, read_model_config, resolve_template

if TYPE_CHECKING:
    from ..encoding.media import MediaSettings

logger = logging.getLogger("mmembed")


@dataclasses.dataclass(frozen=True)
class RunSetup:
    """What the up-front checks read and build, handed on to the run so that nothing is read
    or built twice: the media settings (variables and flags), the model's transformers config,
    its template (with ``--system``) and the loss (with its options, checked against the
    config's width)."""

    media: MediaSettings
    config: Any
    template: Template
    loss: EmbeddingLoss


def check_settings(args: SftArguments, environment: Environment | None = None) -> RunSetup:
    """What of the flags and environment can be checked without the model's weights, as usage
    errors before anything loads and before ``--output_dir`` is touched (the flags' own values
    were checked when they were parsed): the model folders, the template and ``--max_length``
    against the model's config, the variables, the loss with its options and side flags, and
    last that the data files the flags name are there (the user's data: exit status 1).

    First the model flags that name hub ids are resolved to local folders (downloaded once
    per node: :func:`~mmembed.training.hub_models.resolve_model_flags`), so that every check
    after it reads a folder.

    ``environment``: the variables the run read at its start (None: read now).
    Returns the :class:`RunSetup` read and built on the way."""
    resolve_model_flags(args, environment)
    check_model_folders(args)
    media = check_environment(args, environment)
    config = read_model_config(args.model)
    template = resolve_template(args.model, args.template, args.model_type, args.system, config, task=args.task_type)
    check_linear_attention_packing(args, config)
    limit = getattr(config, "max_position_embeddings", None)
    if args.max_length and limit and getattr(config, "position_embedding_type", None) == "absolute" \
            and args.max_length > limit:
        raise UsageError(f"--max_length must be at most {limit} for this model (its position embeddings), "
                         f"got {args.max_length}")
    task = get_task(args.task_type)
    task.check_model(args, config)  # the config against the task (a reranker's head)
    task.check_dataset_entries(args)
    loss = task.build_loss(args, environment)
    task.check_loss(args, loss, template, config)
    check_metric_for_best_model(args, loss)
    # the data paths last: a flag that does not fit the loss says more than a file that is not there
    hub = DatasetHubOptions.of(args.use_hf, environment)
    entries = [spec for entry in args.dataset_entries for spec in entry.specs() + entry.val]
    for flag, specs in (("dataset", args.dataset), ("val_dataset", args.val_dataset), ("dataset_config", entries)):
        for spec in specs:
            try:
                target, _ = parse_spec(spec)  # a path that is not there, a bad #N: the user's data (exit status 1)
            except SpecError as e:
                raise SpecError(f"--{flag}: {e}") from None
            if isinstance(target, HubDataset):
                check_hub_client(target, hub)  # a ModelScope id without modelscope installed: a usage error
    files = [("--eval_sts", args.eval_sts, os.path.isfile)]
    files += [("--eval_beir", folder, os.path.isdir) for _, folder in beir_pairs(args.eval_beir)]
    files += [(f"--{flag}", path, os.path.isfile) for flag in ("teacher_scores_file", "teacher_embeddings_file")
              for path in getattr(args, flag)]
    for flag, path, exists in files:
        if path and not exists(path):  # the user's data, as a --dataset that is not there (exit status 1)
            raise SpecError(f"{flag} {path}: no such {'file' if exists is os.path.isfile else 'folder'}")
    return RunSetup(media, config, template, loss)


def check_linear_attention_packing(args: SftArguments, config) -> None:
    """A model with linear-attention layers (Qwen3.5's Gated DeltaNet: UEmbed, WeMM-Embedding) runs
    a recurrence over the sequence that would carry one row's state into the next in a packed
    sequence; mmembed keeps its rows padded, each alone, and refuses what asks for one sequence."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if "linear_attention" not in (getattr(text, "layer_types", None) or ()):
        return
    asked = [flag for flag, on in (("--packing true", args.packing), ("--padding_free true", args.padding_free)) if on]
    if asked:
        raise UsageError(f"{' and '.join(asked)}: model type {config.model_type} has linear-attention layers "
                         "(Gated DeltaNet), whose recurrence would run from one row into the next in a packed "
                         "sequence; mmembed trains it on padded batches: leave the flag out")


def check_embedding_loss(args: SftArguments, loss: EmbeddingLoss, template: Template, config) -> None:
    """An embedding loss's checks before the weights load: the side-input flags against what it
    takes, its own checks against the model's width (e.g. Matryoshka's widths; the side models'
    widths later), and the LoRA target names against the model's modules."""
    check_side_flags(args, loss.side)
    try:
        loss.check_setup(Setup(width=hidden_size(config), sides_known=False))
    except ValueError as e:
        flag = f"--mrl_dims {args.mrl_dims!r}" if args.mrl_dims and "mrl_dims" in str(e) else f"--loss_type {args.loss_type}"
        raise UsageError(f"{flag}: {e}") from None
    check_lora_targets(args, template, config)


def check_model_folders(args: SftArguments) -> None:
    """The folders the model flags name hold what each flag takes (a model, an adapter)."""
    flags = [("--model", args.model, False), ("--guide_model", args.guide_model, True),
             ("--teacher_model", args.teacher_model, True)]
    for flag, path, adapter in flags:
        if path:
            check_model_folder(path, flag, adapter)
    for path in args.adapters:
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            what = "no such folder" if not os.path.isdir(path) else "no adapter_config.json in it"
            raise UsageError(f"--adapters {path}: {what} (a LoRA checkpoint folder to train on)")


def check_environment(args: SftArguments, environment: Environment | None = None) -> MediaSettings:
    """The variables ms-swift's scripts set, read now whichever loss or model is used, so that
    a malformed one is refused at start rather than ignored or met mid-training: every
    ``INFONCE_*`` variable, the media budgets (``MAX_PIXELS``, ``FPS``, ...) and the download
    variables (``MMEMBED_HTTP_TIMEOUT``, ``MMEMBED_MEDIA_MAX_BYTES``, the offline switches).
    ``environment``: the variables as the run read them at its start (None: read now).
    Returns the run's media settings (:func:`media_settings`)."""
    from ..losses import InfoNCEConfig
    from ..losses.config import ENV_VARS

    environment = read_environment(environment)
    try:
        InfoNCEConfig.from_variables(environment.infonce)
    except ValueError as e:
        raise UsageError(str(e)) from None
    media = media_settings(args, environment)
    unknown = sorted(k for k in environment.infonce.values if k not in ENV_VARS.values())
    if unknown:
        logger.warning("%s: not an InfoNCE variable, so it changes nothing (known: %s)", ", ".join(unknown),
                       ", ".join(ENV_VARS.values()))
    return media


def media_settings(args: SftArguments, environment: Environment | None = None) -> MediaSettings:
    """How the run loads media, parsed once: ms-swift's media variables (``MAX_PIXELS``,
    ``MIN_PIXELS``, ``VIDEO_MAX_PIXELS``, ``FPS``, ``FPS_MAX_FRAMES``, ...) and the download
    variables, with ``--max_pixels`` in the place of ``MAX_PIXELS`` and ``--offline true`` in
    that of ``MMEMBED_OFFLINE=1``. Every builder of the run (the collator's, the length
    check's, the side models') loads with these, data-loader workers included; a malformed
    variable is a usage error naming it. ``environment``: the variables the run read at its
    start (None: read now)."""
    from ..encoding.media import MediaSettings

    try:
        return MediaSettings.from_env(environment, max_pixels=args.max_pixels, offline=args.offline)
    except ValueError as e:
        raise UsageError(str(e)) from None


def check_metric_for_best_model(args: SftArguments, loss: EmbeddingLoss) -> None:
    """``--metric_for_best_model`` names a metric the run's evaluations log (with or without
    the ``eval_`` prefix, as transformers reads it), so a typo is refused now rather than a
    KeyError at the first evaluation. A run that evaluates nothing never reads it."""
    name = args.metric_for_best_model
    entries = getattr(args, "dataset_entries", [])  # --dataset_config: each dataset's own val metrics
    with_val = [e.name for e in entries if e.val or args.split_dataset_ratio > 0]
    dataset = bool(args.val_dataset) or args.split_dataset_ratio > 0 or bool(with_val)
    if not name or str(getattr(args.eval_strategy, "value", args.eval_strategy)) == "no":
        return
    logged = eval_metric_names(loss.layout, dataset, [n for n, _ in beir_pairs(args.eval_beir)], bool(args.eval_sts),
                               with_val)
    if (name if name.startswith("eval_") else f"eval_{name}") not in logged:
        raise UsageError(f"--metric_for_best_model {name!r} is not a metric this run logs; it logs "
                         f"{', '.join(sorted(logged))}")


def check_lora_targets(args: SftArguments, template: Template, config) -> None:
    """``--target_modules``, ``--target_regex`` and ``--modules_to_save`` against the model's
    module names, read from a copy without weights built from its ``config`` (on the meta
    device), so that a name that matches nothing is reported before the weights load rather
    than by PEFT after."""
    import re

    import torch
    from transformers import AutoModel
    from transformers.integrations import is_deepspeed_zero3_enabled

    default = list(args.target_modules) == ["all-linear"] and not args.modules_to_save and not args.target_regex
    if args.tuner_type != "lora" or args.adapters or (default and not template.parts):
        return
    if is_deepspeed_zero3_enabled():  # transformers would build the copy under zero.Init; PEFT checks after the load
        return
    try:
        with torch.device("meta"):
            skeleton = AutoModel.from_config(config)
    except Exception:  # a family that cannot be built without weights: PEFT checks the names after the load
        return
    names = [n for n, _ in skeleton.named_modules() if n]

    def matches(key: str) -> bool:
        return any(n == key or n.endswith("." + key) for n in names)

    if args.target_regex:
        if not any(re.fullmatch(args.target_regex, n) for n in names):
            raise UsageError(f"--target_regex {args.target_regex!r} matches no module of {args.model}")
    else:
        try:
            targets = lora_target_modules(skeleton, list(args.target_modules), template, parts_to_freeze(args))
        except ValueError as e:
            raise UsageError(f"--target_modules all-linear: {e}") from None
        if isinstance(targets, list):
            missing = [t for t in targets if not matches(t)]
            if missing:
                raise UsageError(f"--target_modules {' '.join(args.target_modules)}: no module of {args.model} is "
                                 f"named {', '.join(missing)} (e.g. {', '.join(_linear_names(skeleton)[:6])})")
    missing = [m for m in _backbone_modules_to_save(args) if not matches(m)]
    if missing:
        raise UsageError(f"--modules_to_save {' '.join(args.modules_to_save)}: no module of {args.model} is named "
                         f"{', '.join(missing)}")


def _backbone_modules_to_save(args: SftArguments) -> list[str]:
    """``--modules_to_save`` less the names of a sentence-transformers folder's own modules
    (``2``, ``2_Dense``, ``linear``: :meth:`~mmembed.model.st_modules.SentenceTransformersModules.modules_named`),
    which are trained outside the backbone."""
    from ..model.st_modules import SentenceTransformersModules, modules_of_folder

    entries = modules_of_folder(args.model) if args.modules_to_save else None
    if not entries:
        return list(args.modules_to_save)
    return SentenceTransformersModules(entries, args.model).modules_named(list(args.modules_to_save))[1]


def _linear_names(model: nn.Module) -> list[str]:
    """The distinct last name parts of the model's linear layers: what ``--target_modules`` takes."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
