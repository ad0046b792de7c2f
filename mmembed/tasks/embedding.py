"""``--task_type embedding`` (ms-swift's default): one L2-normalised vector per input, trained
with the losses of :mod:`mmembed.losses` (``infonce`` by default). Its parts are the shared
code itself: the embedding trainer (:func:`mmembed.training.sft.build_trainer`), the checks of
:mod:`mmembed.training.preflight`, the export of :mod:`mmembed.tools.export`."""

from __future__ import annotations

from typing import Any

from ..task import Task


class EmbeddingTask(Task):
    name = "embedding"
    summary = "one vector per input (ms-swift's --task_type embedding)"
    embeds = True
    quantizable = True

    def check_flags(self, args: Any) -> None:
        from ..training.task_flags import refuse_beir_first_stage

        refuse_beir_first_stage(args, "an embedding")
        super().check_flags(args)

    def check_model(self, args: Any, config: Any) -> None:
        """A sentence-transformers folder's modules, before any weight loads: one mmembed cannot
        run is refused, naming it (:func:`~mmembed.model.st_modules.check_modules`)."""
        from ..model.st_modules import check_modules

        check_modules(args.model)

    def build_loss(self, args: Any, environment: Any) -> Any:
        from ..training.model_assembly import make_loss

        return make_loss(args)

    def check_loss(self, args: Any, loss: Any, template: Any, config: Any) -> None:
        from ..training.preflight import check_embedding_loss

        check_embedding_loss(args, loss, template, config)

    def build_trainer(self, args: Any, setup: Any) -> Any:
        from ..training.sft import build_trainer

        return build_trainer(args, setup)

    def model_head(self, args: Any, encoding: Any) -> Any:
        from ..training.model_assembly import embedding_head

        return embedding_head(args, encoding.pooling)

    def saved_config(self, args: Any, encoding: Any, config: dict[str, Any]) -> dict[str, Any]:
        from ..model.st_modules import modules_of_folder, with_normalize

        entries = modules_of_folder(args.model)
        if entries:  # the pipeline each saved folder writes (modules.json) and loads back
            config = {**config, "sentence_transformers_modules": [e.record() for e in with_normalize(entries)]}
        return config

    def export(self, checkpoint: str, output_dir: str) -> str:
        from ..tools.export import export_embedding

        return export_embedding(checkpoint, output_dir)


EMBEDDING = EmbeddingTask()
