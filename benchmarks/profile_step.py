"""One training step under the torch profiler, summarised by region: where a step's time goes.

``bench_gpu.py --profile`` runs one step of each mmembed run (the first after the untimed
warmup, which is then left out of the timed figures: the profiler slows it) inside
:class:`ProfiledStep` and prints :func:`render_text`'s table; docs/benchmarks.md takes
:func:`render_markdown`'s. The same class profiles any block of code (the test does it on a tiny
model)::

    regions = find_regions(model, parts={"vit": ("visual",), "llm": ("language_model",)}, loss=loss_fn)
    with ProfiledStep(regions, cuda=torch.cuda.is_available()) as step:
        ...  # fetch a batch inside step.data(), forward, backward, optimizer step
    summary = step.summary()

How the time is split (all of it is the step's wall time, from the end of the previous step to
the end of this one, ``torch.cuda.synchronize()`` at both ends on a GPU):

- **device busy**: on a GPU the union of the intervals of its kernels and copies; on the CPU
  (``--dry_run``) the union of the intervals of the operators the profiler records (PyTorch's
  ``aten::`` ops, autograd's backward nodes, the optimizer's step), i.e. the host's compute.
- **regions**: each module of a region runs inside a ``torch.profiler.record_function`` range
  (``mmembed::vision`` ...) opened by a forward pre-hook and closed by a forward hook; under
  gradient checkpointing the recomputed forward runs the hooks again, so the recomputation is
  attributed too. A kernel belongs to the regions whose ranges enclose the operator that
  launched it (the profiler's correlation id links the two). Backward runs outside any module
  call: autograd's node ``autograd::engine::evaluate_function: XBackward0`` carries the
  sequence number of the forward operator that made it (and that operator's thread), and takes
  the regions of that operator. So each region's time is its forward plus its backward, each
  in its own column; work done inside autograd's backward counts as backward, gradient
  checkpointing's recomputed forward included. On the CPU an operator's *self* time (its time
  minus its child operators') is attributed the same way. Work inside several regions counts
  once, in the first of data, loss, vision tower, language model.
- **vision tower** = the template's ``[parts] vit`` modules (the aligner / merger inside them
  included); **language model** = ``[parts] llm``, or the whole encoder for a text model;
  **attention** = every ``self_attn`` / ``attn`` / ``attention`` module (projections, rotary,
  the attention product) inside either, shown as an "of which" row under its tower; **loss** =
  the loss module's call (in-process all-gather included) and its backward.
- **other device work** = busy time in none of those: the optimizer, gradient norm and
  accumulation, pooling, host-to-device copies, a VL model's embedding lookup (done outside
  ``language_model``).
- **data** = the wait for the batch (the training loop's ``get_batch_samples``, inside
  :meth:`ProfiledStep.data`); **idle** = the rest of the step: the device waiting on the
  host (Python, kernel launches, synchronisation). The rows sum to the step's wall time.

The top kernels (GPU: device time per kernel name; CPU: self time per operator) close the summary.
"""

from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import dataclass

if not __package__:  # run as a file: the package registered from its folder (benchmarks/_bootstrap.py)
    import _bootstrap  # noqa: F401

LABEL = "mmembed::"
STEP, DATA = LABEL + "step", LABEL + "data"
VISION, LLM, ATTENTION, LOSS = (LABEL + x for x in ("vision", "llm", "attention", "loss"))
ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")
BACKWARD = "autograd::engine::evaluate_function"
# Kineto activities that are no work of the step: the device-side copy of a range, the
# profiler's own overhead, synchronisation markers
NOT_WORK = ("gpu_user_annotation", "overhead", "cuda_sync", "cpu_instant_event", "external_correlation")
ROW_NAMES = {VISION: "vision tower", LLM: "language model", LOSS: "loss", ATTENTION: "attention"}


# ----------------------------------------------------------------------------- which modules


def _matches(name: str, prefix: str) -> bool:
    """``prefix`` names a module of the model AutoModel loads; wrappers (the embedder's
    ``backbone.``, PEFT's ``base_model.model.``) put more in front of it."""
    return name == prefix or name.endswith("." + prefix)


def _outermost(named: list[tuple[str, object]]) -> list[object]:
    out, taken = [], []
    for name, mod in sorted(named, key=lambda x: x[0].count(".")):
        if not any(name.startswith(t + ".") for t in taken):
            taken.append(name)
            out.append(mod)
    return out


