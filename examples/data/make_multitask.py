"""Rebuild the three small datasets of examples/train_multitask.sh in examples/data/multitask/.

    python examples/data/make_multitask.py [OUT_DIR]      # default: multitask/ beside this script

From what examples/data holds already (no download):
- ``image_text.jsonl`` / ``image_text_val.jsonl``: image-text retrieval over the 12 shape
  pictures of ``mm/`` (``make_mm.py``): a caption finds its picture and a picture its
  caption, with a picture or caption of another shape as the hard negative;
- ``text_hardneg.jsonl`` / ``text_hardneg_val.jsonl``: text retrieval with one hard negative
  per row (STS-B sentences, ``stsb_train_hardneg.jsonl``);
- ``sts_pairs.jsonl``: STS-B paraphrase pairs (``stsb_train_pairs.jsonl``), no negatives;
- ``multitask.yaml``: the ``--dataset_config`` naming them, with an instruction per task
  and the loss settings of each.

Media paths are relative to the data file (``../mm/red_circle.png``).
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
COLORS = ("red", "green", "blue", "yellow")
SHAPES = ("circle", "square", "triangle")

CONFIG = """\
# examples/train_multitask.sh: three tasks, one dataset each, every batch from one dataset.
# Paths are relative to this file. docs/datasets.md: "Several datasets and instructions".
datasets:
  - name: image_text                  # image <-> caption retrieval
    path: image_text.jsonl
    weight: 2
    query_system: "Retrieve the picture or caption that matches the query."
    val: image_text_val.jsonl
  - name: text_retrieval              # text retrieval with a hard negative per row
    path: text_hardneg.jsonl
    weight: 1
    query_system: "Given a sentence, retrieve a sentence with the same meaning."
    infonce: {hard_negatives: 1, temperature: 0.05}
    val: text_hardneg_val.jsonl
  - name: sts                         # paraphrase pairs: in-batch negatives only
    path: sts_pairs.jsonl
    weight: 1
    query_system: "Retrieve semantically similar text."
    document_system: "Retrieve semantically similar text."
    infonce: {temperature: 0.05}
"""


def image_text_rows() -> list[dict]:
    rows = []
    pictures = [(c, s) for c in COLORS for s in SHAPES]
    for i, (c, s) in enumerate(pictures):
        other_c, other_s = pictures[(i + 4) % len(pictures)]
        image, other = f"../mm/{c}_{s}.png", f"../mm/{other_c}_{other_s}.png"
        if i % 2 == 0:  # caption -> picture
            rows.append({"query": f"a {c} {s}", "response": "<image>", "rejected_response": ["<image>"],
                         "images": [image, other]})
        else:  # picture -> caption
            rows.append({"query": "<image>", "response": f"a {c} {s}", "rejected_response": [f"a {other_c} {other_s}"],
                         "images": [image]})
    return rows


def read(name: str) -> list[dict]:
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write(path: str, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def main(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    images = image_text_rows()
    write(os.path.join(out_dir, "image_text.jsonl"), images[:8])
    write(os.path.join(out_dir, "image_text_val.jsonl"), images[8:])
    hardneg = read("stsb_train_hardneg.jsonl")
    write(os.path.join(out_dir, "text_hardneg.jsonl"), hardneg[:16])
    write(os.path.join(out_dir, "text_hardneg_val.jsonl"), hardneg[16:24])
    pairs = read("stsb_train_pairs.jsonl")
    write(os.path.join(out_dir, "sts_pairs.jsonl"), [{"query": p["query"], "response": p["response"]}
                                                     for p in pairs[100:116]])
    with open(os.path.join(out_dir, "multitask.yaml"), "w", encoding="utf-8") as f:
        f.write(CONFIG)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "multitask"))
