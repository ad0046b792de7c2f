"""The checks every source of ``mmembed sft``'s rows goes through (``--dataset``,
``--dataset_config``, ``--streaming``), in one order: :data:`PHASES`, run by
:func:`check_rows`.

1. the trainable check: the rows the loss cannot learn from under its settings
   (:func:`check_trainable`; each ``--dataset_config`` dataset against its own loss);
2. the remote media: every http(s) media file downloaded up front (:func:`fetch_remote_media`);
3. the length check (:mod:`mmembed.training.length_check`).

A source yields :class:`Rows` (one :class:`Part` per dataset); a stream's rows are checked as
they are read (the phases add its filters). Each phase that applies logs its rows, removals
and time.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..data.sample import DataError, Sample
from ..data.streaming import Stream
from ..data.trainable import NegativesRule, rows_without_negatives
from ..encoding.instructions import Instructions
from ..losses import EmbeddingLoss
from ..task import get_task
from .arguments import SftArguments, UsageError
from .length_check import check_lengths, length_filter
from .model_assembly import Encoding

if TYPE_CHECKING:  # the media loader is imported at the first row with media (qwen-vl-utils: about a second)
    from ..encoding.media import MediaSettings
    from ..encoding.remote import DownloadSettings

logger = logging.getLogger("mmembed")


@dataclasses.dataclass
class Checks:
    """What the phases check rows against: the run's flags, encoding, loss and media settings."""

    args: SftArguments
    encoding: Encoding
    loss: EmbeddingLoss
    media: MediaSettings
    # the rows were just read and checked by another process of this run (read_once): its
    # length check is taken from the cache even with --strict false
    reuse: bool = False


@dataclasses.dataclass
class Part:
    """One dataset's rows as its source read them: the training rows (a ``datasets.Dataset``, or
    ``--streaming``'s stream, :class:`~mmembed.data.streaming.Stream`), the eval rows (or None), the rule of the loss that trains on them
    (:attr:`~mmembed.losses.EmbeddingLoss.negatives_rule`), the rules of the losses that score
    the eval rows (those a short row would break), and for ``--dataset_config`` its name."""

    train: Any
    val: Any
    rule: NegativesRule | None = None
    val_rules: tuple[NegativesRule, ...] = ()
    name: str | None = None

    @classmethod
    def of(cls, train, val, rule: NegativesRule | None, val_rules: Sequence[NegativesRule | None] | None = None,
           name: str | None = None) -> Part:
        """A part whose eval rows are checked against ``val_rules`` (default: ``rule``), only
        those an untrainable row would break (the eval loss would fail on it), each once."""
        breaking = {id(r): r for r in (val_rules or (rule,)) if r is not None and r.breaks}
        return cls(train, val, rule, tuple(breaking.values()), name)


@dataclasses.dataclass
class Rows:
    """What a source yields: its datasets' rows (one :class:`Part` for ``--dataset`` and the
    stream) and ``join``, which makes them one (training and eval rows) when a phase needs them
    whole; None: the one part is the whole."""

    parts: list[Part]
    join: Callable[[list[Part]], tuple[Any, Any]] | None = None

    def whole(self) -> tuple[Any, Any]:
        """``(train, val)``: the parts as one."""
        if self.join is not None:
            return self.join(self.parts)
        (part,) = self.parts
        return part.train, part.val

    def count(self) -> int:
        """The rows at hand (a stream's are checked as they are read: not counted)."""
        return sum(len(ds) for p in self.parts for ds in (p.train, p.val)
                   if ds is not None and not isinstance(ds, Stream))


@dataclasses.dataclass(frozen=True)
class Phase:
    """One check of the rows: ``run(rows, checks)`` gives the rows it keeps (or raises: the first
    that fails stops the run), when ``applies(rows, checks)``."""

    name: str
    run: Callable[[Rows, Checks], Rows]
    applies: Callable[[Rows, Checks], bool] = lambda rows, checks: True


def check_rows(rows: Rows, checks: Checks, phases: Sequence[Phase] | None = None) -> Rows:
    """The rows of any source through the same checks, in order (``phases``, by default
    :data:`PHASES`). Each phase that applies logs the rows it took in, those it removed and its
    time (none for a stream without eval rows: it has none up front)."""
    for phase in PHASES if phases is None else phases:
        if phase.applies(rows, checks):
            bar = _Phase(phase.name, rows.count())
            rows = phase.run(rows, checks)
            bar.done(rows.count())
    return rows


