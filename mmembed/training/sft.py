"""``mmembed sft``: data, template, model, loss and trainer wired together."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Any

from torch import nn

from ..data import EmbeddingDataset, SpecError, load_samples
from ..data.dataset import parse_spec
from ..data.sample import DataError, Sample
from ..data.streaming import StreamingSamples, stream_samples
from ..data.teacher import SIGNALS, TeacherFiles, teacher_signal
from ..encoding.collator import EmbeddingCollator, token_lengths
from ..encoding.inputs import InputBuilder
from ..encoding.templates import Template, get_template, template_config
from ..errors import one_line
from ..eval.tasks import HeldOutTasks
from ..files import WriteError
from ..losses import EmbeddingLoss, Setup, build_loss
from ..model.embedding import (
    EmbeddingModel,
    check_model_folder,
    default_max_length,
    frozen_parts,
    hidden_size,
    load_backbone,
)
from ..model.packing import PACKABLE_MODEL_TYPES, VARLEN_ATTENTION
from .arguments import SftArguments, UsageError, check_side_flags
from .charts import TrainingCharts, eval_similarities
from .checkpoints import (
    check_complete,
    clear_output_dir,
    find_last_complete_checkpoint,
    foreign_checkpoint,
    is_model_only,
    leftovers,
    list_checkpoints,
    not_a_checkpoint,
    saved_model,
    set_aside_later_checkpoints,
)
from .trainer import EmbeddingTrainer, eval_metric_names, load_backbone_weights

logger = logging.getLogger("mmembed")


def load_processing(path: str, template: Template):
    """The tokenizer, or for a template that takes media the model's processor (which holds
    the tokenizer and the image/video processors or audio feature extractor)."""
    from transformers import AutoProcessor, AutoTokenizer

    if template.media:
        return AutoProcessor.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def resolve_template(model_dir: str, name: str | None, model_type: str | None, system: str | None) -> Template:
    try:
        template = get_template(name, model_type, getattr(read_model_config(model_dir), "model_type", None))
        template.check_installed()
    except ValueError as e:
        raise UsageError(str(e)) from None
    if system is not None:
        template = dataclasses.replace(template, default_system=system)
    return template


def read_model_config(model_dir: str):
    """The model's transformers config; one that cannot be read is a usage error naming --model."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"--model {model_dir}: its config.json cannot be read as a transformers model "
                         f"({one_line(e)})") from None


def lora_target_modules(model: nn.Module, target_modules: list[str], template: Template,
                        frozen: set[str] = frozenset()) -> str | list[str]:
    """``all-linear`` as ms-swift means it: every linear layer of the transformer, but not
    heads or the (unused) BERT pooler; in a multimodal model only the parts not frozen
    (by default the LLM: ``--freeze_vit`` and ``--freeze_aligner`` are on). Other names
    pass to PEFT unchanged."""
    if target_modules != ["all-linear"]:
        return target_modules
    skip = ("lm_head", "pooler", "score", "classifier")
    linear = [
        name for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and not any(s in name.split(".") for s in skip)
    ]
    if template.parts:
        # full names: a suffix such as "qkv" or "fc1" would also match inside frozen parts
        names = sorted(n for n in linear if template.module_part(n) not in frozen and template.module_part(n))
    else:
        names = sorted({n.rsplit(".", 1)[-1] for n in linear})
    if not names:
        raise ValueError("no linear layers found for --target_modules all-linear (are all parts frozen?)")
    return names


def apply_lora(backbone: nn.Module, args: SftArguments, template: Template) -> nn.Module:
    """A new LoRA adapter as the flags say, or (``--adapters``) an existing one trained on."""
    from peft import LoraConfig, TaskType, get_peft_model

    if args.adapters:
        from ..model.adapters import load_lora  # mmembed's adapters and ms-swift's alike

        logger.info("training on the adapter in %s (its own rank, alpha and target modules)", args.adapters[0])
        return load_lora(backbone, args.adapters[0], is_trainable=True)
    init = {"true": True, "false": False}.get(args.init_weights.lower(), args.init_weights)
    config = LoraConfig(
        task_type=TaskType.FEATURE_EXTRACTION,
        r=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=args.target_regex or lora_target_modules(backbone, list(args.target_modules), template,
                                                                _frozen(args)),
        use_dora=args.use_dora,
        use_rslora=args.use_rslora,
        bias=args.lora_bias,
        init_lora_weights=init,
        modules_to_save=list(args.modules_to_save) or None,
    )
    return get_peft_model(backbone, config)


def part_learning_rates(model: EmbeddingModel, template: Template, args: SftArguments) -> dict[int, float]:
    """``--vit_lr`` / ``--aligner_lr``: the learning rate of each trainable parameter of those
    parts (by ``id``), as optimizer parameter groups take them; the rest keep --learning_rate."""
    wanted = {part: lr for part, lr in (("vit", args.vit_lr), ("aligner", args.aligner_lr)) if lr is not None}
    if not wanted:
        return {}
    if not template.parts:
        raise UsageError(f"--vit_lr / --aligner_lr: template '{template.name}' has no vision or audio parts")
    lrs, found = {}, set()
    for name, p in model.backbone.named_parameters():
        for prefix in ("base_model.model.",):  # PEFT's wrapping; parts are named on the bare backbone
            name = name[len(prefix):] if name.startswith(prefix) else name
        part = template.module_part(name)
        if part in wanted and p.requires_grad:
            lrs[id(p)] = wanted[part]
            found.add(part)
    for part in sorted(set(wanted) - found):
        logger.warning("--%s_lr has no effect: no trainable parameter in the %s part (--freeze_%s true, or LoRA puts "
                       "no adapter there)", part, part, part)
    return lrs


