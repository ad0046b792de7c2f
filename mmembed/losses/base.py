"""What a loss declares, so that the rest of mmembed asks the loss instead of its name.

Every loss is an :class:`EmbeddingLoss` (an ``nn.Module`` called as
``loss(outputs, labels) -> scalar``) and states, as class attributes or properties:

- :attr:`~EmbeddingLoss.layout`: how the collator lays out a batch
  (:class:`Layout`: groups ``a0, p0, n0_*, a1, ...`` with 1.0 / 0.0 labels, or pairs
  ``s1_0, s2_0, ...`` with one score per pair);
- :attr:`~EmbeddingLoss.side`: what it takes beside the student's embeddings
  (:class:`SideNeeds`: a guide model's embeddings of the same rows, a teacher's
  embeddings or scores);
- :attr:`~EmbeddingLoss.cross_process`: how a batch spread over several processes is
  combined (:class:`CrossProcess`; ``mmembed.training.distributed`` carries each one out);
- :attr:`~EmbeddingLoss.label_rule`: what each row's ``label`` must be
  (:class:`~mmembed.data.labels.LabelRule`: required or not, allowed values or range),
  checked on every row when the data is read, so a bad label names its file and line;
- :attr:`~EmbeddingLoss.negatives_rule`: how many negatives a row needs for the loss to
  learn from it under the settings in force
  (:class:`~mmembed.data.trainable.NegativesRule`, or None when every row can train),
  counted over the rows before the model loads;
- :meth:`~EmbeddingLoss.check_setup`: start-up checks against the model and the side
  inputs (:class:`Setup`), run before the first step.

The side inputs reach the loss in ``outputs`` under the keys of :class:`Side`
(``guide_hidden_state``, ``teacher_hidden_state``, ``teacher_scores``); the trainer
builds them from a :class:`Side`, never from key names of its own. Group losses take
their labels already split into :class:`Groups` (done once per batch, by
:meth:`EmbeddingLoss.targets`); given the raw 1.0 / 0.0 labels, they split them
themselves, so the public call ``loss({"last_hidden_state": emb}, labels)`` keeps working.
The layout and its splitters live below the losses, in :mod:`mmembed.encoding.layout`.

A loss that combines processes by its parts (``GROUP_PARTS`` / ``ROW_PARTS``) implements
the parts protocol, two methods declared here (their default refuses):

- :meth:`~EmbeddingLoss.split_parts` ``(outputs, labels)`` -> :class:`GroupParts` (the
  student's ``anchors``, ``positives``, ``negatives``, ``neg_group``, and a side model's
  rows aligned with them as ``guide`` / ``teacher`` :class:`SideRows`, None where unused) or
  :class:`RowParts` (``student``, and ``teacher`` / ``guide`` rows);
- :meth:`~EmbeddingLoss.forward_from_parts` ``(parts, *, query_rows=None)``: the loss of
  (possibly gathered) parts, averaged over the ``query_rows`` groups or rows.

``mmembed.training.distributed`` gathers each tensor field of the parts across processes,
and :class:`WrapperLoss` (the Matryoshka wrapper's base) passes them to the loss it wraps,
whose declarations it repeats through one delegation (:attr:`WrapperLoss.DELEGATED`).
"""

from __future__ import annotations

import enum
import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ..data.labels import LabelRule
from ..data.trainable import NegativesRule
from ..encoding.layout import Layout, split_groups
from .maxsim import DOT, Similarity
from .parts import Parts

NEG_INF = float("-inf")

#: The smallest temperature a loss that divides similarities by one takes: 2**-30. Logits are
#: similarities divided by T, and a similarity just below 1 (where a trained model's positives
#: score) becomes a logit just below 1/T. Above 2**30 float32 holds numbers only in steps of
#: 128, so with T < 2**-30 two logits at the top are either equal or at least 128 apart, and a
#: candidate 128 below the top gets the softmax weight exp(-128), which is 0 in float32 (its
#: smallest positive number is 2**-149, about exp(-103.3)): the loss of a group whose positive
#: leads is exactly 0 and so is its gradient; every logit gap float32 keeps saturates. At
#: T = 2**-30 the logits below 2**30 are 64 apart and exp(-64) is still a float32 number, so
#: the smallest gap float32 holds near 1 (2**-24) still gives a gradient.
#: tests/training/test_untrainable.py checks both sides numerically.
MIN_TEMPERATURE = 2.0**-30
#: :data:`MIN_TEMPERATURE` as the messages state it, rounded up (so that it is accepted as written)
MIN_TEMPERATURE_TEXT = f"{math.ceil(MIN_TEMPERATURE * 1e14) / 1e14:g}"


