"""Which instruction (system prompt) each text of a row is embedded with, resolved in one place.

For a text of ``side`` (``query``: a row's anchor; ``document``: its positives and negatives)
of a row drawn from dataset ``d`` (its ``dataset_id``; ``--dataset_config``'s datasets in
order, 0 for ``--dataset``), the first present of:

1. the row's own ``system`` (the text's :attr:`~mmembed.data.sample.Item.system`);
2. dataset ``d``'s instruction for the side (a dataset config's ``query_system`` /
   ``document_system``);
3. the run's instruction for the side (``--query_system`` / ``--document_system``);
4. ``--system``, else the template's default system prompt.

3 and 4 are the student's :class:`~mmembed.encoding.templates.Template` (``side_system``); 2
is applied here by giving each dataset with instructions of its own the template whose side
instructions are that dataset's (:meth:`Instructions.template_for`), so the collator, the
length check and the start-up report render a row the same way without the rows being
rewritten. A GIST guide or a distillation teacher embeds the rows with its own template and
none of these instructions. The export reads the datasets' instructions from the checkpoint's
``mmembed.json`` (``instructions.datasets``, written from the same dataset config).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..data.sample import Item
from .templates import Template


@dataclasses.dataclass(frozen=True)
class Instructions:
    """The datasets' instructions over a template's: ``datasets[d]`` is dataset ``d``'s
    ``(query_system, document_system)``, either None where the dataset gives none (the run's
    then apply); datasets past the end give none."""

    datasets: tuple[tuple[str | None, str | None], ...] = ()

    @classmethod
    def of(cls, entries: Sequence) -> Instructions:
        """From a dataset config's entries (objects with ``query_system`` and ``document_system``),
        in dataset order."""
        return cls(tuple((e.query_system, e.document_system) for e in entries))

    def __bool__(self) -> bool:
        return any(q is not None or d is not None for q, d in self.datasets)

    def own(self, dataset: int) -> tuple[str | None, str | None]:
        """Dataset ``dataset``'s ``(query, document)`` instructions (None: none of its own)."""
        return self.datasets[dataset] if 0 <= dataset < len(self.datasets) else (None, None)

    def template_for(self, template: Template, dataset: int) -> Template:
        """``template`` with dataset ``dataset``'s side instructions where it gives one (the
        template itself when it gives none)."""
        query, document = self.own(dataset)
        changes = {k: v for k, v in (("query_system", query), ("document_system", document)) if v is not None}
        return dataclasses.replace(template, **changes) if changes else template

    def templates(self, template: Template) -> dict[int, Template]:
        """``{dataset: its template}`` for every dataset with an instruction of its own."""
        return {d: self.template_for(template, d) for d in range(len(self.datasets))
                if any(x is not None for x in self.own(d))}

    def with_side(self, template: Template, item: Item, side: str | None, dataset: int = 0) -> Item:
        """``item`` as a ``side`` input of a row of ``dataset``: given the system prompt it is
        embedded with (see the module docstring) when it has none of its own, so that
        ``template.render(...)`` of the result renders it so."""
        return self.template_for(template, dataset).with_side(item, side)

    def system(self, template: Template, item: Item, side: str | None, dataset: int = 0) -> str | None:
        """The system prompt ``item`` is embedded with as a ``side`` input of a row of ``dataset``."""
        if item.system is not None:
            return item.system
        return self.template_for(template, dataset).side_system(side)