def freeze_parts(backbone: nn.Module, template: Template, frozen: set[str]) -> int:
    """Full training of a multimodal model: parameters of the frozen parts keep their
    values. Returns how many parameter tensors were frozen."""
    count = 0
    for name, p in backbone.named_parameters():
        if template.module_part(name) in frozen:
            p.requires_grad_(False)
            count += 1
    return count


def _frozen(args: SftArguments) -> set[str]:
    return frozen_parts(args.freeze_vit, args.freeze_aligner, args.freeze_llm)


def drop_overlong(ds, builder: InputBuilder, layout: str, max_length: int, num_proc: int, what: str,
                  strict: bool = True, truncate: bool = False):
    """``--truncation_strategy delete``: remove rows with any input over ``max_length`` tokens
    (media expanded, as the model sees them), and say how many.

    Measuring loads every row's media, so a media file that opens but does not decode is
    found here, before training: an error naming its row, or with ``strict=False`` the row
    is skipped and listed like the rows skipped when the data was read.

    With ``truncate`` (``--truncation_strategy left|right``) only the rows with media are
    measured, for the same reason: their media are decoded here rather than first in the
    middle of training, and since a row with media is never truncated, one over
    ``max_length`` is a data error naming it (or, with ``strict=False``, skipped and listed).
    Text rows are left to be truncated.
    """

    def lengths_of(samples: list[Sample]) -> list[int]:
        if not truncate:
            return token_lengths(samples, builder, layout)
        media = [i for i, s in enumerate(samples) if any(it.has_media for it in (s.anchor, *s.positives, *s.negatives))]
        out = [0] * len(samples)
        for i, n in zip(media, token_lengths([samples[i] for i in media], builder, layout) if media else []):
            out[i] = n
            if n > max_length:
                raise DataError(samples[i].source, samples[i].line, None,
                                f"{n} tokens with its media, over --max_length {max_length}; a row with media is not "
                                "truncated (that would cut its media tokens): raise --max_length, lower MAX_PIXELS, or "
                                "use --truncation_strategy delete")
        return out

    def measure(batch: dict[str, list]) -> dict[str, list]:
        samples = [Sample.from_json(s) for s in batch["sample"]]
        try:
            return {"n_tokens": lengths_of(samples), "load_error": [""] * len(samples)}
        except DataError:
            if strict:
                raise
        lengths, errors = [], []
        for sample in samples:  # one at a time, to find the rows that fail
            try:
                lengths.append(lengths_of([sample])[0])
                errors.append("")
            except DataError as e:
                lengths.append(0)
                errors.append(json.dumps([e.source, e.line, e.field, e.reason], ensure_ascii=False))
        return {"n_tokens": lengths, "load_error": errors}

    import datasets

    # only the two new columns are written (not another copy of the rows). A result kept from
    # an earlier run is reused only when no row could be skipped (strict): a skip recorded
    # for a media file since mended would otherwise drop its row for good.
    features = datasets.Features({"n_tokens": datasets.Value("int64"), "load_error": datasets.Value("string")})
    measured = ds.map(measure, batched=True, num_proc=num_proc if num_proc > 1 else None, features=features,
                      remove_columns=ds.column_names, desc=f"length check ({what})",
                      new_fingerprint=length_check_fingerprint(ds, builder, layout, strict) + ("-media" if truncate else ""),
                      load_from_cache_file=strict)
    lengths, errors = measured["n_tokens"], measured["load_error"]
    skipped = [DataError(*json.loads(e)) for e in errors if e]
    if skipped:
        listed = "\n".join(f"  {e}" for e in skipped)
        logger.warning("%s: skipped %d row(s) whose media cannot be loaded%s (--strict false):\n%s", what,
                       len(skipped), " or are over --max_length with them" if truncate else "", listed)
    keep = [i for i, (n, e) in enumerate(zip(lengths, errors)) if not e and n <= max_length]
    dropped = len(ds) - len(skipped) - len(keep)
    if dropped:
        logger.warning(
            "%s: %d of %d rows are longer than --max_length %d tokens and were deleted (--truncation_strategy delete; "
            "use left/right to truncate them instead)", what, dropped, len(ds), max_length,
        )
    return ds.select(keep) if len(keep) < len(ds) else ds


def length_check_fingerprint(ds, builder: InputBuilder, layout: str, strict: bool) -> str:
    """The name of the length check's result among ``datasets``' cache files: the rows (their
    fingerprint), the template, the tokenizer's files, ``max_length``, the batch layout and
    the media budget. Given explicitly, because ``datasets`` would otherwise name it by
    pickling the measuring function with everything it holds, the tokenizer included: about
    10 seconds for a Qwen tokenizer of 151k tokens, on every run."""
    import hashlib

    from ..encoding.media import MediaBudget

    h = hashlib.sha256()
    tokenizer = builder.tokenizer
    folder = getattr(tokenizer, "name_or_path", "") or ""
    for part in (ds._fingerprint, repr(builder.template), type(tokenizer).__name__, folder, len(tokenizer),
                 builder.max_length, builder.truncate, builder.truncation_side, layout, strict,
                 repr(MediaBudget.from_env()), type(builder.processor).__name__):
        h.update(repr(part).encode("utf-8") + b"\0")
    if os.path.isdir(folder):  # the files the tokenizer and processor were read from
        for name in sorted(os.listdir(folder)):
            if name.startswith(("tokenizer", "vocab", "merges", "special_tokens", "added_tokens", "chat_template",
                                "preprocessor", "processor", "video_preprocessor")):
                with open(os.path.join(folder, name), "rb") as f:
                    h.update(name.encode("utf-8") + hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:32]


