"""Charts of a run, as PNG files in ``OUTPUT_DIR/charts/``.

- one line chart per logged series over steps, from the Trainer's ``state.log_history``:
  ``train_loss.png``, ``learning_rate.png``, ``grad_norm.png`` and every eval metric
  (``eval_loss.png``, ``eval_margin.png``, ``eval_recall_at_1.png``, ...); written at the
  saves (at most once every :data:`REDRAW_SECONDS` of training: drawing a dozen charts takes
  a second or two, which short runs with frequent saves would pay at every step) and at the
  end of training;
- ``similarity_histogram.png``: the cosine similarity of each eval query with its positive,
  with its hard negatives and with the other eval documents (pair losses: pairs labelled
  above 0.5 against the others), before and after training, over the first
  :data:`HISTOGRAM_SAMPLES` eval samples. Without an eval set it is skipped, and the log
  says so.

Drawn with matplotlib's Agg canvas (no display, no pyplot state). :class:`TrainingCharts`
is the ``TrainerCallback``; :func:`chart_series` and :func:`draw_series` are usable alone.

Each PNG is written under a temporary name and renamed when whole (:func:`save_figure`). A
chart that cannot be written (full disk, read-only folder) does not stop training: the
callback logs one warning line naming the file, and the run goes on (a checkpoint already
published stays as it was; the next checkpoint meets the full disk itself).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback

from ..encoding.layout import Layout, split_groups_numpy, split_pair_rows
from ..files import WriteError, replaced_when_done
from .evaluation import KEPT_SAMPLES, embed_eval_set, kept_embeddings, numpy_scores

logger = logging.getLogger("mmembed")

CHARTS_DIR = "charts"
HISTOGRAM_FILE = "similarity_histogram.png"
HISTOGRAM_SAMPLES = KEPT_SAMPLES  # eval samples the histogram embeds (before and after training)
REDRAW_SECONDS = 60.0  # the line charts are redrawn at a save when this long has passed since training began or they were last drawn

#: log_history keys that are run summaries or bookkeeping, not series over steps.
NOT_SERIES = {"step", "epoch", "total_flos", "train_loss", "train_runtime", "train_samples_per_second",
              "train_steps_per_second", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second"}


def chart_series(log_history: Sequence[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """``{name: (steps, values)}`` of every numeric series in ``log_history``, in log order.
    The training loss (logged as ``loss``) is named ``train_loss``; the end-of-run summary
    (``train_loss``, ``train_runtime``, ...) and eval timings are left out."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for entry in log_history:
        if "step" not in entry:
            continue
        for key, value in entry.items():
            if key in NOT_SERIES or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            name = "train_loss" if key == "loss" else key
            steps, values = series.setdefault(name, ([], []))
            steps.append(int(entry["step"]))
            values.append(float(value))
    return series


def _figure(width: float = 6.4, height: float = 4.0, margins: dict[str, float] | None = None):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # constrained layout for panels with legends; line charts use fixed margins (half the
    # drawing time: they are redrawn at every save)
    fig = Figure(figsize=(width, height), layout="constrained" if margins is None else None)
    if margins is not None:
        fig.subplots_adjust(**margins)
    FigureCanvasAgg(fig)
    return fig


def plot_series(name: str, steps: Sequence[int], values: Sequence[float]):
    """A matplotlib ``Figure``: ``values`` over ``steps`` (its one line holds exactly them)."""
    from matplotlib.ticker import MaxNLocator

    fig = _figure(margins={"left": 0.13, "right": 0.97, "bottom": 0.12, "top": 0.9})
    ax = fig.subplots()
    ax.plot(steps, values, marker="o" if len(steps) <= 30 else None, markersize=3, linewidth=1.5)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(name)
    ax.set_title(name)
    ax.grid(True, alpha=0.3)
    if name == "learning_rate":
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    return fig


