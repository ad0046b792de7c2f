"""Evaluation during training: every metric the trainer logs, gathered in one place.

:func:`evaluation_metrics` is what ``EmbeddingTrainer.evaluate`` logs, as
``<prefix>_<name>`` (:func:`logged_metric_name`):

- with an eval set (:func:`dataset_metrics`): the set is embedded once, each process its
  share (:func:`eval_loader`), and gathered; its loss (when the batches carry what the loss
  needs), ms-swift's metrics (infonce: ``mean_pos``, ``mean_neg``, ``margin``; pair losses:
  pearson / spearman) and retrieval within the set (recall@1/5/10, MRR@10, nDCG@10);
- with ``--eval_beir`` / ``--eval_sts`` (:func:`task_metrics`): the held-out tasks, through
  the Embedder ``mmembed eval`` uses (``beir_*``, ``sts_*``).

:func:`eval_metric_names` gives the names a run will log before it starts (to check
``--metric_for_best_model``). Every process must call these functions together: ZeRO-3
gathers parameters in every forward, so all processes run as many forwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset

from ..encoding.collator import CollatedBatch
from ..eval.metrics import layout_metrics
from ..losses import Layout
from .distributed import all_gather_no_grad, max_over_processes, world

#: an eval set of at most this many samples keeps its last embeddings (EvalEmbeddings): the
#: charts' histogram embeds this many samples at the end of training, which the evaluation at
#: the last step has just done
KEPT_SAMPLES = 1000


@dataclass(frozen=True)
class EvalEmbeddings:
    """The trainer's eval set as :func:`embed_eval_set` gave it at ``step`` (every process's
    share, gathered): ``embeddings [N, D]`` and ``labels``."""

    step: int
    dataset: Any
    embeddings: np.ndarray
    labels: np.ndarray


def kept_embeddings(trainer, dataset) -> EvalEmbeddings | None:
    """The embeddings of ``dataset`` (the trainer's eval set) that the evaluation at this step
    computed, when the model still has that step's weights (``--load_best_model_at_end`` may
    have loaded others after it), else None."""
    kept = trainer.eval_embedded
    if kept is None or kept.dataset is not dataset or kept.step != trainer.state.global_step:
        return None
    return None if trainer.args.load_best_model_at_end else kept


@torch.no_grad()
def evaluation_metrics(trainer, dataset=None, prefix: str = "eval") -> dict[str, float]:
    """The eval set's loss and metrics (``dataset``, default the trainer's eval set, when
    there is one) and the ``--eval_beir`` / ``--eval_sts`` tasks' metrics, named
    ``<prefix>_<name>``. ``trainer``: an :class:`~mmembed.training.trainer.EmbeddingTrainer`."""
    metrics: dict[str, float] = {}
    dataset = dataset if dataset is not None else trainer.eval_dataset
    if dataset is not None:
        metrics.update(dataset_metrics(trainer, dataset))
        metrics.update(per_dataset_metrics(trainer, dataset, metrics))
    elif not trainer.eval_tasks:
        raise ValueError("nothing to evaluate: no eval dataset, --eval_beir or --eval_sts")
    metrics.update(task_metrics(trainer))
    return {logged_metric_name(k, prefix): float(v) for k, v in metrics.items()}


def eval_loader(dataset, args, collate_fn) -> DataLoader:
    """This process's share of ``dataset``: every W-th sample, no padding, no duplicates, so
    uneven eval sets need no ``--dataloader_drop_last`` and nothing is counted twice. ``args``:
    the training arguments (eval batch size, loader workers, prefetch, pinning, device)."""
    rank, w = world()
    if w > 1:
        dataset = Subset(dataset, range(rank, len(dataset), w))
    workers = args.dataloader_num_workers or 0
    extra = {"prefetch_factor": args.dataloader_prefetch_factor} if workers and args.dataloader_prefetch_factor else {}
    return DataLoader(dataset, batch_size=args.per_device_eval_batch_size, collate_fn=collate_fn,
                      num_workers=workers, shuffle=False,
                      pin_memory=bool(args.dataloader_pin_memory) and args.device.type == "cuda", **extra)


@torch.no_grad()
def per_dataset_metrics(trainer, dataset, pooled: dict[str, float] | None = None) -> dict[str, float]:
    """``--dataset_config``: the metrics of each dataset's own validation rows (as
    :func:`dataset_metrics`, with the dataset's loss), named ``<name>_<metric>``; nothing
    when the trainer has no dataset names or the eval set no ``dataset_ids``. ``pooled``: the
    whole set's metrics, taken as they are when all its rows are one dataset's that has the
    run's loss (the same numbers, not embedded again)."""
    names = getattr(trainer, "dataset_names", None)
    ids = getattr(dataset, "dataset_ids", None)
    if not names or ids is None or not hasattr(dataset, "dataset"):
        return {}
    losses = {i: f.loss for i, f in getattr(trainer, "dataset_loss_fns", {}).items()}
    out: dict[str, float] = {}
    for i, name in enumerate(names):
        rows = np.flatnonzero(ids == i)
        if not len(rows):
            continue
        if pooled is not None and len(rows) == len(ids) and i not in losses:
            out.update({f"{name}_{k}": v for k, v in pooled.items()})
            continue
        subset = type(dataset)(dataset.dataset.select(rows), dataset.teacher)
        out.update({f"{name}_{k}": v for k, v in dataset_metrics(trainer, subset, losses.get(i)).items()})
    return out