def make_loss(args: SftArguments) -> EmbeddingLoss:
    """The loss named by ``--loss_type`` with ``--loss_kwargs``, wrapped in Matryoshka when
    ``--mrl_dims`` is given."""
    options = json.loads(args.loss_kwargs) if args.loss_kwargs else {}
    try:
        if args.mrl_dims:
            return build_loss("matryoshka", dims=args.mrl_dims, inner=args.loss_type, **options)
        return build_loss(args.loss_type, **options)
    except ValueError as e:  # an unknown key or a bad value (the INFONCE_* variables are checked before)
        flag = f"--loss_kwargs {args.loss_kwargs!r}" if options else f"--loss_type {args.loss_type}"
        raise UsageError(f"{flag}: {one_line(e)}") from None


@dataclasses.dataclass
class SideModels:
    """The frozen embedders behind the loss's side inputs: the guide (``--guide_model``,
    GIST) and the teacher (``--teacher_model``, distillation), each with its own template
    and tokenizer or processor, embedding the same items as the student (rendered from the
    items, not decoded from the student's ids)."""

    models: dict[str, EmbeddingModel]
    builders: dict[str, InputBuilder]

    @classmethod
    def load(cls, args: SftArguments) -> SideModels:
        from ..model.embedder import load_embedding_model

        models, builders = {}, {}
        for name, path in (("guide", args.guide_model), ("teacher", args.teacher_model)):
            if not path:
                continue
            model, processing, template, info = load_embedding_model(path, args.torch_dtype)
            model.requires_grad_(False)
            models[name] = model.eval()
            builders[name] = InputBuilder(template, processing, info["max_length"], truncate=True)
        return cls(models, builders)

    def width(self, name: str) -> int | None:
        return hidden_size(self.models[name].config) if name in self.models else None


def data_teacher(args: SftArguments, loss: EmbeddingLoss, train: EmbeddingDataset) -> tuple[str | None, int | None]:
    """Distillation without ``--teacher_model``: the teacher signal every training row must
    carry (row fields or ``--teacher_*_file``), checked on every row before training.

    Returns:
        ``("teacher_scores", None)``, ``("teacher_embeddings", width)``, or ``(None, None)``
        when the loss takes no teacher or the teacher is a model.
    """
    accepted = loss.side.teacher
    if not accepted:
        return None, None
    if args.teacher_model:
        first = train[0] if len(train) else None
        if first is not None and (first.teacher_scores is not None or first.teacher_embeddings is not None):
            logger.warning("the rows carry teacher scores or embeddings; --teacher_model is the teacher, so they are unused")
        return None, None
    key, width = teacher_signal((train[i] for i in range(len(train))), accepted, args.loss_type, "training")
    logger.info("teacher from the data: %s%s", key, f" (width {width})" if width else "")
    return key, width


def check_loss_setup(args: SftArguments, loss: EmbeddingLoss, width: int, side_models: SideModels,
                     teacher_key: str | None, teacher_width: int | None) -> None:
    """The loss's start-up checks (widths, side inputs), as usage errors before training."""
    if "teacher" in side_models.models:
        signal, teacher_width = "embeddings", side_models.width("teacher")
    else:
        signal = SIGNALS.get(teacher_key) if teacher_key else None
    setup = Setup(width=width, guide="guide" in side_models.models, teacher_signal=signal, teacher_width=teacher_width)
    try:
        loss.check_setup(setup)
    except ValueError as e:
        flag = "--mrl_dims" if args.mrl_dims and "mrl_dims" in str(e) else f"--loss_type {args.loss_type}"
        raise UsageError(f"{flag}: {e}") from None


