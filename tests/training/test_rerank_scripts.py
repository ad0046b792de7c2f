"""ms-swift's reranker example scripts, as examples/ holds them (`swift sft` ->
`mmembed sft`, hub ids -> local paths), train a few steps as written (the command and flags
bash makes of them: conftest.run_example): a cross-encoder in one process, and across two processes under DeepSpeed ZeRO-3 (a generative reranker, full) and
ZeRO-2 (a classifier with LoRA); each checkpoint scores as the libraries that load it do."""

import json
import os

import numpy as np
import pytest
import torch
from conftest import run_example

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FEW_STEPS = ["--max_steps", "2", "--save_steps", "2", "--eval_steps", "2", "--dataloader_num_workers", "0",
             "--dataset_num_proc", "1", "--report_to", "none", "--dataloader_drop_last", "false",
             "--split_dataset_ratio", "0.01", "--disable_tqdm", "true"]
PAIRS = [("A man is playing a flute.", "A man plays the flute."), ("A man is playing a flute.", "Two dogs run in the snow.")]


def run_script(script, env, extra):
    return run_example(script, env, extra)  # the flags bash makes, in NPROC_PER_NODE forked processes


def _metrics(r):
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    return json.loads(r.stdout[r.stdout.rindex("{\n"):])  # the metrics mmembed sft prints last


@pytest.mark.parametrize("script, nproc, deepspeed, extra", [
    ("train_reranker_listwise.sh", "1", None, ["--per_device_train_batch_size", "4"]),
    ("train_reranker.sh", "2", "zero2", ["--per_device_train_batch_size", "2", "--tuner_type", "lora"]),
], ids=["listwise-1proc", "pointwise-lora-zero2-2proc"])
def test_the_cross_encoder_scripts_train_and_crossencoder_loads_the_result(tmp_path, script, nproc, deepspeed, extra):
    from sentence_transformers import CrossEncoder

    from mmembed.tasks.reranker.scorer import Reranker
    from mmembed.tools.export import export_checkpoint

    env = {"OUTPUT_DIR": str(tmp_path / "out"), "NPROC_PER_NODE": nproc}
    if deepspeed:
        extra = [*extra, "--deepspeed", deepspeed]
    metrics = _metrics(run_script(script, env, FEW_STEPS + extra))
    assert np.isfinite(metrics["train_loss"]) and {"eval_loss", "eval_mrr_at_10", "eval_ndcg_at_10", "eval_accuracy"} <= metrics.keys()
    folder = metrics["last_checkpoint"]
    ours = Reranker.from_pretrained(folder, device="cpu").score_pairs(PAIRS, raw_scores=True)
    merged = folder if "lora" not in extra else export_checkpoint(folder)
    theirs = CrossEncoder(merged, device="cpu").predict(PAIRS, activation_fn=torch.nn.Identity())
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_the_generative_script_trains_under_zero3_across_two_processes(tiny_model, tmp_path):
    """train_generative_reranker.sh (full tuning) on two processes under ZeRO-3: the checkpoint
    holds the whole causal LM, which transformers scores as logit('yes') - logit('no') at the
    last token, mmembed's score."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mmembed.tasks.reranker.scorer import Reranker

    env = {"MODEL": tiny_model("qwen3"), "OUTPUT_DIR": str(tmp_path / "out"), "NPROC_PER_NODE": "2",
           "DEEPSPEED": "zero3"}
    metrics = _metrics(run_script("train_generative_reranker.sh", env,
                                  FEW_STEPS + ["--gradient_accumulation_steps", "1", "--learning_rate", "1e-3"]))
    assert np.isfinite(metrics["train_loss"]) and np.isfinite(metrics["eval_mrr_at_10"])
    folder = metrics["last_checkpoint"]
    config = json.load(open(os.path.join(folder, "mmembed.json")))
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    reranker = Reranker.from_pretrained(folder, device="cpu")
    expected = []
    for query, document in PAIRS:
        text = reranker.template.render(__import__("mmembed.tasks.reranker.inputs", fromlist=["pair_item"]).pair_item(
            reranker.template, *(reranker._item(x) for x in (query, document))))
        with torch.no_grad():
            logits = model(**tok(text, return_tensors="pt", add_special_tokens=False)).logits[0, -1]
        expected.append(float(logits[config["token_ids"][0]] - logits[config["token_ids"][1]]))
    np.testing.assert_allclose(reranker.score_pairs(PAIRS, raw_scores=True), expected, rtol=1e-4, atol=1e-5)
