"""mmembed's reranker training against ms-swift 4.6 itself (tests/fixtures/swift/rerank/).

The fixtures were written by ms-swift (tests/fixtures/swift/make_rerank_fixtures.py, in a venv of
its own; tests/tools/test_swift_rerank_fixtures.py checks them self-consistent). Here mmembed's
own code is run on the same inputs: its losses (value and gradient), its collator's draws (the
pairs of each batch, batch after batch), its pair encodings (the Qwen3-Reranker ids; the BERT
cross-encoder's documented difference) and two training steps of ``mmembed sft`` on the recorded
data with the recorded settings (each step's loss and gradient norm).

Where mmembed differs on purpose the test states the difference exactly (docs/rerankers.md, "Rerankers against ms-swift 4.6.0"):
the BERT pair is the tokenizer's text pair with token type ids (CrossEncoder's encoding; ms-swift
joins the texts with a literal ``[SEP]`` and gives none); the Qwen3 batch is ms-swift's, padded on the right.
"""

import json
import os
import re

import numpy as np
import pytest
import torch
from conftest import REPO, load_tiny_models

RERANK = os.path.join(REPO, "tests", "fixtures", "swift", "rerank")


def load(name: str):
    with open(os.path.join(RERANK, name)) as f:
        return json.load(f)


LOSSES = load("losses.json")
ORDER = load("order.json")
QWEN3 = load("qwen3_reranker.json")
BERT = load("bert.json")
FIRST_STEP = load("first_step.json")
META = load("meta.json")


@pytest.fixture(scope="module")
def qwen_tokenizer():
    return load_tiny_models().make_qwen_tokenizer("qwen3")


@pytest.fixture(scope="module")
def minilm_tokenizer(minilm_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_path)


def read_rows(rows: list[dict], tmp_path, name: str = "rows.jsonl"):
    """``rows`` as a reranker run reads them: a JSONL file through mmembed's reader, several
    ``positive_messages`` groups allowed (``several_positives``, set for reranker runs)."""
    from conftest import write_jsonl

    from mmembed.data.reader import read_file

    return read_file(write_jsonl(tmp_path / name, rows), several_positives=True)


def unpadded(ids, mask) -> list[int]:
    return [int(t) for t, m in zip(ids, mask) if m]


# --------------------------------------------------------------------------- losses


def _loss_cases():
    for batch in LOSSES["batches"]:
        yield pytest.param(batch, "pointwise_reranker", batch["pointwise"], {}, id=f"{batch['name']}-pointwise")
        for entry in batch["listwise"]:
            values = {k: str(entry[k]) for k in ("LISTWISE_RERANKER_TEMPERATURE", "LISTWISE_RERANKER_MIN_GROUP_SIZE")}
            yield pytest.param(batch, "listwise_reranker", entry, values,
                               id=f"{batch['name']}-listwise-t{entry['LISTWISE_RERANKER_TEMPERATURE']}"
                                  f"-g{entry['LISTWISE_RERANKER_MIN_GROUP_SIZE']}")


@pytest.mark.parametrize("batch, loss_type, swift, values", list(_loss_cases()))
def test_loss_and_its_gradient_are_ms_swifts(batch, loss_type, swift, values):
    """build_rerank_loss, given the LISTWISE_RERANKER_* values ms-swift read, on ms-swift's call
    (float32 scores [N, 1], int64 labels): the same loss (float32) and the same gradient w.r.t.
    the scores; where no group is kept, 0 in the graph with a gradient of zeros, as ms-swift's."""
    from mmembed.tasks.reranker.losses import build_rerank_loss

    loss_fn = build_rerank_loss(loss_type, values=values)
    scores = torch.tensor(batch["scores"], dtype=getattr(torch, LOSSES["scores_dtype"]), requires_grad=True)
    labels = torch.tensor(batch["labels"], dtype=getattr(torch, LOSSES["labels_dtype"]))
    loss = loss_fn(scores.unsqueeze(-1), labels)
    assert str(loss.dtype).replace("torch.", "") == swift["dtype"]
    assert loss.shape == ()
    assert abs(float(loss.detach()) - swift["loss"]) <= 1e-6
    assert (loss.grad_fn is not None) == swift["in_graph"]
    loss.backward()
    np.testing.assert_allclose(scores.grad.numpy(), np.asarray(swift["grad"], np.float32), rtol=0, atol=1e-6)
    if swift["loss"] == 0.0:
        assert not scores.grad.any()


# --------------------------------------------------------------------------- the collator's draws


