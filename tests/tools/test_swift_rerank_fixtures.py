"""ms-swift 4.6's reranker facts (tests/fixtures/swift/rerank/), checked against plain written-out rules.

The fixtures were written by ms-swift itself (tests/fixtures/swift/make_rerank_fixtures.py, in a
venv of its own). These tests need neither ms-swift nor mmembed's reranker code: they restate
each fact as a few lines of numpy / transformers and check ms-swift gave the same, so the facts
are pinned (and readable) before mmembed's implementation is compared with them.
"""

import hashlib
import json
import os

import numpy as np
import pytest
import torch
from conftest import REPO

RERANK = os.path.join(REPO, "tests", "fixtures", "swift", "rerank")


def load(name: str):
    with open(os.path.join(RERANK, name)) as f:
        return json.load(f)


# --------------------------------------------------------------------------- losses


def pointwise(scores, labels):
    """Mean binary cross-entropy with logits over every pair."""
    s, y = np.asarray(scores, np.float64), np.asarray(labels, np.float64)
    return float(np.mean(np.logaddexp(0.0, s) - y * s))


def listwise(scores, labels, temperature, min_group_size):
    """Groups start at each positive and run to the next positive (pairs before the first positive
    belong to none); a group smaller than ``min_group_size`` is left out; per group the
    cross-entropy of the positive (its first entry) over scores / temperature; the mean over the
    groups kept, 0 when none."""
    s = np.asarray(scores, np.float64) / temperature
    starts = [i for i, y in enumerate(labels) if y == 1]
    losses = []
    for k, start in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(labels)
        if end - start < min_group_size:
            continue
        g = s[start:end]
        losses.append(np.logaddexp.reduce(g) - g[0])
    return float(np.mean(losses)) if losses else 0.0


def group_sizes(labels):
    starts = [i for i, y in enumerate(labels) if y == 1] + [len(labels)]
    return [b - a for a, b in zip(starts, starts[1:])]


def pointwise_grad(scores, labels):
    """d mean-BCE / d s_i = (sigmoid(s_i) - y_i) / N."""
    s, y = np.asarray(scores, np.float64), np.asarray(labels, np.float64)
    return (1.0 / (1.0 + np.exp(-s)) - y) / len(s)


def listwise_grad(scores, labels, temperature, min_group_size):
    """For a kept group: (softmax(s / T) - onehot(0)) / T / (groups kept); 0 elsewhere."""
    s = np.asarray(scores, np.float64) / temperature
    starts = [i for i, y in enumerate(labels) if y == 1] + [len(labels)]
    kept = [(a, b) for a, b in zip(starts, starts[1:]) if b - a >= min_group_size]
    g = np.zeros(len(s))
    for a, b in kept:
        p = np.exp(s[a:b] - s[a:b].max())
        p /= p.sum()
        p[0] -= 1.0
        g[a:b] = p / temperature / len(kept)
    return g


def test_losses_cover_the_cases():
    batches = {b["name"]: b for b in load("losses.json")["batches"]}
    labels = {name: b["labels"] for name, b in batches.items()}
    assert labels["no_positive"] == [0] * len(labels["no_positive"])
    assert labels["leading_negatives"][0] == 0
    assert any(n == 1 for n in group_sizes(labels["group_of_one"]))
    settings = {(e["LISTWISE_RERANKER_TEMPERATURE"], e["LISTWISE_RERANKER_MIN_GROUP_SIZE"])
                for b in batches.values() for e in b["listwise"]}
    assert settings == {(1.0, 2), (1.0, 3), (0.05, 2), (0.05, 3)}