@torch.no_grad()
def embed_eval_set(trainer, dataset, each: Callable[[CollatedBatch, dict[str, Any]], None] | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """``dataset`` embedded by the trainer's model in eval mode, each process its share
    (:func:`eval_loader`), gathered from all processes: the embeddings ``[N, D]`` (float32) and
    the labels, as numpy arrays. ``each(batch, outputs)`` sees every batch of this process (on
    the device, unpacked) with the model's outputs, for what else the caller needs of it.

    ZeRO-3 gathers parameters inside every forward, so all processes run as many forwards: a
    process whose share ran out first repeats a batch (with none, the set's first row) and
    discards the result. Each batch holds whole groups (or pairs), so the concatenation keeps
    the layout."""
    model, device = trainer.model, trainer.args.device
    was_training = model.training
    model.eval()
    loader = eval_loader(dataset, trainer.args, trainer.data_collator)
    rounds = max_over_processes(len(loader), device)
    embs, labels, batch = [], [], None
    try:
        for raw in loader:
            batch = CollatedBatch.unpack(trainer._prepare_inputs(raw))
            out = model(**batch.inputs)
            if each is not None:
                each(batch, out)
            embs.append(out["last_hidden_state"].float())
            labels.append(batch.labels.float())
        for _ in range(rounds - len(loader)):
            if batch is None:
                batch = CollatedBatch.unpack(trainer._prepare_inputs(trainer.data_collator([dataset[0]])))
            model(**batch.inputs)
    finally:
        model.train(was_training)
    width = max_over_processes(embs[0].shape[-1] if embs else 0, device)
    if embs and embs[0].dim() == 3:  # one vector per token (late interaction): padded with absent (zero) tokens
        tokens = max_over_processes(max(e.shape[1] for e in embs), device)
        embs = [torch.nn.functional.pad(e, (0, 0, 0, tokens - e.shape[1])) for e in embs]
    elif not embs and trainer.accelerator.unwrap_model(model).pooling == "tokens":
        embs = [torch.zeros((0, max_over_processes(0, device), width), device=device)]
    emb = torch.cat(embs) if embs else torch.zeros((0, width), device=device)
    lab = torch.cat(labels) if labels else torch.zeros((0,), device=device)
    return all_gather_no_grad(emb).cpu().numpy(), all_gather_no_grad(lab).cpu().numpy()


@torch.no_grad()
def dataset_metrics(trainer, dataset, loss=None) -> dict[str, float]:
    """Embed the eval set once (:func:`embed_eval_set`): its loss (when the batches carry what
    the loss needs) and ms-swift's metrics plus retrieval within the set. ``loss``: the loss to
    score it with (default the trainer's)."""
    device = trainer.args.device
    loss = loss if loss is not None else trainer.loss
    loss_fn, needs = loss, loss.side  # per-batch loss, no cross-process scaling
    # (sum of batch loss * its terms, terms): the terms the loss averages (groups, pairs, rows)
    loss_sum = torch.zeros(2, dtype=torch.float64, device=device)

    def score(batch: CollatedBatch, outputs: dict[str, Any]) -> None:
        side = trainer.side_inputs(batch.side)
        # eval rows may lack the data's teacher: then no eval loss, the metrics still
        if needs.met_by(side):
            out = {**outputs, **side.outputs()}
            n_rows = out["last_hidden_state"].shape[0]
            targets = loss_fn.targets(batch.labels.to(device), n_rows)
            terms = loss_fn.averaged_over(targets, n_rows)
            loss_sum.add_(torch.tensor([loss_fn(out, targets).item() * terms, terms], dtype=torch.float64,
                                       device=device))

    emb, lab = embed_eval_set(trainer, dataset, score)
    if dataset is trainer.eval_dataset and len(dataset) <= KEPT_SAMPLES:
        trainer.eval_embedded = EvalEmbeddings(trainer.state.global_step, dataset, emb, lab)
    if world()[1] > 1:
        torch.distributed.all_reduce(loss_sum)
    if emb.shape[0] == 0:
        raise ValueError("the eval dataset is empty")
    metrics: dict[str, float] = {}
    if loss_sum[1] > 0:
        metrics["loss"] = float(loss_sum[0] / loss_sum[1])
    # each batch is a whole set of groups (or pairs), so concatenating keeps the layout valid;
    # a group loss's margin / mean_neg come from what it weighs (its INFONCE_* settings), with
    # the hard-negative padding drawn from a generator of its own (same every evaluation); a
    # pair loss has no candidates (None)
    view = getattr(loss, "candidate_scores", None)
    candidates = None if view is None else view(
        {"last_hidden_state": torch.from_numpy(emb)}, torch.from_numpy(lab),
        generator=torch.Generator().manual_seed(trainer.args.seed))
    similarity = getattr(loss, "similarity", None)
    score = None if emb.ndim == 2 or similarity is None else numpy_scores(similarity)
    metrics.update(layout_metrics(loss.layout, emb, lab, candidates=candidates, score=score))
    return metrics


def numpy_scores(similarity) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """A loss's similarity (:class:`~mmembed.losses.maxsim.Similarity`) on numpy rows, for the
    retrieval metrics: ``score(queries, docs) -> [Q, C]`` (float32; each side trimmed of its
    all-absent token columns first)."""

    def score(queries: np.ndarray, docs: np.ndarray) -> np.ndarray:
        q = similarity.trim(torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32)))
        d = similarity.trim(torch.from_numpy(np.ascontiguousarray(docs, dtype=np.float32)))
        return similarity.matrix(q, d).numpy()

    return score


