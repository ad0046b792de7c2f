"""EmbeddingTrainer: the transformers Trainer, taught to train and evaluate embedders.

The trainer is the loss call plus wiring; each side concern has a home of its own:

- the loss call (here): ``compute_loss`` embeds the collated batch and applies the loss to
  ``{"last_hidden_state": [N, D]}`` and ``labels``; ``training_step`` does the same through
  the gradient cache (:mod:`mmembed.training.gradcache`) with ``--gradcache_mini_batch_size``;
- a NaN or infinite loss or gradient stops the run, so do ``--zero_loss_patience`` steps in
  a row with loss and gradient exactly 0; the last step is always saved
  (:mod:`mmembed.training.guards`); SIGTERM / SIGUSR1 stop it after the current step, saved
  (:mod:`mmembed.training.preemption`);
- the rows each process trains on, in ms-swift's order or one dataset per global batch
  (:mod:`mmembed.training.samplers`);
- per-part learning rates as optimizer groups (:mod:`mmembed.training.optimizer`);
- ``evaluate``: the eval set embedded once, its loss and metrics, and the held-out tasks
  (:mod:`mmembed.training.evaluation`);
- checkpoints whole or absent, and resuming from them (:class:`~mmembed.training.saving.CheckpointSaving`,
  mixed in; the protocol is :mod:`mmembed.training.checkpoints`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from transformers import Trainer

from ..encoding.collator import CollatedBatch, raise_batch_error
from ..encoding.inputs import select_rows, split_rows
from ..losses import Side, build_loss
from ..model.embedding import EmbeddingModel
from ..model.folder import write_saved_folder
from .device_flags import import_deepspeed_only_when_used
from .distributed import GlobalBatchLoss, max_over_processes, world
from .evaluation import evaluation_metrics
from .gradcache import GradCache, deepspeed_chunk_backward
from .guards import SaveLastStep, ZeroLossStop, check_grad_norm, check_loss
from .optimizer import split_by_learning_rate
from .preemption import PreemptionStop
from .samplers import check_resumed_state, pass_through_shards, resumed_epoch, train_sampler
from .saving import CheckpointSaving
from .stream_samplers import StreamBatches


class EmbeddingTrainer(CheckpointSaving, Trainer):
    """The transformers Trainer for embedders. Beside the Trainer's own arguments:

    Args:
        loss: The loss (an :class:`~mmembed.losses.EmbeddingLoss`; default ``infonce`` as
            the ``INFONCE_*`` variables set it). It is wrapped for several processes here.
        side_models: Frozen models that embed the same rows for the loss's side inputs:
            ``{"guide": model}`` (GIST) and/or ``{"teacher": model}`` (distillation).
        eval_tasks: ``--eval_beir`` / ``--eval_sts`` (:class:`~mmembed.eval.tasks.HeldOutTasks`).
        mmembed_config: What ``mmembed.json`` in each checkpoint holds (template, pooling,
            ...); default: the model's pooling.
        param_lrs: ``id(parameter) -> learning rate`` (``--vit_lr`` / ``--aligner_lr``).
        dataset_names: ``--dataset_config``'s datasets in index order (a batch's
            ``dataset_ids`` index them): the training log gets ``loss_<name>``, the mean loss
            of the batches drawn from each dataset since the last log (batches of one dataset).
        dataset_losses: ``{dataset index: loss}`` for the datasets with loss settings of their
            own; a batch from such a dataset is scored with its loss (every batch must then
            come from one dataset, on every process).
        train_datasets: The training datasets in index order (objects with ``name`` and
            ``weight``: ``TrainingData.datasets``), which the sampler draws from
            (``--multi_dataset_sampler``); None: the training rows are one dataset.

    ``args`` may be plain ``TrainingArguments``; ``args.gradcache_mini_batch_size`` (mmembed's
    ``SftArguments``) turns the gradient cache on.
    """

    def __init__(self, *args, loss=None, side_models: dict[str, EmbeddingModel] | None = None, eval_tasks=None,
                 mmembed_config: dict[str, Any] | None = None, param_lrs: dict[int, float] | None = None,
                 dataset_names: list[str] | None = None, dataset_losses: dict[int, Any] | None = None,
                 train_datasets: list | None = None, folder_writer: Any = None, **kwargs):
        # the Trainer refuses an eval strategy without an eval set; --eval_beir / --eval_sts
        # are something to evaluate too, so it gets a stand-in that evaluate() never reads
        import_deepspeed_only_when_used()  # no "Setting accelerator to CPU" on runs without DeepSpeed
        tasks_only = kwargs.get("eval_dataset") is None and bool(eval_tasks)
        if tasks_only:
            kwargs["eval_dataset"] = ()
        super().__init__(*args, **kwargs)
        if tasks_only:
            self.eval_dataset = None
        self.eval_tasks = eval_tasks
        loss = loss if loss is not None else build_loss("infonce")
        self.loss_fn = loss if isinstance(loss, GlobalBatchLoss) else GlobalBatchLoss(loss)
        layout = getattr(self.data_collator, "layout", None)
        if layout is not None and layout != self.loss.layout:
            raise ValueError(f"the collator lays batches out as {layout!r} but the loss takes {self.loss.layout.value!r}")
        self.side_models = {name: m.to(self.args.device) for name, m in (side_models or {}).items()}
        # EmbeddingModel.forward takes **inputs, from which the Trainer concludes that the
        # model normalizes its loss by num_items_in_batch and skips dividing the loss by
        # gradient_accumulation_steps; compute_loss does no such thing, so the Trainer must
        # divide (otherwise a step's gradient is the sum, not the mean, of its micro-batches')
        self.model_accepts_loss_kwargs = False
        self.gradcache_mini_batch_size = getattr(self.args, "gradcache_mini_batch_size", 0) or 0
        if mmembed_config is None:
            mmembed_config = {"pooling": self.accelerator.unwrap_model(self.model).pooling, "normalize": True}
        self.mmembed_config = mmembed_config
        self.folder_writer = folder_writer or write_saved_folder  # the task's (Task.folder_writer)
        self.param_lrs = param_lrs or {}
        self.zero_loss = ZeroLossStop(getattr(self.args, "zero_loss_patience", 0) or 0)  # plain TrainingArguments: off
        self.add_callback(SaveLastStep())
        self.preemption = PreemptionStop()  # SIGTERM / SIGUSR1: save the step, then stop (run_sft reports it)
        self.add_callback(self.preemption)
        self.train_datasets = train_datasets
        self.training_sampler = None  # the sampler of the training rows, once the data loader is built
        self.eval_embedded = None  # EvalEmbeddings of the last evaluation (a small eval set: the charts reuse them)
        self.resuming_from: str | None = None  # the checkpoint train() resumes from
        self.dataset_names = list(dataset_names or [])
        self.dataset_loss_fns = {int(i): (f if isinstance(f, GlobalBatchLoss) else GlobalBatchLoss(f))
                                 for i, f in (dataset_losses or {}).items()}
        for f in self.dataset_loss_fns.values():
            if f.loss.layout != self.loss.layout:
                raise ValueError("a dataset's loss lays batches out as the run's loss must: "
                                 f"{f.loss.layout.value!r} against {self.loss.layout.value!r}")
        self._dataset_loss_sums: torch.Tensor | None = None  # [datasets, 2]: sum of batch losses, batches

    @property
    def loss(self):
        """The loss itself (``loss_fn`` is it wrapped for several processes)."""
        return self.loss_fn.loss

    # ---- the loss call --------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        batch = CollatedBatch.unpack(inputs)
        loss_fn, dataset = self.batch_loss(batch.dataset_ids)
        side = self.side_inputs(batch.side)
        outputs = {**model(**batch.inputs), **side.outputs()}
        loss = self._checked(loss_fn(outputs, batch.labels))
        self._count_dataset_loss(dataset, loss)
        return (loss, outputs) if return_outputs else loss

    # ---- several datasets (--dataset_config) -----------------------------------------
    def batch_loss(self, dataset_ids: torch.Tensor | None) -> tuple[GlobalBatchLoss, int | None]:
        """The loss for a batch whose samples came from ``dataset_ids`` (the collator's
        ``dataset_ids``; None: not given) and the one dataset it came from (None when mixed).

        A dataset with loss settings of its own needs the whole global batch from it: a batch
        of several datasets, or processes whose batches came from different datasets, is then
        an error (the homogeneous ``--multi_dataset_sampler`` modes make no such batch)."""
        if not self.dataset_loss_fns:
            return self.loss_fn, batch_dataset(dataset_ids)
        dataset = one_dataset(dataset_ids, self.dataset_names, self.args.device)
        return self.dataset_loss_fns.get(dataset, self.loss_fn), dataset

    def _count_dataset_loss(self, dataset: int | None, loss: torch.Tensor) -> None:
        """Add a training batch's loss to its dataset's sum for the next log's ``loss_<name>``."""
        if dataset is None or not self.dataset_names or not self.model.training:
            return
        if self._dataset_loss_sums is None:
            self._dataset_loss_sums = torch.zeros(len(self.dataset_names), 2, dtype=torch.float64,
                                                  device=loss.device)
        self._dataset_loss_sums[dataset, 0] += loss.detach().double()
        self._dataset_loss_sums[dataset, 1] += 1

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        """The Trainer's log; a training log (``loss``) gets ``loss_<name>`` for each dataset
        the batches since the last log drew from: the mean of their losses over all processes
        (every process logs together, as the Trainer's own loss is gathered)."""
        if "loss" in logs and self.dataset_names:
            sums = self._dataset_loss_sums
            if sums is None:
                sums = torch.zeros(len(self.dataset_names), 2, dtype=torch.float64, device=self.args.device)
            if world()[1] > 1:
                sums = sums.clone()
                torch.distributed.all_reduce(sums)
            for name, (total, count) in zip(self.dataset_names, sums.tolist()):
                if count:
                    logs[f"loss_{name}"] = total / count
            if self._dataset_loss_sums is not None:
                self._dataset_loss_sums.zero_()
        super().log(logs, *args, **kwargs)

    @torch.no_grad()
    def side_inputs(self, batch) -> Side:
        """The loss's side inputs for a batch (a :class:`~mmembed.encoding.collator.SideBatch`):
        the guide's / teacher's embeddings of the same rows (their inputs embedded here,
        without gradient), or the teacher's scores / embeddings the data gave."""
        if batch is None:
            return Side()
        batch = batch.to(self.args.device)

        def embed(name: str, inputs):
            if inputs is None:
                return None
            if name not in self.side_models:
                raise ValueError(f"the batch holds inputs for a {name} model, but the trainer has none")
            return self.side_models[name](**inputs)["last_hidden_state"]

        teacher = embed("teacher", batch.teacher_inputs)
        return Side(guide=embed("guide", batch.guide_inputs),
                    teacher=teacher if teacher is not None else batch.teacher_embeddings,
                    teacher_scores=batch.teacher_scores)

    def _checked(self, loss: torch.Tensor) -> torch.Tensor:
        """Every process checks every micro-batch's loss and they agree, so all stop at the
        first non-finite one, before its backward pass and before any later checkpoint. A
        finite one is counted for the zero-loss stop."""
        loss = check_loss(loss, self.state.global_step + 1, self.last_checkpoint, self.args.device)
        if self.model.training:
            self.zero_loss.saw_loss(loss, self.state.global_step + 1)
        return loss

    def _get_grad_norm(self, model, grad_norm=None):
        """The step's gradient norm, checked like the loss (not under fp16 loss scaling, where
        an overflow is expected and the step skipped): the update would write non-finite
        weights into the next checkpoint."""
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        if not self.args.fp16:
            check_grad_norm(grad_norm, self.state.global_step + 1, self.last_checkpoint)
        self.zero_loss.saw_step(grad_norm, self.state.global_step + 1, self.last_checkpoint, self.args.device)
        return grad_norm

    # ---- the training step ----------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        """With ``--gradcache_mini_batch_size N``: the batch is embedded in chunks of N rows
        without graph, the loss (gathered across processes as usual) is backpropagated to the
        embeddings, then each chunk is embedded again with graph and receives its cached
        gradient (DDP synchronizes on the last chunk only; DeepSpeed: see
        :func:`~mmembed.training.gradcache.deepspeed_chunk_backward`). Same gradients, the
        memory of N rows."""
        raise_batch_error(inputs)  # a row a data-loader worker could not collate
        if not self.gradcache_mini_batch_size:
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        batch = CollatedBatch.unpack(self._prepare_inputs(inputs))
        inputs, labels = batch.inputs, batch.labels
        loss_fn, dataset = self.batch_loss(batch.dataset_ids)
        side = self.side_inputs(batch.side).outputs()  # whole batch, no gradient
        scale = 1.0 / self.current_gradient_accumulation_steps
        # mini-batches of rows of similar length carry little padding; the loss sees the
        # embeddings back in the batch's order. Rows move with their own images, videos
        # and audio (select_rows), and chunks are cut the same way (split_rows).
        order = torch.argsort(inputs["attention_mask"].sum(1), stable=True)
        restore = torch.argsort(order)
        inputs = select_rows(inputs, order)

        def loss_in_batch_order(outputs, lab):
            return loss_fn({"last_hidden_state": outputs["last_hidden_state"][restore], **side}, lab)

        loss = self.gradcache_step(model, model, loss_in_batch_order, inputs, labels, scale)
        self._count_dataset_loss(dataset, loss)
        return loss.detach() * scale

    def gradcache_step(self, model, forward, loss_fn, inputs, labels, scale: float):
        """One cached step (:class:`~mmembed.training.gradcache.GradCache`) of ``forward`` (the
        model, or a function of a chunk's inputs giving ``{"last_hidden_state": ...}``) under
        ``loss_fn(outputs, labels)``, the loss scaled by ``scale`` before its backward, with the
        process group's rules: under DeepSpeed every process runs as many chunk passes
        (:func:`~mmembed.training.gradcache.deepspeed_chunk_backward`); under DDP only the last
        chunk's backward communicates, so chunk counts may differ. Returns the loss (unscaled)."""
        if self.is_deepspeed_enabled:
            backward_fn, no_sync = deepspeed_chunk_backward(self.accelerator), None
            num_chunks_fn = functools.partial(max_over_processes, device=self.args.device)
        else:
            backward_fn, no_sync, num_chunks_fn = None, getattr(model, "no_sync", None), None
        cache = GradCache(forward, loss_fn, self.gradcache_mini_batch_size, split_fn=split_rows)
        return cache.step(inputs, labels, loss_backward_fn=lambda value: (self._checked(value) * scale).backward(),
                          backward_fn=backward_fn, no_sync=no_sync, num_chunks_fn=num_chunks_fn)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """The Trainer's loop, with two of its steps left out where mmembed did them already:

        - ``--use_liger_kernel`` was applied to the backbone when it was built
          (``build_model``); the Trainer would apply it again to the EmbeddingModel wrapper,
          which is no PreTrainedModel, and warn that nothing was applied.
        - under DeepSpeed the engine loads its checkpoint with ``weights_only=True`` (and not
          at all with ``--resume_only_model``):
          :meth:`~mmembed.training.saving.CheckpointSaving.guarded_engine_load`.

        SIGTERM / SIGUSR1 during the loop stop it after the current step, saved
        (:mod:`mmembed.training.preemption`).
        """
        liger, self.args.use_liger_kernel = self.args.use_liger_kernel, False
        self.resuming_from = resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None
        try:
            with self.guarded_engine_load(resume_from_checkpoint), self.preemption.handling():
                return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self.args.use_liger_kernel = liger

    # ---- delegated: optimizer groups, samplers, evaluation ---------------------------
    def create_optimizer(self, model=None):
        """The Trainer's optimizer, its parameter groups split by ``param_lrs``."""
        return split_by_learning_rate(super().create_optimizer(model), self.param_lrs)

    def _get_train_sampler(self, train_dataset=None):
        """mmembed's sampler (:func:`~mmembed.training.samplers.train_sampler`; the datasets'
        names and weights from ``train_datasets``), kept as ``training_sampler`` for the
        checkpoints' record of its position; on resuming, that record must match
        (:func:`~mmembed.training.samplers.check_resumed_state`)."""
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        sampler = train_sampler(dataset, self.args, self.train_datasets)
        self.training_sampler = sampler
        if sampler is not None and self.resuming_from and not self.args.ignore_data_skip:
            check_resumed_state(sampler, self.resuming_from)
        return sampler if sampler is not None else super()._get_train_sampler(train_dataset)

    def get_train_dataloader(self):
        """The Trainer's loader (accelerate's sharding passed through where mmembed's sampler shares
        the rows out). The global batches of a streamed ``--dataset_config`` run
        (:class:`~mmembed.training.stream_samplers.StreamBatches`) are their own sampler: kept
        as ``training_sampler`` for the checkpoints' record of the position, which a resumed run
        must reach (the Trainer skips the trained batches of the endless stream)."""
        loader = pass_through_shards(super().get_train_dataloader())
        if isinstance(self.train_dataset, StreamBatches):
            self.training_sampler = self.train_dataset
            if self.resuming_from and not self.args.ignore_data_skip:
                check_resumed_state(self.training_sampler, self.resuming_from)
        elif self.resuming_from and self.training_sampler is not None:
            resumed_epoch(self.training_sampler, len(loader), self.args.gradient_accumulation_steps, self.resuming_from)
        return loader

    @torch.no_grad()
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """The eval set's loss and metrics (when there is one) and the ``--eval_beir`` /
        ``--eval_sts`` tasks' metrics, logged as ``<prefix>_<name>``
        (:func:`~mmembed.training.evaluation.evaluation_metrics`)."""
        metrics = evaluation_metrics(self, eval_dataset, metric_key_prefix)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics


def batch_dataset(dataset_ids: torch.Tensor | None) -> int | None:
    """The one dataset a batch's ``dataset_ids`` name, or None (mixed, or not given)."""
    if dataset_ids is None or not dataset_ids.numel():
        return None
    first = int(dataset_ids[0])
    return first if bool((dataset_ids == first).all()) else None


def one_dataset(dataset_ids: torch.Tensor | None, names: list[str], device) -> int:
    """The one dataset of this step's batch on every process (``dataset_ids``: this process's),
    or a ValueError on every process when a batch mixes datasets or the processes' batches
    came from different datasets: a dataset's own loss must be the loss of the whole global
    batch, and its exchanges the same on every process. Every process takes part in the one
    exchange before any raises (one left in it would wait)."""
    advice = ("datasets with loss settings of their own need the whole global batch from one dataset: use "
              "--multi_dataset_sampler proportional, round_robin or weighted")
    if dataset_ids is None:
        raise ValueError(f"the batches carry no dataset_ids (the collator's with_dataset_ids=True); {advice}")
    dataset = batch_dataset(dataset_ids)
    local = dataset if dataset is not None else -1
    agree = True
    if world()[1] > 1:
        both = torch.tensor([local, -local], device=device)
        torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX)
        agree = int(both[0]) == -int(both[1])
    if dataset is None:
        ids = sorted({int(i) for i in dataset_ids.tolist()})
        named = [names[i] if i < len(names) else str(i) for i in ids]
        raise ValueError(f"a batch holds rows of several datasets ({', '.join(named)}), but {advice}")
    if not agree:
        raise ValueError(f"the processes' batches of this step came from different datasets (or mixed ones), but {advice}")
    return dataset
