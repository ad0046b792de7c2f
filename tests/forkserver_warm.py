"""Imported once by the tests' forkserver (tests/forked_cli.py), after torch, transformers,
DeepSpeed and mmembed: the work every forked run would otherwise repeat on its own.

- DeepSpeed's Muon optimizer module, which its ZeRO optimizer check imports on every
  ``deepspeed.initialize`` and which compiles its kernels at import (torch's inductor: ~2.5 s
  of CPU in each DeepSpeed process);
- matplotlib's figure and Agg canvas, and one small chart drawn (the font loaded and its
  glyph cache filled: ~0.5 s of the first chart each run draws at its end)."""

import io

import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

import mmembed.encoding.media  # noqa: F401
import mmembed.training.charts  # noqa: F401


def _draw_once() -> None:
    fig = Figure(figsize=(2, 2))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.plot([1, 2], [0.5, 0.25], marker="o")
    ax.set_title("warm")
    ax.set_xlabel("step")
    ax.legend(["x"], fontsize=7)
    fig.savefig(io.BytesIO(), format="png", dpi=100)


_draw_once()
