"""Rebuild the bundled STS-B files from the CSVs in ../shared/data/stsb (sentence1, sentence2, score 0-5).

    python examples/data/make_stsb.py ../shared/data/stsb

Writes, in ms-swift's query form:
- stsb_train_pairs.jsonl / stsb_dev_pairs.jsonl: positive pairs (score >= 3.75) for InfoNCE;
- stsb_train_scored.jsonl / stsb_test_scored.jsonl: every pair with label = score / 5 in [0, 1]
  (cosine_similarity training; STS Spearman and pair-retrieval evaluation).
"""

import csv
import json
import os
import sys

POSITIVE = 3.75


def read(path):
    with open(path, encoding="utf-8", newline="") as f:
        for s1, s2, score in csv.reader(f):
            yield s1.strip(), s2.strip(), float(score)


def write(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(path, len(rows))


def main(src):
    here = os.path.dirname(os.path.abspath(__file__))
    for split in ("train", "dev", "test"):
        rows = list(read(os.path.join(src, f"stsb-en-{split}.csv")))
        if split in ("train", "dev"):
            write(os.path.join(here, f"stsb_{split}_pairs.jsonl"), [{"query": a, "response": b} for a, b, s in rows if s >= POSITIVE])
        if split in ("train", "test"):
            write(os.path.join(here, f"stsb_{split}_scored.jsonl"), [{"query": a, "response": b, "label": round(s / 5, 4)} for a, b, s in rows])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "../shared/data/stsb")