def _init_deepspeed_comm() -> None:
    """DeepSpeed keeps its own view of the process group; ZeRO-3 builds the model under
    ``zero.Init``, which reads the world size from it, so it must wrap the group that
    accelerate started (gloo on CPU) before the model is loaded."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_initialized() and not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend())


def build_model(args: SftArguments, template: Template, pooling: str) -> EmbeddingModel:
    backbone = load_backbone(args.model, args.torch_dtype, args.attn_impl)
    if args.use_liger_kernel:
        # the Trainer would try this on the EmbeddingModel wrapper, which is no PreTrainedModel
        from transformers.integrations.liger import apply_liger_kernel

        apply_liger_kernel(backbone, args.liger_kernel_config)
        logger.info("--use_liger_kernel: liger-kernel's fused kernels applied to the %s backbone",
                    backbone.config.model_type)
    if args.tuner_type == "lora":
        try:
            backbone = apply_lora(backbone, args, template)
        except ValueError as e:  # PEFT's refusal of a target the skeleton check could not see
            if args.adapters:
                raise
            raise UsageError(f"{_lora_flags(args)}: {one_line(e)}") from None
    elif freeze_parts(backbone, template, _frozen(args)):
        logger.info("full training with frozen parts: %s", ", ".join(sorted(_frozen(args))))
    padding_free = use_padding_free(args, backbone.config, template)
    logger.info("on %s: %s", args.device.type, ", ".join(
        [*getattr(args, "device_defaults", []), f"--padding_free {str(padding_free).lower()}",
         f"--attn_impl {backbone.config._attn_implementation}"]))
    return EmbeddingModel(backbone, pooling, length_chunks=args.length_chunks, tower=template.tower,
                          padding_free=padding_free, bucket=bool(args.length_buckets))


def use_padding_free(args: SftArguments, config, template: Template) -> bool:
    """Whether text batches are packed (``--padding_free``; see mmembed.model.packing).

    By default they are where packing saves work: a text model of a family whose positions
    restart per row (bert, qwen2, qwen3) under FlashAttention or FlexAttention. SDPA and
    eager would compute the packed attention as a dense mask, slower than the padded batch,
    so ``--padding_free true`` with them (as ms-swift's example scripts pass it) keeps padded
    batches and says so. A multimodal model's batches stay padded (its rotary positions come
    from the media grid)."""
    implementation = config._attn_implementation
    reasons = []
    if template.tower is not None:
        reasons.append(f"the {template.name} template's media rows")
    if config.model_type not in PACKABLE_MODEL_TYPES:
        reasons.append(f"model type {config.model_type} (packed: {', '.join(sorted(PACKABLE_MODEL_TYPES))})")
    if implementation not in VARLEN_ATTENTION:
        reasons.append(f"--attn_impl {implementation}, whose packed attention is a dense mask "
                       "(use flash_attn or flex_attention)")
    if args.padding_free is None:
        return not reasons
    if args.padding_free and reasons:
        logger.warning("--padding_free true: batches stay padded because of %s", "; ".join(reasons))
        return False
    return bool(args.padding_free)


@dataclasses.dataclass
class Encoding:
    """How rows become the student's inputs: template, tokenizer or processor, pooling, length."""

    template: Template
    processing: Any
    pooling: str
    max_length: int

    @classmethod
    def resolve(cls, args: SftArguments) -> Encoding:
        check_model_folders(args)  # the tokenizer loads before the model does
        template = resolve_template(args.model, args.template, args.model_type, args.system)
        if args.padding_side:
            template = dataclasses.replace(template, padding_side=args.padding_side)
        processing = load_processing(args.model, template)
        tokenizer = getattr(processing, "tokenizer", None) or processing
        pooling = args.pooling or template.resolve_pooling(args.model)
        return cls(template, processing, pooling, args.max_length or default_max_length(args.model, tokenizer))


@dataclasses.dataclass
class TrainingData:
    """The training and eval rows, with their teacher signals."""

    train: EmbeddingDataset | StreamingSamples  # (--streaming: rows read as training consumes them)
    val: EmbeddingDataset | None
    teacher_key: str | None = None  # the data's teacher signal the collator passes on
    teacher_width: int | None = None
    # rows read per data file (bad ones included), for the model card
    files: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    @classmethod
    def load(cls, args: SftArguments, encoding: Encoding, loss: EmbeddingLoss) -> TrainingData:
        # ms-swift's order: --data_seed (not --seed) drives the split, #N sampling and --dataset_shuffle.
        # Every row is checked now against what the loss takes as a label and the media the
        # model takes, so a row training could not use is an error (or skipped) before training.
        load_opts = dict(strict=args.strict, seed=args.data_seed, num_proc=args.dataset_num_proc,
                         load_from_cache_file=args.load_from_cache_file,
                         columns=json.loads(args.columns) if args.columns else None,
                         label_rule=loss.label_rule, media_kinds=frozenset(encoding.template.media))
        if args.streaming:
            return cls.stream(args, encoding, loss, load_opts)
        loaded = load_samples(args.dataset, split_ratio=0.0 if args.val_dataset else args.split_dataset_ratio,
                              shuffle=args.dataset_shuffle, **load_opts)
        train = loaded.dataset
        try:
            teacher_files = TeacherFiles.open(loaded.files, loaded.records, args.teacher_scores_file,
                                              args.teacher_embeddings_file)
        except ValueError as e:
            raise UsageError(str(e)) from None
        files = {"train": loaded.records}
        if args.val_dataset:
            val_loaded = load_samples(args.val_dataset, split_ratio=1.0, shuffle=args.val_dataset_shuffle, **load_opts)
            val, files["val"] = val_loaded.dataset, val_loaded.records
        else:
            val = loaded.val
        train, val = fetch_remote_media(train, val, args.strict)
        if args.truncation_strategy == "delete" or encoding.template.media:
            # delete: the over-long rows go; left / right: the media rows are decoded and measured now
            truncate = args.truncation_strategy != "delete"
            builder = InputBuilder(encoding.template, encoding.processing, encoding.max_length, truncate=False)
            train = drop_overlong(train, builder, loss.layout, encoding.max_length, args.dataset_num_proc, "train",
                                  args.strict, truncate)
            if val is not None:
                val = drop_overlong(val, builder, loss.layout, encoding.max_length, args.dataset_num_proc, "val",
                                    args.strict, truncate)
        if len(train) == 0:  # all deleted by the length check (loading itself refuses empty data): a data error
            raise SpecError(f"no training rows left: every row of {', '.join(args.dataset)} is longer than "
                            f"--max_length {encoding.max_length} or has media that cannot be loaded (listed above; "
                            "--truncation_strategy delete); raise --max_length or use --truncation_strategy right")
        data = cls(EmbeddingDataset(train, teacher_files), EmbeddingDataset(val, teacher_files) if val is not None else None,
                   files=files)
        data.teacher_key, data.teacher_width = data_teacher(args, loss, data.train)
        if val is not None:  # data_teacher read the training rows with their arrays; the eval rows' must fit too
            teacher_files.check_rows(val)
        return data


    @classmethod
    def stream(cls, args: SftArguments, encoding: Encoding, loss: EmbeddingLoss, load_opts: dict) -> TrainingData:
        """``--streaming true``: the training rows as a stream (:mod:`mmembed.data.streaming`);
        ``--val_dataset`` is read whole as usual. Rows over ``--max_length`` are dropped as
        they are read (``--truncation_strategy delete``), remote media fetched when read."""
        if loss.side.teacher and not args.teacher_model:
            raise UsageError(f"--loss_type {args.loss_type} with the teacher's signals in the rows cannot be checked "
                             "up front with --streaming true: give --teacher_model, or leave out --streaming")
        train = stream_samples(args.dataset, strict=args.strict, seed=args.data_seed, shuffle=args.dataset_shuffle,
                               buffer_size=args.shuffle_buffer_size, columns=load_opts["columns"],
                               label_rule=load_opts["label_rule"], media_kinds=load_opts["media_kinds"])
        val, files = None, {}
        if args.val_dataset:
            val_loaded = load_samples(args.val_dataset, split_ratio=1.0, shuffle=args.val_dataset_shuffle, **load_opts)
            val, files["val"] = val_loaded.dataset, val_loaded.records
            _, val = fetch_remote_media(None, val, args.strict)
        if args.truncation_strategy == "delete":
            builder = InputBuilder(encoding.template, encoding.processing, encoding.max_length, truncate=False)
            train.keep = lambda sample: token_lengths([sample], builder, loss.layout)[0] <= encoding.max_length
            if val is not None:
                val = drop_overlong(val, builder, loss.layout, encoding.max_length, args.dataset_num_proc, "val",
                                    args.strict)
        return cls(train, EmbeddingDataset(val) if val is not None else None, files=files)


