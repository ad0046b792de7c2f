"""Matryoshka representation learning: one loss applied to several prefixes of the embedding.

A Matryoshka-trained model's embedding stays useful when cut to its first ``d``
components (and normalized again), so a user can store 64 numbers instead of 1024. The
wrapper here trains that property: the inner loss is computed on each requested prefix
and the results are added with their weights.

This is ms-swift's ``--mrl_dims '{"64": 1.0, "128": 1.0}'``: a JSON object from width to
weight; ms-swift's embedding trainer adds ``weight * loss(normalize(emb[:, :d]))`` over
the listed widths. Two differences: ms-swift skips (with a warning) a width larger than
the embedding, mmembed refuses it (:meth:`MatryoshkaLoss.check_dims`), since a silently
skipped width is a training run that does not do what its script says; and only
``last_hidden_state`` is cut here, while the other outputs (a guide's or teacher's
embeddings) pass through untouched.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import partial
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from .base import Setup, WrapperLoss, finite_number
from .parts import Parts
from .registry import build_loss, register_loss


def parse_dims(dims: Mapping[int | str, float] | str) -> dict[int, float]:
    """``{width: weight}`` from a mapping or its JSON text (ms-swift's ``--mrl_dims``).

    Keys may be ints or decimal strings (JSON object keys are strings). Order is kept.

    Raises:
        ValueError: Not a JSON object, no entry, a width that is not an integer >= 1, a
            width given twice, or a weight that is not a finite number >= 0.
    """
    if isinstance(dims, str):
        try:
            dims = json.loads(dims)
        except json.JSONDecodeError as exc:
            raise ValueError(f"mrl_dims must be a JSON object like '{{\"64\": 1.0}}', got {dims!r} ({exc})") from None
    if not isinstance(dims, Mapping):
        raise ValueError(f"mrl_dims must map widths to weights, like {{64: 1.0, 128: 1.0}}, got {dims!r}")
    if not dims:
        raise ValueError("mrl_dims is empty: give at least one width, like {64: 1.0}")
    out: dict[int, float] = {}
    for key, weight in dims.items():
        if isinstance(key, int) and not isinstance(key, bool):
            width = key
        elif isinstance(key, str) and key.strip().isdigit():
            width = int(key)
        else:
            width = None
        if width is None or width < 1:
            raise ValueError(f"mrl_dims width {key!r} must be an integer >= 1")
        if width in out:
            raise ValueError(f"mrl_dims gives width {width} twice")
        out[width] = finite_number("mrl_dims", f"weight of width {width}", weight, minimum=0)
    return out


def truncate(embeddings: Tensor, width: int) -> Tensor:
    """The first ``width`` components of each row, L2-normalized again."""
    return F.normalize(embeddings[..., :width], p=2, dim=-1)


class MatryoshkaLoss(WrapperLoss):
    """Wrap a loss so that it trains every listed prefix width of the embedding.

    ``loss = sum_d w_d * inner({**outputs, "last_hidden_state": normalize(emb[:, :d])}, labels)``

    A weighted **sum**, not a weighted mean, as in ms-swift (and in the Matryoshka paper):
    ``{"64": 1.0, "768": 1.0}`` doubles the scale of a single loss. Only the listed widths
    are trained; list the full width to train it too. ``{D: 1.0}`` with ``D`` the full
    width is the inner loss itself: the same value, and the same gradient for the model
    (normalizing the model's normalized rows again changes nothing it sees; only the
    gradient w.r.t. the normalized rows themselves loses its radial part). Every other
    entry of ``outputs`` (``guide_hidden_state``,
    ``teacher_hidden_state``, ``teacher_scores``) is passed to the inner loss unchanged.

    Each width calls the inner loss once. A loss that samples (``infonce`` with
    ``hard_negatives`` padding) therefore draws once per width in :meth:`forward`, as
    ms-swift does; the :meth:`split_parts` path draws once for all widths.

    The wrapper declares what the inner loss declares (layout, side inputs, cross-process
    strategy, ...: :class:`~mmembed.losses.base.WrapperLoss`).

    Args:
        inner: The loss to wrap (any ``loss(outputs, labels)`` module).
        dims: ``{width: weight}``, or ms-swift's JSON text; see :func:`parse_dims`.

    Example:
        ::

            from mmembed.losses import build_loss

            loss_fn = build_loss("matryoshka", dims={64: 1.0, 128: 1.0, 384: 1.0}, inner="infonce")
            loss_fn.check_dims(384)  # the trainer checks the model's width once at start
            loss = loss_fn({"last_hidden_state": emb}, labels)
    """

    def __init__(self, inner: nn.Module, dims: Mapping[int | str, float] | str) -> None:
        super().__init__(inner)
        self.dims = parse_dims(dims)

    @classmethod
    def build(cls, dims: Mapping[int | str, float] | str | None = None, inner: str | nn.Module = "infonce",
              **inner_options: Any):
        """Build from ``build_loss`` options.

        Args:
            dims: ``{width: weight}`` or its JSON text.
            inner: A loss name (built with ``build_loss(inner, **inner_options)``, so
                ``infonce`` reads ``INFONCE_*``) or a loss module.
            **inner_options: Options of the inner loss (only with a name).
        """
        if dims is None:
            raise ValueError("matryoshka needs its widths: --mrl_dims '{\"64\": 1.0, \"256\": 1.0}' "
                             "(or dims in --loss_kwargs), around --loss_type infonce or another loss")
        if isinstance(inner, str):
            if inner == "matryoshka":
                raise ValueError("matryoshka cannot wrap itself; give the inner loss's name, e.g. inner='infonce'")
            inner = build_loss(inner, **inner_options)
        elif inner_options:
            raise ValueError(f"options {sorted(inner_options)} are for an inner loss given by name, not a module")
        return cls(inner, dims)

    @classmethod
    def option_names(cls) -> None:
        """``dims`` and ``inner``, and the inner loss's options, which its own build checks."""
        return None

    def extra_repr(self) -> str:
        return f"dims={self.dims}"

    def check_setup(self, setup: Setup) -> None:
        """Every width fits the model's (:meth:`check_dims`), and the inner loss's own checks."""
        self.check_dims(setup.width)
        super().check_setup(setup)

    def check_dims(self, width: int) -> None:
        """Raise ``ValueError`` if a listed width exceeds the embedding's ``width``.

        The trainer calls this once the model's embedding width is known, so a bad
        ``--mrl_dims`` fails before the first step; :meth:`forward` checks again.
        """
        too_wide = [d for d in self.dims if d > width]
        if too_wide:
            raise ValueError(
                f"mrl_dims {too_wide} exceed the embedding width {width}: every width must be <= {width} "
                "(ms-swift skips such a width with a warning; mmembed refuses it)"
            )

    def forward(self, outputs: Mapping[str, Tensor], labels: Tensor) -> Tensor:
        """Weighted sum over the widths of the inner loss on the cut embeddings."""
        emb = outputs["last_hidden_state"]
        self.check_dims(emb.shape[-1])
        total = None
        for width, weight in self.dims.items():
            term = weight * self.inner({**outputs, "last_hidden_state": truncate(emb, width)}, labels)
            total = term if total is None else total + term
        return total

    # ---- the cross-device seam, when the inner loss has one ----------------------------

    @property
    def config(self):
        """The inner loss's ``config`` (``infonce``), so code written for InfoNCE works on the wrapper."""
        return self.inner.config

    def split_parts(self, outputs: Mapping[str, Tensor], labels: Tensor) -> Parts:
        """The inner loss's parts at full width (cut per width in :meth:`forward_from_parts`).

        Raises:
            TypeError: The inner loss has no ``split_parts``.
        """
        if not hasattr(self.inner, "split_parts"):
            raise TypeError(f"the wrapped loss {type(self.inner).__name__} has no split_parts")
        self.check_dims(outputs["last_hidden_state"].shape[-1])
        return self.inner.split_parts(outputs, labels)

    def forward_from_parts(self, parts: Parts, *, query_rows: slice | None = None) -> Tensor:
        """Weighted sum over the widths of the inner loss's ``forward_from_parts``.

        The student's embeddings of the parts (:meth:`GroupParts.with_student
        <mmembed.losses.parts.GroupParts.with_student>`: ``anchors``, ``positives``,
        ``negatives``; ``student`` of :class:`~mmembed.losses.parts.RowParts`) are cut to each
        width and normalized again; ``neg_group`` and the guide's or teacher's rows pass
        through. Cutting after a cross-device gather equals cutting before it (it acts row by
        row), so the wrapper's parts are gathered exactly as the inner loss's.
        """
        self.check_dims(parts.width)
        total = None
        for width, weight in self.dims.items():
            term = weight * self.inner.forward_from_parts(parts.with_student(partial(truncate, width=width)),
                                                          query_rows=query_rows)
            total = term if total is None else total + term
        return total


register_loss("matryoshka", MatryoshkaLoss)  # the registry cannot import this module: it builds the inner loss