def save_figure(fig, path: str) -> None:
    """``fig`` as a PNG at ``path``, written under a temporary name and renamed when whole;
    a failed write raises :class:`WriteError` naming ``path`` and leaves no file behind."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    except OSError as e:
        raise WriteError(path, e) from e
    with replaced_when_done(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100)


def draw_series(log_history: Sequence[dict[str, Any]], folder: str,
                drawn: dict[str, tuple[list[int], list[float]]] | None = None) -> list[str]:
    """One PNG per series of ``log_history`` in ``folder``; returns the paths of all of them.

    ``drawn``: the series as last drawn into ``folder``, updated here; a chart whose series
    has not changed since and whose file is there is not drawn again (the end of training
    usually follows a save at the same step)."""
    paths = []
    all_series = chart_series(log_history)
    for name, series in all_series.items():
        path = os.path.join(folder, f"{name}.png")
        if drawn is None or drawn.get(name) != series or not os.path.isfile(path):
            save_figure(plot_series(name, *series), path)
            if drawn is not None:
                drawn[name] = series
        paths.append(path)
    # --dataset_config: the training loss of each dataset (loss_<name>) in one chart
    by_dataset = {name[len("loss_"):]: series for name, series in all_series.items() if name.startswith("loss_")}
    if by_dataset:
        path = os.path.join(folder, f"{BY_DATASET}.png")
        key = f"{BY_DATASET} {sorted(by_dataset.items())}"
        if drawn is None or drawn.get(BY_DATASET) != key or not os.path.isfile(path):
            save_figure(plot_lines("train loss by dataset", by_dataset), path)
            if drawn is not None:
                drawn[BY_DATASET] = key
        paths.append(path)
    return paths


#: the chart of every dataset's training loss (``loss_<name>``), one line each
BY_DATASET = "train_loss_by_dataset"


def plot_lines(title: str, lines: dict[str, tuple[list[int], list[float]]]):
    """A matplotlib ``Figure``: one line per entry of ``lines`` (label -> steps, values)."""
    from matplotlib.ticker import MaxNLocator

    fig = _figure(margins={"left": 0.13, "right": 0.97, "bottom": 0.12, "top": 0.9})
    ax = fig.subplots()
    for label, (steps, values) in lines.items():
        ax.plot(steps, values, marker="o" if len(steps) <= 30 else None, markersize=3, linewidth=1.5, label=label)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return fig


Similarities = dict[str, np.ndarray]  # kind ("positive", "hard negative", ...) -> cosines


def plot_histogram(before: Similarities, after: Similarities | None, after_label: str = "after training",
                   x_label: str = "cosine similarity"):
    """The cosine similarities of each kind, one panel per moment (before, after); any other
    ``x_label`` (a reranker's scores, unbounded): 80 bins over the values' range."""
    from matplotlib.ticker import MaxNLocator

    panels = [("before training", before)] + ([(after_label, after)] if after is not None else [])
    width, height = 5.5 * len(panels), 4.0
    # fixed margins in inches (room for the tick labels and axis titles): constrained layout
    # would take 0.5 s more of each run's last drawing
    fig = _figure(width, height, margins={"left": 0.75 / width, "right": 1 - 0.15 / width, "bottom": 0.55 / height,
                                          "top": 1 - 0.35 / height, "wspace": 0.05})
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    if x_label == "cosine similarity":
        bins = np.linspace(-1.0, 1.0, 81)
    else:
        values = np.concatenate([np.asarray(v, dtype=float) for _, sims in panels for v in sims.values()] or [np.zeros(1)])
        low, high = float(values.min()), float(values.max())
        bins = np.linspace(low, high if high > low else low + 1.0, 81)
    colors = {"positive": "tab:green", "hard negative": "tab:red", "negative": "tab:red", "other documents": "tab:gray"}
    for ax, (title, sims) in zip(axes, panels):
        for kind, values in sims.items():
            if len(values):
                # densities: the kinds differ in count by orders of magnitude (in-batch documents);
                # one filled outline per kind (the look of 80 bars, a tenth of their drawing time)
                ax.hist(values, bins=bins, density=True, alpha=0.5, color=colors.get(kind), histtype="stepfilled",
                        label=f"query-{kind} (n={len(values)}, mean {np.mean(values):.3f})")
        ax.set_title(title)
        ax.set_xlabel(x_label)
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("density")
    axes[0].yaxis.set_major_locator(MaxNLocator(nbins=6))
    return fig


def pair_similarities(emb: np.ndarray, labels: np.ndarray, layout: Layout, score=None) -> Similarities:
    """Cosine similarities by kind for rows in the loss's layout (read with the splitters of
    :mod:`mmembed.encoding.layout`, as the losses read it).

    Groups (``a0, p0, n0_*, a1, ...`` with 1.0/0.0 labels): ``positive`` (each anchor with
    its positive), ``hard negative`` (with each negative of its own group) and ``other
    documents`` (with every other group's positive and negatives, the in-batch negatives of
    InfoNCE). Pairs (``s1, s2, ...``, one score per pair): ``positive`` for pairs scored
    above 0.5, ``negative`` for the rest. ``score``: the loss's similarity when it is not the
    cosine (``score(queries, docs) -> [Q, C]``: MaxSim of multi-vector rows ``[N, L, D]``)."""
    if score is not None and layout is not Layout.PAIR:
        a, p, n, ng = split_groups_numpy(labels, emb.shape[0])
        scores = np.asarray(score(emb[a], emb[np.concatenate([p, n])]))  # [B, B + M]
        b = len(a)
        other = np.ones_like(scores, dtype=bool)
        other[np.arange(b), np.arange(b)] = False
        other[ng, b + np.arange(len(n))] = False
        return {"positive": scores[np.arange(b), np.arange(b)], "hard negative": scores[ng, b + np.arange(len(n))],
                "other documents": scores[other]}
    unit = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
    if layout is Layout.PAIR:
        s1, s2 = split_pair_rows(unit, len(labels))
        cos = np.sum(s1 * s2, axis=1)
        return {"positive": cos[labels > 0.5], "negative": cos[labels <= 0.5]}
    a, p, n, ng = split_groups_numpy(labels, emb.shape[0])
    docs = np.concatenate([p, n])
    doc_group = np.concatenate([np.arange(len(p)), ng])
    scores = unit[a] @ unit[docs].T  # [B, docs]
    other = doc_group[None, :] != np.arange(len(a))[:, None]
    return {"positive": np.sum(unit[a] * unit[p], axis=1), "hard negative": np.sum(unit[a[ng]] * unit[n], axis=1),
            "other documents": scores[other]}


def eval_similarities(trainer) -> Similarities | None:
    """:func:`pair_similarities` of the first :data:`HISTOGRAM_SAMPLES` samples of
    ``trainer``'s eval set with its model as it is now, over all processes (each embeds its
    share; all run as many forwards, as ZeRO-3 needs); None without an eval set."""
    dataset = trainer.eval_dataset
    if dataset is None or len(dataset) == 0:
        return None
    from torch.utils.data import Subset

    similarity = getattr(trainer.loss, "similarity", None)
    kept = kept_embeddings(trainer, dataset)  # kept only for a set of <= HISTOGRAM_SAMPLES samples
    if kept is not None:  # the evaluation at this step embedded the whole set with these weights
        emb, lab = kept.embeddings, kept.labels
    else:
        if len(dataset) > HISTOGRAM_SAMPLES:
            dataset = Subset(dataset, range(HISTOGRAM_SAMPLES))
        emb, lab = embed_eval_set(trainer, dataset)
    score = numpy_scores(similarity) if emb.ndim == 3 and similarity is not None else None
    return pair_similarities(emb, lab, trainer.loss.layout, score)


def _rng_states() -> tuple:
    import random

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return random.getstate(), np.random.get_state(), torch.random.get_rng_state(), cuda


def _set_rng_states(states: tuple) -> None:
    import random

    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.random.set_rng_state(states[2])
    if states[3] is not None:
        torch.cuda.set_rng_state_all(states[3])


class TrainingCharts(TrainerCallback):
    """Writes the charts of the module docstring into ``OUTPUT_DIR/charts/``.

    Args:
        similarities: Returns the eval set's cosines by kind with the model as it is (e.g.
            ``lambda: eval_similarities(trainer)``), or None when there is no eval set.
            Called on every process at the start and the end of training.
        x_label: What ``similarities`` measures (a reranker run's: its pair scores).
    """

    def __init__(self, similarities: Callable[[], Similarities | None] | None = None,
                 redraw_seconds: float = REDRAW_SECONDS, clock: Callable[[], float] = time.monotonic,
                 x_label: str = "cosine similarity"):
        self.similarities = similarities
        self.x_label = x_label  # what similarities() measures (a reranker's: "reranker score")
        self.before: Similarities | None = None
        self.drawn: dict[str, tuple[list[int], list[float]]] = {}  # series -> as last drawn
        self.redraw_seconds = redraw_seconds
        self.clock = clock
        self.last_drawn = clock()  # (training's start, until the first draw)

    def _measure(self) -> Similarities | None:
        """``similarities()`` with every random generator as it found it: a DataLoader draws
        its seed from the global generator, and training must not depend on the charts."""
        if self.similarities is None:
            return None
        states = _rng_states()
        try:
            return self.similarities()
        finally:
            _set_rng_states(states)

    @staticmethod
    def folder(args) -> str:
        return os.path.join(args.output_dir, CHARTS_DIR)

    def on_train_begin(self, args, state, control, **kwargs):
        self.last_drawn = self.clock()
        self.before = self._measure()
        if self.before is None and state.is_world_process_zero:
            logger.info("no eval set: the before/after similarity histogram is skipped (the other charts are drawn)")

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.clock() - self.last_drawn >= self.redraw_seconds:
            try:
                draw_series(state.log_history, self.folder(args), self.drawn)
                self.last_drawn = self.clock()
            except WriteError as e:  # the charts are a view of the run: training goes on
                logger.warning("charts: %s; training goes on without them", e)

    def on_train_end(self, args, state, control, **kwargs):
        after = self._measure() if self.before is not None else None
        if not state.is_world_process_zero:
            return
        folder = self.folder(args)
        try:
            written = draw_series(state.log_history, folder, self.drawn)
            if self.before is not None:
                path = os.path.join(folder, HISTOGRAM_FILE)
                save_figure(plot_histogram(self.before, after, f"after training (step {state.global_step})",
                                           self.x_label), path)
                written.append(path)
        except WriteError as e:  # the charts are a view of the run: its model is saved all the same
            logger.warning("charts: %s; the run goes on without them", e)
            return
        logger.info("charts (%d): %s", len(written), folder)
