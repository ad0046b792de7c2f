"""Reranker training: ``mmembed sft --task_type reranker | generative_reranker``.

The same run as an embedding model's (the flags, the data reading and its checks, the
samplers, checkpoints written whole, exact resume, preemption, DeepSpeed, the gradient
cache), with three parts of its own:

- the model, a :class:`~mmembed.tasks.reranker.model.RerankerModel` (a classification head over the
  pair, or a causal LM's ``yes`` / ``no`` logits at the last position), under LoRA
  (PEFT's ``SEQ_CLS`` task for a classifier, so the new head trains and is saved whole;
  ``CAUSAL_LM`` for a generative one) or trained in full;
- the batch, :class:`~mmembed.tasks.reranker.inputs.RerankCollator`'s scored pairs (ms-swift's
  draws of ``MAX_POSITIVE_SAMPLES`` positives and ``MAX_NEGATIVE_SAMPLES`` negatives);
- the loss, a :class:`~mmembed.tasks.reranker.losses.RerankLoss` of the scores and the 1.0 / 0.0 labels,
  computed on each process's own pairs as in ms-swift (DDP and DeepSpeed average the gradients).

With ``--gradcache_mini_batch_size N`` the pairs are scored in chunks of N without graph, the
loss's gradient with respect to the scores is taken, then each chunk is scored again with graph
and given its slice: the same gradients as the plain step, with the memory of N pairs.

Evaluation scores every pair of each eval row (no draws: each positive with every negative) and
logs ``eval_loss`` with ``eval_mrr_at_10``, ``eval_ndcg_at_10`` and ``eval_accuracy``
(:func:`~mmembed.eval.rerank.rerank_metrics`). Every process scores the whole eval set (as many
forwards on each, as ZeRO-3 requires), so no gather is needed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import numpy as np
import torch

from ...encoding.collator import raise_batch_error
from ...encoding.templates import template_config
from ...eval.rerank import rerank_metrics
from ...eval.rerank_beir import rerank_beir
from ...model.io import save_tokenizer
from ...training import checkpoints
from ...training.arguments import SftArguments, UsageError
from ...training.device_flags import training_padding
from ...training.evaluation import logged_metric_name
from ...training.flag_checks import beir_pairs, has_accelerator
from ...training.model_assembly import (
    Encoding,
    apply_lora,
    check_attention_dropout,
    freeze_parts,
    lora_flags,
    parts_to_freeze,
    use_padding_free,
)
from ...training.run_folder import training_facts
from ...training.trainer import EmbeddingTrainer
from .inputs import GROUP_IDS, RerankCollator
from .losses import RerankLoss
from .model import RerankerModel, load_reranker
from .scorer import pair_batches

logger = logging.getLogger("mmembed")

#: the batch keys that are not the model's inputs
_NOT_INPUTS = ("labels", GROUP_IDS, "dataset_ids", "side")
#: mmembed.json's name in a saved folder
CONFIG_NAME = "mmembed.json"


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in batch.items() if k not in _NOT_INPUTS}


class RerankTrainer(EmbeddingTrainer):
    """The Trainer for rerankers: :class:`EmbeddingTrainer`'s run (checkpoints, resume,
    samplers, preemption, guards) with the reranker's loss call, gradient cache, evaluation
    and saved folder. ``loss``: a :class:`~mmembed.tasks.reranker.losses.RerankLoss`."""

    def __init__(self, *args, loss: RerankLoss, beir_tasks: list | None = None, first_stages: list | None = None,
                 **kwargs):
        """``beir_tasks``: ``[(name or None, BeirData, query instruction or None)]`` of
        ``--eval_beir``, evaluated at every evaluation (:func:`~mmembed.eval.rerank_beir.rerank_beir`);
        ``first_stages``: one scorer per task (an embedding model's, ``--eval_beir_first_stage``),
        or None: BM25."""
        self.beir_tasks = list(beir_tasks or [])
        self.first_stages = list(first_stages or [None] * len(self.beir_tasks))
        super().__init__(*args, loss=loss, eval_tasks=bool(self.beir_tasks) or None, **kwargs)

    # ---- the loss call --------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        scores = model(**model_inputs(inputs))["scores"]
        loss = self._checked(self.loss(scores, inputs["labels"]))
        return (loss, {"scores": scores}) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The plain step, or with ``--gradcache_mini_batch_size`` the cached one (see the
        module docstring): the scores are the gradient cache's one-column "embeddings"."""
        raise_batch_error(inputs)
        if not self.gradcache_mini_batch_size:
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        batch = self._prepare_inputs(inputs)
        labels = batch["labels"]
        scale = 1.0 / self.current_gradient_accumulation_steps

        def scored(**chunk):
            return {"last_hidden_state": model(**chunk)["scores"][:, None]}

        def loss_of_scores(outputs, lab):
            return self.loss(outputs["last_hidden_state"][:, 0], lab)

        loss = self.gradcache_step(model, scored, loss_of_scores, model_inputs(batch), labels, scale)
        return loss.detach() * scale

    # ---- the draws, resumed --------------------------------------------------------
    def _draws_file(self, folder: str) -> str:
        return os.path.join(folder, f"rerank_draws_{self.args.process_index}.json")

    def _save_rng_state(self, output_dir) -> None:
        """The Trainer's RNG states, and the collator's draws (its ``RandomState``, ms-swift's one
        stream of positives and negatives): a resumed run draws what the uninterrupted run
        would have. With data-loader workers each worker holds its own copy, which the main
        process cannot see (said at start, :func:`build_rerank_trainer`)."""
        super()._save_rng_state(output_dir)
        state = self.data_collator.random_state.get_state()
        with open(self._draws_file(output_dir), "w", encoding="utf-8") as f:
            json.dump({"algorithm": state[0], "keys": state[1].tolist(), "pos": int(state[2]),
                       "has_gauss": int(state[3]), "cached_gaussian": float(state[4])}, f)

    def _load_rng_state(self, checkpoint) -> None:
        super()._load_rng_state(checkpoint)
        path = self._draws_file(checkpoint) if checkpoint else None
        if self.weights_only_resume or not path or not os.path.isfile(path):
            return
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        self.data_collator.random_state.set_state((saved["algorithm"], np.array(saved["keys"], dtype=np.uint32),
                                                   saved["pos"], saved["has_gauss"], saved["cached_gaussian"]))

    # ---- evaluation -----------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if (dataset is None or not len(dataset)) and not self.beir_tasks:
            return {}
        found = self.score_eval_set(dataset) if dataset is not None and len(dataset) else {}
        for (name, data, system), first in zip(self.beir_tasks, self.first_stages):  # --eval_beir: reordered
            scores = rerank_beir(self.score_pairs, data, query_system=system, first_stage=first,
                                 first_stage_name="bm25" if first is None else "embedder")
            found.update({f"beir_{name}_{k}" if name else f"beir_{k}": v for k, v in scores.items()})
        metrics = {logged_metric_name(k, metric_key_prefix): v for k, v in found.items()}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def score_eval_set(self, dataset) -> dict[str, float]:
        """The eval rows' loss (the mean over batches, as the Trainer's ``eval_loss``) and ranking
        metrics, every pair of each row scored."""
        scores, labels, groups, losses = self.scored_eval_pairs(dataset)
        return {"loss": float(np.mean(losses)), **rerank_metrics(scores, labels, groups)}

    @torch.no_grad()
    def score_pairs(self, pairs, batch_size: int | None = None) -> np.ndarray:
        """The model's scores of ``(query, document)`` pairs (strings, or dicts as
        :class:`~mmembed.tasks.reranker.scorer.Reranker` takes them), built as in training."""
        model = self.model_wrapped if self.is_deepspeed_enabled else self.model
        was_training = model.training
        model.eval()
        collator = dataclasses.replace(self.data_collator, train=False)
        size = batch_size or max(8, self.args.per_device_eval_batch_size)
        out = []
        try:
            for batch in pair_batches(collator, pairs, size, source="<eval_beir>"):
                batch = self._prepare_inputs(batch)
                out.append(model(**model_inputs(batch))["scores"].float().cpu().numpy())
        finally:
            model.train(was_training)
        return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)

    def score_kinds(self, rows: int = 256) -> dict[str, np.ndarray] | None:
        """The scores of the first ``rows`` eval rows' pairs by kind (``positive``, ``negative``),
        for the before / after histogram of :class:`~mmembed.training.charts.TrainingCharts`;
        None without an eval set."""
        dataset = self.eval_dataset
        if dataset is None or not len(dataset):
            return None
        from torch.utils.data import Subset

        scores, labels, _, _ = self.scored_eval_pairs(Subset(dataset, range(min(rows, len(dataset)))))
        return {"positive": scores[labels == 1], "negative": scores[labels == 0]}

    @torch.no_grad()
    def scored_eval_pairs(self, dataset) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[float]]:
        """Every pair of each row of ``dataset`` scored (no draws): ``(scores, labels,
        group ids, the loss of each batch)``."""
        model = self.model_wrapped if self.is_deepspeed_enabled else self.model
        was_training = model.training
        model.eval()
        collator = dataclasses.replace(self.data_collator, train=False)
        size = self.args.per_device_eval_batch_size
        scores, labels, groups, losses = [], [], [], []
        offset = 0
        try:
            for start in range(0, len(dataset), size):
                batch = collator([dataset[i] for i in range(start, min(start + size, len(dataset)))])
                raise_batch_error(batch)
                batch = self._prepare_inputs(batch)
                out = model(**model_inputs(batch))["scores"].float()
                losses.append(float(self.loss(out, batch["labels"])))
                scores.append(out.cpu().numpy())
                labels.append(batch["labels"].cpu().numpy())
                ids = batch[GROUP_IDS].cpu().numpy()
                groups.append(ids + offset)
                offset += int(ids.max()) + 1 if ids.size else 0
        finally:
            model.train(was_training)
        return np.concatenate(scores), np.concatenate(labels), np.concatenate(groups), losses

    # ---- the saved folder -----------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The reranker's folder: the backbone's own (an adapter, or a model transformers
        loads as ``AutoModelForSequenceClassification`` / the causal LM), the tokenizer or
        processor, ``mmembed.json`` (how to score with it) and the model card."""
        from .card import write_reranker_card

        output_dir = output_dir or self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        model: RerankerModel = self.accelerator.unwrap_model(self.model)
        if state_dict is not None:
            prefix = "backbone."
            state_dict = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        model.backbone.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
        model.save_head(output_dir)  # a CrossEncoder folder's sentence-transformers files
        if self.processing_class is not None:
            save_tokenizer(output_dir, self.processing_class)
        config = dict(self.mmembed_config)
        config["training"] = {"global_step": self.state.global_step,
                              "log": [r for r in self.state.log_history if "loss" in r or "eval_loss" in r][-20:]}
        with open(os.path.join(output_dir, CONFIG_NAME), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
        write_reranker_card(output_dir, config, final_path=checkpoints.final_folder(output_dir))
        from ...training.saving import args_without_tokens

        torch.save(args_without_tokens(self.args), os.path.join(output_dir, "training_args.bin"))


# ----------------------------------------------------------------------------- building the run


def build_reranker(args: SftArguments, encoding: Encoding) -> RerankerModel:
    """The student reranker: ``--model`` as the task's model class, then LoRA or full training
    with the frozen parts frozen."""
    tokenizer = getattr(encoding.processing, "tokenizer", None) or encoding.processing
    model = load_reranker(args.model, args.task_type, torch_dtype=args.torch_dtype, tokenizer=tokenizer,
                          attn_impl=args.attn_impl)
    if model.cross_encoder is not None:  # its default prompt: the run's query instruction, as the template writes it
        model.cross_encoder = model.cross_encoder.with_instruction(encoding.template)
    if args.tuner_type == "lora":
        task = "SEQ_CLS" if model.kind == "classifier" else "CAUSAL_LM"
        try:
            model.backbone = apply_lora(model.backbone, args, encoding.template, peft_task=task)
        except ValueError as e:
            if args.adapters:
                raise
            raise UsageError(f"{lora_flags(args)}: {e}") from None
    elif freeze_parts(model.backbone, encoding.template, parts_to_freeze(args)):
        logger.info("full training with frozen parts: %s", ", ".join(sorted(parts_to_freeze(args))))
    if use_padding_free(args, model.config, encoding.template):
        reason = model.packable()
        if reason is None:
            check_attention_dropout(model.config)  # the packed attention has none (varlen, FlexAttention)
            model.padding_free = True
        elif args.padding_free:
            logger.warning("--padding_free true: batches stay padded because %s", reason)
    return model


def reranker_config(args: SftArguments, encoding: Encoding, model: RerankerModel, loss: RerankLoss,
                    data: Any) -> dict[str, Any]:
    """What each saved reranker's ``mmembed.json`` records: how to score with it (task, kind,
    template, tokens, length) and how it was trained."""
    return {
        "task_type": args.task_type,
        "kind": model.kind,
        "base_model": os.path.abspath(args.model),
        "template": template_config(encoding.template),
        "default_system": encoding.template.default_system,
        "instructions": {"query": args.query_system, "document": None, "datasets": {}},
        "padding_side": encoding.template.padding_side,
        "media": sorted(encoding.template.media),
        "max_length": encoding.max_length,
        "tokens": list(model.tokens) if model.kind == "generative" else None,
        "token_ids": list(model.token_ids) if model.kind == "generative" else None,
        "tuner_type": args.tuner_type,
        "loss_type": args.loss_type,
        **training_facts(args, loss, data),
    }


def build_rerank_trainer(args: SftArguments, setup) -> RerankTrainer:
    """Everything a reranker run trains with (the reranker's counterpart of
    :func:`~mmembed.training.sft.build_trainer`), from the up-front checks' ``setup``."""
    from ...training.model_assembly import init_deepspeed_comm
    from ...training.sft import run_collator_options, run_data

    setup, encoding, data = run_data(args, setup)
    media, loss = setup.media, setup.loss
    if args.deepspeed:
        init_deepspeed_comm()
    model = build_reranker(args, encoding)
    if args.dataloader_num_workers:
        logger.info("--dataloader_num_workers %d: each worker draws the reranker's positives and negatives from its "
                    "own RandomState(42), as ms-swift's do; a resumed run starts those draws afresh (with 0 workers "
                    "the draws are saved in each checkpoint and resumed exactly)", args.dataloader_num_workers)
    collator = RerankCollator(
        training_padding(encoding.template, args.padding_side, has_accelerator()), encoding.processing, encoding.max_length,
        truncate=True,  # rows over --max_length are gone already under `delete`; a pair is cut document first
        **run_collator_options(args, media),
    )
    beir_tasks = []
    for name, folder in beir_pairs(args.eval_beir):  # --eval_beir [name=]folder: the first stage's candidates reranked
        from ...eval.beir import load_beir

        try:
            beir_tasks.append((name, load_beir(folder, args.eval_beir_split), None))
        except ValueError as e:
            raise UsageError(f"--eval_beir {folder if name is None else f'{name}={folder}'}: {e}") from None
    first_stages = embedder_first_stages(args.eval_beir_first_stage, beir_tasks)
    trainer = RerankTrainer(
        model=model,
        args=args,
        train_dataset=data.train,
        eval_dataset=data.val,
        data_collator=collator,
        processing_class=encoding.processing,
        loss=loss,
        mmembed_config=reranker_config(args, encoding, model, loss, data),
        train_datasets=data.datasets,
        dataset_names=[d.name for d in data.datasets] if args.dataset_config else None,
        beir_tasks=beir_tasks,
        first_stages=first_stages,
    )
    from ...training.charts import HISTOGRAM_SAMPLES, TrainingCharts

    # the line charts of the logged series, and the eval pairs' scores before / after training
    trainer.add_callback(TrainingCharts(lambda: trainer.score_kinds(HISTOGRAM_SAMPLES), x_label="reranker score"))
    return trainer


def embedder_first_stages(path: str | None, beir_tasks: list) -> list:
    """``--eval_beir_first_stage``: one dense scorer per BEIR task, from the embedding model at
    ``path`` (its vectors of the queries and the corpus, computed once now); None each: BM25."""
    if not path:
        return [None] * len(beir_tasks)
    if not beir_tasks:
        raise UsageError("--eval_beir_first_stage names the first stage of --eval_beir, which is not given")
    from ...eval.first_stage import dense_scorer
    from ...model.embedder import Embedder

    embedder = Embedder.from_pretrained(path)
    stages = []
    for _, data, _ in beir_tasks:
        queries = embedder.encode(data.query_texts, input_type="query")
        docs = embedder.encode(data.doc_texts, input_type="document")
        stages.append(dense_scorer(np.asarray(queries), np.asarray(docs)))
    return stages
