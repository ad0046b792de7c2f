"""``--task_type`` and the flags that depend on it, checked by the task itself
(:meth:`mmembed.task.Task.check_flags`): the loss follows the task (``infonce`` by default
for an embedding model, ``pointwise_reranker`` for a reranker: ms-swift 4 leaves a reranker
without ``--loss_type`` to the model's own loss, a regression on the 1/0 labels for a one-label
head; mmembed gives it the loss ms-swift's reranker scripts name). A loss of another task is a
usage error naming both flags; so are the flags of embedding methods a task does not take (a
guide, a teacher, Matryoshka widths, held-out retrieval), listed here once for every task that
refuses them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import UsageError
from ..task import all_tasks, canonical_task, get_task

#: flags of single-vector embedding methods (name, what it is), refused by the tasks that do not take them
EMBEDDING_ONLY = (
    ("guide_model", "a GIST guide model"),
    ("teacher_model", "a distillation teacher"),
    ("teacher_scores_file", "a distillation teacher's scores"),
    ("teacher_embeddings_file", "a distillation teacher's embeddings"),
    ("mrl_dims", "Matryoshka widths"),
    ("eval_sts", "held-out STS of embeddings"),
    ("loss_kwargs", "options of an embedding loss (the reranker losses read LISTWISE_RERANKER_*)"),
    ("pooling", "an embedding pooling"),
)


def check_task(args: Any) -> None:
    """``--task_type`` (an alias becomes its task's name) and what its task checks of the
    other flags (``--loss_type``, whose default it sets, and the flags it refuses)."""
    args.task_type = canonical_task(args.task_type)
    task = get_task(args.task_type)
    for other in all_tasks():
        if other is task:
            continue
        for flag in other.own_flags:
            if getattr(args, flag, None) is not None:
                raise UsageError(f"--{flag} is for --task_type {other.name}; this run's --task_type is {task.name}")
    task.check_flags(args)


def refuse_beir_first_stage(args: Any, run: str) -> None:
    """``--eval_beir_first_stage`` names the candidates a reranker reorders: a usage error for a
    ``run`` (``an embedding``, ``a late-interaction``) that retrieves from the whole corpus."""
    if getattr(args, "eval_beir_first_stage", None):
        raise UsageError(f"--eval_beir_first_stage is a reranker's (the candidates it reorders); {run} run's "
                         "--eval_beir retrieves from the whole corpus itself")


def refuse_flags(args: Any, task: str, flags: Sequence[tuple[str, str]]) -> None:
    """A usage error for the first of ``flags`` (name, what it is) that is set: ``--task_type
    task`` does not take it."""
    for name, what in flags:
        if getattr(args, name, None):
            raise UsageError(f"--{name} ({what}) is for embedding runs; --task_type {task} does not take it")