def _trainable(rows: Rows, checks: Checks) -> Rows:
    """The rows each part's loss can learn from (:func:`check_trainable`); a stream's rows are
    checked as they are read, for a rule they would break (a row that merely learns nothing is kept)."""
    strict, parts = checks.args.strict, []
    for part in rows.parts:
        own = "" if part.name is None else f" ({part.name})"
        train, val = part.train, part.val
        if not isinstance(train, Stream):
            train = check_trainable(train, part.rule, strict, "train" + own)
        elif part.rule is not None and part.rule.breaks:
            train.add_filter(_negatives_filter(part.rule))
        for rule in part.val_rules if val is not None else ():
            val = check_trainable(val, rule, strict, "val" + own)
        parts.append(dataclasses.replace(part, train=train, val=val))
    return Rows(parts, rows.join)


def _remote_media(rows: Rows, checks: Checks) -> Rows:
    """The remote media downloaded now (:func:`fetch_remote_media`); a stream's when read."""
    train, val = rows.whole()
    streamed = isinstance(train, Stream)
    kept, val = fetch_remote_media(None if streamed else train, val, checks.args.strict, checks.media.downloads)
    return Rows([Part(train if streamed else kept, val)])


def _lengths(rows: Rows, checks: Checks) -> Rows:
    """The length check (:func:`~mmembed.training.length_check.check_lengths`); a stream's rows
    over ``--max_length`` are dropped as they are read (``--truncation_strategy delete``)."""
    args, train, val = checks.args, *rows.whole()
    if isinstance(train, Stream):
        if args.truncation_strategy == "delete":
            # a --dataset_config dataset's instruction counts toward its rows' length
            own = Instructions.of(getattr(args, "dataset_entries", None) or []).templates(checks.encoding.template)
            train.add_filter(length_filter(checks.encoding, checks.media, args.check_media, checks.loss.layout, own,
                                           get_task(args.task_type)))
        return Rows([Part(train, check_lengths(args, checks.encoding, checks.loss, checks.media, None, val, checks.reuse)[1])])
    return Rows([Part(*check_lengths(args, checks.encoding, checks.loss, checks.media, train, val, checks.reuse))])


#: the phases every source's rows go through, in this order
PHASES: tuple[Phase, ...] = (
    Phase("trainable check", _trainable, lambda rows, checks: any(p.rule is not None or p.val_rules for p in rows.parts)),
    Phase("remote media", _remote_media),
    Phase("length check", _lengths, lambda rows, checks: (checks.args.truncation_strategy == "delete"
                                                          or bool(checks.encoding.template.media))),
)


def _negatives_filter(rule: NegativesRule) -> Callable[[Sample], bool]:
    def keep(sample: Sample) -> bool:  # a data error naming the row, or skipped and logged with --strict false
        if rule.falls_short(len(sample.negatives)):
            raise DataError(sample.source, sample.line, None, f"{rule.reason()}; {rule.fix}")
        return True

    return keep


class _Phase:
    """One phase of reading the data, timed from its creation: ``done(left)`` logs the rows it
    took in, those it removed (``left``: the rows it kept), and its time; nothing for no rows."""

    def __init__(self, name: str, rows: int):
        self.name, self.rows = name, rows
        self.started = time.perf_counter()

    def done(self, left: int) -> None:
        if not self.rows:
            return
        removed = f"{self.rows - left} removed (listed above), " if left < self.rows else ""
        log_phase(self.name, self.rows, time.perf_counter() - self.started, removed)


def log_phase(name: str, rows: int, seconds: float, removed: str = "", how: str = "") -> None:
    rate = f", {rows / seconds:,.0f} rows/s" if seconds > 0 and rows else ""
    logger.info("data: %s: %s rows, %s%.1f s%s%s", name, f"{rows:,}", removed, seconds, rate, f" ({how})" if how else "")


# ----------------------------------------------------------------------------- rows that cannot train

#: rows named in a message (file:line); the --strict false list names up to _LISTED
_NAMED, _LISTED = 5, 50


