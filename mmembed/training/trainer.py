"""EmbeddingTrainer: the transformers Trainer, taught to train and evaluate embedders.

- ``compute_loss`` embeds the collated batch and applies the loss to
  ``{"last_hidden_state": [N, D]}`` and ``labels``; a NaN or infinite loss stops the run.
- ``evaluate`` embeds the whole eval set once and reports ms-swift's metrics
  (infonce: mean_pos, mean_neg, margin; pair losses: pearson/spearman) plus retrieval
  (recall@1/5/10, MRR@10, nDCG@10) and the eval loss; then the held-out tasks
  (``--eval_beir``, ``--eval_sts``) through the Embedder ``mmembed eval`` uses.
- checkpoints hold the backbone (a PEFT adapter for LoRA, safetensors weights for full
  training), the tokenizer and ``mmembed.json``; each is written under a staging name,
  marked and renamed, so ``checkpoint-N`` is whole or absent whatever is killed when
  (:mod:`mmembed.training.checkpoints`), and resuming never picks an incomplete one.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Trainer

from ..encoding.collator import raise_batch_error
from ..encoding.inputs import select_rows, split_rows
from ..losses import Side, build_loss
from ..model.embedding import EmbeddingModel
from ..model.weights import load_backbone_weights  # noqa: F401  (re-exported: sft.py imports it from here)
from .distributed import GlobalBatchLoss, gather_sizes, world
from .evaluation import eval_loader, eval_metric_names, evaluation_metrics  # noqa: F401  (eval_metric_names: sft.py)
from .gradcache import GradCache
from .guards import SaveLastStep, check_grad_norm, check_loss
from .optimizer import split_by_learning_rate
from .samplers import pass_through_shards, train_sampler
from .saving import CheckpointSaving


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

    ``args`` may be plain ``TrainingArguments``; ``args.gradcache_mini_batch_size`` (mmembed's
    ``SftArguments``) turns the gradient cache on.
    """

    def __init__(self, *args, loss=None, side_models: dict[str, EmbeddingModel] | None = None, eval_tasks=None,
                 mmembed_config: dict[str, Any] | None = None, param_lrs: dict[int, float] | None = None, **kwargs):
        # the Trainer refuses an eval strategy without an eval set; --eval_beir / --eval_sts
        # are something to evaluate too, so it gets a stand-in that evaluate() never reads
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
        self.param_lrs = param_lrs or {}
        self.add_callback(SaveLastStep())

    def create_optimizer(self, model=None):
        """The Trainer's optimizer, its parameter groups split by ``param_lrs``."""
        return split_by_learning_rate(super().create_optimizer(model), self.param_lrs)

    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        sampler = train_sampler(dataset, self.args)
        return sampler if sampler is not None else super()._get_train_sampler(train_dataset)

    def get_train_dataloader(self):
        return pass_through_shards(super().get_train_dataloader())

    @property
    def loss(self):
        """The loss itself (``loss_fn`` is it wrapped for several processes)."""
        return self.loss_fn.loss

    # ---- training -------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        side = self.side_inputs(inputs.pop("side", None))
        outputs = {**model(**inputs), **side.outputs()}
        loss = self._checked(self.loss_fn(outputs, labels))
        return (loss, outputs) if return_outputs else loss

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
        first non-finite one, before its backward pass and before any later checkpoint."""
        return check_loss(loss, self.state.global_step + 1, self.last_checkpoint, self.args.device)

    def _get_grad_norm(self, model, grad_norm=None):
        """The step's gradient norm, checked like the loss (not under fp16 loss scaling, where
        an overflow is expected and the step skipped): the update would write non-finite
        weights into the next checkpoint."""
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        if not self.args.fp16:
            check_grad_norm(grad_norm, self.state.global_step + 1, self.last_checkpoint)
        return grad_norm

    def training_step(self, model, inputs, num_items_in_batch=None):
        """With ``--gradcache_mini_batch_size N``: the batch is embedded in chunks of N rows
        without graph, the loss (gathered across processes as usual) is backpropagated to the
        embeddings, then each chunk is embedded again with graph and receives its cached
        gradient (DDP synchronizes on the last chunk only; DeepSpeed: see
        :meth:`_deepspeed_chunk_backward`). Same gradients, the memory of N rows."""
        raise_batch_error(inputs)  # a row a data-loader worker could not collate
        if not self.gradcache_mini_batch_size:
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        inputs = self._prepare_inputs(inputs)
        labels = inputs.pop("labels")
        side = self.side_inputs(inputs.pop("side", None)).outputs()  # whole batch, no gradient
        scale = 1.0 / self.current_gradient_accumulation_steps
        # mini-batches of rows of similar length carry little padding; the loss sees the
        # embeddings back in the batch's order. Rows move with their own images, videos
        # and audio (select_rows), and chunks are cut the same way (split_rows).
        order = torch.argsort(inputs["attention_mask"].sum(1), stable=True)
        restore = torch.argsort(order)
        inputs = select_rows(inputs, order)

        def loss_in_batch_order(outputs, lab):
            return self.loss_fn({"last_hidden_state": outputs["last_hidden_state"][restore], **side}, lab)

        if self.is_deepspeed_enabled:
            # every process runs as many chunk passes (see _deepspeed_chunk_backward)
            backward_fn, no_sync, num_chunks_fn = self._deepspeed_chunk_backward(), None, self._max_over_processes
        else:
            # DDP communicates only in the last chunk's backward, so chunk counts may differ
            backward_fn, no_sync, num_chunks_fn = None, getattr(model, "no_sync", None), None
        cache = GradCache(model, loss_in_batch_order, self.gradcache_mini_batch_size, split_fn=split_rows)
        loss = cache.step(inputs, labels, loss_backward_fn=lambda value: (self._checked(value) * scale).backward(),
                          backward_fn=backward_fn, no_sync=no_sync, num_chunks_fn=num_chunks_fn)
        return loss.detach() * scale

    def _deepspeed_chunk_backward(self):
        """The gradient cache's per-chunk backward under DeepSpeed: K engine backwards that
        together make one micro-batch.

        ``accelerator.backward`` under DeepSpeed sets the engine's gradient accumulation
        boundary to ``sync_gradients`` and, at a boundary, calls ``engine.step()``; called
        once per chunk it would step the optimizer after every chunk. So every chunk but
        the last runs ``engine.backward`` with the boundary off, exactly like the earlier
        micro-batches of gradient accumulation (ZeRO-2/3 reduce-scatter each backward's
        gradients into the owned partition and add them up, which is what keeps the full
        gradient out of memory; stages 0/1 keep them local until the boundary), and the
        last chunk goes through ``accelerator.backward`` like a plain micro-batch. The
        engine's ``no_sync`` is not used: ZeRO-2/3 refuse it. ``scale_wrt_gas=False``, as
        in the Trainer: the cached gradient already carries 1 / gradient_accumulation_steps,
        and going through ``engine.backward`` keeps the engine from dividing again.
        ``(reps * grad).sum()`` is a scalar whose gradient with respect to ``reps`` is
        ``grad`` (fp16 loss scaling applies to it like to a loss).

        ZeRO-2/3 reduce in every backward and ZeRO-3 gathers parameters in every forward,
        so all processes must run as many chunks, though their rows (groups with more or
        fewer negatives) may need more or fewer: a process with fewer chunks runs extra
        passes with a zero gradient (``num_chunks_fn`` of :meth:`GradCache.step`)."""
        engine = self.accelerator.deepspeed_engine_wrapped.engine

        def backward(reps: torch.Tensor, grad: torch.Tensor, is_last: bool) -> None:
            surrogate = (reps * grad).sum()
            if is_last:
                self.accelerator.backward(surrogate, scale_wrt_gas=False)
            else:
                engine.set_gradient_accumulation_boundary(False)
                engine.backward(surrogate, scale_wrt_gas=False)

        return backward

    def _max_over_processes(self, n: int) -> int:
        _, w = world()
        return max(gather_sizes(n, self.args.device)) if w > 1 else n

    # ---- evaluation -----------------------------------------------------------------
    def _eval_loader(self, eval_dataset=None):
        """This process's share of the eval set (:func:`~mmembed.training.evaluation.eval_loader`)."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        return eval_loader(dataset, self.args, self.data_collator)

    @torch.no_grad()
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """The eval set's loss and metrics (when there is one) and the ``--eval_beir`` /
        ``--eval_sts`` tasks' metrics, logged as ``<prefix>_<name>``
        (:func:`~mmembed.training.evaluation.evaluation_metrics`)."""
        metrics = evaluation_metrics(self, eval_dataset, metric_key_prefix)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """The Trainer's loop, with two of its steps left out where mmembed did them already:

        - ``--use_liger_kernel`` was applied to the backbone when it was built
          (``build_model``); the Trainer would apply it again to the EmbeddingModel wrapper,
          which is no PreTrainedModel, and warn that nothing was applied.
        - ``--resume_only_model`` under DeepSpeed: the engine does not load its checkpoint
          (:meth:`~mmembed.training.saving.CheckpointSaving.weights_only_engine`).
        """
        liger, self.args.use_liger_kernel = self.args.use_liger_kernel, False
        try:
            with self.weights_only_engine(resume_from_checkpoint):
                return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self.args.use_liger_kernel = liger