@pytest.mark.parametrize("name", [b["name"] for b in load("losses.json")["batches"]])
def test_losses_equal_the_written_out_formulas(name):
    batch = next(b for b in load("losses.json")["batches"] if b["name"] == name)
    scores, labels = batch["scores"], batch["labels"]
    # ms-swift computes in float32 on float32 scores; the formulas in float64 on the same values
    scores32 = np.asarray(scores, np.float32).astype(np.float64)
    pw = batch["pointwise"]
    assert pw["dtype"] == "float32" and pw["in_graph"]
    np.testing.assert_allclose(pw["loss"], pointwise(scores32, labels), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(pw["grad"], pointwise_grad(scores32, labels), rtol=1e-5, atol=1e-7)
    for entry in batch["listwise"]:
        t, m = entry["LISTWISE_RERANKER_TEMPERATURE"], entry["LISTWISE_RERANKER_MIN_GROUP_SIZE"]
        want = listwise(scores32, labels, t, m)
        np.testing.assert_allclose(entry["loss"], want, rtol=1e-6, atol=1e-6, err_msg=f"{t} {m}")
        np.testing.assert_allclose(entry["grad"], listwise_grad(scores32, labels, t, m), rtol=1e-5, atol=1e-6,
                                   err_msg=f"{t} {m}")
        # no group kept: still a float32 loss in the graph (ms-swift 4.6 returns logits[:0].sum())
        assert entry["in_graph"] and entry["dtype"] == "float32"
        if want == 0.0:
            assert entry["loss"] == 0.0 and entry["grad"] == [0.0] * len(scores)


# --------------------------------------------------------------------------- collator order


def sampled_order(rows, batch_rows, max_pos, max_neg):
    """One RandomState(42) for all batches; per row in batch order: ``choice(n_pos, min(n_pos,
    max_pos), replace=False)`` positives, and after EACH drawn positive ``choice(n_neg, min(n_neg,
    max_neg), replace=False)`` negatives (drawn anew per positive)."""
    rs = np.random.RandomState(42)
    batches = []
    for start in range(0, len(rows), batch_rows):
        pairs = []
        for row in rows[start:start + batch_rows]:
            n_pos, n_neg = row["positives"], row["negatives"]
            for i in rs.choice(n_pos, min(n_pos, max_pos), replace=False):
                pairs.append([row["id"], "pos", int(i)])
                for j in rs.choice(n_neg, min(n_neg, max_neg), replace=False):
                    pairs.append([row["id"], "neg", int(j)])
        batches.append(pairs)
    return batches


def test_order_is_the_seeded_numpy_loop():
    order = load("order.json")
    assert [r["positives"] for r in order["rows"]] and min(r["negatives"] for r in order["rows"]) == 0
    for run in order["runs"]:
        want = sampled_order(order["rows"], order["batch_rows"], run["MAX_POSITIVE_SAMPLES"], run["MAX_NEGATIVE_SAMPLES"])
        assert len(run["batches"]) == 3
        for got, pairs in zip(run["batches"], want):
            assert got["pairs"] == pairs, run
            assert got["labels"] == [1 if kind == "pos" else 0 for _, kind, _ in pairs]


# --------------------------------------------------------------------------- templates

QWEN3_RERANKER = ("<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n<Instruct>: {instruction}\n"
                  "<Query>: {query}\n<Document>: {document}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def _content(messages, role):
    return next((m["content"] for m in messages if m["role"] == role), None)


def _documents(row):
    return [(1, d) for d in row["positive_messages"]] + [(0, d) for d in row["negative_messages"]]


@pytest.fixture(scope="module")
def qwen3_tokenizer(tiny_model):
    """The tiny Qwen3's tokenizer (the real Qwen vocabulary), read once for the file."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model("qwen3"))


def test_qwen3_reranker_inputs_are_the_written_out_prompt(qwen3_tokenizer):
    """Every pair: ms-swift's fixed system prompt, the instruction (the document's own system, else
    the row's, else the default), the query and the document; the real Qwen tokenizer's ids of it."""
    fx = load("qwen3_reranker.json")
    tok = qwen3_tokenizer
    assert tok.convert_tokens_to_ids(["yes", "no"]) == fx["yes_no_token_ids"]
    for entry in fx["rows"]:
        row = entry["row"]
        docs = _documents(row)
        assert [p["label"] for p in entry["pairs"]] == [label for label, _ in docs]  # positives, then negatives
        for pair, (_, doc) in zip(entry["pairs"], docs):
            instruction = _content(doc, "system") or _content(row["messages"], "system") or fx["default_instruction"]
            text = QWEN3_RERANKER.format(system=fx["default_system"], instruction=instruction,
                                         query=_content(row["messages"], "user"), document=_content(doc, "assistant"))
            assert pair["text"] == text
            assert pair["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
            assert sorted(pair) == ["input_ids", "label", "text"]
    # the instruction's three sources all occur
    instructions = {p["text"].split("<Instruct>: ")[1].split("\n")[0] for e in fx["rows"] for p in e["pairs"]}
    assert {fx["default_instruction"], "Given a question, find the passage that answers it",
            "Judge the document by its topic only"} <= instructions
    check_collated(fx)


def check_collated(fx):
    """The training collator on the first two rows (a fresh template: RandomState(42), 1 positive
    and up to 7 negatives a row): the sampled pairs' ids, right-padded, attention mask 1 on them."""
    c = fx["collated_first_two_rows"]
    assert c["padding_side"] == "right" and sorted(c["keys"]) == ["attention_mask", "input_ids", "labels"]
    rows = [{"id": i, "positives": len(e["row"]["positive_messages"]), "negatives": len(e["row"]["negative_messages"])}
            for i, e in enumerate(fx["rows"][:2])]
    pairs = sampled_order(rows, 2, 1, 7)[0]
    assert c["labels"] == [1 if kind == "pos" else 0 for _, kind, _ in pairs]
    for (r, kind, i), ids, mask in zip(pairs, c["input_ids"], c["attention_mask"]):
        want = fx["rows"][r]["pairs"][i if kind == "pos" else rows[r]["positives"] + i]["input_ids"]
        assert ids[: len(want)] == want and mask == [1] * len(want) + [0] * (len(ids) - len(want))


def test_bert_inputs_are_the_tokenizer_pair_without_token_types(minilm_path):
    """ms-swift's bert template gives the tokenizer's [CLS] query [SEP] document [SEP] ids and no
    token_type_ids (the model sees segment 0 throughout), and refuses a system."""
    from transformers import AutoTokenizer

    fx = load("bert.json")
    assert fx["system_error"].startswith("AssertionError: The template does not support `system`")
    tok = AutoTokenizer.from_pretrained(minilm_path)
    for entry in fx["rows"]:
        row = entry["row"]
        for pair, (label, doc) in zip(entry["pairs"], _documents(row)):
            want = tok(_content(row["messages"], "user"), _content(doc, "assistant"))
            assert pair["label"] == label and pair["input_ids"] == want["input_ids"]
            assert "token_type_ids" not in pair and set(want["token_type_ids"]) == {0, 1}
    check_collated(fx)


# --------------------------------------------------------------------------- first steps


def _digest_float32(model) -> str:
    """make_rerank_fixtures.py's digest of the parameters ms-swift starts training from."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        t = p.detach().float().contiguous()
        h.update(f"{name}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _first_step_fixture():
    path = os.path.join(RERANK, "first_step.json")
    if not os.path.exists(path):
        pytest.skip("first_step.json was not recorded")
    return load("first_step.json")


def _loss(scores, labels, listwise_loss: bool):
    if not listwise_loss:
        return torch.nn.functional.binary_cross_entropy_with_logits(scores, torch.tensor(labels, dtype=torch.float32))
    starts = [i for i, y in enumerate(labels) if y == 1] + [len(labels)]
    groups = [scores[a:b] for a, b in zip(starts, starts[1:]) if b - a >= 2]
    return torch.stack([torch.logsumexp(g, 0) - g[0] for g in groups]).mean()


def _grad_norm(model) -> float:
    return float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None)))


def _optimizer(model, opt: dict):
    """transformers' AdamW as its Trainer sets it up: no weight decay on biases and norms."""
    import re

    no_decay = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if not no_decay.search(n)], "weight_decay": opt["weight_decay"]},
              {"params": [p for n, p in named if no_decay.search(n)], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=opt["learning_rate"], betas=(opt["adam_beta1"], opt["adam_beta2"]),
                             eps=opt["adam_epsilon"])