def fetch_remote_media(train, val, strict: bool = True):
    """Download every http(s) media file of the rows into the media cache now (once; a cached
    one is not fetched again), so that a URL that fails does so before training, and steps,
    epochs and data-loader workers read the cache. Logs one line per download and a summary.
    A URL that cannot be fetched is an error naming its row, or with ``strict=False`` each row
    naming it is skipped and listed like the other skipped rows. Returns ``(train, val)``."""
    from ..encoding import remote

    named = [(what, ds) for what, ds in (("train", train), ("val", val)) if ds is not None]

    def urls(ds):
        for i, batch in enumerate(ds.select_columns(["sample"]).iter(batch_size=1024)):
            for j, text in enumerate(batch["sample"]):
                if "://" in text:  # most rows have no URL: skip decoding them
                    for url, where in remote.sample_urls(Sample.from_json(text)):
                        yield i * 1024 + j, url, where

    failed: dict[str, str] | None = None if strict else {}
    remote.prefetch(((url, where) for _, ds in named for _, url, where in urls(ds)), failed=failed)
    if not failed:
        return train, val
    kept = {}
    for what, ds in named:
        skipped: dict[int, DataError] = {}
        for i, url, (source, line, fieldname) in urls(ds):
            if url.strip() in failed and i not in skipped:
                skipped[i] = DataError(source, line, fieldname,
                                       f"cannot download ({failed[url.strip()]}): {remote.redact(url)!r}")
        if skipped:
            listed = "\n".join(f"  {e}" for e in skipped.values())
            logger.warning("%s: skipped %d row(s) whose media cannot be downloaded (--strict false):\n%s", what,
                           len(skipped), listed)
            ds = ds.select([i for i in range(len(ds)) if i not in skipped])
        kept[what] = ds
    return kept.get("train", train), kept.get("val", val)


