"""Which rows a loss can learn from, so that a run whose rows cannot train is found when the
rows are read, before the model loads, rather than after hours of steps with loss 0.

A loss states what it needs of each row's negatives as
:attr:`mmembed.losses.EmbeddingLoss.negatives_rule` (a :class:`NegativesRule`, or None when
every row can train: InfoNCE with ``INFONCE_USE_BATCH=false`` needs one negative per row, as
a row's only other candidate is then its positive; with ``INFONCE_HARD_NEGATIVES`` it needs
one to sample from). :func:`rows_without_negatives` finds the rows that fall short. The rule
lives here, beside the row contract, so that the data layer does not import the losses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["NegativesRule", "rows_without_negatives"]


@dataclass(frozen=True)
class NegativesRule:
    """The negatives a row needs for a loss to learn from it.

    Attributes:
        min_negatives: Rows with fewer negatives cannot train.
        why: Why such a row cannot train, under the settings in force (completes
            "a row with fewer than ``min_negatives`` negatives ...": ``"contributes loss 0
            and gradient 0: with INFONCE_USE_BATCH=false its only candidate is its positive"``).
        fix: What the user can change (``"give the rows negatives, or set INFONCE_USE_BATCH=true"``).
        breaks: True when the loss fails on such a row (it cannot be kept: an error, or
            skipped with ``--strict false``); False when it merely contributes nothing (kept
            with a warning, or skipped with ``--strict false``).
    """

    min_negatives: int
    why: str
    fix: str
    breaks: bool = False

    def falls_short(self, n_negatives: int) -> bool:
        """Whether a row with ``n_negatives`` negatives cannot train."""
        return n_negatives < self.min_negatives

    def reason(self) -> str:
        """The reason a short row is named with (``file:line: <reason>``)."""
        have = "no negatives" if self.min_negatives == 1 else f"fewer than {self.min_negatives} negatives"
        return f"{have}: {self.why}"


_BAR_ROWS = 50_000  # the fewest rows the trainable check shows a progress bar for


def rows_without_negatives(ds, rule: NegativesRule, batch_size: int = 1024) -> list[tuple[int, str, int]]:
    """The rows of ``ds`` (a ``datasets.Dataset`` with :func:`~mmembed.data.load_samples`'
    columns ``sample``, ``source``, ``line``) with fewer negatives than ``rule`` asks for, as
    ``(index, source, line)`` in the dataset's order. Reads only the negatives of each row."""
    from datasets.utils import tqdm  # datasets' progress bar (rows/s, ETA; off with datasets' switch)

    short = []
    columns = ds.select_columns(["sample", "source", "line"])
    # a bar for data worth one (at about 200k rows/s, fewer rows take a blink and would only add lines to a short run's output)
    bar = tqdm(total=len(ds), unit=" rows", desc="trainable check", disable=len(ds) < _BAR_ROWS)
    for b, batch in enumerate(columns.iter(batch_size=batch_size)):
        bar.update(len(batch["line"]))
        for j, (text, source, line) in enumerate(zip(batch["sample"], batch["source"], batch["line"])):
            if rule.falls_short(len(json.loads(text)["negatives"])):
                short.append((b * batch_size + j, source, line))
    bar.close()
    return short
