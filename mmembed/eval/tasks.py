"""Held-out evaluations beside the eval set: ``--eval_beir`` and ``--eval_sts``.

Read and checked when training starts (a bad file fails then, not at the first
evaluation); run on the model as it is at each evaluation, through the same
:class:`~mmembed.model.embedder.Embedder` that ``mmembed eval`` uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..encoding.templates import Template


@dataclass
class HeldOutTasks:
    """``beir``: a :class:`~mmembed.eval.beir.BeirData`; ``sts``: ``(queries, responses,
    labels)``; ``template`` / ``max_length``: how the model renders text."""

    template: Template
    max_length: int
    beir: Any = None
    sts: tuple[list[str], list[str], list[float]] | None = None
    # named BEIR folders (--eval_beir name=folder): name -> BeirData, and the (query,
    # document) instructions each is embedded with
    beir_named: dict[str, Any] = field(default_factory=dict)
    instructions: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)
    # encoder(model, processing, template, max_length, device): what embeds for the tasks
    # (None: an Embedder; a late-interaction model's task gives its MaxSim scorer)
    encoder: Any = None

    @classmethod
    def load(cls, template: Template, max_length: int, beir: str | list | None = None, beir_split: str = "test",
             sts: str | None = None, instructions: dict[str, tuple[str | None, str | None]] | None = None,
             encoder: Any = None) -> HeldOutTasks:
        """Read the files now. ``beir``: a folder, or ``(name, folder)`` pairs (name None: the
        unnamed folder, whose metrics are ``beir_*``; a named one's are ``beir_<name>_*``);
        ``instructions``: ``name -> (query instruction, document instruction)`` for named ones.

        Raises:
            ValueError: a BEIR folder that cannot be used (the message names it).
            DataError: a bad STS row (file, line and field).
        """
        tasks = cls(template, max_length, instructions=dict(instructions or {}), encoder=encoder)
        pairs = [(None, beir)] if isinstance(beir, str) else list(beir or [])
        if pairs:
            from .beir import load_beir

            for name, folder in pairs:
                try:
                    data = load_beir(folder, beir_split)
                except ValueError as e:
                    raise ValueError(f"--eval_beir {folder if name is None else f'{name}={folder}'}: {e}") from None
                if name is None:
                    tasks.beir = data
                else:
                    tasks.beir_named[name] = data
        if sts:
            from .sts import read_pairs

            tasks.sts = read_pairs(sts)
        return tasks

    def __bool__(self) -> bool:
        return self.beir is not None or self.sts is not None or bool(self.beir_named)

    def evaluate(self, model, processing, device: str, batch_size: int) -> dict[str, float]:
        """``beir_*`` and ``sts_*`` metrics of ``model`` (an ``EmbeddingModel``, left in eval mode)."""
        from ..model.embedder import Embedder
        from .beir import evaluate_beir
        from .sts import evaluate_pairs

        make = self.encoder or (lambda m, p, t, n, d: Embedder(m, p, t, n, device=d))
        embedder = make(model, processing, self.template, self.max_length, device)
        out: dict[str, float] = {}
        if self.beir is not None:
            out.update({f"beir_{k}": v for k, v in evaluate_beir(embedder, self.beir, batch_size=batch_size).items()})
        for name, data in self.beir_named.items():
            query, document = self.instructions.get(name, (None, None))
            found = evaluate_beir(embedder, data, batch_size=batch_size, query_system=query, doc_system=document)
            out.update({f"beir_{name}_{k}": v for k, v in found.items()})
        if self.sts is not None:
            sts = evaluate_pairs(lambda texts: embedder.encode(texts, batch_size=batch_size), *self.sts)
            out.update({f"sts_{k}": v for k, v in sts.items()})
        return out