def order_rows() -> list[dict]:
    """The rows of order.json as make_rerank_fixtures.order_rows writes them: row r has its
    recorded numbers of positives and negatives, each document naming its row and index."""
    def doc(text):
        return [{"role": "assistant", "content": text}]

    return [{"messages": [{"role": "user", "content": f"query {r['id']}"}],
             "positive_messages": [doc(f"row {r['id']} pos {i}") for i in range(r["positives"])],
             "negative_messages": [doc(f"row {r['id']} neg {j}") for j in range(r["negatives"])]}
            for r in ORDER["rows"]]


@pytest.mark.parametrize("run", ORDER["runs"], ids=lambda r: f"P{r['MAX_POSITIVE_SAMPLES']}-N{r['MAX_NEGATIVE_SAMPLES']}")
def test_collator_draws_ms_swifts_pairs_batch_after_batch(run, qwen_tokenizer, tmp_path):
    """One RerankCollator (training, ms-swift's MAX_POSITIVE_SAMPLES / MAX_NEGATIVE_SAMPLES)
    over the recorded batches of rows gives ms-swift's pairs in ms-swift's order and its
    labels, batch after batch (one RandomState(42) drawn from across batches); each pair is
    identified, as the generator did, by decoding the ids the model is fed."""
    from mmembed.encoding.templates import get_template
    from mmembed.tasks.reranker.inputs import RerankCollator

    samples = read_rows(order_rows(), tmp_path)
    assert [(len(s.positives), len(s.negatives)) for s in samples] == \
        [(r["positives"], r["negatives"]) for r in ORDER["rows"]]
    collator = RerankCollator(get_template("qwen3_reranker"), qwen_tokenizer, train=True,
                              max_positive=run["MAX_POSITIVE_SAMPLES"], max_negative=run["MAX_NEGATIVE_SAMPLES"])
    for k, recorded in enumerate(run["batches"]):
        batch = collator([samples[i] for i in recorded["row_ids"]])
        pairs = []
        for ids, mask in zip(batch["input_ids"].tolist(), batch["attention_mask"].tolist()):
            text = qwen_tokenizer.decode(unpadded(ids, mask))
            r, kind, i = re.search(r"<Document>: row (\d+) (pos|neg) (\d+)", text).groups()
            pairs.append([int(r), kind, int(i)])
        assert pairs == recorded["pairs"], f"batch {k}"
        assert batch["labels"].tolist() == [float(y) for y in recorded["labels"]], f"batch {k}"


def test_an_embedding_run_still_refuses_several_positives(tmp_path):
    """Several positive groups are a reranker run's (ms-swift's reranker draws among them); the
    embedding reader keeps refusing them with its message."""
    from conftest import write_jsonl

    from mmembed.data.reader import read_file
    from mmembed.data.sample import DataError

    path = write_jsonl(tmp_path / "rows.jsonl", order_rows()[1:2])
    with pytest.raises(DataError, match=r"must hold exactly one positive group .*got 2"):
        read_file(path)
    assert len(read_file(path, several_positives=True)[0].positives) == 2


# --------------------------------------------------------------------------- the pairs' ids


def _pairs_by_document(collator, sample) -> list[tuple[list[int], dict]]:
    """(ids, batch row) of each document of ``sample`` in ms-swift's encoder order (its
    positives, then its negatives), from mmembed's evaluation batch (each positive followed
    by every negative)."""
    batch = collator([sample])
    rows = [unpadded(ids, mask) for ids, mask in zip(batch["input_ids"].tolist(), batch["attention_mask"].tolist())]
    width = 1 + len(sample.negatives)
    positives = [i * width for i in range(len(sample.positives))]
    negatives = [1 + j for j in range(len(sample.negatives))]
    return [(rows[i], {k: v[i] for k, v in batch.items() if torch.is_tensor(v) and v.dim() == 2})
            for i in positives + negatives]


