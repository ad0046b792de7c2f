"""What a ``--task_type`` is: one :class:`Task` object per kind of model, found by name here.

A task supplies everything the shared code used to branch on: the templates it searches, the
default loss and the flags it refuses, the checks of the model's config before the weights
load, the loss, the longest model input of a row (the length check), the trainer, the metric
names of its evaluation, the export of a checkpoint, and the scorer that ``mmembed rerank``,
``POST /v1/rerank`` and the miner's teacher use. Shared code calls :func:`get_task` (or
:func:`task_of_folder` for a saved model) and asks the object; it never compares task names.

Each task's code lives in its own package under :mod:`mmembed.tasks`, which imports the shared
code and is never imported by it: the table below names each task's object by a dotted path,
imported on first use (as an entry point would), so the shared layers stay below the tasks.

The tasks: ``embedding`` (one vector per input, ms-swift's ``--task_type embedding``),
``reranker`` (a classification head over a (query, document) pair), ``generative_reranker``
(a causal LM's ``yes`` / ``no`` logits at the last position) and ``late_interaction`` (one
vector per token, scored by MaxSim: ColBERT, ColQwen).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from typing import Any

from .errors import UsageError
from .files import read_json_once

#: every task's object, by its ``--task_type`` name (the one place task names are defined)
_TASKS = {
    "embedding": "mmembed.tasks.embedding:EMBEDDING",
    "reranker": "mmembed.tasks.reranker:RERANKER",
    "generative_reranker": "mmembed.tasks.reranker:GENERATIVE_RERANKER",
    "late_interaction": "mmembed.tasks.late_interaction:LATE_INTERACTION",
}
#: other spellings users write (ms-swift's ``seq_cls`` for a classification reranker is not one:
#: ms-swift's reranker scripts spell ``reranker``)
ALIASES = {"colbert": "late_interaction", "multi_vector": "late_interaction", "multivector": "late_interaction",
           "colqwen": "late_interaction"}
TASK_NAMES: tuple[str, ...] = tuple(_TASKS)

_loaded: dict[str, Task] = {}


def canonical_task(name: str | None, flag: str = "--task_type") -> str:
    """``name`` (an alias too) as its task's name; None: ``embedding``.

    Raises:
        UsageError: an unknown name, naming ``flag`` and the known names.
    """
    if name is None:
        return "embedding"
    key = str(name).strip().lower()
    key = ALIASES.get(key, key)
    if key not in _TASKS:
        raise UsageError(f"{flag} must be one of {', '.join(TASK_NAMES)} (or {', '.join(ALIASES)}), got {name!r}")
    return key


def get_task(name: str | None) -> Task:
    """The :class:`Task` of ``--task_type name`` (an alias too; None: ``embedding``)."""
    key = canonical_task(name)
    if key not in _loaded:
        module, _, attr = _TASKS[key].partition(":")
        _loaded[key] = getattr(importlib.import_module(module), attr)
    return _loaded[key]


def all_tasks() -> list[Task]:
    """Every task, in :data:`TASK_NAMES` order."""
    return [get_task(name) for name in TASK_NAMES]


def task_of_loss(loss_type: str | None) -> Task | None:
    """The task whose own loss ``loss_type`` is (None for the embedding losses and unknown names)."""
    if not loss_type:
        return None
    for task in all_tasks():
        if loss_type in task.own_losses:
            return task
    return None


def folder_json(path: str, name: str) -> Any:
    """A model folder's small JSON file ``name`` (read once per process:
    :func:`~mmembed.files.read_json_once`); ``{}`` when it is missing or does not parse."""
    try:
        return read_json_once(os.path.join(path, name))
    except (OSError, ValueError):
        return {}


def folder_architectures(path: str) -> list[str]:
    """The ``architectures`` of a model folder's ``config.json`` (``[]``: none, or no config)."""
    config = folder_json(path, "config.json")
    return [str(a) for a in (config.get("architectures") if isinstance(config, dict) else None) or []]


def saved_task_type(path: str) -> str | None:
    """The ``task_type`` a saved model's ``mmembed.json`` records (None: no such file or field)."""
    file = os.path.join(path, "mmembed.json")
    if not os.path.isfile(file):
        return None
    return read_json_once(file).get("task_type")


