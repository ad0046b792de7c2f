"""``--task_type late_interaction`` (aliases ``colbert``, ``multi_vector``, ``colqwen``): a
backbone's token states through a linear projection (``--late_interaction_dim``, 128) and L2
normalisation, one vector per kept token, a query scored against a document by MaxSim. ColBERT
from a text encoder (PyLate, sentence-transformers' ``MultiVectorEncoder``), ColQwen from a
Qwen2-VL / Qwen2.5-VL / Qwen3-VL backbone, trained from the same rows as an embedding model.

The run is the embedding run (:func:`mmembed.training.sft.build_trainer`: data, samplers,
DeepSpeed, gradient cache, resume) with this task's model head
(:class:`~mmembed.model.late_interaction.LateInteractionModel`), collator
(:mod:`.inputs`), losses over MaxSim (``infonce`` is :class:`mmembed.losses.LateInteractionInfoNCELoss`
here, every ``INFONCE_*`` as for one vector; colpali-engine's ``colbert_*`` losses) and saved
folder (:mod:`.folder`); :mod:`.export` writes what sentence-transformers, PyLate and
transformers load; :mod:`.scorer` scores with it (``mmembed rerank``, ``POST /v1/rerank``).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from ...errors import UsageError
from ...losses.late_interaction import LATE_INTERACTION_LOSSES
from ...task import Task, folder_architectures, folder_json
from ...training.task_flags import refuse_beir_first_stage, refuse_flags
from .settings import FLAGS, LateInteractionSettings, check_flags

__all__ = ["LATE_INTERACTION", "LateInteractionTask"]

logger = logging.getLogger("mmembed")

#: ``--loss_type`` names and the loss each builds here (the embedding name of InfoNCE trains over MaxSim)
_LOSSES = {"infonce": "late_interaction_infonce", **{name: name for name in LATE_INTERACTION_LOSSES}}

#: single-vector flags a late-interaction run refuses (name, what it is)
_SINGLE_VECTOR_ONLY = (
    ("guide_model", "a GIST guide model"),
    ("teacher_model", "a distillation teacher"),
    ("teacher_scores_file", "a distillation teacher's scores"),
    ("teacher_embeddings_file", "a distillation teacher's embeddings"),
    ("mrl_dims", "Matryoshka widths"),
    ("eval_sts", "held-out STS of single embeddings"),
    ("pooling", "an embedding pooling (a late-interaction model keeps every token)"),
)

_MULTI_VECTOR_TYPES = ("MultiVectorEncoder", "ColBERT")


class LateInteractionTask(Task):
    name = "late_interaction"
    summary = "one vector per token, scored by MaxSim (ColBERT, ColQwen)"
    own_losses = tuple(LATE_INTERACTION_LOSSES)
    scores_pairs = True
    embeds = True
    own_flags = FLAGS
    score_name = "MaxSim score"
    token_vectors = True

    def check_flags(self, args: Any) -> None:
        if args.loss_type is None:
            args.loss_type = self.default_loss
        if args.loss_type not in _LOSSES:
            raise UsageError(f"--task_type {self.name} trains with a loss over MaxSim scores ({', '.join(_LOSSES)}), "
                             f"got --loss_type {args.loss_type}")
        refuse_flags(args, self.name, _SINGLE_VECTOR_ONLY)
        refuse_beir_first_stage(args, "a late-interaction")
        if getattr(args, "padding_free", None):
            raise UsageError(f"--padding_free true packs rows into one sequence; --task_type {self.name} gives a vector "
                             "per token of each padded row: leave --padding_free unset")
        check_flags(args)

    def recognises(self, path: str) -> bool:
        st = folder_json(path, "config_sentence_transformers.json")
        if isinstance(st, dict) and st.get("model_type") in _MULTI_VECTOR_TYPES:
            return True
        return "ColQwen2ForRetrieval" in folder_architectures(path)

    def check_model(self, args: Any, config: Any) -> None:
        """A backbone whose transformers class gives scores rather than token states (a
        classification or retrieval head saved whole) is refused; so is a checkpoint to train
        on whose projection has another width than ``--late_interaction_dim``."""
        heads = [a for a in getattr(config, "architectures", None) or []
                 if a.endswith(("ForSequenceClassification", "ForTokenClassification", "ForRetrieval"))]
        if heads:
            raise UsageError(f"--model {args.model}: a {heads[0]} gives scores, not a transformer's token states; train "
                             "from its base model (a late-interaction projection is added)")
        from .start import check_multivector_folder, folder_projection

        if os.path.isdir(args.model):
            check_multivector_folder(args.model)  # every module kept, or refused naming it
        start = folder_projection(args.model) if os.path.isdir(args.model) else None
        if start is not None and args.late_interaction_dim is not None and start.shape[0] != args.late_interaction_dim:
            raise UsageError(f"--model {args.model}: its late-interaction projection is {start.shape[0]}-d, this run's "
                             f"--late_interaction_dim is {args.late_interaction_dim}; leave it unset to train the "
                             "folder's projection")
        for flag, folders in (("--resume_from_checkpoint", [args.resume_from_checkpoint]), ("--adapters", args.adapters)):
            for folder in folders:
                if not folder or not isinstance(folder, str) or not os.path.isdir(folder):
                    continue
                saved = _saved_dim(folder)
                wanted = args.late_interaction_dim or LateInteractionSettings.dim
                if saved is not None and saved != wanted:
                    raise UsageError(f"{flag} {folder}: its late-interaction projection is {saved}-d, this run's "
                                     f"--late_interaction_dim is {wanted}; pass --late_interaction_dim {saved}")

    def check_dataset_entries(self, args: Any) -> None:
        own = [e.name for e in args.dataset_entries if e.has_loss_settings]
        if own:
            raise UsageError(f"--dataset_config {args.dataset_config}: dataset(s) {', '.join(own)} have loss settings of "
                             f"their own (loss_kwargs / infonce); --task_type {self.name} trains every dataset with "
                             "the run's loss (INFONCE_*, --loss_kwargs)")

    def build_loss(self, args: Any, environment: Any) -> Any:
        from ...losses import build_loss

        options = json.loads(args.loss_kwargs) if args.loss_kwargs else {}
        options.setdefault("normalize_scores", bool(args.late_interaction_normalize_scores))
        try:
            return build_loss(_LOSSES[args.loss_type], **options)
        except ValueError as e:
            raise UsageError(f"--loss_type {args.loss_type}: {e}") from None

    def check_loss(self, args: Any, loss: Any, template: Any, config: Any) -> None:
        from ...training.flag_checks import check_side_flags
        from ...training.preflight import check_lora_targets

        check_side_flags(args, loss.side)
        check_lora_targets(args, template, config)

    def pooling(self, args: Any, template: Any) -> str:
        return "tokens"

    def build_trainer(self, args: Any, setup: Any) -> Any:
        from ...training.sft import build_trainer

        return build_trainer(args, setup)

    def settings(self, args: Any, encoding: Any) -> LateInteractionSettings:
        """The run's settings: the flags, then what ``--model`` says when it is a late-interaction
        model already (:mod:`.start`), then the anchors' defaults for the backbone."""
        from types import SimpleNamespace

        from .start import folder_defaults, folder_projection

        flags = {name: getattr(args, name) for name in FLAGS}
        folder = folder_defaults(args.model) if os.path.isdir(args.model) else {}
        same_expansion = flags["late_interaction_query_expansion"] in (None, folder.get("late_interaction_query_expansion"))
        for name, value in folder.items():
            if flags[name] is None and (same_expansion or name in ("late_interaction_skiplist",
                                                                   "late_interaction_normalize_scores")):
                flags[name] = value
        if flags["late_interaction_dim"] is None and os.path.isdir(args.model):
            start = folder_projection(args.model)
            flags["late_interaction_dim"] = None if start is None else int(start.shape[0])
        return LateInteractionSettings.resolve(SimpleNamespace(model=args.model, **flags), encoding.template,
                                               encoding.processing)

    def eval_encoder(self, args: Any, encoding: Any) -> Any:
        from .scorer import MultiVectorScorer

        settings = self.settings(args, encoding)

        def encoder(model, processing, template, max_length, device):
            return MultiVectorScorer(model, processing, template, max_length, settings, device=device)

        return encoder

    def model_head(self, args: Any, encoding: Any) -> Any:
        from ...model.late_interaction import LateInteractionModel, skiplist_token_ids
        from ...model.multivector_io import projection_from_weight
        from .start import folder_projection

        settings = self.settings(args, encoding)
        tokenizer = getattr(encoding.processing, "tokenizer", None) or encoding.processing
        start = folder_projection(args.model) if os.path.isdir(args.model) else None

        def head(backbone, pooling=None, padding_free=False, **options):
            # padding_free: on by default under a varlen attention for the one-vector tasks; the
            # output here is per token of each padded row (an explicit --padding_free true is refused)
            projection = None
            if start is not None:  # a late-interaction model already: its projection trains on
                logger.info("--model %s: starting from its %d-d late-interaction projection", args.model, start.shape[0])
                projection = projection_from_weight(start.float())
            return LateInteractionModel(backbone, settings.dim, skiplist_ids=skiplist_token_ids(tokenizer, settings.skiplist),
                                        projection=projection, **options)

        return head

    def collator_type(self) -> Any:
        from .inputs import LateInteractionCollator

        return LateInteractionCollator

    def collator_options(self, args: Any, encoding: Any) -> dict[str, Any]:
        return {"settings": self.settings(args, encoding)}

    def saved_config(self, args: Any, encoding: Any, config: dict[str, Any]) -> dict[str, Any]:
        from ...model.multivector_io import LATE_INTERACTION_KEY

        return {**config, "task_type": self.name, "pooling": "tokens", "normalize": True,
                LATE_INTERACTION_KEY: self.settings(args, encoding).record()}

    def folder_writer(self) -> Any:
        from .folder import write_late_interaction_folder

        return write_late_interaction_folder

    def export(self, checkpoint: str, output_dir: str) -> str:
        from .export import export_late_interaction

        return export_late_interaction(checkpoint, output_dir)

    def load_scorer(self, path: str, device: str | None = None, torch_dtype: str | None = None) -> Any:
        from .scorer import MultiVectorScorer

        return MultiVectorScorer.from_pretrained(path, device=device, torch_dtype=torch_dtype)


def _saved_dim(folder: str) -> int | None:
    saved = folder_json(folder, "mmembed.json")
    try:
        return int((saved.get("late_interaction") or {}).get("dim")) or None
    except (AttributeError, ValueError, TypeError):
        return None


LATE_INTERACTION = LateInteractionTask()