def find_regions(model, parts: dict | None = None, loss=None) -> dict[str, list]:
    """``{range label: [modules]}`` of a model: ``parts`` is a template's ``[parts]``
    (``vit`` / ``llm`` prefixes of module names); without ``llm`` the language model is the
    embedder's ``backbone`` (a text model's whole encoder), else ``model`` itself. ``loss``: the
    loss module (the trainer's ``loss_fn``), if it is one."""
    from torch import nn

    parts = parts or {}
    named = list(model.named_modules())
    regions: dict[str, list] = {}
    for label, key in ((VISION, "vit"), (LLM, "llm")):
        prefixes = parts.get(key) or ()
        found = _outermost([(n, m) for n, m in named if any(_matches(n, p) for p in prefixes)])
        if found:
            regions[label] = found
    if LLM not in regions:
        backbone = getattr(model, "backbone", None)
        regions[LLM] = [backbone if isinstance(backbone, nn.Module) else model]
    regions[ATTENTION] = _outermost([(n, m) for n, m in named if n.rsplit(".", 1)[-1] in ATTENTION_NAMES])
    if isinstance(loss, nn.Module):
        regions[LOSS] = [loss]
    return {k: v for k, v in regions.items() if v}


def trainer_regions(trainer) -> dict[str, list]:
    """The regions of an mmembed (or any transformers) Trainer's model: the template's
    ``[parts]`` from the run's ``mmembed_config``, the loss from ``loss_fn`` (or ``loss``)."""
    parts: dict = {}
    template = (getattr(trainer, "mmembed_config", None) or {}).get("template")
    if template is not None:
        from mmembed.encoding.templates import template_from_config

        parts = dict(template_from_config(template).parts)
    loss = getattr(trainer, "loss_fn", None) or getattr(trainer, "loss", None)
    return find_regions(trainer.model, parts, loss)


# ----------------------------------------------------------------------------- profiling


class _Ranges:
    """record_function ranges around every call of the regions' modules, one stack per module
    and thread (a checkpointed forward is recomputed on autograd's thread)."""

    def __init__(self, regions: dict[str, list]):
        self.regions = regions
        self.handles: list = []
        self.open: dict = {}

    def attach(self) -> None:
        from torch.autograd.profiler import record_function

        for label, modules in self.regions.items():
            for mod in modules:
                def enter(module, args, label=label):
                    rf = record_function(label)
                    rf.__enter__()
                    self.open.setdefault((id(module), threading.get_ident()), []).append(rf)

                def leave(module, args, output):
                    stack = self.open.get((id(module), threading.get_ident()))
                    if stack:
                        stack.pop().__exit__(None, None, None)

                self.handles.append(mod.register_forward_pre_hook(enter))
                self.handles.append(mod.register_forward_hook(leave, always_call=True))

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


