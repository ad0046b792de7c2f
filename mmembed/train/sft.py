"""``mmembed sft``: data, template, model, loss and trainer wired together."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

from torch import nn

from ..data import EmbeddingDataset, load_samples, split_dataset
from ..data.sample import Sample
from ..data.teacher import TeacherFiles, teacher_signal
from ..encoding.collator import EmbeddingCollator, layout_for_loss, token_lengths
from ..encoding.inputs import InputBuilder
from ..encoding.templates import Template, get_template
from ..losses import build_loss
from ..model.embedding import (
    MULTIMODAL_PARTS,
    EmbeddingModel,
    default_max_length,
    frozen_parts,
    hidden_size,
    load_backbone,
    module_part,
    require_local_model,
)
from .arguments import SftArguments, UsageError
from .distributed import GlobalBatchLoss, uses_whole_batch
from .trainer import EmbeddingTrainer, check_complete, find_last_complete_checkpoint

logger = logging.getLogger("mmembed")


def load_processing(path: str, template: Template):
    """The tokenizer, or for a template that takes media the model's processor (which holds
    the tokenizer and the image/video processors or audio feature extractor)."""
    from transformers import AutoProcessor, AutoTokenizer

    if template.media:
        return AutoProcessor.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def resolve_template(model_dir: str, name: str | None, model_type: str | None, system: str | None) -> Template:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    template = get_template(name, model_type, getattr(config, "model_type", None))
    if system is not None:
        template = dataclasses.replace(template, default_system=system)
    return template


def lora_target_modules(model: nn.Module, target_modules: list[str], frozen: set[str] = frozenset()) -> str | list[str]:
    """``all-linear`` as ms-swift means it: every linear layer of the transformer, but not
    heads or the (unused) BERT pooler; in a multimodal model only the parts not frozen
    (by default the LLM: ``--freeze_vit`` and ``--freeze_aligner`` are on). Other names
    pass to PEFT unchanged."""
    if target_modules != ["all-linear"]:
        return target_modules
    skip = ("lm_head", "pooler", "score", "classifier")
    model_type = getattr(model.config, "model_type", "")
    linear = [
        name for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and not any(s in name.split(".") for s in skip)
    ]
    if model_type in MULTIMODAL_PARTS:
        # full names: a suffix such as "qkv" or "fc1" would also match inside frozen parts
        names = sorted(n for n in linear if module_part(n, model_type) not in frozen and module_part(n, model_type))
    else:
        names = sorted({n.rsplit(".", 1)[-1] for n in linear})
    if not names:
        raise ValueError("no linear layers found for --target_modules all-linear (are all parts frozen?)")
    return names


def apply_lora(backbone: nn.Module, args: SftArguments) -> nn.Module:
    from peft import LoraConfig, TaskType, get_peft_model

    config = LoraConfig(
        task_type=TaskType.FEATURE_EXTRACTION,
        r=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=lora_target_modules(backbone, list(args.target_modules), _frozen(args)),
    )
    return get_peft_model(backbone, config)


def freeze_parts(backbone: nn.Module, frozen: set[str]) -> int:
    """Full training of a multimodal model: parameters of the frozen parts keep their
    values. Returns how many parameter tensors were frozen."""
    model_type = getattr(backbone.config, "model_type", "")
    count = 0
    for name, p in backbone.named_parameters():
        if module_part(name, model_type) in frozen:
            p.requires_grad_(False)
            count += 1
    return count


def _frozen(args: SftArguments) -> set[str]:
    return frozen_parts(args.freeze_vit, args.freeze_aligner, args.freeze_llm)


def drop_overlong(ds, builder: InputBuilder, layout: str, max_length: int, num_proc: int, what: str):
    """``--truncation_strategy delete``: remove rows with any input over ``max_length`` tokens
    (media expanded, as the model sees them), and say how many."""

    def keep(batch: dict[str, list]) -> list[bool]:
        samples = [Sample.from_json(s) for s in batch["sample"]]
        return [n <= max_length for n in token_lengths(samples, builder, layout)]

    before = len(ds)
    ds = ds.filter(keep, batched=True, num_proc=num_proc if num_proc > 1 else None, desc=f"length check ({what})")
    dropped = before - len(ds)
    if dropped:
        logger.warning(
            "%s: %d of %d rows are longer than --max_length %d tokens and were deleted (--truncation_strategy delete; "
            "use left/right to truncate them instead)", what, dropped, before, max_length,
        )
    return ds


def make_loss(args: SftArguments) -> nn.Module:
    """The loss named by ``--loss_type`` with ``--loss_kwargs``, wrapped in Matryoshka when
    ``--mrl_dims`` is given."""
    options = json.loads(args.loss_kwargs) if args.loss_kwargs else {}
    if args.mrl_dims:
        return build_loss("matryoshka", dims=args.mrl_dims, inner=args.loss_type, **options)
    return build_loss(args.loss_type, **options)


def load_aux_models(args: SftArguments) -> tuple[dict[str, EmbeddingModel], dict[str, InputBuilder]]:
    """The guide (``--guide_model``, GIST) and the teacher (``--teacher_model``, distillation):
    frozen embedders, each with its own template and tokenizer or processor, that embed the
    same items as the student (rendered from the items, not decoded from the student's ids)."""
    from ..model.embedder import load_embedding_model

    models: dict[str, EmbeddingModel] = {}
    builders: dict[str, InputBuilder] = {}
    for name, path in (("guide", args.guide_model), ("teacher", args.teacher_model)):
        if not path:
            continue
        model, processing, template, info = load_embedding_model(path, args.torch_dtype)
        model.requires_grad_(False)
        models[name] = model.eval()
        builders[name] = InputBuilder(template, processing, info["max_length"], truncate=True)
    return models, builders


def data_teacher(args: SftArguments, loss: nn.Module, train: EmbeddingDataset) -> dict[str, int | None]:
    """Distillation without ``--teacher_model``: the teacher signal every training row must
    carry (row fields or ``--teacher_*_file``), checked on every row before training.

    Returns:
        ``{"teacher_scores": None}`` or ``{"teacher_embeddings": width}`` (what the
        collator puts in each batch); ``{}`` when the data gives no teacher.
    """
    if not args.loss_type.startswith("distill_"):
        return {}
    if args.teacher_model:
        first = train[0] if len(train) else None
        if first is not None and (first.teacher_scores is not None or first.teacher_embeddings is not None):
            logger.warning("the rows carry teacher scores or embeddings; --teacher_model is the teacher, so they are unused")
        return {}
    key, width = teacher_signal((train[i] for i in range(len(train))), args.loss_type, uses_whole_batch(loss), "training")
    logger.info("teacher from the data: %s%s", key, f" (width {width})" if width else "")
    return {key: width}


def load_eval_tasks(args: SftArguments) -> dict[str, Any]:
    """``--eval_beir`` and ``--eval_sts``, read and checked before training (a bad file fails
    now, not at the first evaluation)."""
    tasks: dict[str, Any] = {}
    if args.eval_beir:
        from ..eval.beir import load_beir

        try:
            tasks["beir"] = load_beir(args.eval_beir, args.eval_beir_split)
        except ValueError as e:
            raise UsageError(f"--eval_beir: {e}") from None
    if args.eval_sts:
        from ..eval.sts import read_pairs

        tasks["sts"] = read_pairs(args.eval_sts)
    return tasks


def check_widths(args: SftArguments, loss: nn.Module, width: int, aux_models: dict[str, EmbeddingModel],
                 data_teacher_keys: dict[str, int | None] | None = None) -> None:
    """Width errors at start, not mid-run: Matryoshka widths above the model's, and a
    teacher (model or data) of another width for the embedding distillation losses."""
    if hasattr(loss, "check_dims"):
        try:
            loss.check_dims(width)
        except ValueError as e:
            raise UsageError(f"--mrl_dims: {e}") from None
    teacher_width = None
    if "teacher" in aux_models:
        teacher_width = hidden_size(aux_models["teacher"].config)
    elif data_teacher_keys:
        teacher_width = data_teacher_keys.get("teacher_embeddings")
    if args.loss_type in ("distill_cosine", "distill_mse", "distill_marginal") and teacher_width is not None:
        if teacher_width != width:
            raise UsageError(f"--loss_type {args.loss_type} compares embeddings directly, but the teacher's width is "
                             f"{teacher_width} and the student's {width}; use distill_kl (scores) instead")


def _init_deepspeed_comm() -> None:
    """DeepSpeed keeps its own view of the process group; ZeRO-3 builds the model under
    ``zero.Init``, which reads the world size from it, so it must wrap the group that
    accelerate started (gloo on CPU) before the model is loaded."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_initialized() and not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend())


def build_model(args: SftArguments, pooling: str) -> EmbeddingModel:
    backbone = load_backbone(args.model, args.torch_dtype, args.attn_impl)
    if args.tuner_type == "lora":
        backbone = apply_lora(backbone, args)
    elif freeze_parts(backbone, _frozen(args)):
        logger.info("full training with frozen parts: %s", ", ".join(sorted(_frozen(args))))
    return EmbeddingModel(backbone, pooling, length_chunks=args.length_chunks)


def run_sft(args: SftArguments) -> dict[str, Any]:
    """Train as ``args`` say; returns the final metrics and the last checkpoint path."""
    from transformers import set_seed

    set_seed(args.seed)
    require_local_model(args.model)  # the tokenizer loads before the model does
    template = resolve_template(args.model, args.template, args.model_type, args.system)
    if args.padding_side:
        template = dataclasses.replace(template, padding_side=args.padding_side)
    processing = load_processing(args.model, template)
    tokenizer = getattr(processing, "tokenizer", None) or processing
    pooling = args.pooling or template.resolve_pooling(args.model)
    max_length = args.max_length or default_max_length(args.model, tokenizer)
    layout = layout_for_loss(args.loss_type)
    loss_fn = GlobalBatchLoss(make_loss(args), args.loss_type)
    aux_models, aux_builders = load_aux_models(args)

    load_opts = dict(strict=args.strict, seed=args.seed, num_proc=args.dataset_num_proc,
                     load_from_cache_file=args.load_from_cache_file)
    loaded = load_samples(args.dataset, **load_opts)
    train = loaded.dataset
    try:
        teacher_files = TeacherFiles.open(loaded.files, loaded.records, args.teacher_scores_file,
                                          args.teacher_embeddings_file)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.val_dataset:
        val = load_samples(args.val_dataset, **load_opts).dataset
    else:
        train, val = split_dataset(train, args.split_dataset_ratio, args.seed)
    if args.truncation_strategy == "delete":
        builder = InputBuilder(template, processing, max_length, truncate=False)
        train = drop_overlong(train, builder, layout, max_length, args.dataset_num_proc, "train")
        if val is not None:
            val = drop_overlong(val, builder, layout, max_length, args.dataset_num_proc, "val")
    if len(train) == 0:
        raise ValueError("no training rows left after loading " + ", ".join(args.dataset))

    teacher_keys = data_teacher(args, loss_fn.loss, EmbeddingDataset(train, teacher_files))
    if teacher_keys and val is not None:  # eval rows may go without, but what they carry must fit
        val_rows = EmbeddingDataset(val, teacher_files)
        for i in range(len(val_rows)):
            val_rows[i]
    eval_tasks = load_eval_tasks(args)

    if args.deepspeed:
        _init_deepspeed_comm()
    model = build_model(args, pooling)
    check_widths(args, loss_fn.loss, hidden_size(model.config), aux_models, teacher_keys)
    collator = EmbeddingCollator(
        template, processing, layout, max_length,
        truncation_side="left" if args.truncation_strategy == "left" else "right",
        truncate=args.truncation_strategy != "delete",
        aux_builders=aux_builders,
        teacher_keys=tuple(teacher_keys),
    )
    mmembed_config = {
        "base_model": os.path.abspath(args.model),
        "template": template.name,
        "default_system": template.default_system,
        "padding_side": template.padding_side,
        "pooling": pooling,
        "media": sorted(template.media),
        "normalize": True,
        "max_length": max_length,
        "tuner_type": args.tuner_type,
        "loss_type": args.loss_type,
    }
    trainer = EmbeddingTrainer(
        model=model,
        args=args,
        train_dataset=EmbeddingDataset(train, teacher_files),
        eval_dataset=EmbeddingDataset(val, teacher_files) if val is not None else None,
        data_collator=collator,
        processing_class=processing,
        loss_fn=loss_fn,
        loss_type=args.loss_type,
        mmembed_config=mmembed_config,
        gradcache_mini_batch_size=args.gradcache_mini_batch_size,
        aux_models=aux_models,
        eval_tasks=eval_tasks,
    )
    resume = args.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() in ("true", "last"):
        resume = find_last_complete_checkpoint(args.output_dir)
        if resume is None:
            raise FileNotFoundError(f"--resume_from_checkpoint true: no complete checkpoint under {args.output_dir}")
    elif isinstance(resume, str) and resume.lower() in ("false", "none", ""):
        resume = None
    if resume:
        check_complete(resume)  # before the Trainer's own loaders (DeepSpeed's included) read it
    result = trainer.train(resume_from_checkpoint=resume)
    final = os.path.join(args.output_dir, f"checkpoint-{trainer.state.global_step}")
    if not os.path.isdir(final):
        trainer._save_checkpoint(trainer.model, trial=None)
    metrics: dict[str, Any] = dict(result.metrics)
    if val is not None or eval_tasks:
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