def check_temperature(owner: str, name: str, value: Any) -> float:
    """``value`` as a float, or a ValueError naming ``owner``'s option ``name``: a finite
    number no smaller than :data:`MIN_TEMPERATURE`, below which float32 logits saturate
    (loss and gradient exactly 0) and nothing trains."""
    value = finite_number(owner, name, value, above=0)
    if value < MIN_TEMPERATURE:
        raise ValueError(f"{owner} {name} {value!r} is too small: float32 logits saturate (a positive that leads by any "
                         f"gap float32 keeps gets loss 0 and gradient 0, so nothing trains); the smallest usable value "
                         f"is {MIN_TEMPERATURE_TEXT} (2**-30)")
    return value


class CrossProcess(str, enum.Enum):
    """How a loss is combined over W processes so that the averaged gradients equal one
    process's gradient on the whole global batch (``mmembed.training.distributed``)."""

    #: each group's loss involves only its own group: the local mean, scaled by B_r * W / B
    LOCAL_GROUPS = "local_groups"
    #: each pair's loss involves only its own pair: the local mean, scaled by P_r * W / P
    LOCAL_PAIRS = "local_pairs"
    #: each row's loss involves only its own row: the local mean, scaled by N_r * W / N
    LOCAL_ROWS = "local_rows"
    #: anchors score against the documents of every process: the loss's ``split_parts``
    #: (a :class:`GroupParts`) is gathered field by field, with gradient for the student's,
    #: and ``forward_from_parts`` scores this process's anchors (``query_rows``)
    GROUP_PARTS = "group_parts"
    #: rows compare with the rows of every process: ``split_parts`` gives a
    #: :class:`RowParts`, gathered the same way, ``forward_from_parts`` averages over this
    #: process's rows
    ROW_PARTS = "row_parts"
    #: anything else: every process computes the loss on the whole gathered batch
    #: (correct for any loss; each process repeats the same work)
    WHOLE_BATCH = "whole_batch"


class SideMismatch(enum.Enum):
    """How the side inputs of a run differ from what a loss takes (:meth:`SideNeeds.mismatch`,
    the one rule); each edge words it for its reader: :func:`check_side` for the loss's
    start-up check, ``mmembed.training.arguments.check_side_flags`` for the command line."""

    #: the loss takes a guide model, none is given
    NEEDS_GUIDE = "needs_guide"
    #: a guide model is given, the loss takes none
    TAKES_NO_GUIDE = "takes_no_guide"
    #: the loss takes a teacher, none is given
    NEEDS_TEACHER = "needs_teacher"
    #: a teacher is given, the loss takes none
    TAKES_NO_TEACHER = "takes_no_teacher"
    #: the teacher gives a signal (embeddings, scores) the loss does not take
    OTHER_TEACHER_SIGNAL = "other_teacher_signal"


@dataclass(frozen=True)
class SideNeeds:
    """What a loss takes beside the student's embeddings.

    Attributes:
        guide: A guide model's embeddings of the same rows (``--guide_model``).
        teacher: The teacher signals the loss accepts: ``"embeddings"`` (a teacher's
            embeddings of the same rows: ``--teacher_model``, or the data's
            ``teacher_embeddings``) and/or ``"scores"`` (the data's ``teacher_scores``
            of each group's own candidates). Empty: no teacher.
    """

    guide: bool = False
    teacher: frozenset[str] = frozenset()

    def met_by(self, side: Side) -> bool:
        """Whether a batch's side inputs hold everything asked for."""
        guide_ok = side.guide is not None or not self.guide
        teacher_ok = not self.teacher or side.teacher_signal() in self.teacher
        return guide_ok and teacher_ok

    def mismatch(self, guide: bool, teacher_signal: str | None, *, teacher_known: bool = True) -> SideMismatch | None:
        """The first way the given side inputs differ from these needs (in the order of
        :class:`SideMismatch`), or None when they fit.

        Args:
            guide: Whether a guide model is given.
            teacher_signal: The teacher's signal, ``"embeddings"`` or ``"scores"``, or None.
            teacher_known: False while a teacher may still come with the data (its rows can
                carry teacher signals): a missing teacher is then not a mismatch.
        """
        if self.guide and not guide:
            return SideMismatch.NEEDS_GUIDE
        if guide and not self.guide:
            return SideMismatch.TAKES_NO_GUIDE
        if teacher_signal is None:
            return SideMismatch.NEEDS_TEACHER if self.teacher and teacher_known else None
        if not self.teacher:
            return SideMismatch.TAKES_NO_TEACHER
        if teacher_signal not in self.teacher:
            return SideMismatch.OTHER_TEACHER_SIGNAL
        return None

    def __post_init__(self) -> None:
        unknown = set(self.teacher) - {"embeddings", "scores"}
        if unknown:
            raise ValueError(f"SideNeeds.teacher takes 'embeddings' and 'scores', not {sorted(unknown)}")


