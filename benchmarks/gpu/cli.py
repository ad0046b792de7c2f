"""bench_gpu's command (``python benchmarks/bench_gpu.py``, whose docstring documents it): the
benchmark, ``--load``'s table of saved results, and ``--child SPEC``, the job a child process runs
(build the models, train one side, report the versions)."""

from __future__ import annotations

import json
import os
import tempfile

from benchmarks.gpu.child import child, swift_versions, versions
from benchmarks.gpu.dry_run import check_same_work, meta_checks
from benchmarks.gpu.models import build_job
from benchmarks.gpu.run import benchmark, save
from benchmarks.gpu.specs import build_parser
from benchmarks.gpu.tables import print_largest, print_profiles, print_table

#: what a child runs (bench_gpu.py --child SPEC), by the spec's "job"; any other job trains (child)
JOBS = {"build": lambda spec: {"built": build_job(spec)}, "versions": lambda spec: versions(),
        "swift_versions": lambda spec: swift_versions()}


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    if a.child:
        spec = json.loads(a.child)
        out = JOBS.get(spec["job"], child)(spec)
        print("RESULT " + json.dumps(out))
        return
    if a.load:
        loaded = [json.load(open(f, encoding="utf-8")) for f in a.load.split(",")]
        res = {"meta": loaded[0]["meta"], "runs": [r for x in loaded for r in x["runs"]],
               "largest": [f for x in loaded for f in x.get("largest", [])]}
        for x in loaded[1:]:
            res["meta"]["shapes"].update(x["meta"]["shapes"])
            if x["meta"]["env"]["device"] != res["meta"]["env"]["device"]:
                print(f"note: results from different devices: {x['meta']['env']['device']}")
        print_table(res, a.peak_tflops)
        print_largest(res)
        print_profiles(res)
        return
    if a.dry_run:
        meta_checks()
    with tempfile.TemporaryDirectory(prefix="mmembed-bench-gpu-") as tmp:
        work = a.work_dir or tmp
        os.makedirs(work, exist_ok=True)
        res = benchmark(a, work)
    if a.save:
        save(a.save, res)
    print_table(res, a.peak_tflops)
    print_largest(res)
    print_profiles(res, a.save)
    print(f"\n{res['meta']['wall_s']:.0f} s in all")
    if a.dry_run:
        check_same_work(res["runs"])
