"""What a loss needs of each row's ``label``, so that a bad label is found when the rows are
read (naming file and line) rather than in the middle of training.

A loss states it as :attr:`mmembed.losses.EmbeddingLoss.label_rule` (a :class:`LabelRule`, or
None when it does not read labels); :func:`mmembed.data.load_samples` and
:func:`mmembed.data.parse_row` take it as ``label_rule=`` and check every row against it.
The rule lives here, with the row contract, so that the data layer does not import the
losses: it is plain data, and it keys the Arrow cache like the other reading options.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["LabelRule"]


@dataclass(frozen=True)
class LabelRule:
    """The labels a loss accepts.

    Attributes:
        loss: The loss's name, for messages (``"contrastive"``).
        required: Every row must carry a label.
        values: The only values allowed (e.g. ``(0.0, 1.0)``), or None for any number in
            ``[low, high]``.
        low: The smallest value allowed (inclusive), or None.
        high: The largest value allowed (inclusive), or None.
        meaning: What the label is to this loss, said after a bad value
            (``"the pair's cosine, which lies in [-1, 1]"``).
    """

    loss: str
    required: bool = True
    values: tuple[float, ...] | None = None
    low: float | None = None
    high: float | None = None
    meaning: str = ""

    def problem(self, label: float | None) -> str | None:
        """Why ``label`` (a row's label, None when the row has none) does not fit, or None."""
        if label is None:
            if not self.required:
                return None
            return f"missing; {self.loss} needs a numeric label on every row{self._meaning()}"
        if not math.isfinite(label):
            return f"is {label}; {self.loss} needs a finite number"
        if self.values is not None and label not in self.values:
            allowed = " or ".join(_show(v) for v in self.values)
            return f"is {_show(label)}; {self.loss} takes {allowed}{self._meaning()}"
        if (self.low is not None and label < self.low) or (self.high is not None and label > self.high):
            return f"is {_show(label)}, outside {self.span()}; {self.loss} takes labels in {self.span()}{self._meaning()}"
        return None

    def span(self) -> str:
        """``[low, high]`` as text (``-inf`` / ``inf`` for a missing bound)."""
        low = _show(self.low) if self.low is not None else "-inf"
        high = _show(self.high) if self.high is not None else "inf"
        return f"[{low}, {high}]"

    def as_dict(self) -> dict[str, Any]:
        """The rule as JSON-ready data (what keys the Arrow cache); :meth:`from_dict` reads it."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LabelRule:
        values = data.get("values")
        return cls(**{**data, "values": tuple(values) if values is not None else None})

    def _meaning(self) -> str:
        return f" ({self.meaning})" if self.meaning else ""


def _show(value: float) -> str:
    return f"{value:g}"