def task_of_folder(path: str, given: str | None = None, flag: str = "--task_type") -> Task:
    """The task of a model folder: ``given`` (a ``--task_type`` flag) when set, else its
    ``mmembed.json``, else the first task that recognises the folder's ``config.json``
    (:meth:`Task.recognises`: a ``*ForSequenceClassification`` is a reranker, a
    ``config_sentence_transformers.json`` of a multi-vector model a late-interaction model),
    else ``embedding``."""
    if given is not None:
        return get_task(canonical_task(given, flag))
    saved = saved_task_type(path)
    if saved is not None:
        return get_task(saved)
    for task in all_tasks():
        if task.recognises(path):
            return task
    return get_task("embedding")


def pair_scorer_task(path: str, given: str | None = None, flag: str = "--task_type") -> Task:
    """The task that scores (query, document) pairs with the model folder ``path``
    (``mmembed rerank``, the miner's teacher): as :func:`task_of_folder`, except that a folder
    no task recognises is taken by the first pair-scoring task that can load it
    (:meth:`Task.may_score`: a causal LM as a generative reranker).

    Raises:
        UsageError: the folder's model does not score pairs (an embedding model), or no task
            can take it.
    """
    task = task_of_folder(path, given, flag)
    if task.scores_pairs:
        return task
    if given is not None or saved_task_type(path) is not None or os.path.isfile(os.path.join(path, "mmembed.json")):
        raise UsageError(f"{path}: {task.article} model (its mmembed.json), not a reranker; use mmembed embed")
    for other in all_tasks():
        if other.scores_pairs and other.may_score(path):
            return other
    raise UsageError(f"{path}: not a reranker ({task.unrecognised_reason(path)}); pass --task_type "
                     + " or ".join(t.name for t in all_tasks() if t.scores_pairs))


