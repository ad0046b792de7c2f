"""Running a side in a child process of its own, so that each peak memory figure is that run's own and
the parent never holds a CUDA context: the child's side (child: train once as a spec says, timing each
step and each wait for a batch), how the parent starts one (run_child: bench_gpu.py ``--child SPEC``,
in this python or the ms-swift one) and the versions each python reports (versions, swift_versions).
Nothing imported here at the top imports mmembed: the ms-swift python runs this module without it."""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import json
import os
import platform
import resource
import subprocess
import sys
import time

from benchmarks.checkout import REPO
from benchmarks.gpu.measure import batch_digest, batch_stats, draws_dropout, saved_for_backward
from benchmarks.gpu.st_side import train_st, train_st_vl
from benchmarks.gpu.swift_side import train_mmembed, train_swift

ENTRY = os.path.join(REPO, "benchmarks", "bench_gpu.py")  # its --child SPEC runs child() or another job


def _is_oom(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower() or "ALLOC_FAILED" in str(e)


def child(spec: dict) -> dict:
    """Train once as ``spec`` says, timing each step and each wait for a batch."""
    import torch
    import transformers

    cuda = spec["device"] == "cuda"
    cap = spec.get("memory_cap_gb")
    if cuda and cap:  # --largest_batch: an 80 GB GPU on a larger one (a cap above the GPU's size changes nothing)
        total = torch.cuda.get_device_properties(0).total_memory
        if cap * 2**30 < total:
            torch.cuda.set_per_process_memory_fraction(cap * 2**30 / total)
    rec: dict = {"t": [], "wait": [], "stats": [], "trainer": None, "max_padded": 0, "profilers": [], "memory": [],
                 "first_loss": None, "first_batch": None, "saved": None}
    profile, memory = bool(spec.get("profile")), bool(spec.get("profile_memory"))
    if profile or memory:
        from benchmarks.profile_step import ProfiledStep, step_profiler

    class Clock(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            rec["t"].append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            rec["t"].append(time.perf_counter())

    # both trainers are transformers.Trainer subclasses: time them in the base class
    base_init, base_batches = transformers.Trainer.__init__, transformers.Trainer.get_batch_samples

    @functools.wraps(base_init)  # ms-swift reads Trainer.__init__'s signature (processing_class or tokenizer)
    def init(self, *a, **k):
        base_init(self, *a, **k)
        if profile:  # --profile: the first step after warmup (before Clock: see step_profiler)
            rec["profilers"].append(step_profiler(self, spec["warmup"], cuda, trace=spec.get("profile_trace")))
            self.add_callback(rec["profilers"][-1])
        if memory:  # --profile_memory: the next step's memory (the one after --profile's, if any)
            rec["memory"].append(step_profiler(self, spec["warmup"] + int(profile), cuda, memory=True))
            self.add_callback(rec["memory"][-1])
        self.add_callback(Clock())
        rec["trainer"] = self
        step = self.training_step  # the first step's loss, on the first batch (the same-work check)

        def training_step(*a, **k):
            if rec["saved"] is None:  # the first step: what autograd keeps for backward (the activations)
                with saved_for_backward(self.model) as rec["saved"]:
                    loss = step(*a, **k)
            else:
                loss = step(*a, **k)
            if rec["first_loss"] is None:
                rec["first_loss"] = float(loss.detach().float().item())
            return loss

        self.training_step = training_step

    @functools.wraps(base_batches)
    def get_batch_samples(self, *a, **k):
        t0 = time.perf_counter()
        with ProfiledStep.data() if profile or memory else contextlib.nullcontext():
            out = base_batches(self, *a, **k)
        rec["wait"].append(time.perf_counter() - t0)
        if rec["first_batch"] is None and out[0]:
            rec["first_batch"] = batch_digest(out[0][0])
        total: dict = {}
        for b in out[0]:
            one = batch_stats(b)
            for key, v in one.items():
                total[key] = total.get(key, 0) + v
            # the largest collated batch of the run (warmup too: peak memory is over the whole run)
            rec["max_padded"] = max(rec["max_padded"], one["padded"])
        rec["stats"].append(total)
        return out

    transformers.Trainer.__init__ = init
    transformers.Trainer.get_batch_samples = get_batch_samples
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    error = None
    try:
        train = {"st": train_st_vl if spec["kind"] == "gme" else train_st, "mmembed": train_mmembed,
                 "swift": train_swift}
        train[spec["side"]](spec)
    except Exception as e:  # noqa: BLE001 - an out-of-memory run is a result; anything else is re-raised
        if not _is_oom(e):
            raise
        error = "out of memory: " + str(e).splitlines()[0][:160]
    steps = [b - a for a, b in zip(rec["t"], rec["t"][1:])]
    warmup = spec["warmup"]
    timed = slice(warmup + int(profile) + int(memory), len(steps))  # profiled steps are slowed: not timed
    stats = {k: sum(s.get(k, 0) for s in rec["stats"][timed]) for k in
             ("rows", "tokens", "padded", "sq", "images", "patches", "patches_sq")}
    trainer = rec["trainer"]
    result = {
        "steps": len(steps[timed]), "step_s": sum(steps[timed]), "wait_s": sum(rec["wait"][timed]),
        "warmup_s": sum(steps[:warmup]), "stats": stats, "error": error,
        "optim": str(getattr(trainer.args.optim, "value", trainer.args.optim)) if trainer else None,
        "workers": trainer.args.dataloader_num_workers if trainer else None,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "max_padded": rec["max_padded"], "first_loss": rec["first_loss"], "first_batch": rec["first_batch"],
        "saved": rec["saved"], "dropout": trainer is not None and draws_dropout(trainer.model),
    }
    if profile:
        result["profile"] = next((x for x in (p.summary() for p in rec["profilers"]) if x), None)
    if memory:
        result["memory"] = next((x for x in (p.memory_figures() for p in rec["memory"]) if x), None)
    if cuda:
        result.update(alloc_mb=torch.cuda.max_memory_allocated() / 2**20,
                      reserved_mb=torch.cuda.max_memory_reserved() / 2**20)
    return result


class RunFailed(Exception):
    """A training child that crashed or ran past the benchmark's --time_limit."""


def run_child(spec: dict, env: dict, deadline: float | None = None, python: str | None = None) -> dict:
    """bench_gpu.py's ``--child`` in a fresh process of ``python`` (default: this one; the ms-swift
    side: --swift_python)."""
    t0 = time.time()
    timeout = None if deadline is None else max(1.0, deadline - t0)
    try:
        proc = subprocess.run([python or sys.executable, ENTRY, "--child", json.dumps(spec)], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise RunFailed(f"stopped at --time_limit after {time.time() - t0:.0f} s") from e
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
        raise RunFailed(f"failed (exit {proc.returncode}): {last}")
    result = json.loads(lines[-1][len("RESULT "):])
    result["wall_s"] = time.time() - t0
    return result


def failed_run(error: str, wall_s: float) -> dict:
    """The record of a run that gave no figures, so that the table names it and the others stand."""
    return {"steps": 0, "step_s": 0.0, "wait_s": 0.0, "warmup_s": 0.0, "stats": {}, "error": error, "optim": None,
            "workers": None, "peak_rss_mb": 0.0, "wall_s": wall_s}


# ----------------------------------------------------------------------------- the benchmark (parent)


def versions() -> dict:
    """This python's device and versions (the ``versions`` job: the parent keeps CUDA uninitialised)."""
    import torch
    import transformers

    v = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}
    for m in ("sentence_transformers", "peft", "accelerate", "flash_attn", "liger_kernel"):
        try:
            v[m] = __import__(m).__version__
        except Exception:  # noqa: BLE001 - any failure to import is "not there"
            v[m] = None
    v["cuda"] = torch.cuda.is_available()
    v["device"] = torch.cuda.get_device_name() if v["cuda"] else platform.processor() or "CPU"
    v["gpu_mb"] = torch.cuda.get_device_properties(0).total_memory / 2**20 if v["cuda"] else None
    v["cpus"] = os.cpu_count()
    return v


def swift_versions() -> dict:
    """The ms-swift python's versions (the ``swift_versions`` job), after importing ms-swift's sft
    entry point as its side will."""
    v = {}
    for d in ("ms_swift", "transformers", "peft", "torch", "deepspeed"):
        try:
            v[d] = importlib.metadata.version(d)
        except Exception:  # noqa: BLE001 - not installed
            v[d] = None
    import swift.pipelines  # noqa: F401

    return v


def environment(dry: bool) -> dict:
    """Device and versions, read in a child (the parent keeps CUDA uninitialised)."""
    proc = subprocess.run([sys.executable, ENTRY, "--child", json.dumps({"job": "versions"})], capture_output=True,
                          text=True, check=True)
    v = json.loads([x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1][len("RESULT "):])
    if not dry and not v["cuda"]:
        raise SystemExit("bench_gpu.py needs CUDA and torch sees no GPU here; --dry_run runs every code path on the CPU")
    return v


def swift_environment(python: str, env: dict) -> dict:
    """The ms-swift python's versions (ms-swift, transformers, peft, torch), read in a child."""
    proc = subprocess.run([python, ENTRY, "--child", json.dumps({"job": "swift_versions"})], capture_output=True,
                          text=True, env=env)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"--swift_python {python}: cannot import ms-swift's sft entry point (swift.pipelines):\n"
                         + proc.stderr[-2000:])
    return json.loads(lines[-1][len("RESULT "):])
