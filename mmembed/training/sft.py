"""``mmembed sft``: the run's sequence. Check the flags and the environment, find the
checkpoint to resume and prepare ``--output_dir``, assemble the trainer (loss, encoding,
data, side models, model, collator), train, save, and return the metrics.

What each step builds lives in a module of its own: :mod:`~mmembed.training.preflight` (the
up-front checks), :mod:`~mmembed.training.run_folder` (the output folder and resuming),
:mod:`~mmembed.training.model_assembly` (encoding, model, loss, side models) and
:mod:`~mmembed.training.data_assembly` (the rows of each source, checked by
:mod:`~mmembed.training.row_checks`: remote media, the length check; teacher signals,
held-out tasks).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..encoding.instructions import Instructions
from ..encoding.templates import template_config
from ..environment import Environment
from ..environment import read as read_environment
from ..losses import EmbeddingLoss
from ..model.embedding import hidden_size
from ..task import get_task
from .arguments import SftArguments
from .charts import TrainingCharts, eval_similarities
from .data_assembly import TrainingData, check_drop_last, load_eval_tasks, read_once
from .device_flags import training_padding
from .evaluation import final_evaluation
from .flag_checks import has_accelerator
from .hooks import arm_test_hooks
from .model_assembly import (
    Encoding,
    SideModels,
    build_model,
    check_loss_setup,
    init_deepspeed_comm,
    part_learning_rates,
)
from .preemption import preempted
from .preflight import RunSetup, check_settings
from .quant_flags import quantization
from .run_folder import prepare_output_dir, resume_checkpoint, resume_weights_only, training_facts
from .sample_packs import pack_training_rows
from .samplers import check_sampling
from .trainer import EmbeddingTrainer

logger = logging.getLogger("mmembed")


def run_sft(args: SftArguments, environment: Environment | None = None) -> dict[str, Any]:
    """Train as ``args`` say; returns the final metrics and the last checkpoint path (the
    checkpoint this run wrote at its last step). ``environment``: the variables as the
    run reads them at its start (None: read now): the up-front checks, the media settings and
    the test hooks come from it (the loss and the data reader, library functions, read theirs
    through :mod:`mmembed.environment` when they are built)."""
    from transformers import set_seed

    environment = read_environment(environment)
    arm_test_hooks(environment.test_hooks)
    set_seed(args.seed)
    setup = check_settings(args, environment)
    resume = resume_checkpoint(args)
    prepare_output_dir(args, resume)
    trainer = get_task(args.task_type).build_trainer(args, setup)  # the embedding task's: build_trainer below
    if resume and args.resume_only_model:
        resume = resume_weights_only(trainer, args, resume)
    trainer.last_checkpoint = resume  # the run's result until it saves (DeepSpeed loads without _load_from_checkpoint)
    result = trainer.train(resume_from_checkpoint=resume)
    final = trainer.last_checkpoint
    model_only = str(getattr(args.save_strategy, "value", args.save_strategy)) == "no"
    if model_only:
        # no checkpoints, no optimizer state: the trained model alone (weights or adapter,
        # tokenizer / processor, mmembed.json), which embeds and exports but does not resume
        final = os.path.join(args.output_dir, f"checkpoint-{trainer.state.global_step}")
        trainer.save_final_model(final)
    stop = trainer.preemption
    if stop.stopped_at is not None and trainer.state.global_step < trainer.state.max_steps:
        # SIGTERM / SIGUSR1: the step is saved; no evaluation in the time left before the kill
        raise preempted(stop, trainer.state.global_step, final, resumable=not model_only)
    metrics: dict[str, Any] = dict(result.metrics)
    if trainer.eval_dataset is not None or trainer.eval_tasks:
        metrics.update(final_evaluation(trainer))
    metrics["last_checkpoint"] = final
    if args.should_save:
        logger.info("last checkpoint: %s", final)
    if trainer.state.best_model_checkpoint:  # with --metric_for_best_model
        metrics["best_model_checkpoint"] = trainer.state.best_model_checkpoint
        if args.should_save:
            logger.info("best checkpoint: %s (%s %s)%s", trainer.state.best_model_checkpoint, args.metric_for_best_model,
                        trainer.state.best_metric, ", loaded at the end" if args.load_best_model_at_end else "")
    return metrics


def run_data(args: SftArguments, setup: RunSetup | None = None) -> tuple[RunSetup, Encoding, TrainingData]:
    """What every task's trainer starts from: the up-front checks' ``setup`` (made now when
    None), the encoding, and the rows, read once per node and checked against the batch and the
    samplers (``--dataloader_drop_last``, ``--multi_dataset_sampler``)."""
    setup = check_settings(args) if setup is None else setup
    encoding = Encoding.resolve(args, setup.template)
    def read(reuse: bool) -> TrainingData:
        data = TrainingData.load(args, encoding, setup.loss, setup.media, reuse)
        if args.packing:  # ms-swift's packs of rows (mmembed.training.sample_packs), measured once per node too
            data.train = pack_training_rows(args, encoding, setup.media, setup.loss.layout, get_task(args.task_type),
                                            data.train)
        return data

    data = read_once(args, read)
    check_drop_last(args, data)
    check_sampling(args, data.train, getattr(data, "datasets", None))  # --multi_dataset_sampler against the data
    return setup, encoding, data


def run_collator_options(args: SftArguments, media) -> dict[str, Any]:
    """What every task's collator takes from the run's flags: the side a row is cut on
    (``--truncation_strategy``), bucketed widths (``--length_buckets``), the media settings,
    ``--strict`` and the datasets' instructions (``--dataset_config``)."""
    return {"truncation_side": "left" if args.truncation_strategy == "left" else "right",
            "bucket": bool(args.length_buckets), "media": media, "strict": args.strict,
            "instructions": Instructions.of(args.dataset_entries)}