@dataclass
class Side:
    """The side inputs of one batch, on the loss's device.

    Attributes:
        guide: ``[N, Dg]``: the guide's embeddings of the batch's rows.
        teacher: ``[N, Dt]``: the teacher's embeddings of the batch's rows.
        teacher_scores: ``[B, W]``: per group, the teacher's scores of its own positive
            and negatives, NaN past them.
    """

    guide: Tensor | None = None
    teacher: Tensor | None = None
    teacher_scores: Tensor | None = None

    #: the ``outputs`` key each field travels under (the losses' documented names)
    KEYS: ClassVar[dict[str, str]] = {
        "guide": "guide_hidden_state",
        "teacher": "teacher_hidden_state",
        "teacher_scores": "teacher_scores",
    }

    def outputs(self) -> dict[str, Tensor]:
        """The fields that are set, under their ``outputs`` keys."""
        return {self.KEYS[f.name]: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def teacher_signal(self) -> str | None:
        """``"embeddings"``, ``"scores"`` or None: which teacher signal the batch carries."""
        if self.teacher is not None:
            return "embeddings"
        if self.teacher_scores is not None:
            return "scores"
        return None


GUIDE = Side.KEYS["guide"]
TEACHER = Side.KEYS["teacher"]
TEACHER_SCORES = Side.KEYS["teacher_scores"]


@dataclass(frozen=True)
class Setup:
    """What a loss is checked against at start (:meth:`EmbeddingLoss.check_setup`).

    Attributes:
        width: The student's embedding width.
        guide: Whether a guide model is given.
        teacher_signal: ``"embeddings"`` (a teacher model, or the data's embeddings),
            ``"scores"`` (the data's scores) or None.
        teacher_width: The teacher's embedding width, when it gives embeddings.
        sides_known: False while the side inputs are not known yet (``mmembed sft`` checks
            the width from the model's config before the data is read): only the checks
            against ``width`` run, :func:`check_side` passes.
    """

    width: int
    guide: bool = False
    teacher_signal: str | None = None
    teacher_width: int | None = None
    sides_known: bool = True


@dataclass(frozen=True)
class Groups:
    """The rows of a group batch: ``anchor [B]``, ``positive [B]`` (row indices),
    ``negative [M]`` (row indices, in group order) and ``neg_group [M]`` (the group of each
    negative, non-decreasing); long tensors on one device."""

    anchor: Tensor
    positive: Tensor
    negative: Tensor
    neg_group: Tensor

    @classmethod
    def from_labels(cls, labels: Tensor, n_rows: int) -> Groups:
        """Split ms-swift's labels (see :func:`mmembed.encoding.layout.split_groups`)."""
        return cls(*split_groups(labels, n_rows))

    @property
    def n_groups(self) -> int:
        return self.anchor.numel()

    def counts(self) -> Tensor:
        """``[B]``: the number of negatives of each group."""
        return torch.bincount(self.neg_group, minlength=self.n_groups)

    def to(self, device: torch.device | str) -> Groups:
        return Groups(*(t.to(device) for t in (self.anchor, self.positive, self.negative, self.neg_group)))


def as_groups(labels: Tensor | Groups, n_rows: int, device: torch.device | None = None) -> Groups:
    """``labels`` as :class:`Groups` (split now when given as 1.0 / 0.0 labels)."""
    if isinstance(labels, Groups):
        return labels if device is None else labels.to(device)
    if device is not None:
        labels = labels.to(device)
    return Groups.from_labels(labels, n_rows)


def finite_number(owner: str, name: str, value: Any, *, minimum: float | None = None, above: float | None = None) -> float:
    """``value`` as a float, or a ValueError naming ``owner``'s option ``name``: it must be a
    finite number (not a bool), ``>= minimum`` and ``> above`` when given."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{owner} option {name} must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{owner} option {name} must be >= {minimum}, got {value!r}")
    if above is not None and value <= above:
        raise ValueError(f"{owner} option {name} must be > {above}, got {value!r}")
    return float(value)


def in_group_scores(anchors: Tensor, positives: Tensor, negatives: Tensor, neg_group: Tensor,
                    similarity: Similarity = DOT) -> tuple[Tensor, Tensor]:
    """Each anchor's similarities to ``[own positive, own negatives]``, padded with -inf.

    Args:
        anchors, positives, negatives, neg_group: As :class:`GroupParts` holds them
            (``[B, D]`` rows, or ``[B, L, D]`` token vectors for :class:`MaxSim`).
        similarity: How an anchor scores a document (:meth:`Similarity.pairs`): the dot
            product by default.

    Returns:
        ``(scores [B, 1 + K], valid [B, 1 + K])``, ``K`` the largest group's number of
        negatives; a group's negatives keep their given order.
    """
    n_groups = anchors.shape[0]
    pos = similarity.pairs(anchors, positives)[:, None]  # [B, 1]
    if negatives.shape[0] == 0:
        return pos, torch.ones_like(pos, dtype=torch.bool)
    counts = torch.bincount(neg_group, minlength=n_groups)
    # slot of each negative within its group's row (its rank there, in given order)
    order = torch.argsort(neg_group, stable=True)
    first = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(neg_group)
    slot[order] = torch.arange(neg_group.numel(), device=neg_group.device) - first[neg_group[order]]
    neg = similarity.pairs(anchors.index_select(0, neg_group), negatives)  # [M]
    width = int(counts.max())
    padded = pos.new_full((n_groups, width), NEG_INF).index_put((neg_group, slot), neg)
    valid = torch.arange(width, device=anchors.device)[None, :] < counts[:, None]
    return torch.cat([pos, padded], dim=1), torch.cat([torch.ones_like(pos, dtype=torch.bool), valid], dim=1)


class EmbeddingLoss(nn.Module):
    """Base class of every loss: the declarations above, with the defaults of a plain group
    loss that needs nothing beside the embeddings and is computed on the whole gathered
    batch under several processes. A subclass overrides what differs and ``forward``.

    A user's own loss subclasses this and is named on the command line as
    ``--loss_type package.module:ClassName`` or registered with
    :func:`mmembed.losses.register_loss`.
    """

    #: the batch layout the collator builds for this loss
    layout: ClassVar[Layout] = Layout.GROUP

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A user's class that declares its ``layout`` by the value (``"pair"``) gets the
        enum, here, once: everything downstream takes a :class:`Layout` only."""
        super().__init_subclass__(**kwargs)
        declared = cls.__dict__.get("layout")
        if isinstance(declared, str) and not isinstance(declared, Layout):
            try:
                cls.layout = Layout(declared)
            except ValueError:
                raise ValueError(f"{cls.__name__}.layout must be Layout.GROUP or Layout.PAIR, "
                                 f"got {declared!r}") from None

    @property
    def side(self) -> SideNeeds:
        """What the loss takes beside the student's embeddings (default: nothing)."""
        return SideNeeds()

    @property
    def cross_process(self) -> CrossProcess:
        """How the loss is combined over several processes (default: on the whole gathered batch)."""
        return CrossProcess.WHOLE_BATCH

    @property
    def label_rule(self) -> LabelRule | None:
        """What each row's ``label`` must be, checked when the rows are read (a bad one is an
        error naming file and line, or a skipped row with ``--strict false``). Default: a
        group loss reads no labels (None); a pair loss needs a number on every row."""
        if self.layout is Layout.PAIR:
            return LabelRule(type(self).__name__)
        return None

    @classmethod
    def build(cls, **options: Any) -> EmbeddingLoss:
        """Build from ``build_loss`` options (by default the constructor's arguments)."""
        return cls(**options)

    @classmethod
    def option_names(cls) -> frozenset[str] | None:
        """The ``build_loss`` options (``--loss_kwargs`` keys) this loss takes, so that an
        unknown key is refused by name before anything loads. Read from the signatures: the
        named parameters of :meth:`build`, and when it passes ``**options`` on, those of the
        constructor. None when the keys cannot be known (a constructor taking ``**kwargs``);
        such a loss checks its own."""
        names: set[str] = set()
        for method in (cls.build, cls.__init__):
            if method is cls.__init__ and method is nn.Module.__init__:
                return frozenset(names)  # no constructor of its own: no options
            params = list(inspect.signature(method).parameters.values())
            if method is cls.__init__:
                params = params[1:]  # self
            names.update(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
            if not any(p.kind is p.VAR_KEYWORD for p in params):
                return frozenset(names)
        return None

    def targets(self, labels: Tensor, n_rows: int) -> Tensor | Groups:
        """The batch's labels as the loss takes them: :class:`Groups` for the group layout
        (split once here), the scores as given for the pair layout."""
        if self.layout is Layout.GROUP:
            return Groups.from_labels(labels, n_rows)
        return labels

    def averaged_over(self, targets: Tensor | Groups, n_rows: int) -> int:
        """How many terms the loss of a batch is the mean of: the batch's weight when the
        evaluation averages batch losses over the whole set (so that set's mean is the loss's
        mean over every group, not skewed by how many negatives a batch's groups hold). The
        groups (anchors) of the group layout, the pairs of the pair layout; a loss averaging
        over something else says so here."""
        if isinstance(targets, Groups):
            return targets.n_groups
        if self.layout is Layout.GROUP:
            return int((targets == 1.0).sum())
        return int(targets.shape[0])

    @property
    def negatives_rule(self) -> NegativesRule | None:
        """How many negatives a row must have for this loss to learn from it under its
        settings (a :class:`~mmembed.data.trainable.NegativesRule`): ``mmembed sft`` counts
        the rows with fewer before the model loads, names them, and refuses, warns or skips
        (``--strict false``) as the rule says. Default: None, every row can train."""
        return None

    def check_setup(self, setup: Setup) -> None:
        """Start-up checks (before the first step); raise ``ValueError`` with a message a
        user can act on. The default checks the side inputs against :attr:`side`."""
        check_side(type(self).__name__, self.side, setup)

    #: which documents each anchor's softmax weighs, for a group loss that ranks candidates:
    #: True every positive and every negative of the batch, False its own group's positive and
    #: negatives, None (the default) not declared. :meth:`candidate_scores` follows it, so the
    #: evaluation's ``margin`` / ``mean_neg`` are over the candidates the loss weighs.
    use_batch: ClassVar[bool | None] = None

    def candidate_scores(self, outputs: Any, labels: Any, *, generator: torch.Generator | None = None,
                         block_rows: int = 1024) -> Any:
        """The evaluation's view of a group loss: per block of anchors, ``(scores [b, C],
        target [b])``, the similarities its softmax weighs (``-inf`` where a candidate is
        left out) and each anchor's positive column (see
        :meth:`mmembed.losses.InfoNCELoss.candidate_scores`, which adds its own settings).
        By default the candidates :attr:`use_batch` declares (``generator``: unused here);
        ``None`` when it declares none (or for the pair layout): then the evaluation ranks
        every document of the set."""
        use_batch = self.use_batch
        if self.layout is not Layout.GROUP or use_batch is None:
            return None
        emb = outputs["last_hidden_state"]
        groups = as_groups(labels, emb.shape[0], emb.device)
        return _candidate_blocks(emb.index_select(0, groups.anchor), emb.index_select(0, groups.positive),
                                 emb.index_select(0, groups.negative), groups.neg_group, bool(use_batch), block_rows)

    def split_parts(self, outputs: Mapping[str, Tensor], labels: Any) -> Parts:
        """The parts protocol (``GROUP_PARTS`` / ``ROW_PARTS``): the batch split into what one
        process contributes to a cross-process batch: a :class:`GroupParts` (the student's
        embeddings keep their graph, side rows are detached) or a :class:`RowParts`. By
        default the loss has none (TypeError): it is combined another way (``cross_process``)."""
        raise TypeError(f"{type(self).__name__} has no split_parts: it is combined over processes as "
                        f"{self.cross_process.value}, not by parts")

    def forward_from_parts(self, parts: Parts, *, query_rows: slice | None = None) -> Tensor:
        """The loss of ``parts`` (the result of :meth:`split_parts`, or those of every process
        gathered), averaged over the ``query_rows`` groups (:class:`GroupParts`) or rows
        (:class:`RowParts`), a non-empty contiguous slice, all of them when None. By default
        the loss has none (TypeError), as for :meth:`split_parts`."""
        raise TypeError(f"{type(self).__name__} has no forward_from_parts: it is combined over processes as "
                        f"{self.cross_process.value}, not by parts")


def _candidate_blocks(anchors: Tensor, positives: Tensor, negatives: Tensor, neg_group: Tensor, use_batch: bool,
                      block_rows: int):
    """``(scores, target)`` blocks: against every positive and negative of the set (the own
    positive's column is the anchor's index) or, without ``use_batch``, against the own group's
    ``[positive, negatives]`` (target column 0)."""
    n = anchors.shape[0]
    if use_batch:
        docs = torch.cat([positives, negatives])
        for start in range(0, n, block_rows):
            stop = min(n, start + block_rows)
            yield anchors[start:stop] @ docs.T, torch.arange(start, stop, device=anchors.device)
        return
    scores, _ = in_group_scores(anchors, positives, negatives, neg_group)
    for start in range(0, n, block_rows):
        block = scores[start : start + block_rows]
        yield block, torch.zeros(block.shape[0], dtype=torch.long, device=block.device)


def check_side(loss_name: str, side: SideNeeds, setup: Setup) -> None:
    """The side inputs ``setup`` provides are the ones ``side`` asks for
    (:meth:`SideNeeds.mismatch`); a ValueError naming ``loss_name`` otherwise."""
    if not setup.sides_known:
        return
    problem = side.mismatch(setup.guide, setup.teacher_signal)
    if problem is None:
        return
    messages = {
        SideMismatch.NEEDS_GUIDE: "needs a guide model (--guide_model): its similarities decide the candidates",
        SideMismatch.TAKES_NO_GUIDE: "takes no guide model; drop --guide_model",
        SideMismatch.NEEDS_TEACHER: "needs a teacher: --teacher_model, or teacher signals in the data "
                                    "(teacher_scores / teacher_embeddings row fields or --teacher_*_file)",
        SideMismatch.TAKES_NO_TEACHER: "takes no teacher; drop --teacher_model / --teacher_*_file",
        SideMismatch.OTHER_TEACHER_SIGNAL: f"takes the teacher's {' or '.join(sorted(side.teacher))}, "
                                           f"not its {setup.teacher_signal}",
    }
    raise ValueError(f"{loss_name} {messages[problem]}")


#: a declaration's value when the wrapped module lacks it: the wrapper's own (EmbeddingLoss's default)
_BASE = object()


def _delegated(name: str, undeclared: Any = _BASE) -> property:
    """A :class:`WrapperLoss` property: the wrapped loss's ``name``; when the wrapped module
    does not declare it (a plain ``nn.Module``), ``undeclared``, by default what
    :class:`EmbeddingLoss` declares, evaluated on the wrapper."""

    def get(self: WrapperLoss) -> Any:
        value = getattr(self.inner, name, _BASE)
        if value is not _BASE:
            return value
        return getattr(super(WrapperLoss, self), name) if undeclared is _BASE else undeclared

    return property(get, doc=f"The wrapped loss's ``{name}``.")


def _labels_as_given(labels: Any, n_rows: int) -> Any:
    return labels


def _nothing_to_check(setup: Setup) -> None:
    return None


class WrapperLoss(EmbeddingLoss):
    """A loss computed by another loss, ``inner``, on changed inputs (the Matryoshka wrapper:
    on cut embeddings). It declares what ``inner`` declares: every name of :attr:`DELEGATED`
    reads the wrapped loss's own. A subclass writes ``forward`` (and, for a loss combined by
    parts, ``split_parts`` / ``forward_from_parts`` in terms of ``inner``'s).

    ``inner`` may be a plain ``nn.Module`` called as ``loss(outputs, labels)``: then it is
    taken to declare :class:`EmbeddingLoss`'s defaults, except that it gets its labels as
    given (``targets``) and has nothing to check at start (``check_setup``), as
    ``mmembed.training.distributed`` treats a module that declares nothing.
    """

    #: the declarations that are the wrapped loss's
    DELEGATED: ClassVar[tuple[str, ...]] = (
        "layout", "side", "cross_process", "label_rule", "negatives_rule", "use_batch",
        "targets", "averaged_over", "check_setup", "candidate_scores",
    )

    layout = _delegated("layout")
    side = _delegated("side")
    cross_process = _delegated("cross_process")
    label_rule = _delegated("label_rule")
    negatives_rule = _delegated("negatives_rule")
    use_batch = _delegated("use_batch")
    targets = _delegated("targets", _labels_as_given)
    averaged_over = _delegated("averaged_over")
    check_setup = _delegated("check_setup", _nothing_to_check)
    candidate_scores = _delegated("candidate_scores")

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        if not callable(inner):
            raise ValueError(f"{type(self).__name__} needs a loss module to wrap, got {inner!r}")
        self.inner = inner