def build_trainer(args: SftArguments) -> EmbeddingTrainer:
    """Everything ``mmembed sft`` trains with, checked before the model loads where it can be:
    the loss, the encoding, the data, the side models and held-out tasks, then the model."""
    from transformers import AutoConfig

    loss = make_loss(args)
    check_side_flags(args, loss.side)
    encoding = Encoding.resolve(args)
    data = TrainingData.load(args, encoding, loss)
    check_drop_last(args, data)
    eval_tasks = load_eval_tasks(args, encoding)
    side_models = SideModels.load(args)
    width = hidden_size(AutoConfig.from_pretrained(args.model))
    check_loss_setup(args, loss, width, side_models, data.teacher_key, data.teacher_width)
    if args.deepspeed:
        _init_deepspeed_comm()
    model = build_model(args, encoding.template, encoding.pooling)
    collator = EmbeddingCollator(
        encoding.template, encoding.processing, loss.layout, encoding.max_length,
        truncation_side="left" if args.truncation_strategy == "left" else "right",
        truncate=args.truncation_strategy != "delete",
        guide=side_models.builders.get("guide"),
        teacher=side_models.builders.get("teacher"),
        teacher_signal=data.teacher_key,
        bucket=bool(args.length_buckets),
    )
    mmembed_config = {
        "base_model": os.path.abspath(args.model),
        "template": template_config(encoding.template),
        "default_system": encoding.template.default_system,
        "padding_side": encoding.template.padding_side,
        "pooling": encoding.pooling,
        "media": sorted(encoding.template.media),
        "normalize": True,
        "max_length": encoding.max_length,
        "tuner_type": args.tuner_type,
        "loss_type": args.loss_type,
        **training_facts(args, loss, data),
    }
    trainer = EmbeddingTrainer(
        model=model,
        args=args,
        train_dataset=data.train,
        eval_dataset=data.val,
        data_collator=collator,
        processing_class=encoding.processing,
        loss=loss,
        side_models=side_models.models,
        eval_tasks=eval_tasks,
        mmembed_config=mmembed_config,
        param_lrs=part_learning_rates(model, encoding.template, args),
    )
    trainer.add_callback(TrainingCharts(lambda: eval_similarities(trainer)))
    return trainer


def check_drop_last(args: SftArguments, data: TrainingData) -> None:
    """``--dataloader_drop_last true`` drops each epoch's last incomplete batch: with fewer
    training rows (after the checks) than one batch of every process, it drops them all and
    trains nothing. Refused now, after the data is read and before the model loads."""
    if not args.dataloader_drop_last or not hasattr(data.train, "__len__"):  # a stream: its length is unknown
        return
    batch = args.per_device_train_batch_size * args.world_size
    if len(data.train) < batch:
        raise UsageError(f"--dataloader_drop_last true with {len(data.train)} training row(s), fewer than one batch "
                         f"({batch} = --per_device_train_batch_size {args.per_device_train_batch_size} x "
                         f"{args.world_size} process(es)): every batch would be dropped and nothing trained; "
                         "leave out --dataloader_drop_last or lower --per_device_train_batch_size")


def training_facts(args: SftArguments, loss: EmbeddingLoss, data: TrainingData) -> dict[str, Any]:
    """What the model card reports beside the model: the loss's settings, the data files with
    their row counts, the main hyperparameters and when training started."""
    settings = " ".join(repr(loss).split())  # the loss's repr names its settings (and an inner loss's)
    return {
        "loss_settings": settings,
        "data": {
            **{kind: [{"file": f, "rows": n} for f, n in records.items()] for kind, records in data.files.items()},
            "train_rows": len(data.train) if hasattr(data.train, "__len__") else None,  # a stream: unknown
            "val_rows": len(data.val) if data.val is not None else None,
        },
        "learning_rate": args.learning_rate,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "num_train_epochs": args.num_train_epochs if not args.max_steps or args.max_steps < 0 else None,
        "max_steps": args.max_steps if args.max_steps and args.max_steps > 0 else None,
        "seed": args.seed,
        "started_at": time.time(),
    }


def load_eval_tasks(args: SftArguments, encoding: Encoding) -> HeldOutTasks | None:
    """``--eval_beir`` and ``--eval_sts``, read and checked before training."""
    if not (args.eval_beir or args.eval_sts):
        return None
    try:
        return HeldOutTasks.load(encoding.template, encoding.max_length or 512, beir=args.eval_beir,
                                 beir_split=args.eval_beir_split, sts=args.eval_sts)
    except ValueError as e:
        if isinstance(e, DataError):
            raise
        raise UsageError(str(e)) from None


def resume_checkpoint(args: SftArguments) -> str | None:
    """``--resume_from_checkpoint``: a folder, or ``true``/``last`` for the newest complete one."""
    resume = args.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() in ("true", "last"):
        resume = find_last_complete_checkpoint(args.output_dir)
        if resume is None:
            raise FileNotFoundError(
                f"--resume_from_checkpoint true: no complete checkpoint under {args.output_dir} "
                "(start afresh with --overwrite_output_dir true)")
    elif isinstance(resume, str) and resume.lower() in ("false", "none", ""):
        resume = None
    if resume:
        if not os.path.isdir(resume):
            raise UsageError(f"--resume_from_checkpoint {resume}: no such folder (a checkpoint folder, or true for "
                             "the newest complete one in --output_dir)")
        if args.resume_only_model and (foreign_checkpoint(resume) or saved_model(resume)):
            # weights only: ms-swift's checkpoints, plain model / adapter folders and mmembed's
            # final models and exports load too (an mmembed checkpoint must still be whole: a
            # killed save's weights may be partial)
            return resume
        check_complete(resume)  # before the Trainer's own loaders (DeepSpeed's included) read it
        if is_model_only(resume):  # whole, but the model alone (--resume_only_model took it above)
            raise UsageError(f"--resume_from_checkpoint: {not_a_checkpoint(resume, saved_model(resume))}")
    return resume