def build_trainer(args: SftArguments, setup: RunSetup | None = None) -> EmbeddingTrainer:
    """Everything ``mmembed sft`` trains with, checked before the model loads where it can be:
    the encoding, the data, the side models and held-out tasks, then the model. ``setup``:
    what the up-front checks read and built (the media settings every builder of the run
    loads media with, the model's config and template, the loss); None: checked now
    (:func:`~mmembed.training.preflight.check_settings`)."""
    setup, encoding, data = run_data(args, setup)
    media, loss = setup.media, setup.loss
    eval_tasks = load_eval_tasks(args, encoding)
    side_models = SideModels.load(args, media)
    width = hidden_size(setup.config)
    check_loss_setup(args, loss, width, side_models, data.teacher_key, data.teacher_width)
    for own in data.losses.values():  # --dataset_config: the datasets' own losses
        check_loss_setup(args, own, width, side_models, data.teacher_key, data.teacher_width)
    if args.deepspeed:
        init_deepspeed_comm()
    task = get_task(args.task_type)
    model = build_model(args, encoding.template, encoding.pooling, head=task.model_head(args, encoding))
    collator = task.collator_type()(
        training_padding(encoding.template, args.padding_side, has_accelerator()), encoding.processing, loss.layout, encoding.max_length,
        truncate=args.truncation_strategy != "delete",
        guide=side_models.builders.get("guide"),
        teacher=side_models.builders.get("teacher"),
        teacher_signal=data.teacher_key,
        with_dataset_ids=True,
        **run_collator_options(args, media),
        **task.collator_options(args, encoding),
    )
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
        mmembed_config=task.saved_config(args, encoding, saved_config(args, encoding, loss, data)),
        folder_writer=task.folder_writer(),
        param_lrs=part_learning_rates(model, encoding.template, args),
        dataset_names=[d.name for d in data.datasets] if args.dataset_config else None,
        dataset_losses=data.losses,
        train_datasets=data.datasets,
    )
    trainer.add_callback(TrainingCharts(lambda: eval_similarities(trainer), x_label=task.score_name))
    return trainer


def saved_config(args: SftArguments, encoding: Encoding, loss: EmbeddingLoss, data: TrainingData) -> dict[str, Any]:
    """What each saved model's ``mmembed.json`` records: how the model embeds (base model,
    template, pooling, media, length), how it was trained, and :func:`training_facts`."""
    config = {
        "base_model": os.path.abspath(args.model),
        "template": template_config(encoding.template),
        "default_system": encoding.template.default_system,
        # each side's instruction (--query_system, --document_system; "datasets": each dataset's), see model.io
        "instructions": {"query": args.query_system, "document": args.document_system, "datasets": {}},
        "padding_side": encoding.template.padding_side,
        "pooling": encoding.pooling,
        "media": sorted(encoding.template.media),
        "normalize": True,
        "max_length": encoding.max_length,
        "tuner_type": args.tuner_type,
        "loss_type": args.loss_type,
        **training_facts(args, loss, data),
    }
    quant = quantization(args)
    if quant is not None:  # QLoRA: how the base was quantized while the adapter trained (ms-swift's flag names)
        config["quantization"] = quant.record()
    if args.dataset_config:  # each dataset's instructions, for the export's <name>_query prompts
        config.setdefault("instructions", {})["datasets"] = {
            d.name: {"query": d.entry.query_system, "document": d.entry.document_system}
            for d in data.datasets if d.entry is not None}
    return config
