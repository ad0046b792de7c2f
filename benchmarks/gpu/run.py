"""bench_gpu's parent: builds the models (in a child), writes the rows, and runs each part's sides and
variants one child at a time (text, oom, gme, qwen3vl, then ``--largest_batch``'s probes), keeping
every run's record (a crash or the time limit is that run's result) and, with ``--save``, writing
them after every run."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import time
from dataclasses import asdict

from benchmarks.checkout import REPO
from benchmarks.gpu.child import RunFailed, environment, failed_run, run_child, swift_environment
from benchmarks.gpu.largest import LARGEST_LABELS, LARGEST_SIDES, largest_batch
from benchmarks.gpu.measure import model_shape
from benchmarks.gpu.models import minilm_source, to_messages_form, write_text_rows
from benchmarks.gpu.specs import GME_LR, MODEL_TYPE, TEXT, side_name, sizes_for, variants
from benchmarks.gpu.tables import one_line


def benchmark(a: argparse.Namespace, work: str) -> dict:
    dry = a.dry_run
    s = sizes_for(a)
    env_info = environment(dry)
    parts = [p for p in a.parts.split(",") if p]
    if a.profile and (("text" in parts and s.steps < s.warmup + 2) or ("gme" in parts and s.gme_steps < s.gme_warmup + 2)
                      or ("oom" in parts and s.oom_steps < 3)):
        raise SystemExit("--profile leaves the profiled step (the first after warmup) out of the timing: give each "
                         "part at least warmup + 2 steps")
    amp = a.precision == "amp" and not dry
    child_env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
                     INFONCE_TEMPERATURE=str(TEXT["temperature"]))
    # the repository last: an installed mmembed (the editable install here, the wheel of gpu_wheels.sh on a GPU
    # machine) comes first, since a bare source tree lacks the package data (mmembed.template_files)
    child_env["PYTHONPATH"] = os.pathsep.join([p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [REPO])
    if dry:
        child_env.setdefault("OMP_NUM_THREADS", "2")
    # the ms-swift side: its own python (a venv of its own, ms-swift pins older transformers and
    # PEFT) and, on a GPU machine whose image lacks ms-swift, its own --target folder of wheels
    swift_python = a.swift_python or os.environ.get("MMEMBED_SWIFT_PYTHON")
    swift_env = dict(child_env)
    swift_env.pop("PYTHONPATH", None)
    swift_path = a.swift_pythonpath or os.environ.get("MMEMBED_SWIFT_PYTHONPATH")
    if swift_path:
        swift_env["PYTHONPATH"] = swift_path
    if swift_python:
        env_info["swift"] = swift_environment(swift_python, swift_env)
        env_info["swift"]["python"] = swift_python
    else:
        print("ms-swift side skipped: no --swift_python and MMEMBED_SWIFT_PYTHON is not set (a python with "
              "ms-swift 4.6, e.g. ../swift-venv/bin/python)", flush=True)
    t0 = time.time()
    deadline = t0 + a.time_limit if a.time_limit else None
    # models
    build = {"dry": dry, "device": s.device, "dtype": "bfloat16" if not dry else "float32"}
    minilm, minilm_real = (None, True)
    if "text" in parts:
        minilm, minilm_real = minilm_source(a.minilm)
        if not minilm_real:
            build["minilm_from"], build["minilm"] = minilm, os.path.join(work, "minilm")
    searched = [p for p in (a.largest_batch or "").split(",") if p]
    if set(searched) - set(LARGEST_SIDES):
        raise SystemExit(f"--largest_batch takes {', '.join(LARGEST_SIDES)}, not {a.largest_batch!r}")
    if "text" in parts or "oom" in parts or "text" in searched:
        build["qwen3"] = os.path.join(work, "qwen3")
    if "gme" in parts or "gme" in searched:
        build["gme"] = os.path.join(work, "gme")
    if "qwen3vl" in parts or "qwen3vl" in searched:
        build["qwen3vl"] = os.path.join(work, "qwen3vl")
    built = run_child(dict(build, job="build"), child_env, deadline)["built"]
    minilm = built.get("minilm", minilm)
    print(f"built the models in {time.time() - t0:.0f} s", flush=True)
    shapes = {k: model_shape(v) for k, v in (("minilm", minilm), ("qwen3", built.get("qwen3")),
                                             ("gme", built.get("gme")), ("qwen3vl", built.get("qwen3vl"))) if v}
    models = {"minilm": minilm, "qwen3": built.get("qwen3"), "gme": built.get("gme"), "qwen3vl": built.get("qwen3vl")}
    common = dict(job="train", device=s.device, dtype=s.dtype, amp=amp, attn_impl=a.attn_impl, workers=a.workers,
                  out=os.path.join(work, "out"), deepspeed=a.deepspeed, profile_memory=a.profile_memory)
    swift_extra = shlex.split(a.swift_args or "")
    mm_extra = shlex.split(a.mmembed_args or "")
    runs: list[dict] = []

    def meta() -> dict:
        return dict(env=env_info, sizes=asdict(s), precision="float32 (dry run)" if dry else a.precision, dry=dry,
                    minilm_real=minilm_real, shapes={k: asdict(v) for k, v in shapes.items()},
                    wall_s=time.time() - t0, attn_impl=a.attn_impl, mmembed_args=a.mmembed_args,
                    gme_args=a.gme_args, workers=a.workers, deepspeed=a.deepspeed, swift_args=a.swift_args,
                    memory_cap_gb=a.memory_cap_gb)

    def record(spec: dict, env: dict, **fields) -> None:
        """Run one child; a crash or the time limit is that run's result, not the benchmark's end.
        With --save, the results so far are written after every run (a cut-off call keeps them)."""
        t1 = time.time()
        if spec.get("profile_memory"):  # one more step: the memory step is not timed, the timed ones stay as many
            spec = dict(spec, steps=spec["steps"] + 1)
        if deadline is not None and time.time() >= deadline:
            r = failed_run("not run: --time_limit reached", 0.0)
        else:
            try:
                r = run_child(spec, env, deadline, swift_python if spec["side"] == "swift" else None)
            except RunFailed as e:
                r = failed_run(str(e), time.time() - t1)
        r.update(fields)
        runs.append(r)
        print("  " + one_line(r), flush=True)
        if a.save:
            save(a.save, {"meta": meta(), "runs": runs})

    def text_job(label: str, side: str, model: str, batch: int, steps: int, warmup: int, data: str,
                 **kw) -> tuple[dict, dict]:
        """The spec and environment of one text run (full tuning) of ``side``."""
        spec = dict(common, label=label, side=side, model=models[model], batch=batch, steps=steps, warmup=warmup,
                    data=data, kind="text", tuner="full", lr=TEXT["lr"], checkpointing=False, **kw)
        if side != "st" and model in MODEL_TYPE:
            spec["model_type"] = MODEL_TYPE[model]
        return spec, swift_env if side == "swift" else child_env

    def go(label: str, side: str, model: str, batch: int, steps: int, warmup: int, data: str, **kw) -> None:
        spec, env = text_job(label, side, model, batch, steps, warmup, data, **kw)
        if a.profile and side == "mmembed":
            shown = side_name({"side": side, "variant": kw.get("variant", ""), "gradcache": kw.get("gradcache", 0)})
            spec.update(profile=True, profile_trace=trace_path(a, label, shown, batch))
        record(spec, env, label=label, side=side, model=model, batch=batch, kind="text", tuner=spec["tuner"],
               checkpointing=spec["checkpointing"], gradcache=spec.get("gradcache", 0), variant=kw.get("variant", ""))

    gme_env = dict(child_env, MAX_PIXELS=str(s.image_size ** 2), MIN_PIXELS=str(56 * 56))
    gme_swift_env = dict(swift_env, MAX_PIXELS=gme_env["MAX_PIXELS"], MIN_PIXELS=gme_env["MIN_PIXELS"])

    def vl_job(model: str, label: str, side: str, batch: int, steps: int, warmup: int, data: str, pictures: str,
               flags: list) -> tuple[dict, dict]:
        """The spec and environment of one picture run (GME or Qwen3-VL-Embedding, LoRA) of ``side``."""
        extra = shlex.split({"mmembed": a.gme_args, "swift": a.swift_args}.get(side) or "")
        spec = dict(common, label=label, side=side, model=models[model], model_type=MODEL_TYPE[model],
                    batch=batch, steps=steps, warmup=warmup, data=data, kind="gme", tuner="lora",
                    lr=GME_LR, checkpointing=True, workers=a.workers, amp=amp, dtype=s.dtype, st_data=pictures,
                    attn_impl=a.attn_impl or "sdpa", extra=extra + flags)
        env = gme_swift_env if side == "swift" else gme_env
        if side == "swift" and model == "qwen3vl":
            # ms-swift 4.6's qwen3_vl_emb loader sets IMAGE_MAX_TOKEN_NUM=1800 before it converts MAX_PIXELS
            # to tokens, so MAX_PIXELS has no effect there: the same budget in its tokens (32x32 pixels each)
            env = dict(env, IMAGE_MAX_TOKEN_NUM=str(s.image_size ** 2 // 32 ** 2))
        return spec, env

    def probe(part: str, side: str, batch: int) -> bool | None:
        """--largest_batch: does ``side`` train ``part``'s model at ``batch`` (two steps, under the
        memory cap)? True, False (out of memory), None (it failed otherwise, or the time is up)."""
        if deadline is not None and time.time() >= deadline:
            return None
        folder = os.path.join(work, "largest", f"{part}-{batch}")
        os.makedirs(folder, exist_ok=True)
        if part == "text":
            pairs = write_text_rows(os.path.join(folder, "text.jsonl"), 2 * batch)
            data = to_messages_form(pairs, os.path.join(folder, "text.messages.jsonl"))
            extra = {"mmembed": mm_extra, "swift": swift_extra}.get(side, [])
            spec, env = text_job(LARGEST_LABELS[part][dry], side, "qwen3", batch, 2, 1, data, st_data=pairs, extra=extra)
        else:
            from benchmarks.bench_multimodal import make_images

            pictures = make_images(folder, 3 * batch, 1, 0, s.image_size)
            data = to_messages_form(pictures, os.path.join(folder, "images.messages.jsonl"))
            spec, env = vl_job(part, LARGEST_LABELS[part][dry], side, batch, 2, 1, data, pictures, [])
        spec.update(profile_memory=False, memory_cap_gb=a.memory_cap_gb)
        try:
            r = run_child(spec, env, deadline, swift_python if side == "swift" else None)
        except RunFailed as e:
            print(f"  {part} {side} batch {batch}: {e}", flush=True)
            return None
        fits = not r["error"]
        print(f"  {part} {side} batch {batch}: {'fits' if fits else r['error'][:120]}", flush=True)
        return fits if fits or r["error"].startswith("out of memory") else None

    if "text" in parts:
        pairs = write_text_rows(os.path.join(work, "text.jsonl"), s.steps * max(b for _, _, b in s.text_runs))
        data = to_messages_form(pairs, os.path.join(work, "text.messages.jsonl"))  # mmembed and ms-swift
        for label, model, batch in s.text_runs:
            go(label, "st", model, batch, s.steps, s.warmup, data, st_data=pairs)
            go(label, "mmembed", model, batch, s.steps, s.warmup, data, extra=mm_extra)
            if swift_python and model in MODEL_TYPE:  # ms-swift 4.6 has no BERT-like embedding models
                go(label, "swift", model, batch, s.steps, s.warmup, data, extra=swift_extra)
            for name, flags in variants(a):  # mmembed's speed options on the same work
                go(label, "mmembed", model, batch, s.steps, s.warmup, data, extra=mm_extra + flags, variant=name)
    if "oom" in parts:
        data = write_text_rows(os.path.join(work, "oom.jsonl"), s.oom_steps * s.oom_batch)
        label = "Qwen3 2-layer" if dry else "Qwen3-0.6B-sized"
        w = min(s.warmup, s.oom_steps // 3)
        go(label, "st", "qwen3", s.oom_batch, s.oom_steps, w, data)
        go(label, "mmembed", "qwen3", s.oom_batch, s.oom_steps, w, data, extra=mm_extra)
        go(label, "mmembed", "qwen3", s.oom_batch, s.oom_steps, w, data, gradcache=s.gradcache, extra=mm_extra)
    if "gme" in parts or "qwen3vl" in parts:
        from benchmarks.bench_multimodal import make_images

        batches = sorted(set((s.gme_batches if "gme" in parts else []) + (s.qwen3vl_batches if "qwen3vl" in parts else [])))
        rows = (s.gme_steps + 1) * max(batches)
        pictures = make_images(os.path.join(work, "images"), rows, 1, 0, s.image_size)
        data = to_messages_form(pictures, os.path.join(work, "images", "images.messages.jsonl"))
        vl_runs = [("gme", b, "GME Qwen2-VL-2B-sized" if not dry else "GME tiny Qwen2-VL") for b in s.gme_batches
                   if "gme" in parts]
        vl_runs += [("qwen3vl", b, "Qwen3-VL-Emb-2B-sized" if not dry else "tiny Qwen3-VL-Emb") for b in s.qwen3vl_batches
                    if "qwen3vl" in parts]
        sides = [("mmembed", "")] + ([("swift", "")] if swift_python else [])
        sides += [("mmembed", name) for name, _ in variants(a, "vl")]
        variant_flags = dict(variants(a, "vl"))
        for model, batch, label in vl_runs:
            # sentence-transformers trains Qwen3-VL-Embedding (not GME, whose model is remote code): first,
            # as the table's ratios are to the s-t run before them
            for side, variant in ([("st", "")] if model == "qwen3vl" else []) + sides:
                spec, env = vl_job(model, label, side, batch, s.gme_steps, s.gme_warmup, data, pictures,
                                   variant_flags.get(variant, []))
                if a.profile and side == "mmembed":
                    shown = " ".join(x for x in ("mmembed", variant) if x)
                    spec.update(profile=True, profile_trace=trace_path(a, spec["label"], shown, batch))
                record(spec, env, label=spec["label"], side=side, model=model,
                       batch=batch, kind="gme", tuner="lora", checkpointing=True, gradcache=0, variant=variant)
    largest = []
    for part in searched:
        for side in LARGEST_SIDES[part]:
            if side == "swift" and not swift_python:
                continue
            found = largest_batch(lambda b, part=part, side=side: probe(part, side, b), a.largest_start, a.largest_limit,
                                  a.largest_step)
            largest.append(dict(found, part=part, side=side, label=LARGEST_LABELS[part][dry]))
    return {"meta": meta(), "runs": runs, "largest": largest}


def trace_path(a: argparse.Namespace, label: str, side: str, batch: int) -> str | None:
    """Where ``--profile_trace DIR`` puts a profiled step's Chrome trace (chrome://tracing, Perfetto)."""
    if not a.profile_trace:
        return None
    os.makedirs(a.profile_trace, exist_ok=True)
    name = "-".join(x for x in (label, side, f"b{batch}") if x)
    return os.path.join(os.path.abspath(a.profile_trace), "".join(c if c.isalnum() or c in "-." else "_" for c in name)
                        + ".json")


def save(path: str, res: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1)
    os.replace(tmp, path)