def test_qwen3_reranker_pairs_are_ms_swifts_ids(qwen_tokenizer, tmp_path):
    """Every (query, document) pair of the recorded rows (no system; the row's system; a
    negative with its own system) has ms-swift's input ids and label; ms-swift's training
    batch of the first two rows holds the same rows (unpadded) and labels, as wide."""
    from mmembed.encoding.templates import get_template
    from mmembed.tasks.reranker.inputs import RerankCollator
    from mmembed.tasks.reranker.model import token_id

    template = get_template("qwen3_reranker")
    assert template.default_system == QWEN3["default_system"]
    assert template.default_instruction == QWEN3["default_instruction"]
    assert [token_id(qwen_tokenizer, t, "") for t in ("yes", "no")] == QWEN3["yes_no_token_ids"]
    samples = read_rows([r["row"] for r in QWEN3["rows"]], tmp_path)
    collator = RerankCollator(template, qwen_tokenizer, train=False)
    for k, (sample, recorded) in enumerate(zip(samples, QWEN3["rows"])):
        got = _pairs_by_document(collator, sample)
        labels = [1] * len(sample.positives) + [0] * len(sample.negatives)
        assert labels == [p["label"] for p in recorded["pairs"]], f"row {k}"
        assert [ids for ids, _ in got] == [p["input_ids"] for p in recorded["pairs"]], f"row {k}"
        assert [qwen_tokenizer.decode(ids) for ids, _ in got] == [p["text"] for p in recorded["pairs"]]

    swift = QWEN3["collated_first_two_rows"]
    batch = RerankCollator(template, qwen_tokenizer, train=True, max_positive=1, max_negative=7)(samples[:2])
    assert sorted(k for k in batch if k not in ("group_ids",)) == sorted(swift["keys"])
    assert list(batch["input_ids"].shape) == swift["keys"]["input_ids"]
    assert batch["labels"].tolist() == [float(y) for y in swift["labels"]]
    # padded on the right as ms-swift pads: the very batch
    assert swift["padding_side"] == "right" and template.padding_side == "right"
    assert batch["input_ids"].tolist() == swift["input_ids"]
    assert batch["attention_mask"].tolist() == swift["attention_mask"]


def test_bert_pairs_are_the_tokenizers_text_pair_where_ms_swift_joins_with_sep(minilm_tokenizer, tmp_path):
    """A documented difference: mmembed's bert_reranker encodes a pair as the tokenizer's text
    pair (``[CLS] query [SEP] document [SEP]`` with token type ids 0 then 1: what
    sentence-transformers' CrossEncoder feeds the model); ms-swift's bert template joins the
    texts with a literal ``[SEP]`` and gives no token type ids (the model then takes 0
    everywhere). The input ids are the same; only the token type ids of the document differ.
    A row with a system is an error in ms-swift; mmembed puts the instruction before the query."""
    from mmembed.encoding.templates import get_template
    from mmembed.tasks.reranker.inputs import RerankCollator

    template = get_template("bert_reranker")
    samples = read_rows([r["row"] for r in BERT["rows"]], tmp_path)
    collator = RerankCollator(template, minilm_tokenizer, train=False)
    sep = minilm_tokenizer.sep_token_id
    for k, (sample, recorded) in enumerate(zip(samples, BERT["rows"])):
        got = _pairs_by_document(collator, sample)
        assert [ids for ids, _ in got] == [p["input_ids"] for p in recorded["pairs"]], f"row {k}"
        for ids, row in got:
            assert "token_type_ids" not in recorded["pairs"][0]
            first_sep = ids.index(sep)
            types = row["token_type_ids"][:len(ids)].tolist()
            assert types == [0] * (first_sep + 1) + [1] * (len(ids) - first_sep - 1)
    swift = BERT["collated_first_two_rows"]
    assert "token_type_ids" not in swift["keys"]
    batch = RerankCollator(template, minilm_tokenizer, train=True, max_positive=1, max_negative=7)(samples[:2])
    assert "token_type_ids" in batch and batch["token_type_ids"].any()
    assert batch["labels"].tolist() == [float(y) for y in swift["labels"]]
    assert batch["input_ids"].tolist() == swift["input_ids"] and batch["attention_mask"].tolist() == swift["attention_mask"]

    # a row with a system: ms-swift refuses it; mmembed's pair is the instruction before the query
    assert BERT["system_error"].startswith("AssertionError: The template does not support `system`")
    with_system = read_rows([QWEN3["rows"][1]["row"]], tmp_path, "system.jsonl")[0]
    system = with_system.anchor.system
    ids, _ = _pairs_by_document(collator, with_system)[0]
    plain = BERT["rows"][1]["pairs"][0]["input_ids"]
    instruction = minilm_tokenizer(system, add_special_tokens=False)["input_ids"]
    assert ids == plain[:1] + instruction + plain[1:]


# --------------------------------------------------------------------------- two training steps