@torch.no_grad()
def task_metrics(trainer) -> dict[str, float]:
    """``--eval_beir`` (``beir_*``) and ``--eval_sts`` (``sts_*``): the model as it is
    now. Every process runs the same forwards (ZeRO-3 gathers parameters in each)."""
    if not trainer.eval_tasks:
        return {}
    model = trainer.accelerator.unwrap_model(trainer.model)
    was_training = model.training
    model.eval()
    try:
        return trainer.eval_tasks.evaluate(model, trainer.processing_class, str(trainer.args.device),
                                           trainer.args.per_device_eval_batch_size)
    finally:
        model.train(was_training)


def final_evaluation(trainer) -> dict[str, float]:
    """The run's closing evaluation (what ``mmembed sft`` reports): the ``eval_*`` metrics the
    Trainer logged when it evaluated at this very step, while the model still has that
    step's weights, else ``trainer.evaluate()``. transformers evaluates at the last step of a
    run whose eval strategy is ``steps`` or ``epoch``, so the set is not embedded twice with
    the same weights; ``--load_best_model_at_end`` may have loaded other weights since, so it
    evaluates again."""
    step = trainer.state.global_step
    if not trainer.args.load_best_model_at_end:
        for entry in reversed(trainer.state.log_history):
            if entry.get("step") != step:
                break
            logged = {k: v for k, v in entry.items() if k.startswith("eval_")}
            if logged:
                return logged
    return trainer.evaluate()


