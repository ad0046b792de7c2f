"""What a training step's memory holds at its peak, by kind: parameters, optimizer state, gradients,
activations, autograd's own buffers, temporaries, inputs.

``bench_gpu.py --profile_memory`` runs one step of every run (every side: s-t, mmembed, ms-swift;
the first after the untimed warmup, then left out of the timed figures) under ``torch.profiler``
with ``profile_memory``, ``record_shapes`` and ``with_stack``, and reads the step's memory timeline
as PyTorch's own memory profiler categorises it (``torch.profiler._memory_profiler``: the tool
behind ``profile.export_memory_timeline``, on any device, the CPU included): each tensor's bytes
from its allocation to its release, with its role (a parameter; the optimizer's state; a
gradient; an activation kept for backward; autograd's detail; a temporary; an input), the
tensors alive before the step (parameters, optimizer state) counted from its start. The peak is
the largest sum over the step; :func:`memory_at_peak` returns the bytes of each kind there, and
the most each kind held at any point. On a GPU the figures are the tensors' bytes, not the
caching allocator's blocks (``max_memory_allocated`` also counts the rounding to blocks and the
kernels' workspaces, which are not tensors)::

    with memory_profile() as prof:
        ...  # one training step
    figures = memory_at_peak(prof, "cpu")  # or "cuda:0"
"""

from __future__ import annotations

MIB = 2**20


def _kinds() -> list[str]:
    """The timeline's columns after its first (unused): the profiler's categories in its own order,
    then the bytes it could not categorise."""
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX

    names = [None] * len(_CATEGORY_TO_INDEX)
    for category, i in _CATEGORY_TO_INDEX.items():
        names[i] = "unknown" if category is None else category.name.lower()
    return names


def memory_profile(cuda: bool = False):
    """A ``torch.profiler.profile`` that records what the memory timeline needs (a context manager)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    return profile(activities=activities, profile_memory=True, record_shapes=True, with_stack=True)


def memory_at_peak(prof, device: str) -> dict | None:
    """``{"peak_mb", "at_peak": {kind: MiB}, "most": {kind: MiB}}`` of the profiled block on
    ``device`` (``"cpu"``, ``"cuda:0"``), or None when it allocated nothing there."""
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(device)
    if not sizes:
        return None
    kinds = _kinds()
    totals = [sum(row[1:]) for row in sizes]
    peak = max(range(len(totals)), key=totals.__getitem__)
    at_peak = {k: sizes[peak][i + 1] / MIB for i, k in enumerate(kinds)}
    most = {k: max(row[i + 1] for row in sizes) / MIB for i, k in enumerate(kinds)}
    return {"peak_mb": totals[peak] / MIB, "at_peak": at_peak, "most": most}


def render(runs: list[dict], peer_key, name_of) -> list[str]:
    """Lines of a table: each run's peak and its kinds there (MiB), the most the activations held
    during the step (the peak of a small model is the optimizer's update, where they are gone),
    and the peak's ratio to the other sides' at the same work (``peer_key(run)``; ``name_of(run)``:
    the side's name)."""
    measured = [r for r in runs if r.get("memory")]
    if not measured:
        return []
    kinds = [k for k in _kinds() if any(r["memory"]["at_peak"].get(k) for r in measured)]
    head = (f"{'run':<34}{'peak':>9}" + "".join(f"{k.replace('_', ' '):>17}" for k in kinds)
            + f"{'activations at most':>21}   vs the others")
    lines = [head, "-" * len(head)]
    for r in measured:
        m = r["memory"]
        others = [(name_of(o), o["memory"]["peak_mb"]) for o in measured if o is not r and peer_key(o) == peer_key(r)]
        ratios = ", ".join(f"{m['peak_mb'] / v:.2f}x {n}" for n, v in others if v)
        label = f"{r['label']} b{r['batch']} {name_of(r)}"
        lines.append(f"{label:<34}{m['peak_mb']:>9.1f}" + "".join(f"{m['at_peak'].get(k, 0):>17.1f}" for k in kinds)
                     + f"{m['most'].get('activation', 0):>21.1f}   {ratios}")
    return lines
