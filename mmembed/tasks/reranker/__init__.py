"""The reranker tasks: ``--task_type reranker`` (a sequence-classification head scores a
(query, document) pair: BERT, modernbert, GTE rerankers) and ``generative_reranker`` (a causal
LM's ``yes`` vs ``no`` logits at the last position: Qwen3-Reranker, Qwen3-VL-Reranker).

Their parts: :mod:`.inputs` (pairs rendered and collated, ms-swift's draws of positives and
negatives), :mod:`.model` (the model classes), :mod:`.losses` (``pointwise_reranker``,
``listwise_reranker`` and ms-swift 3's generative names), :mod:`.trainer` (the run),
:mod:`.scorer` (:class:`Reranker`, what ``mmembed rerank``, ``POST /v1/rerank`` and the miner's
teacher score with) and :mod:`.export`.
"""

from __future__ import annotations

from typing import Any

from ...errors import UsageError
from ...task import Task, folder_architectures, folder_json
from ...training.task_flags import EMBEDDING_ONLY, refuse_flags
from .losses import RERANK_LOSS_CLASSES, RERANK_LOSSES, is_rerank_loss, rerank_task_of

__all__ = ["GENERATIVE_RERANKER", "RERANKER", "RerankerTask"]


class RerankerTask(Task):
    """A reranker: one score per (query, document) pair, trained from the same rows as an
    embedding model (ms-swift's reranker contract)."""

    template_task = "reranker"
    default_loss = "pointwise_reranker"
    own_losses = RERANK_LOSSES
    builds_own_losses = True
    several_positives = True  # ms-swift's reranker draws from rows with several positive groups
    scores_pairs = True
    measures_items = False  # its inputs are (query, document) pairs

    def __init__(self, name: str, summary: str, head_suffixes: tuple[str, ...]):
        self.name = name
        self.summary = summary
        self.head_suffixes = head_suffixes  # the architectures this kind of reranker loads

    def loss_tasks(self, loss_type: str) -> tuple[str, ...]:
        implied = rerank_task_of(loss_type)
        return (implied,) if implied else ("reranker", "generative_reranker")

    def wrong_task_message(self, loss_type: str, task: Task) -> str:
        return (f"--loss_type {loss_type} is a reranker loss; add --task_type reranker (a classification head over "
                "the pair) or --task_type generative_reranker (a causal LM's yes / no logits)")

    def check_flags(self, args: Any) -> None:
        if args.loss_type is None:
            args.loss_type = self.default_loss
        if not is_rerank_loss(args.loss_type):
            raise UsageError(f"--task_type {self.name} trains with a reranker loss ({', '.join(RERANK_LOSSES)}), "
                             f"got --loss_type {args.loss_type}")
        implied = rerank_task_of(args.loss_type)
        if implied is not None and implied != self.name:
            raise UsageError(f"--loss_type {args.loss_type} (ms-swift 3's name) scores with a causal LM: use it with "
                             f"--task_type {implied}, or --loss_type "
                             f"{RERANK_LOSS_CLASSES[args.loss_type].name} with --task_type {self.name}")
        refuse_flags(args, self.name, EMBEDDING_ONLY)

    def recognises(self, path: str) -> bool:
        # a cross-encoder says what it is; a causal LM may as well be an embedding model (Qwen3-Embedding)
        return self.name == "reranker" and any(a.endswith(self.head_suffixes) for a in folder_architectures(path))

    def may_score(self, path: str) -> bool:
        return any(a.endswith(self.head_suffixes) for a in folder_architectures(path))

    def check_model(self, args: Any, config: Any) -> None:
        """A folder whose classification head has more than one label (an NLI classifier, a
        multi-class model) is refused before it loads; one without a classification head gets
        a new one-label head. A sentence-transformers CrossEncoder folder is kept whole or
        refused, naming what cannot be kept (:mod:`.st_folder`); its default prompt becomes the
        run's query instruction unless ``--query_system`` gives one."""
        from .st_folder import read_cross_encoder

        if self.name != "reranker":
            st = folder_json(args.model, "config_sentence_transformers.json")
            if isinstance(st, dict) and st.get("model_type") == "CrossEncoder":
                raise UsageError(f"--model {args.model}: a sentence-transformers CrossEncoder folder (a causal LM's "
                                 "LogitScore): mmembed's generative reranker scores its template's prompt layout, which "
                                 "CrossEncoder does not write; give the causal LM's folder without the "
                                 "sentence-transformers files")
        else:
            cross_encoder = read_cross_encoder(args.model)
            if cross_encoder is not None and args.query_system is None:
                args.query_system = cross_encoder.instruction
        architectures = getattr(config, "architectures", None) or []
        labels = getattr(config, "num_labels", 1)
        if self.name == "reranker" and labels != 1 and any(a.endswith("ForSequenceClassification")
                                                           for a in architectures):
            raise UsageError(f"--model {args.model}: its classification head has {labels} labels (config.json's "
                             "id2label); a reranker scores a pair with one label: use a one-label cross-encoder, or "
                             "its base model (a new one-label head is trained)")

    def check_dataset_entries(self, args: Any) -> None:
        own = [e.name for e in args.dataset_entries if e.has_loss_settings]
        if own:  # the reranker losses take their settings from LISTWISE_RERANKER_*, one for the run
            raise UsageError(f"--dataset_config {args.dataset_config}: dataset(s) {', '.join(own)} have loss settings of "
                             f"their own (loss_kwargs / infonce), which --task_type {self.name} does not take")

    def build_loss(self, args: Any, environment: Any) -> Any:
        from .losses import build_rerank_loss

        return build_rerank_loss(args.loss_type, environment)  # LISTWISE_RERANKER_* checked now

    def pooling(self, args: Any, template: Any) -> str:
        return args.pooling or template.pooling

    def input_lengths(self, samples: list, builder: Any, layout: Any, total_within: int | None = None) -> list[int]:
        from .inputs import pair_token_lengths

        return pair_token_lengths(samples, builder, total_within)

    def build_trainer(self, args: Any, setup: Any) -> Any:
        from .trainer import build_rerank_trainer

        return build_rerank_trainer(args, setup)

    def export(self, checkpoint: str, output_dir: str) -> str:
        from .export import export_reranker

        return export_reranker(checkpoint, output_dir)

    def load_scorer(self, path: str, device: str | None = None, torch_dtype: str | None = None) -> Any:
        from .scorer import Reranker

        return Reranker.from_pretrained(path, device=device, torch_dtype=torch_dtype, task_type=self.name)


RERANKER = RerankerTask("reranker", "a classification head over the (query, document) pair",
                        ("ForSequenceClassification", "JinaVLForRanking"))  # jina-reranker-m0's score MLP
GENERATIVE_RERANKER = RerankerTask("generative_reranker", "a causal LM's yes / no logits at the last position",
                                   ("ForCausalLM", "ForConditionalGeneration"))
