"""The parts of a batch that a loss gathers from every process, with named fields.

A loss whose anchors (or rows) are compared with the documents (or rows) of every process
declares :attr:`CrossProcess.GROUP_PARTS <mmembed.losses.CrossProcess>` or ``ROW_PARTS`` and
implements two methods (:class:`~mmembed.losses.EmbeddingLoss`):

- ``split_parts(outputs, labels)`` -> :class:`GroupParts` or :class:`RowParts`: the batch
  split into what crosses processes (the student's embeddings, keeping their graph; a side
  model's rows, detached);
- ``forward_from_parts(parts, *, query_rows=None)``: the loss of parts that may hold the
  batches of every process, averaged over the ``query_rows`` groups (or rows) only.

``mmembed.training.distributed`` gathers every tensor field in rank order (the student's
with gradient, the side models' without, ``neg_group`` offset by the groups before each
process) and passes this process's own groups as ``query_rows``; the Matryoshka wrapper
cuts the student's fields (:meth:`GroupParts.with_student`) and passes the rest through.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import ClassVar

from torch import Tensor


def query_range(n: int, query_rows: slice | None) -> range:
    """``query_rows`` (None: all) as a range of ``0..n``.

    Raises:
        ValueError: It is not a non-empty contiguous slice.
    """
    rows = range(n)[query_rows if query_rows is not None else slice(None)]
    if rows.step != 1 or len(rows) == 0:
        raise ValueError(f"query_rows must select a non-empty contiguous slice of 0..{n}, got {query_rows}")
    return rows


@dataclass(frozen=True)
class SideRows:
    """A side model's embeddings (a guide's or a teacher's) of the rows of a
    :class:`GroupParts`, aligned with its student fields; they never get gradient.

    Attributes:
        anchors: ``[B, Ds]``.
        positives: ``[B, Ds]``.
        negatives: ``[M, Ds]``.
    """

    anchors: Tensor
    positives: Tensor
    negatives: Tensor

    def map(self, fn: Callable[[Tensor], Tensor]) -> SideRows:
        """The three fields through ``fn`` (a gather, a move to another device)."""
        return SideRows(fn(self.anchors), fn(self.positives), fn(self.negatives))


@dataclass(frozen=True)
class GroupParts:
    """A group batch (``a0, p0, n0_*, a1, ...``) split into groups, as
    ``EmbeddingLoss.split_parts`` gives it and ``forward_from_parts`` takes it.

    Attributes:
        anchors: ``[B, D]``, the student's anchor of each group.
        positives: ``[B, D]``; ``positives[g]`` belongs to ``anchors[g]``.
        negatives: ``[M, D]``, any number per group (``M`` may be 0), after any selection
            the loss makes (``hard_negatives``).
        neg_group: Long ``[M]``, the group (``0 <= g < B``) of each negative.
        guide: The guide's rows (``gist``), or None.
        teacher: The teacher's rows (``distill_kl``), or None.
    """

    anchors: Tensor
    positives: Tensor
    negatives: Tensor
    neg_group: Tensor
    guide: SideRows | None = None
    teacher: SideRows | None = None

    #: the side fields, and the name of their width in error messages
    SIDES: ClassVar[dict[str, str]] = {"guide": "Dg", "teacher": "Dt"}

    @property
    def n_queries(self) -> int:
        """``B``: ``query_rows`` selects from the groups."""
        return self.anchors.shape[0]

    @property
    def width(self) -> int:
        """``D``, the student's embedding width."""
        return self.anchors.shape[-1]

    def sides(self) -> dict[str, SideRows]:
        """The side fields that are set, by name (``guide``, ``teacher``)."""
        return {name: getattr(self, name) for name in self.SIDES if getattr(self, name) is not None}

    def tensors(self) -> dict[str, Tensor]:
        """Every tensor, by the name errors give it: ``anchors``, ``positives``, ``negatives``,
        ``neg_group``, then ``guide_anchors``, ..., ``teacher_negatives`` for the sides set."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in self.SIDES}
        for name, rows in self.sides().items():
            out.update({f"{name}_{f.name}": getattr(rows, f.name) for f in fields(rows)})
        return out

    def with_student(self, fn: Callable[[Tensor], Tensor]) -> GroupParts:
        """A copy with ``fn`` applied to the student's embeddings (``anchors``, ``positives``,
        ``negatives``); ``neg_group`` and the sides as they are (Matryoshka's cut)."""
        return replace(self, anchors=fn(self.anchors), positives=fn(self.positives), negatives=fn(self.negatives))

    def check(self, query_rows: slice | None, needs: tuple[str, ...] = ()) -> range:
        """Validate the shapes (each side aligned with the student's rows) and ``neg_group``;
        returns ``query_rows`` as a range of group indices.

        Args:
            query_rows: As ``forward_from_parts`` takes it.
            needs: The side fields the loss reads (``("guide",)``): they must be set.

        Raises:
            ValueError: naming the field that does not fit.
        """
        anchors, positives, negatives, neg_group = self.anchors, self.positives, self.negatives, self.neg_group
        if anchors.dim() != 2 or positives.shape != anchors.shape:
            raise ValueError(
                f"anchors and positives must both be [B, D], got {tuple(anchors.shape)} and {tuple(positives.shape)}"
            )
        n_groups, dim = anchors.shape
        n_neg = negatives.shape[0] if negatives.dim() == 2 else -1
        if negatives.dim() != 2 or negatives.shape[1] != dim or neg_group.shape != (n_neg,):
            raise ValueError(
                f"negatives must be [M, {dim}] with neg_group [M], got {tuple(negatives.shape)} "
                f"and {tuple(neg_group.shape)}"
            )
        if neg_group.numel() and not bool(((neg_group >= 0) & (neg_group < n_groups)).all()):
            raise ValueError(f"neg_group values must lie in [0, {n_groups}), the range of group indices")
        for name in needs:
            if getattr(self, name) is None:
                raise ValueError(f"the parts hold no {name} rows (parts.{name} is None); this loss needs them, "
                                 "as its split_parts gives them")
        for name, rows in self.sides().items():
            width = rows.anchors.shape[-1]
            for f, n_rows in zip(fields(rows), (n_groups, n_groups, n_neg)):
                part = getattr(rows, f.name)
                if part.dim() != 2 or part.shape != (n_rows, width):
                    raise ValueError(f"{name}_{f.name} must be [{n_rows}, {self.SIDES[name]}] (aligned with the "
                                     f"student rows), got {tuple(part.shape)}")
        return query_range(n_groups, query_rows)


@dataclass(frozen=True)
class RowParts:
    """A batch whose rows are compared with the rows of every process (``distill_marginal``),
    as ``split_parts`` gives it and ``forward_from_parts`` takes it.

    Attributes:
        student: ``[n, D]``, the student's rows.
        teacher: ``[n, Dt]``, the teacher's rows, aligned with them, or None.
        guide: ``[n, Dg]``, the guide's rows, aligned with them, or None.
    """

    student: Tensor
    teacher: Tensor | None = None
    guide: Tensor | None = None

    #: the side fields
    SIDES: ClassVar[tuple[str, ...]] = ("teacher", "guide")

    @property
    def n_queries(self) -> int:
        """``n``: ``query_rows`` selects from the rows."""
        return self.student.shape[0]

    @property
    def width(self) -> int:
        """``D``, the student's embedding width."""
        return self.student.shape[-1]

    def sides(self) -> dict[str, Tensor]:
        """The side fields that are set, by name."""
        return {name: getattr(self, name) for name in self.SIDES if getattr(self, name) is not None}

    def tensors(self) -> dict[str, Tensor]:
        """Every tensor that is set, by field name."""
        return {"student": self.student, **self.sides()}

    def with_student(self, fn: Callable[[Tensor], Tensor]) -> RowParts:
        """A copy with ``fn`` applied to ``student``; the sides as they are (Matryoshka's cut)."""
        return replace(self, student=fn(self.student))


#: what ``EmbeddingLoss.split_parts`` gives and ``forward_from_parts`` takes
Parts = GroupParts | RowParts
