"""``--padding_free`` for rerankers (RerankerModel(padding_free=True)): the pairs of a batch packed
into one sequence, each scored at its last token, give the padded batch's scores and gradients:
a generative reranker (the tiny Qwen3, text; the tiny Qwen3-VL on picture rows, its 3D rotary
positions per pair) and a classifier whose head scores a causal model's last token (Qwen3 for
sequence classification). An encoder's classifier (BERT's pooler) is not packed, and says why.

The reference is the padded forward under eager attention, on the batch the reranker's collator
builds from the rows (the query with each document: pairs of very different lengths).
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import DATA, write_jsonl

from mmembed.tasks.reranker.model import load_reranker

MM = os.path.join(DATA, "mm")
TEXT_ROWS = [
    {"query": "what is a flute", "response": "a flute is a woodwind instrument played by blowing across a hole",
     "rejected_response": ["bananas", "the sea is wide and deep and full of fish of every colour and size"]},
    {"query": "a much longer question about the history of the violin and its makers in Italy",
     "response": "Stradivari", "rejected_response": ["x"]},
]
IMAGE_ROWS = [
    {"query": "<image>", "response": "a red circle drawn in the middle of a white page",
     "rejected_response": ["blue"], "images": [f"{MM}/red_circle.png"]},
    {"query": "which shape is green?", "response": "<image>", "rejected_response": ["a square of many colours"],
     "images": [f"{MM}/green_triangle.png"]},
]


def batch_of(folder: str, task: str, template: str | None, rows: list, tmp_path):
    from mmembed.data import read_file
    from mmembed.tasks.reranker.inputs import RerankCollator
    from mmembed.tasks.reranker.trainer import model_inputs
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.model_assembly import Encoding

    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    flags = ["--model", folder, "--task_type", task, "--dataset", path, "--output_dir", str(tmp_path / "o")]
    encoding = Encoding.resolve(parse_sft_args(flags + (["--template", template] if template else [])))
    batch = RerankCollator(encoding.template, encoding.processing, max_positive=1, max_negative=2)(read_file(path))
    return encoding, model_inputs(batch)


def scores_and_grads(folder, task, encoding, inputs, implementation, padding_free, weights=None):
    torch.manual_seed(0)  # the classifier's new head: the same random start each time
    tokenizer = getattr(encoding.processing, "tokenizer", None) or encoding.processing
    model = load_reranker(folder, task, tokenizer=tokenizer, attn_impl=implementation)
    model.padding_free = padding_free
    if padding_free:
        assert model.packable() is None
    scores = model(**dict(inputs))["scores"]
    if weights is None:
        return scores.detach(), None, model
    (scores * weights).sum().backward()
    return scores.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, model


@pytest.mark.parametrize("case", ["generative_text", "classifier_text", "generative_images"])
@pytest.mark.parametrize("implementation", ["sdpa", "varlen"])
def test_packed_pairs_give_the_padded_scores_and_gradients(tiny_model, tmp_path, case, implementation):
    task = "reranker" if case.startswith("classifier") else "generative_reranker"
    if case == "generative_images":
        folder, template, rows = tiny_model("qwen3_vl"), "qwen3_vl_reranker", IMAGE_ROWS
    else:
        folder, template, rows = tiny_model("qwen3"), None, TEXT_ROWS
    encoding, inputs = batch_of(folder, task, template, rows, tmp_path)
    lengths = inputs["attention_mask"].sum(1)
    assert lengths.max() - lengths.min() >= 10  # pairs of different lengths: padding to leave out
    ref, _, _ = scores_and_grads(folder, task, encoding, inputs, "eager", False)
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    ref, want, _ = scores_and_grads(folder, task, encoding, inputs, "eager", False, weights)
    got_scores, got, _ = scores_and_grads(folder, task, encoding, inputs, implementation, True, weights)
    torch.testing.assert_close(got_scores, ref, atol=2e-5, rtol=1e-4)
    assert want.keys() == got.keys() and want
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=5e-5, rtol=1e-3, msg=name)


def test_an_encoders_classifier_stays_padded_and_says_why(minilm_path):
    model = load_reranker(minilm_path, "reranker")
    assert "BertForSequenceClassification pools each row inside the model" in model.packable()


def test_the_run_packs_where_the_attention_and_the_head_allow(tiny_model, minilm_path, tmp_path, caplog):
    from mmembed.tasks.reranker.trainer import build_reranker
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.model_assembly import Encoding

    def built(folder: str, task: str, *flags: str):
        args = parse_sft_args(["--model", folder, "--task_type", task, "--dataset", "d.jsonl", "--output_dir",
                               str(tmp_path / "o"), *flags])
        return build_reranker(args, Encoding.resolve(args))

    assert built(tiny_model("qwen3"), "generative_reranker", "--attn_impl", "varlen").padding_free
    assert not built(tiny_model("qwen3"), "generative_reranker", "--attn_impl", "sdpa").padding_free  # dense mask
    with caplog.at_level("WARNING", logger="mmembed"):
        assert not built(minilm_path, "reranker", "--attn_impl", "varlen", "--padding_free", "true").padding_free
    assert "batches stay padded because BertForSequenceClassification pools each row inside the model" in caplog.text
