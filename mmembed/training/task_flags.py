"""``--task_type`` and the flags that depend on it: an embedding model (ms-swift's
``embedding``) or a reranker (``reranker``: a classification head over the pair;
``generative_reranker``: a causal LM's ``yes`` / ``no`` logits at the last position).

The loss follows the task: ``infonce`` by default for an embedding model,
``pointwise_reranker`` for a reranker (ms-swift 4 leaves a reranker without ``--loss_type`` to
the model's own loss, a regression on the 1/0 labels for a one-label head; mmembed gives it the
loss ms-swift's reranker scripts name). A reranker loss with an embedding task, or the other way
round, is a usage error naming both flags; so are the flags of embedding methods a reranker
run does not take (a guide, a teacher, Matryoshka widths, held-out retrieval).
"""

from __future__ import annotations

from typing import Any

from ..errors import UsageError

TASK_TYPES = ("embedding", "reranker", "generative_reranker")
RERANK_TASKS = ("reranker", "generative_reranker")

#: embedding-only flags (name, what it is) a reranker run refuses when set
_EMBEDDING_ONLY = (
    ("guide_model", "a GIST guide model"),
    ("teacher_model", "a distillation teacher"),
    ("teacher_scores_file", "a distillation teacher's scores"),
    ("teacher_embeddings_file", "a distillation teacher's embeddings"),
    ("mrl_dims", "Matryoshka widths"),
    ("eval_sts", "held-out STS of embeddings"),
    ("loss_kwargs", "options of an embedding loss (the reranker losses read LISTWISE_RERANKER_*)"),
    ("pooling", "an embedding pooling"),
)


def is_reranker(args: Any) -> bool:
    return getattr(args, "task_type", "embedding") in RERANK_TASKS


def check_task(args: Any) -> None:
    """``--task_type`` against ``--loss_type`` (whose default it sets) and the embedding-only flags."""
    from ..losses.rerank import RERANK_LOSS_CLASSES, RERANK_LOSSES, is_rerank_loss, rerank_task_of

    task = args.task_type
    if task not in TASK_TYPES:
        raise UsageError(f"--task_type must be one of {', '.join(TASK_TYPES)}, got {task!r}")
    if task == "embedding":
        if getattr(args, "eval_beir_first_stage", None):
            raise UsageError("--eval_beir_first_stage is a reranker's (the candidates it reorders); an embedding "
                             "run's --eval_beir retrieves from the whole corpus itself")
        if args.loss_type is None:
            args.loss_type = "infonce"
        elif is_rerank_loss(args.loss_type):
            raise UsageError(f"--loss_type {args.loss_type} is a reranker loss; add --task_type reranker (a classification "
                             "head over the pair) or --task_type generative_reranker (a causal LM's yes / no logits)")
        return
    if args.loss_type is None:
        args.loss_type = "pointwise_reranker"
    if not is_rerank_loss(args.loss_type):
        raise UsageError(f"--task_type {task} trains with a reranker loss ({', '.join(RERANK_LOSSES)}), "
                         f"got --loss_type {args.loss_type}")
    implied = rerank_task_of(args.loss_type)
    if implied is not None and implied != task:
        raise UsageError(f"--loss_type {args.loss_type} (ms-swift 3's name) scores with a causal LM: use it with "
                         f"--task_type {implied}, or --loss_type "
                         f"{RERANK_LOSS_CLASSES[args.loss_type].name} with --task_type {task}")
    for name, what in _EMBEDDING_ONLY:
        if getattr(args, name, None):
            raise UsageError(f"--{name} ({what}) is for embedding runs; --task_type {task} does not take it")
