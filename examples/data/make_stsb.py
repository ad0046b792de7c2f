"""Rebuild the bundled STS-B files from the CSVs in ../shared/data/stsb (sentence1, sentence2, score 0-5).

    python examples/data/make_stsb.py ../shared/data/stsb

Writes, in ms-swift's query form:
- stsb_train_pairs.jsonl / stsb_dev_pairs.jsonl: positive pairs (score >= 3.75) for InfoNCE;
- stsb_train_hardneg.jsonl: the train positive pairs, each with one hard negative in
  rejected_response: the train sentence sharing the most words with the query (Jaccard),
  leaving out the pair's own sentences, sentences labelled similar to the query (score >= 2)
  and near-copies (Jaccard > 0.8). Word overlap is a crude miner: some of these negatives
  are in fact paraphrases;
- stsb_train_scored.jsonl / stsb_test_scored.jsonl: every pair with label = score / 5 in [0, 1]
  (cosine_similarity training; STS Spearman and pair-retrieval evaluation).
"""

import collections
import csv
import json
import os
import re
import sys

POSITIVE = 3.75
STOP = {"a", "an", "the", "is", "are", "of", "in", "on", "and", "to", "with", "at", "for", "s", "man", "woman"}


def words(text):
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def mine_word_overlap(rows):
    """One lexical hard negative per positive pair (see the module docstring)."""
    score = {}
    for a, b, s in rows:
        score[(a, b)] = score[(b, a)] = s
    sentences = sorted({x for a, b, _ in rows for x in (a, b)})
    bags = [words(x) for x in sentences]
    index = collections.defaultdict(list)
    for i, bag in enumerate(bags):
        for w in bag - STOP:
            index[w].append(i)
    out = []
    for a, b, s in rows:
        if s < POSITIVE:
            continue
        qa = words(a)
        shared = collections.Counter(i for w in qa - STOP for i in index[w])
        best, best_j = None, 0.0
        for i, _ in sorted(shared.items(), key=lambda kv: (-kv[1], kv[0]))[:50]:
            x = sentences[i]
            if x in (a, b) or score.get((a, x), 0.0) >= 2.0:
                continue
            j = len(qa & bags[i]) / len(qa | bags[i])
            if j <= 0.8 and j > best_j:
                best, best_j = x, j
        out.append({"query": a, "response": b, "rejected_response": [best] if best else []})
    return out


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
        if split == "train":
            write(os.path.join(here, "stsb_train_hardneg.jsonl"), mine_word_overlap(rows))
        if split in ("train", "test"):
            write(os.path.join(here, f"stsb_{split}_scored.jsonl"), [{"query": a, "response": b, "label": round(s / 5, 4)} for a, b, s in rows])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "../shared/data/stsb")