def prepare_output_dir(args: SftArguments, resume: str | None) -> None:
    """A run into an ``--output_dir`` that holds checkpoints (or a killed save's leftovers)
    continues it (``--resume_from_checkpoint``), replaces them (``--overwrite_output_dir``:
    they are deleted now), or is refused, so a result is never confused with another run's."""
    with args.main_process_first(desc="checking --output_dir", local=args.save_on_each_node):
        check_writable(args.output_dir)  # every process writes into checkpoints (its RNG state)
        found = [path for _, path in list_checkpoints(args.output_dir)] + leftovers(args.output_dir)
        if resume and args.should_save:
            later, folder = set_aside_later_checkpoints(args.output_dir, resume, delete=args.overwrite_output_dir)
            if later:
                names = ", ".join(os.path.basename(p) for p in later)
                logger.warning("--resume_from_checkpoint %s goes back to an earlier step: the later checkpoints of the "
                               "run it leaves (%s) were %s, so that neither --resume_from_checkpoint true nor "
                               "--save_total_limit takes them for this run's", os.path.basename(resume), names,
                               f"moved to {folder}" if folder else "deleted (--overwrite_output_dir)")
        if not found or resume:
            return
        if not args.overwrite_output_dir:
            names = ", ".join(os.path.basename(p) for p in found[:4]) + (", ..." if len(found) > 4 else "")
            raise UsageError(
                f"--output_dir {args.output_dir} already holds checkpoints of another run ({names}); continue it with "
                "--resume_from_checkpoint true, replace them with --overwrite_output_dir true, or pick another --output_dir"
            )
        if args.should_save:
            removed = clear_output_dir(args.output_dir)
            logger.info("--overwrite_output_dir: deleted %d checkpoint folder(s) of an earlier run in %s", len(removed),
                        args.output_dir)


def check_writable(folder: str) -> None:
    """Create ``folder`` if needed and write a file in it now, so that a read-only or full
    ``--output_dir`` fails in one line before the model loads, not at the first checkpoint."""
    import tempfile

    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder) as f:
            f.write(b"mmembed")
            f.flush()
    except OSError as e:
        raise WriteError(folder, e) from e


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


def check_environment() -> None:
    """The variables ms-swift's scripts set, read now whichever loss or model is used, so that
    a malformed one is refused at start rather than ignored or met mid-training: every
    ``INFONCE_*`` variable, the media budgets (``MAX_PIXELS``, ``FPS``, ...) and the download
    variables (``MMEMBED_HTTP_TIMEOUT``, ``MMEMBED_MEDIA_MAX_BYTES``, the offline switches)."""
    from ..encoding import remote
    from ..encoding.media import MediaBudget
    from ..losses import InfoNCEConfig
    from ..losses.config import ENV_VARS

    try:
        InfoNCEConfig.from_env()
        MediaBudget.from_env()
        remote.check_settings()  # MMEMBED_HTTP_TIMEOUT, MMEMBED_MEDIA_MAX_BYTES, MMEMBED_OFFLINE, HF_HUB_OFFLINE
    except ValueError as e:
        raise UsageError(str(e)) from None
    unknown = sorted(k for k in os.environ if k.startswith("INFONCE_") and k not in ENV_VARS.values())
    if unknown:
        logger.warning("%s: not an InfoNCE variable, so it changes nothing (known: %s)", ", ".join(unknown),
                       ", ".join(ENV_VARS.values()))


def check_settings(args: SftArguments) -> None:
    """What of the flags and environment can be checked without the model's weights, as usage
    errors before anything loads and before ``--output_dir`` is touched (the flags' own values
    were checked when they were parsed): the model folders, the template and ``--max_length``
    against the model's config, the variables, the loss with its options and side flags, and
    last that the data files the flags name are there (the user's data: exit status 1)."""
    check_model_folders(args)
    check_environment()
    template = resolve_template(args.model, args.template, args.model_type, args.system)
    config = read_model_config(args.model)
    limit = getattr(config, "max_position_embeddings", None)
    if args.max_length and limit and getattr(config, "position_embedding_type", None) == "absolute" \
            and args.max_length > limit:
        raise UsageError(f"--max_length must be at most {limit} for this model (its position embeddings), "
                         f"got {args.max_length}")
    loss = make_loss(args)
    check_side_flags(args, loss.side)
    try:  # the loss's checks against the width, known from the config (e.g. Matryoshka's widths); sides: later
        loss.check_setup(Setup(width=hidden_size(config), sides_known=False))
    except ValueError as e:
        flag = f"--mrl_dims {args.mrl_dims!r}" if args.mrl_dims and "mrl_dims" in str(e) else f"--loss_type {args.loss_type}"
        raise UsageError(f"{flag}: {e}") from None
    check_lora_targets(args, template, config)
    check_metric_for_best_model(args, loss)
    # the data paths last: a flag that does not fit the loss says more than a file that is not there
    for flag in ("dataset", "val_dataset"):
        for spec in getattr(args, flag):
            try:
                parse_spec(spec)  # a path that is not there, a hub id, a bad #N: the user's data (exit status 1)
            except SpecError as e:
                raise SpecError(f"--{flag}: {e}") from None
    files = [("--eval_sts", args.eval_sts, os.path.isfile), ("--eval_beir", args.eval_beir, os.path.isdir)]
    files += [(f"--{flag}", path, os.path.isfile) for flag in ("teacher_scores_file", "teacher_embeddings_file")
              for path in getattr(args, flag)]
    for flag, path, exists in files:
        if path and not exists(path):  # the user's data, as a --dataset that is not there (exit status 1)
            raise SpecError(f"{flag} {path}: no such {'file' if exists is os.path.isfile else 'folder'}")