class Task:
    """What a kind of model supplies to the shared run; a task subclasses it and overrides
    what differs. The defaults are an embedding model's where one exists.

    Attributes:
        name: the ``--task_type`` name.
        summary: one line for the help.
        template_task: the templates it searches (a template's ``task``: ``embedding`` or ``reranker``).
        default_loss: ``--loss_type`` when not given.
        own_losses: the loss names only this task trains with (a ``--loss_type`` of another
            task's is refused, naming the task that takes it).
        several_positives: its rows may hold several positive groups (a reranker's draws).
        scores_pairs: it scores a (query, document) pair (``mmembed rerank``, ``/v1/rerank``).
        embeds: it gives embeddings (``mmembed embed``, ``/v1/embeddings``).
        quantizable: it trains on a quantized base (QLoRA, ``--quant_method bnb``).
        measures_items: its model inputs are the rows' items one by one (the length check's
            fast path over text rows applies), not pairs.
        own_flags: the ``mmembed sft`` flags only this task takes (set with another task: a
            usage error naming the task that takes them).
        builds_own_losses: its losses are not :mod:`mmembed.losses`' (the task builds and checks them).
        score_name: what its query-document score is (the charts' axis).
        token_vectors: it embeds an input as one vector per token (``mmembed embed`` writes
            token matrices; the scorer's ``encode`` gives them).
    """

    name: str = ""
    summary: str = ""
    template_task: str = "embedding"
    default_loss: str = "infonce"
    own_losses: Sequence[str] = ()
    several_positives: bool = False
    scores_pairs: bool = False
    embeds: bool = False
    quantizable: bool = False
    measures_items: bool = True
    own_flags: Sequence[str] = ()
    builds_own_losses: bool = False
    score_name: str = "cosine similarity"
    token_vectors: bool = False

    def __repr__(self) -> str:
        return f"<task {self.name}>"

    # --------------------------------------------------------------- flags and folders

    def check_flags(self, args: Any) -> None:
        """``--loss_type`` (its default set here) and the flags this task does not take, as
        usage errors before anything loads."""
        if args.loss_type is None:
            args.loss_type = self.default_loss
        owner = task_of_loss(args.loss_type)
        if owner is not None and owner is not self and self.name not in owner.loss_tasks(args.loss_type):
            raise UsageError(owner.wrong_task_message(args.loss_type, self))

    def owns_loss(self, loss_type: str | None) -> bool:
        """Whether ``loss_type`` is one of this task's own losses (built and checked by the task)."""
        return loss_type in self.own_losses

    def loss_tasks(self, loss_type: str) -> tuple[str, ...]:
        """The tasks that train with ``loss_type``, one of :attr:`own_losses`."""
        return (self.name,)

    def wrong_task_message(self, loss_type: str, task: Task) -> str:
        """The usage error for ``--loss_type loss_type`` (one of this task's) with ``--task_type task``."""
        return f"--loss_type {loss_type} is a {self.name} loss; add --task_type {self.name}"

    def recognises(self, path: str) -> bool:
        """Whether a folder without ``mmembed.json`` holds a model of this task (its config files)."""
        return False

    def may_score(self, path: str) -> bool:
        """Whether a folder no task recognises can be loaded as this task's pair scorer."""
        return False

    def unrecognised_reason(self, path: str) -> str:
        """Why no task took the folder (its config's ``architectures``)."""
        if not os.path.isfile(os.path.join(path, "config.json")):
            return "no config.json"
        return f"config.json's architectures {folder_architectures(path)}"

    @property
    def article(self) -> str:
        """``an embedding`` / ``a reranker``: the task's name with its article, for messages."""
        return ("an " if self.name[:1] in "aeiou" else "a ") + self.name.replace("_", " ")

    def check_model(self, args: Any, config: Any) -> None:
        """Checks of the model's transformers config before the weights load."""

    def check_dataset_entries(self, args: Any) -> None:
        """Checks of ``--dataset_config``'s entries against the task."""

    # --------------------------------------------------------------- the run

    def build_loss(self, args: Any, environment: Any) -> Any:
        """The loss of the run, built and checked against the model's config (``setup``-time)."""
        raise NotImplementedError

    def check_loss(self, args: Any, loss: Any, template: Any, config: Any) -> None:
        """The loss's checks against the model, before the weights load."""

    def pooling(self, args: Any, template: Any) -> str:
        """The pooling of the run's encoding."""
        return args.pooling or template.resolve_pooling(args.model)

    def input_lengths(self, samples: list, builder: Any, layout: Any, total_within: int | None = None) -> list[int]:
        """The longest model input of each sample, in tokens (the length check); with
        ``total_within``, the sum of its inputs, each counted to at most that many (``--packing``)."""
        from .encoding.collator import token_lengths

        return token_lengths(samples, builder, layout, total_within)

    def build_trainer(self, args: Any, setup: Any) -> Any:
        """The trainer of ``mmembed sft`` (``setup``: what the up-front checks read and built)."""
        raise NotImplementedError

    def model_head(self, args: Any, encoding: Any) -> Any:
        """``head(backbone, **options) -> model``: what the shared trainer's model builder
        (:func:`~mmembed.training.model_assembly.build_model`) wraps the backbone in; options:
        ``pooling``, ``length_chunks``, ``tower``, ``padding_free``, ``bucket``."""
        from .model.embedding import EmbeddingModel

        return EmbeddingModel

    def collator_type(self) -> Any:
        """The collator class of the shared trainer's batches."""
        from .encoding.collator import EmbeddingCollator

        return EmbeddingCollator

    def collator_options(self, args: Any, encoding: Any) -> dict[str, Any]:
        """What the task's collator takes beyond the shared collator's options."""
        return {}

    def saved_config(self, args: Any, encoding: Any, config: dict[str, Any]) -> dict[str, Any]:
        """``mmembed.json``'s fields of each saved model, from the shared ones (``config``)."""
        return config

    def folder_writer(self) -> Any:
        """``write(output_dir, config, dim, log_history, final_path=, global_step=, tokenizer=)``:
        what a saved folder holds beside the weights and the tokenizer."""
        from .model.folder import write_saved_folder

        return write_saved_folder

    def eval_metrics(self, layout: Any, vectors: Any) -> set[str] | None:
        """The names of the metrics its evaluation of a set of rows logs (None: the
        shared evaluation's, of the loss's layout)."""
        return None

    def eval_encoder(self, args: Any, encoding: Any) -> Any:
        """``encoder(model, processing, template, max_length, device)``: what embeds the
        ``--eval_beir`` / ``--eval_sts`` tasks during training (None: an ``Embedder``)."""
        return None

    def beir_metrics(self) -> list[str] | None:
        """The names of its ``--eval_beir`` metrics (None: the shared retrieval's)."""
        return None

    # --------------------------------------------------------------- saved models

    def export(self, checkpoint: str, output_dir: str) -> str:
        """``mmembed export``: the merged, standalone folder of a checkpoint."""
        raise NotImplementedError

    def load_scorer(self, path: str, device: str | None = None, torch_dtype: str | None = None) -> Any:
        """What ``mmembed rerank``, ``POST /v1/rerank`` and the miner's teacher score pairs with
        (``.score(query, documents, batch_size, raw)``, ``.template``, ``.max_length``)."""
        raise UsageError(f"{path}: a {self.name} model does not score (query, document) pairs; "
                         "rerank with a reranker or a late-interaction model")