def check_trainable(ds, rule: NegativesRule | None, strict: bool = True, what: str = "train"):
    """The rows of ``ds`` the loss can learn from, as its ``negatives_rule`` says (None:
    every row; ``ds`` is returned as it is), checked before the model loads.

    Rows with fewer negatives than the rule asks for are counted and the first few named
    (``file:line``). None left that can train: a :class:`UsageError`, whatever ``strict`` says.
    Some: with ``strict=False`` they are skipped and listed like the other skipped rows; with
    ``strict`` a row the loss would fail on (``rule.breaks``: ``INFONCE_HARD_NEGATIVES`` with
    nothing to sample) is a :class:`UsageError`, one it merely learns nothing from
    (``INFONCE_USE_BATCH=false``) is kept, with a warning giving the count.
    """
    if rule is None:
        return ds
    short = rows_without_negatives(ds, rule)
    if not short:
        return ds
    reason = rule.reason()
    in_file_order = sorted((source, line) for _, source, line in short)  # the rows may be shuffled
    first = ", ".join(f"{source}:{line}" for source, line in in_file_order[:_NAMED]) + (", ..." if len(short) > _NAMED else "")
    rows = "training rows" if what == "train" else f"{what} rows"
    if len(short) == len(ds):
        raise UsageError(f"no {rows[:-1]} can train: every one of the {len(ds)} has {reason} ({first}); {rule.fix}")
    if strict and rule.breaks:
        raise UsageError(f"{len(short)} of {len(ds)} {rows} have {reason} ({first}); {rule.fix}, or pass --strict false "
                         "to skip them")
    if strict:
        logger.warning("%s: %d of %d rows cannot train: they have %s (%s); they are kept (--strict false skips them); %s",
                       what, len(short), len(ds), reason, first, rule.fix)
        return ds
    listed = "\n".join(f"  {source}:{line}: {reason}" for source, line in in_file_order[:_LISTED])
    if len(short) > _LISTED:
        listed += f"\n  ... {len(short) - _LISTED} more"
    logger.warning("%s: skipped %d of %d row(s) that cannot train (--strict false):\n%s", what, len(short), len(ds),
                   listed)
    dropped = {i for i, _, _ in short}
    return ds.select([i for i in range(len(ds)) if i not in dropped])


# ----------------------------------------------------------------------------- remote media


def fetch_remote_media(train, val, strict: bool = True, downloads: DownloadSettings | None = None):
    """Download every http(s) media file of the rows into the media cache now (once; a cached
    one is not fetched again) with ``downloads`` (the run's settings; None: the environment's),
    so that a URL that fails does so before training, and steps,
    epochs and data-loader workers read the cache. Logs one line per download and a summary.
    A URL that cannot be fetched is an error naming its row, or with ``strict=False`` each row
    naming it is skipped and listed like the other skipped rows. Returns ``(train, val)``."""
    from ..encoding import remote

    named = [(what, ds) for what, ds in (("train", train), ("val", val)) if ds is not None]

    def urls(ds):
        # most rows have no URL: find the stored rows whose JSON holds "://" in Arrow (vectorized,
        # in storage order: no gather through a shuffle's index), then decode only those, in order
        import numpy as np
        import pyarrow.compute as pc

        if "remote" in ds.column_names:  # marked when the rows were parsed
            stored = np.flatnonzero(ds.data.column("remote").to_numpy(zero_copy_only=False))
        else:
            stored = np.flatnonzero(pc.fill_null(pc.match_substring(ds.data.column("sample"), "://"), False)
                                    .to_numpy(zero_copy_only=False))
        if not len(stored):
            return
        indices = getattr(ds, "_indices", None)
        rows = stored if indices is None else np.flatnonzero(np.isin(indices.column(0).to_numpy(), stored))
        for i in rows:
            for url, where in remote.sample_urls(Sample.from_json(ds[int(i)]["sample"])):
                yield int(i), url, where

    failed: dict[str, str] | None = None if strict else {}
    remote.prefetch(((url, where) for _, ds in named for _, url, where in urls(ds)), failed=failed, settings=downloads)
    if not failed:
        return train, val
    kept = {}
    for what, ds in named:
        skipped: dict[int, DataError] = {}
        for i, url, (source, line, fieldname) in urls(ds):
            if url.strip() in failed and i not in skipped:
                skipped[i] = DataError(source, line, fieldname,
                                       f"cannot download ({failed[url.strip()]}): {remote.redact(url)!r}")
        if skipped:
            listed = "\n".join(f"  {e}" for e in skipped.values())
            logger.warning("%s: skipped %d row(s) whose media cannot be downloaded (--strict false):\n%s", what,
                           len(skipped), listed)
            ds = ds.select([i for i in range(len(ds)) if i not in skipped])
        kept[what] = ds
    return kept.get("train", train), kept.get("val", val)