def _train_two_steps(run, model, scores_of, listwise_loss: bool):
    """Step 1 from the start weights: ms-swift's loss and grad_norm; clipped to max_grad_norm,
    one AdamW step at the full learning rate (the cosine schedule's first value: the logged
    learning_rate of a step is the next step's), then step 2's loss and grad_norm."""
    opt = run["optimizer"]
    assert opt["optim"].startswith("adamw") and opt["lr_scheduler_type"] == "cosine" and not opt["warmup_steps"]
    optimizer = _optimizer(model, opt)
    for n, step in enumerate(run["steps"]):
        scores = scores_of(step["inputs"])
        loss = _loss(scores, step["labels"], listwise_loss)
        s64 = scores.detach().double().numpy()
        want = listwise(s64, step["labels"], 1.0, 2) if listwise_loss else pointwise(s64, step["labels"])
        np.testing.assert_allclose(step["loss"], want, rtol=1e-5, atol=1e-6, err_msg=f"step {n + 1}")
        np.testing.assert_allclose(step["loss"], float(loss.detach()), rtol=1e-5, atol=1e-6)
        assert abs(step["logged_loss"] - step["loss"]) < 1e-4
        optimizer.zero_grad()
        loss.backward()
        np.testing.assert_allclose(step["grad_norm"], _grad_norm(model), rtol=1e-4, err_msg=f"step {n + 1}")
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt["max_grad_norm"])
        optimizer.step()