def logged_metric_name(name: str, prefix: str = "eval") -> str:
    """The name :meth:`EmbeddingTrainer.evaluate` logs a metric under (``recall@1`` ->
    ``eval_recall_at_1``)."""
    return f"{prefix}_{name.replace('@', '_at_')}"


def eval_metric_names(layout: Layout, dataset: bool, beir, sts: bool, datasets=()) -> set[str]:
    """Every metric name :meth:`EmbeddingTrainer.evaluate` logs for a run with an eval set
    (``dataset``) of the loss's ``layout`` and the ``--eval_beir`` / ``--eval_sts`` tasks: the
    metric functions run on a few random vectors, so the names are theirs, not a copy.
    ``beir``: whether there is one BEIR folder, or the names of the ``--eval_beir`` folders
    (None for an unnamed one); ``datasets``: the ``--dataset_config`` datasets with
    validation rows (their ``<name>_*`` metrics)."""
    import numpy as np

    from ..eval.beir import BeirData, evaluate_beir
    from ..eval.sts import evaluate_pairs

    rng = np.random.default_rng(0)

    def unit(n: int) -> np.ndarray:
        x = rng.normal(size=(n, 4)).astype(np.float32)
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    class Vectors:
        def encode(self, texts: list[Any], batch_size: int | None = None) -> np.ndarray:
            return unit(len(texts))

    names: set[str] = set()
    if dataset or datasets:
        # pairs: s1_0 s2_0 s1_1 s2_1 s1_2 s2_2; groups: a0 p0 n0, a1 p1
        rows, labels = (6, [0.0, 1.0, 0.5]) if layout is Layout.PAIR else (5, [1.0, 0.0, 1.0])
        if layout is Layout.RERANK:  # a reranker's (RerankTrainer.evaluate)
            from ..eval.rerank import RERANK_METRICS

            of_a_set = {"loss", *RERANK_METRICS}
        else:
            of_a_set = {"loss", *layout_metrics(layout, unit(rows), np.array(labels))}
        names |= of_a_set
        names |= {f"{name}_{k}" for name in datasets for k in of_a_set}
    beir_names = ([None] if beir else []) if isinstance(beir, bool) else list(beir)
    if beir_names:
        data = BeirData(["d0", "d1"], ["x", "y"], ["q0"], ["q"], {"q0": {"d0": 1.0}})
        if layout is Layout.RERANK:  # a reranker reorders BM25's candidates (eval.rerank_beir)
            from ..eval.rerank_beir import rerank_beir

            found = [k for stage in ("bm25", "embedder")  # --eval_beir_first_stage: the embedder's
                     for k in rerank_beir(lambda pairs: np.zeros(len(pairs)), data, first_stage_name=stage)]
        else:
            found = list(evaluate_beir(Vectors(), data))
        names |= {f"beir_{name}_{k}" if name else f"beir_{k}" for name in beir_names for k in found}
    if sts:
        names |= {f"sts_{k}" for k in evaluate_pairs(Vectors().encode, ["a", "b"], ["c", "d"], [1.0, 0.0])}
    return {logged_metric_name(k) for k in names}
