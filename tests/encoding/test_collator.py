"""The collator (mmembed/encoding/collator.py) with the real all-MiniLM-L6-v2 tokenizer: the
rows of a batch in ms-swift's group / pair layout, tokenized as the tokenizer tokenizes each
text alone, the labels written out, the dataset indices, and the one way a collated batch is
taken apart (CollatedBatch), which the trainer, the evaluation and the charts share."""

import pytest
import torch

from mmembed.data.sample import DataError, Item, Sample
from mmembed.encoding.collator import DATA_ERROR, DATASET_IDS, CollatedBatch, EmbeddingCollator
from mmembed.encoding.layout import Layout
from mmembed.encoding.templates import get_template


@pytest.fixture(scope="module")
def tokenizer(minilm_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_path)


def samples() -> list[Sample]:
    return [
        Sample(Item("what is a cat"), [Item("a small feline")], [Item("a dog"), Item("a car")], source="d.jsonl",
               line=1, dataset_id=0),
        Sample(Item("capital of france"), [Item("paris")], [], source="d.jsonl", line=2, dataset_id=1),
        Sample(Item("sky colour"), [Item("blue")], [Item("green")], source="d.jsonl", line=3, dataset_id=1),
    ]


def collator(tokenizer, layout=Layout.GROUP, **kw) -> EmbeddingCollator:
    return EmbeddingCollator(get_template("bert"), tokenizer, layout, 64, **kw)


def test_group_batch_is_each_text_tokenized_alone_in_group_order(tokenizer):
    batch = collator(tokenizer, with_dataset_ids=True)(samples())
    texts = ["what is a cat", "a small feline", "a dog", "a car", "capital of france", "paris", "sky colour",
             "blue", "green"]
    want = [tokenizer(t)["input_ids"] for t in texts]  # the reference: the tokenizer, text by text
    mask = batch["attention_mask"]
    got = [row[m.bool()].tolist() for row, m in zip(batch["input_ids"], mask)]
    assert got == want
    # one label per non-anchor row: 1 for the positive, 0 for each negative
    assert batch["labels"].tolist() == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    assert batch[DATASET_IDS].tolist() == [0, 1, 1]
    assert "side" not in batch  # the loss takes no side inputs


def test_pair_batch_takes_the_label_and_the_first_positive(tokenizer):
    rows = [Sample(Item("a"), [Item("b")], [Item("x")], label=0.25), Sample(Item("c"), [Item("d")], label=1.0)]
    batch = collator(tokenizer, Layout.PAIR)(rows)
    assert batch["input_ids"].shape[0] == 4  # s1_0, s2_0, s1_1, s2_1: the negative is not a pair row
    assert batch["labels"].tolist() == [0.25, 1.0]
    assert DATASET_IDS not in batch  # not asked for
    with pytest.raises(DataError, match="label"):
        collator(tokenizer, Layout.PAIR)([Sample(Item("a"), [Item("b")])])


def test_collated_batch_unpacks_without_touching_the_batch(tokenizer):
    batch = collator(tokenizer, with_dataset_ids=True)(samples())
    keys = set(batch)
    parts = CollatedBatch.unpack(batch)
    assert set(batch) == keys  # the Trainer's dict is left whole
    assert set(parts.inputs) == keys - {"labels", DATASET_IDS}
    assert parts.labels is batch["labels"] and parts.dataset_ids is batch[DATASET_IDS] and parts.side is None
    assert torch.equal(parts.inputs["input_ids"], batch["input_ids"])
    bare = CollatedBatch.unpack({"input_ids": batch["input_ids"], "labels": batch["labels"]})
    assert bare.dataset_ids is None and bare.side is None


def test_collated_batch_raises_a_workers_data_error():
    error = DataError("d.jsonl", 7, "images", "cannot be read")
    with pytest.raises(DataError, match="d.jsonl.*7.*images"):
        CollatedBatch.unpack({DATA_ERROR: error})