def check_metric_for_best_model(args: SftArguments, loss: EmbeddingLoss) -> None:
    """``--metric_for_best_model`` names a metric the run's evaluations log (with or without
    the ``eval_`` prefix, as transformers reads it), so a typo is refused now rather than a
    KeyError at the first evaluation. A run that evaluates nothing never reads it."""
    name = args.metric_for_best_model
    dataset = bool(args.val_dataset) or args.split_dataset_ratio > 0
    if not name or str(getattr(args.eval_strategy, "value", args.eval_strategy)) == "no":
        return
    logged = eval_metric_names(loss.layout, dataset, bool(args.eval_beir), bool(args.eval_sts))
    if (name if name.startswith("eval_") else f"eval_{name}") not in logged:
        raise UsageError(f"--metric_for_best_model {name!r} is not a metric this run logs; it logs "
                         f"{', '.join(sorted(logged))}")


def _lora_flags(args: SftArguments) -> str:
    """The flags that chose the LoRA targets, as the user gave them (for an error about them)."""
    if args.target_regex:
        return f"--target_regex {args.target_regex!r}"
    flags = f"--target_modules {' '.join(args.target_modules)}"
    return flags + (f" --modules_to_save {' '.join(args.modules_to_save)}" if args.modules_to_save else "")


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
            targets = lora_target_modules(skeleton, list(args.target_modules), template, _frozen(args))
        except ValueError as e:
            raise UsageError(f"--target_modules all-linear: {e}") from None
        if isinstance(targets, list):
            missing = [t for t in targets if not matches(t)]
            if missing:
                raise UsageError(f"--target_modules {' '.join(args.target_modules)}: no module of {args.model} is "
                                 f"named {', '.join(missing)} (e.g. {', '.join(_linear_names(skeleton)[:6])})")
    missing = [m for m in args.modules_to_save if not matches(m)]
    if missing:
        raise UsageError(f"--modules_to_save {' '.join(args.modules_to_save)}: no module of {args.model} is named "
                         f"{', '.join(missing)}")


def _linear_names(model: nn.Module) -> list[str]:
    """The distinct last name parts of the model's linear layers: what ``--target_modules`` takes."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})


def resume_weights_only(trainer: EmbeddingTrainer, args: SftArguments, resume: str) -> str | None:
    """ms-swift's ``--resume_only_model``: the checkpoint's weights, a fresh optimizer, learning
    rate schedule and RNG; the step count and the data position continue from the checkpoint's
    ``trainer_state.json`` (batches already trained are skipped) unless ``--ignore_data_skip
    true``, which starts at step 0. Returns what ``Trainer.train`` resumes from (None: afresh)."""
    load_backbone_weights(trainer.accelerator.unwrap_model(trainer.model).backbone, resume)
    state = os.path.join(resume, "trainer_state.json")
    if args.ignore_data_skip or not os.path.isfile(state):
        why = "--ignore_data_skip true" if args.ignore_data_skip else "it has no trainer_state.json"
        logger.info("--resume_only_model: weights from %s; step count, data position, optimizer, scheduler and RNG "
                    "start afresh (%s)", resume, why)
        return None
    with open(state, encoding="utf-8") as f:
        step = json.load(f).get("global_step", 0)
    logger.info("--resume_only_model: weights from %s; training goes on from step %d with the data that follows "
                "(--ignore_data_skip true starts at step 0); optimizer, scheduler and RNG start afresh", resume, step)
    trainer.weights_only_resume = True
    return resume


def run_sft(args: SftArguments) -> dict[str, Any]:
    """Train as ``args`` say; returns the final metrics and the last checkpoint path (the
    checkpoint this run wrote at its last step)."""
    from transformers import set_seed

    set_seed(args.seed)
    check_settings(args)
    if args.offline:  # the media loader reads the switch where data-loader workers see it too
        os.environ["MMEMBED_OFFLINE"] = "1"
    resume = resume_checkpoint(args)
    prepare_output_dir(args, resume)
    trainer = build_trainer(args)
    if resume and args.resume_only_model:
        resume = resume_weights_only(trainer, args, resume)
    trainer.last_checkpoint = resume  # the run's result until it saves (DeepSpeed loads without _load_from_checkpoint)
    result = trainer.train(resume_from_checkpoint=resume)
    final = trainer.last_checkpoint
    if str(getattr(args.save_strategy, "value", args.save_strategy)) == "no":
        # no checkpoints, no optimizer state: the trained model alone (weights or adapter,
        # tokenizer / processor, mmembed.json), which embeds and exports but does not resume
        final = os.path.join(args.output_dir, f"checkpoint-{trainer.state.global_step}")
        trainer.save_final_model(final)
    metrics: dict[str, Any] = dict(result.metrics)
    if trainer.eval_dataset is not None or trainer.eval_tasks:
        metrics.update(trainer.evaluate())
    metrics["last_checkpoint"] = final
    if args.should_save:
        logger.info("last checkpoint: %s", final)
    if trainer.state.best_model_checkpoint:  # with --metric_for_best_model
        metrics["best_model_checkpoint"] = trainer.state.best_model_checkpoint
        if args.should_save:
            logger.info("best checkpoint: %s (%s %s)%s", trainer.state.best_model_checkpoint, args.metric_for_best_model,
                        trainer.state.best_metric, ", loaded at the end" if args.load_best_model_at_end else "")
    return metrics