class ProfiledStep:
    """Profile a block (one training step) with the regions' ranges; :meth:`summary` after it.
    ``start`` / ``stop`` for a block that spans callbacks (:class:`StepProfiler`)."""

    def __init__(self, regions: dict[str, list], cuda: bool = False, top: int = 15, trace: str | None = None,
                 memory: bool = False):
        self.ranges = _Ranges(regions)
        self.cuda, self.top, self.trace, self.memory = cuda, top, trace, memory
        self.prof = None
        self.step_range = None
        self.modules = {ROW_NAMES.get(k, k): len(v) for k, v in regions.items()}

    def start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile, record_function

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        if self.memory:  # what the memory timeline needs (memory_step.py)
            from benchmarks.memory_step import memory_profile

            self.prof = memory_profile(self.cuda)
        else:
            self.prof = profile(activities=activities)
        self.ranges.attach()
        if self.cuda:
            torch.cuda.synchronize()
        self.prof.start()
        self.step_range = record_function(STEP)
        self.step_range.__enter__()

    def stop(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        self.step_range.__exit__(None, None, None)
        self.prof.stop()
        self.ranges.detach()

    def __enter__(self) -> ProfiledStep:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @staticmethod
    def data():
        """The range of the wait for the batch (a no-op while nothing profiles)."""
        from torch.autograd.profiler import record_function

        return record_function(DATA)

    def memory_figures(self) -> dict | None:
        """memory_step.memory_at_peak of the step (``memory=True``), else None."""
        if self.prof is None or not self.memory:
            return None
        from benchmarks.memory_step import memory_at_peak

        return memory_at_peak(self.prof, "cuda:0" if self.cuda else "cpu")

    def summary(self) -> dict | None:
        if self.prof is None:
            return None
        if self.trace:
            self.prof.export_chrome_trace(self.trace)
        out = summarise(events_of(self.prof), top=self.top, device="cuda" if self.cuda else "cpu")
        out["modules"] = self.modules
        return out


def step_profiler(trainer, step: int, cuda: bool, top: int = 15, trace: str | None = None, memory: bool = False):
    """A TrainerCallback that profiles optimizer step ``step`` (0-based) of ``trainer``: from the
    end of step ``step - 1`` (or the start of training) to the end of step ``step``. Add it
    before any callback that times the steps, so that starting and stopping the profiler fall
    into the untimed step before and the profiled step. ``.summary()`` after training (None if
    the run ended first). ``memory``: the step's memory instead (``.memory_figures()``; no regions)."""
    import transformers

    class StepProfiler(transformers.TrainerCallback):
        def __init__(self):
            self.step, self.running = None, False

        def _begin(self):
            self.step = ProfiledStep({} if memory else trainer_regions(trainer), cuda=cuda, top=top, trace=trace,
                                     memory=memory)
            self.step.start()
            self.running = True

        def on_train_begin(self, args, state, control, **kw):
            self.running = False
            if step == 0:
                self._begin()

        def on_step_end(self, args, state, control, **kw):
            if self.running and state.global_step == step + 1:
                self.step.stop()
                self.running = False
            elif state.global_step == step and step > 0:
                self._begin()

        def on_train_end(self, args, state, control, **kw):
            if self.running:  # the run ended inside the step: no summary
                self.step.stop()
                self.running, self.step = False, None

        def summary(self) -> dict | None:
            if self.running:  # the step raised (out of memory): no summary of half a step
                self.step.stop()
                self.running, self.step = False, None
            return self.step.summary() if self.step is not None else None

        def memory_figures(self) -> dict | None:
            if self.running:  # the step raised (out of memory): no figures of half a step
                self.step.stop()
                self.running, self.step = False, None
            return self.step.memory_figures() if self.step is not None else None

    return StepProfiler()


# ----------------------------------------------------------------------------- the summary


@dataclass
class Ev:
    """One profiler event, in microseconds from the trace's start. ``kind``: ``op`` (a host
    operator), ``range`` (a record_function range) or ``device`` (a kernel or a copy)."""

    name: str
    kind: str
    start: float
    end: float
    thread: int = 0
    id: int = 0  # an op's correlation id
    link: int = 0  # a device event's (or a CUDA runtime call's) launching op: its correlation id
    seq: int = -1  # autograd sequence number (a forward op's, or the forward op's of a backward node)
    fwd_thread: int = 0  # a backward node's forward thread


def events_of(prof) -> list[Ev]:
    """The events of a stopped ``torch.profiler.profile``."""
    from torch.autograd import DeviceType

    out = []
    for e in prof.events():
        activity = getattr(e, "activity_type", None)
        if e.name.startswith("[memory]") or e.name == "[OutOfMemory]" or activity in NOT_WORK:
            continue
        if e.device_type == DeviceType.CPU:
            if getattr(e, "is_async", False):
                continue
            kind = "range" if (getattr(e, "is_user_annotation", False) or e.name.startswith(LABEL)) else "op"
        elif getattr(e, "is_user_annotation", False):
            continue  # the device-side shadow of a range
        else:
            kind = "device"
        out.append(Ev(e.name, kind, e.time_range.start, e.time_range.end, thread=int(e.thread), id=int(e.id),
                      link=int(getattr(e, "linked_correlation_id", 0) or 0), seq=int(e.sequence_nr),
                      fwd_thread=int(getattr(e, "fwd_thread", 0) or 0)))
    return out


def _union(intervals) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(intervals) -> float:
    return sum(b - a for a, b in _union(intervals))


def _nest(events: list[Ev]) -> dict[int, dict]:
    """Per host event (by index, nested per thread by time): the labels of the ranges around it
    (its own too), the nearest enclosing backward node (or itself) and the nearest enclosing op."""
    info: dict[int, dict] = {}
    host = [i for i, e in enumerate(events) if e.kind != "device"]
    host.sort(key=lambda i: (events[i].thread, events[i].start, -events[i].end))
    stack: list[int] = []
    thread = None
    for i in host:
        e = events[i]
        if e.thread != thread:
            stack, thread = [], e.thread
        while stack and (events[stack[-1]].end <= e.start or events[stack[-1]].end < e.end):
            stack.pop()
        parent = info[stack[-1]] if stack else {"labels": frozenset(), "bwd": None}
        labels = parent["labels"] | ({e.name} if e.kind == "range" and e.name.startswith(LABEL) else set())
        bwd = i if e.kind == "op" and e.name.startswith(BACKWARD) else parent["bwd"]
        op_parent = next((j for j in reversed(stack) if events[j].kind == "op"), None)
        info[i] = {"labels": frozenset(labels), "bwd": bwd, "op_parent": op_parent}
        stack.append(i)
    return info


def _attribution(events: list[Ev], info: dict[int, dict]):
    """A function: host event index -> (region labels, backward?). A forward op's labels are its
    ranges'; a backward node's those of the forward op with its sequence number (the last one
    recorded with that number on that thread: the op that made the node)."""
    made: dict[tuple[int, int], tuple[float, frozenset]] = {}
    for i, inf in info.items():
        e = events[i]
        # forward ops only: a backward node and its inner ``XBackward0`` carry the forward's
        # number too, with the forward thread in fwd_thread (0 on a forward op)
        if e.kind == "op" and e.seq >= 0 and not e.fwd_thread:
            key = (e.thread, e.seq)
            if key not in made or e.start >= made[key][0]:
                made[key] = (e.start, inf["labels"])

    def of(i: int) -> tuple[frozenset, bool]:
        inf = info[i]
        b = inf["bwd"]
        if b is None:
            return inf["labels"], False
        node = events[b]
        forward = made.get((node.fwd_thread or node.thread, node.seq), (0, frozenset()))[1]
        return inf["labels"] | forward, True

    return of


def summarise(events: list[Ev], top: int = 15, device: str = "cpu") -> dict:
    """The step's time by region (see the module docstring) and the top kernels / ops.

    ``device`` ``cuda``: busy time is the device events'; ``cpu``: the host ops'. Times in ms;
    shares of the step's wall time (regions) or of the busy time (top)."""
    gpu = device != "cpu"
    info = _nest(events)
    of = _attribution(events, info)
    steps = [e for e in events if e.kind == "range" and e.name == STEP]
    if steps:
        w0, w1 = steps[0].start, steps[0].end
    else:
        w0, w1 = min(e.start for e in events), max(e.end for e in events)
    wall = w1 - w0

    def clip(e: Ev) -> tuple[float, float]:
        return max(e.start, w0), min(e.end, w1)

    data = _union(clip(e) for e in events if e.kind == "range" and e.name == DATA)
    # what launched each kernel, by correlation id: the innermost op (or range) around the launch;
    # not the CUDA runtime calls (link > 0), whose ids are CUPTI's, another numbering
    by_id = {e.id: i for i, e in enumerate(events) if e.kind != "device" and e.id and not e.link}
    pieces: list[tuple[str, float, frozenset, bool]] = []  # (name, us, labels, backward?)
    busy_iv = []
    if gpu:
        for e in events:
            if e.kind != "device":
                continue
            a, b = clip(e)
            if b <= a:
                continue
            busy_iv.append((a, b))
            launcher = by_id.get(e.link)
            labels, bwd = of(launcher) if launcher is not None else (frozenset(), False)
            pieces.append((e.name, b - a, labels, bwd))
    else:
        children: dict[int, float] = {}
        ops = [i for i in info if events[i].kind == "op" and events[i].start >= w0 and events[i].end <= w1]
        for i in ops:
            p = info[i]["op_parent"]
            if p is not None:
                children[p] = children.get(p, 0.0) + events[i].end - events[i].start
        for i in ops:
            e = events[i]
            busy_iv.append((e.start, e.end))
            labels, bwd = of(i)
            pieces.append((e.name, max(0.0, e.end - e.start - children.get(i, 0.0)), labels, bwd))
    busy = _union(busy_iv)
    busy_out = _length(busy + data) - _length(data)  # busy time outside the wait for data

    def primary(labels: frozenset) -> str | None:
        for label in (DATA, LOSS, VISION, LLM):
            if label in labels:
                return label
        return None

    acc: dict[str, list[float]] = {}
    for _, us, labels, bwd in pieces:
        p = primary(labels)
        if p is None or p == DATA:
            continue
        rows = [p] + ([p + "/attention"] if ATTENTION in labels and p in (VISION, LLM) else [])
        for r in rows:
            a = acc.setdefault(r, [0.0, 0.0])
            a[1 if bwd else 0] += us
    ms = 1e-3
    regions = []

    def row(name: str, us: float, fwd: float | None = None, bwd: float | None = None) -> None:
        regions.append({"region": name, "ms": us * ms, "share": us / wall if wall else 0.0,
                        "forward_ms": None if fwd is None else fwd * ms,
                        "backward_ms": None if bwd is None else bwd * ms})

    counted = 0.0
    for label in (VISION, LLM, LOSS):
        f, b = acc.get(label, [0.0, 0.0])
        counted += f + b
        row(ROW_NAMES[label], f + b, f, b)
        if label in (VISION, LLM):
            fa, ba = acc.get(label + "/attention", [0.0, 0.0])
            row("  of which attention", fa + ba, fa, ba)
    data_us = _length(data)
    row("other device work", max(0.0, busy_out - counted))
    row("data (wait for the batch)", data_us)
    row("idle (device waits on the host)", max(0.0, wall - data_us - busy_out))
    named: dict[str, list[float]] = {}
    for name, us, labels, _ in pieces:
        if DATA in labels:
            continue
        n = named.setdefault(name, [0, 0.0])
        n[0] += 1
        n[1] += us
    busy_total = sum(n[1] for n in named.values())
    top_rows = [{"name": name, "calls": n[0], "ms": n[1] * ms, "share": n[1] / busy_total if busy_total else 0.0}
                for name, n in sorted(named.items(), key=lambda x: -x[1][1])[:top]]
    out = {"device": device, "wall_ms": wall * ms, "busy_ms": busy_out * ms, "regions": regions, "top": top_rows}
    if gpu and not busy_iv:
        out["note"] = "no device events in the trace (is CUPTI missing?): every row but data is idle"
    return out


# ----------------------------------------------------------------------------- rendering


def _busy_word(s: dict) -> str:
    return "device" if s["device"] != "cpu" else "host op"


def render_text(s: dict, title: str = "") -> str:
    """The summary as plain text (bench_gpu's output)."""
    lines = [f"profile of one step{': ' + title if title else ''} ({s['device']}): step {s['wall_ms']:.1f} ms, "
             f"{_busy_word(s)} busy {s['busy_ms']:.1f} ms ({s['busy_ms'] / s['wall_ms']:.1%})"]
    if s.get("note"):
        lines.append("  NOTE: " + s["note"])
    lines.append("  modules hooked: " + ", ".join(f"{k} {v}" for k, v in s.get("modules", {}).items()))
    lines.append(f"  {'region':<34}{'ms':>10}{'share':>8}{'forward':>10}{'backward':>10}")
    for r in s["regions"]:
        f = "" if r["forward_ms"] is None else f"{r['forward_ms']:.1f}"
        b = "" if r["backward_ms"] is None else f"{r['backward_ms']:.1f}"
        lines.append(f"  {r['region']:<34}{r['ms']:>10.1f}{r['share']:>8.1%}{f:>10}{b:>10}")
    what = "kernels by device time" if s["device"] != "cpu" else "ops by self time"
    lines.append(f"  top {len(s['top'])} {what} (share of the busy time):")
    for t in s["top"]:
        lines.append(f"    {t['ms']:>9.2f} ms {t['share']:>6.1%} {t['calls']:>6}x  {t['name'][:100]}")
    return "\n".join(lines)


def render_markdown(s: dict, title: str = "") -> str:
    """The summary as the two markdown tables of docs/benchmarks.md."""
    out = [f"Profile of one step{': ' + title if title else ''} ({s['device']}): {s['wall_ms']:.1f} ms, "
           f"{_busy_word(s)} busy {s['busy_ms'] / s['wall_ms']:.1%}." + (f" {s['note']}." if s.get("note") else ""), "",
           "| region | ms | share of the step | forward ms | backward ms |", "|---|---:|---:|---:|---:|"]
    for r in s["regions"]:
        f = "" if r["forward_ms"] is None else f"{r['forward_ms']:.1f}"
        b = "" if r["backward_ms"] is None else f"{r['backward_ms']:.1f}"
        name = r["region"].strip()
        out.append(f"| {'&nbsp;&nbsp;' + name if r['region'].startswith(' ') else name} | {r['ms']:.1f} | "
                   f"{r['share']:.1%} | {f} | {b} |")
    what = "kernel" if s["device"] != "cpu" else "op (self time)"
    out += ["", f"| {what} | calls | ms | share of busy |", "|---|---:|---:|---:|"]
    for t in s["top"]:
        name = t["name"].replace("|", "\\|")[:120]
        out.append(f"| `{name}` | {t['calls']} | {t['ms']:.2f} | {t['share']:.1%} |")
    return "\n".join(out)


def main() -> None:
    """``python benchmarks/profile_step.py results.json``: the saved profiles of a bench_gpu
    ``--save`` file as markdown."""
    import sys

    with open(sys.argv[1], encoding="utf-8") as f:
        res = json.load(f)
    for r in res["runs"]:
        if r.get("profile"):
            print(render_markdown(r["profile"], f"{r['label']} batch {r['batch']}") + "\n")


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