def _digest(model) -> str:
    """make_rerank_fixtures.run_sft_recording's digest of the weights a run starts from."""
    import hashlib

    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        t = p.detach().float().contiguous()
        h.update(f"{name}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("name", sorted(FIRST_STEP))
def test_two_training_steps_are_ms_swifts(name, tiny_model, minilm_no_dropout, tmp_path, monkeypatch):
    """``mmembed sft`` with the recorded ``swift sft`` command (its flags as they are, the
    optimizer settings ms-swift's args.json recorded) on the recorded data, from the weights
    ms-swift started from (the tiny Qwen3 rebuilt from seed 0; all-MiniLM-L6-v2 without
    dropout, given the classification head ms-swift initialised): each step trains the rows
    and pairs ms-swift fed, with its loss (1e-5) and gradient norm (1e-4).

    The classifier (bert) run is fed ms-swift's inputs: its pairs without token type ids.
    mmembed's own bert_reranker batch adds the tokenizer's token type ids (1 on the document,
    CrossEncoder's encoding), with which the loss differs (asserted): the documented difference."""
    from mmembed.tasks.reranker.trainer import RerankTrainer
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.sft import run_sft

    run = FIRST_STEP[name]
    for var in ("MAX_POSITIVE_SAMPLES", "MAX_NEGATIVE_SAMPLES", "LISTWISE_RERANKER_TEMPERATURE",
                "LISTWISE_RERANKER_MIN_GROUP_SIZE", "GENERATIVE_RERANKER_POSITIVE_TOKEN",
                "GENERATIVE_RERANKER_NEGATIVE_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    base = tiny_model("qwen3") if run["base"] == "qwen3" else minilm_no_dropout
    assert run["command"][:2] == ["swift", "sft"]
    flags = [base if f == f"TINY_{run['base'].upper()}" else f for f in run["command"][2:]]
    opt = run["optimizer"]
    flags += ["--optim", opt["optim"], "--learning_rate", str(opt["learning_rate"]),
              "--weight_decay", str(opt["weight_decay"]), "--adam_beta1", str(opt["adam_beta1"]),
              "--adam_beta2", str(opt["adam_beta2"]), "--adam_epsilon", str(opt["adam_epsilon"]),
              "--max_grad_norm", str(opt["max_grad_norm"]), "--lr_scheduler_type", opt["lr_scheduler_type"],
              "--warmup_steps", str(opt["warmup_steps"]), "--output_dir", str(tmp_path / "out"),
              "--disable_tqdm", "true"]
    head = run["classifier_head"]
    steps = []
    compute_loss = RerankTrainer.compute_loss

    def recording(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        start = None
        if not steps:
            if head is not None:  # ms-swift's new head, before the first forward (AdamW holds no state yet)
                params = dict(model.backbone.named_parameters())
                with torch.no_grad():
                    for key, value in head.items():
                        params[key].copy_(torch.tensor(value))
            start = _digest(model.backbone)
        own = None
        if "token_type_ids" in inputs:  # the bert pair as mmembed encodes it, then as ms-swift does
            with torch.no_grad():
                own = float(compute_loss(self, model, dict(inputs)))
            inputs = {k: v for k, v in inputs.items() if k != "token_type_ids"}
        result = compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
        loss = result[0] if isinstance(result, tuple) else result
        steps.append({"loss": float(loss.detach()), "own_inputs_loss": own, "start": start,
                      "labels": inputs["labels"].tolist(),
                      "rows": [unpadded(*r) for r in zip(inputs["input_ids"].tolist(),
                                                         inputs["attention_mask"].tolist())]})
        return result

    monkeypatch.setattr(RerankTrainer, "compute_loss", recording)
    monkeypatch.chdir(RERANK)  # the command names data.jsonl, as ms-swift ran it
    result = run_sft(parse_sft_args(flags))

    assert steps[0]["start"] == run["start_weights_sha256_float32"], "not the weights ms-swift started from"
    with open(os.path.join(result["last_checkpoint"], "mmembed.json")) as f:
        logged = [e for e in json.load(f)["training"]["log"] if "loss" in e]
    assert len(steps) == len(logged) == len(run["steps"]) == 2
    for k, (ours, log, theirs) in enumerate(zip(steps, logged, run["steps"])):
        swift_rows = [unpadded(*r) for r in zip(theirs["inputs"]["input_ids"], theirs["inputs"]["attention_mask"])]
        assert ours["rows"] == swift_rows, f"step {k + 1}: other pairs than ms-swift's"
        assert ours["labels"] == [float(y) for y in theirs["labels"]], f"step {k + 1}"
        assert abs(ours["loss"] - theirs["loss"]) <= 1e-5, f"step {k + 1}: loss {ours['loss']} vs {theirs['loss']}"
        assert abs(log["loss"] - theirs["logged_loss"]) <= 1e-5, f"step {k + 1}"
        assert abs(log["grad_norm"] - theirs["grad_norm"]) <= 1e-4, \
            f"step {k + 1}: grad_norm {log['grad_norm']} vs {theirs['grad_norm']}"
        if head is not None:
            assert abs(ours["own_inputs_loss"] - theirs["loss"]) > 1e-5  # with the token type ids: other scores
        else:
            assert ours["own_inputs_loss"] is None
    # the rate logged: the step's own in mmembed, the next step's in ms-swift
    assert [e["learning_rate"] for e in logged][1:] == pytest.approx([s["logged_learning_rate"] for s in run["steps"]][:-1])
