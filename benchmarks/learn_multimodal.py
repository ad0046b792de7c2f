"""Does multimodal training learn? A tiny Qwen2-VL from random weights on image-text retrieval.

The task is made here: pictures of coloured shapes (6 colours x 3 shapes = 18 classes; each
picture draws its shape at a random size and place) with captions such as "a red circle".
Training pictures and held-out pictures are drawn separately. The model (a random-weight
Qwen2-VL built offline by examples/tiny_models.py, loaded from its folder as a user would)
is trained with ``mmembed sft`` (InfoNCE, caption -> picture, full training with the vision
tower and aligner unfrozen), then each held-out picture is ranked against the 18 captions.
Chance recall@1 is 1/18.

    python benchmarks/learn_multimodal.py            # prints before/after recall@1 and MRR

``--task_type late_interaction``: the same task for a multi-vector model (ColQwen: a 128-d vector
per token and image patch, MaxSim; the InfoNCE temperature the task's default, 1.0, unless
INFONCE_TEMPERATURE is set). A caption is the query and a picture the document, as trained; each
held-out picture ranks the 18 captions by MaxSim(caption, picture). "Before" is the start weights
with a projection drawn under ``torch.manual_seed(seed)`` (the base folder has none).

    python benchmarks/learn_multimodal.py --task_type late_interaction
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import numpy as np

if not __package__:  # run as a file: the package registered from its folder (benchmarks/_bootstrap.py)
    import _bootstrap  # noqa: F401

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 50), "blue": (40, 60, 220),
           "yellow": (235, 215, 30), "purple": (140, 40, 170), "orange": (245, 140, 20)}
SHAPES = ("circle", "square", "triangle")
SIZE = 56  # pixels a side: 4 x 4 patches of 14, merged into 4 tokens


def draw(colour: str, shape: str, rng: random.Random):
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (SIZE, SIZE), (250, 250, 250))
    d = ImageDraw.Draw(img)
    r = rng.randint(10, 22)
    cx, cy = rng.randint(r, SIZE - r), rng.randint(r, SIZE - r)
    fill = tuple(max(0, min(255, c + rng.randint(-20, 20))) for c in COLOURS[colour])
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    return img


def caption(colour: str, shape: str) -> str:
    return f"a {colour} {shape}"


def make_task(out_dir: str, train_per_class: int, test_per_class: int, seed: int) -> tuple[str, list[tuple[str, str]]]:
    """Write the pictures and the training rows; returns (train.jsonl, [(held-out picture, caption)])."""
    rng = random.Random(seed)
    os.makedirs(os.path.join(out_dir, "img"), exist_ok=True)
    train_rows, test = [], []
    for colour in COLOURS:
        for shape in SHAPES:
            for k in range(train_per_class + test_per_class):
                name = f"img/{colour}_{shape}_{k}.png"
                draw(colour, shape, rng).save(os.path.join(out_dir, name))
                if k < train_per_class:
                    train_rows.append({"query": caption(colour, shape), "response": "<image>", "images": [name]})
                else:
                    test.append((os.path.join(out_dir, name), caption(colour, shape)))
    rng.shuffle(train_rows)
    path = os.path.join(out_dir, "train.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for row in train_rows:
            f.write(json.dumps(row) + "\n")
    return path, test


def evaluate(model_dir: str, test: list[tuple[str, str]]) -> dict[str, float]:
    """Rank the distinct captions for each held-out picture: recall@1 and MRR."""
    from mmembed import Embedder

    emb = Embedder.from_pretrained(model_dir)
    captions = sorted({c for _, c in test})
    cap = emb.encode(captions, batch_size=32)
    img = emb.encode([{"query": "<image>", "images": [p]} for p, _ in test], batch_size=32)
    scores = img @ cap.T
    target = np.array([captions.index(c) for _, c in test])
    rank = (scores > scores[np.arange(len(test)), target][:, None]).sum(1)  # 0 = first
    return {"recall@1": float((rank == 0).mean()), "mrr": float((1.0 / (rank + 1)).mean()),
            "chance": 1.0 / len(captions)}


def evaluate_late_interaction(model_dir: str, test: list[tuple[str, str]], seed: int | None = None) -> dict[str, float]:
    """As :func:`evaluate`, for a late-interaction checkpoint (``seed`` given: ``model_dir`` is the
    base folder, scored with a seeded random projection)."""
    import torch

    from mmembed.task import get_task

    task = get_task("late_interaction")
    if seed is None:
        scorer = task.load_scorer(model_dir, device="cpu")
    else:
        from types import SimpleNamespace

        from transformers import AutoProcessor

        from mmembed.encoding.templates import get_template
        from mmembed.model.embedding import load_backbone
        from mmembed.model.late_interaction import LateInteractionModel
        from mmembed.tasks.late_interaction.scorer import MultiVectorScorer
        from mmembed.tasks.late_interaction.settings import FLAGS, LateInteractionSettings

        processing = AutoProcessor.from_pretrained(model_dir)
        template = get_template(config_model_type="qwen2_vl")
        settings = LateInteractionSettings.resolve(SimpleNamespace(model=model_dir, **dict.fromkeys(FLAGS)), template,
                                                   processing)
        backbone = load_backbone(model_dir)
        torch.manual_seed(seed)
        model = LateInteractionModel(backbone, settings.dim, tower=template.tower)
        scorer = MultiVectorScorer(model, processing, template, 512, settings, device="cpu")
    captions = sorted({c for _, c in test})
    queries = scorer.search_vectors(captions, "query")
    docs = scorer.search_vectors([{"text": "<image>", "images": [p]} for p, _ in test], "document")
    scores = scorer.scores(queries, docs).T  # [pictures, captions]
    target = np.array([captions.index(c) for _, c in test])
    rank = (scores > scores[np.arange(len(test)), target][:, None]).sum(1)  # 0 = first
    return {"recall@1": float((rank == 0).mean()), "mrr": float((1.0 / (rank + 1)).mean()),
            "chance": 1.0 / len(captions)}


def main(argv: list[str] | None = None, run=None) -> dict[str, dict[str, float]]:
    """``run(args, env)``: how ``python ARGS`` (the ``mmembed sft`` command) runs with the
    environment ``env``; default a fresh interpreter (the test suite forks its own)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train_per_class", type=int, default=12)
    ap.add_argument("--test_per_class", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--learning_rate", type=float, default=2e-3)
    ap.add_argument("--batch_size", type=int, default=18)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work_dir", default=None)
    ap.add_argument("--task_type", default="embedding", choices=["embedding", "late_interaction"])
    args = ap.parse_args(argv)
    late = args.task_type == "late_interaction"

    from benchmarks.checkout import tiny_models

    work = args.work_dir or tempfile.mkdtemp(prefix="mmembed-learn-")
    model_dir = tiny_models().build("qwen2_vl", os.path.join(work, "model"), seed=args.seed)
    train, test = make_task(os.path.join(work, "data"), args.train_per_class, args.test_per_class, args.seed)
    before = evaluate_late_interaction(model_dir, test, seed=args.seed) if late else evaluate(model_dir, test)
    out = os.path.join(work, "out")
    cmd = ["-m", "mmembed.tools.cli", "sft", "--model", model_dir, "--dataset", train,
           "--tuner_type", "full", "--freeze_vit", "false", "--freeze_aligner", "false",
           "--num_train_epochs", str(args.epochs), "--per_device_train_batch_size", str(args.batch_size),
           "--gradient_accumulation_steps", "1", "--learning_rate", str(args.learning_rate),
           "--warmup_ratio", "0.1", "--save_strategy", "no", "--logging_steps", "10",
           "--gradient_checkpointing", "false", "--seed", str(args.seed), "--output_dir", out, "--overwrite_output_dir", "true",
           "--report_to", "none", "--task_type", args.task_type]
    env = dict(os.environ, MAX_PIXELS=str(SIZE * SIZE), MIN_PIXELS=str(SIZE * SIZE))
    if not late:  # the late-interaction task's own default temperature (MaxSim sums) unless set
        env["INFONCE_TEMPERATURE"] = os.environ.get("INFONCE_TEMPERATURE", "0.05")
    t0 = time.time()
    if run is None:
        subprocess.run([sys.executable, *cmd], check=True, env=env)
    else:
        run(cmd, env)
    seconds = time.time() - t0
    ckpts = sorted((d for d in os.listdir(out) if d.startswith("checkpoint-")), key=lambda d: int(d.split("-")[1]))
    # the trained model reads the held-out pictures under the training's budget, set for that
    # only: main() runs in the test suite's processes too, whose later runs must not inherit it
    saved = {k: os.environ.get(k) for k in ("MAX_PIXELS", "MIN_PIXELS")}
    os.environ.update(MAX_PIXELS=env["MAX_PIXELS"], MIN_PIXELS=env["MIN_PIXELS"])
    try:
        after = (evaluate_late_interaction if late else evaluate)(os.path.join(out, ckpts[-1]), test)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    print(f"\ntiny Qwen2-VL ({args.task_type}) from random weights, {len(test)} held-out pictures x 18 captions; training took {seconds:.0f} s")
    print(f"{'metric':10s}{'before':>10s}{'after':>10s}{'chance':>10s}")
    print(f"{'recall@1':10s}{before['recall@1']:10.4f}{after['recall@1']:10.4f}{after['chance']:10.4f}")
    print(f"{'mrr':10s}{before['mrr']:10.4f}{after['mrr']:10.4f}")
    print(f"recall@1 after / chance = {after['recall@1'] / after['chance']:.2f}x")
    return {"before": before, "after": after, "seconds": seconds}


if __name__ == "__main__":
    main()