@pytest.mark.parametrize("name", ["generative_pointwise", "generative_listwise"])
def test_generative_first_steps_are_yes_minus_no_at_the_last_position(name, tiny_model, qwen3_tokenizer):
    """``swift sft --task_type generative_reranker``: score = logit(yes) - logit(no) at the last
    attended position of the causal LM (the tiny Qwen3, its head tied to the embeddings), the
    loss over the collated pairs; grad_norm over all parameters before clipping; step 2 after
    one AdamW step as transformers' Trainer takes it."""
    from transformers import AutoModelForCausalLM

    run = _first_step_fixture()[name]
    base = tiny_model("qwen3")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).train()
    assert _digest_float32(model) == run["start_weights_sha256_float32"]
    yes, no = qwen3_tokenizer.convert_tokens_to_ids(["yes", "no"])

    def scores_of(inputs):
        ids, mask = torch.tensor(inputs["input_ids"]), torch.tensor(inputs["attention_mask"])
        last = mask.sum(1) - 1  # right padding in training
        assert all(m[: n + 1].all() and not m[n + 1:].any() for m, n in zip(mask, last))
        h = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[torch.arange(len(ids)), last]
        head = model.get_output_embeddings().weight
        return h @ head[yes] - h @ head[no]

    _train_two_steps(run, model, scores_of, "listwise" in name)


def test_classifier_first_steps_are_bce_on_the_recorded_head(minilm_no_dropout):
    """``swift sft --task_type reranker`` on all-MiniLM-L6-v2 (dropout off): a
    BertForSequenceClassification (num_labels 1) whose head ms-swift initialised (its values are
    recorded), fed input_ids and attention_mask only; pointwise loss, two steps."""
    from transformers import AutoModelForSequenceClassification

    run = _first_step_fixture().get("classifier_pointwise")
    if run is None:
        pytest.skip("the classifier run was not recorded")
    model = AutoModelForSequenceClassification.from_pretrained(minilm_no_dropout, num_labels=1, dtype=torch.float32)
    with torch.no_grad():
        for pname, values in run["classifier_head"].items():
            dict(model.named_parameters())[pname].copy_(torch.tensor(values))
    model.train()
    assert _digest_float32(model) == run["start_weights_sha256_float32"]
    assert all("token_type_ids" not in step["inputs"] for step in run["steps"])

    def scores_of(inputs):
        return model(input_ids=torch.tensor(inputs["input_ids"]),
                     attention_mask=torch.tensor(inputs["attention_mask"])).logits.squeeze(-1)

    _train_two_steps(run, model, scores_of, False)


def test_first_steps_read_the_rows_in_file_order():
    fx = _first_step_fixture()
    for run in fx.values():
        assert [s["rows"] for s in run["steps"]] == [[0, 1], [2, 3]]
        assert len(run["steps"]) == 2 and all(s["grad_norm"] > 0 for s in run["steps"])
