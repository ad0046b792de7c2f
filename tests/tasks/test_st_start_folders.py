"""A sentence-transformers 6.2 ``CrossEncoder`` or ``MultiVectorEncoder`` folder as ``--model``
of a reranker / late-interaction run is kept whole or refused, naming what cannot be kept,
before the weights load; never changed silently.

- CrossEncoder (all-MiniLM-L6-v2 with a one-label head, ``activation_fn`` Tanh, a default
  ``query: `` prompt): full and LoRA runs of 2 steps; the checkpoint / export keep modules.json,
  sentence_bert_config.json and config_sentence_transformers.json, and
  ``CrossEncoder(folder).predict`` gives mmembed's scores (1e-5), prompt and activation included.
- MultiVectorEncoder: a folder without MultiVectorMask trains and scores as sentence-transformers
  does; a Dense with a bias or an activation, a second Dense, a LayerNorm, no Normalize, prompts
  are refused in one line naming the module.
"""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import write_jsonl

from mmembed.errors import UsageError
from mmembed.training.arguments import parse_sft_args
from mmembed.training.preflight import check_settings
from mmembed.training.sft import run_sft

PAIRS = [("question 1 about flutes", "answer: a flute is a woodwind"), ("what is the sea", "bananas are yellow"),
         ("Who, exactly, plays the flute?", "A man plays the flute; loudly!")]
ROWS = [{"query": f"question {i} about flutes", "response": f"answer {i}: a flute is a woodwind",
         "rejected_response": [f"bananas {i}", f"the sea {i}"]} for i in range(8)]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("st_rows") / "train.jsonl", ROWS)


def _run(model, rows, out, task, *flags):
    return run_sft(parse_sft_args(["--model", model, "--task_type", task, "--dataset", rows, "--output_dir", str(out),
                                   "--per_device_train_batch_size", "2", "--max_length", "64", "--max_steps", "2",
                                   "--save_steps", "2", "--report_to", "none", "--disable_tqdm", "true",
                                   "--dataloader_num_workers", "0", *flags]))["last_checkpoint"]


def _refused(model, rows, tmp_path, task, said):
    """The run's checks (before any weight loads) refuse ``model`` in one line saying ``said``."""
    with pytest.raises(UsageError, match=said) as e:
        check_settings(parse_sft_args(["--model", model, "--task_type", task, "--dataset", rows,
                                       "--output_dir", str(tmp_path / "o")]))
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- CrossEncoder


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory, minilm_no_dropout):
    from sentence_transformers import CrossEncoder

    torch.manual_seed(0)
    folder = str(tmp_path_factory.mktemp("ce") / "model")
    CrossEncoder(minilm_no_dropout, num_labels=1, device="cpu", activation_fn=torch.nn.Tanh(),
                 prompts={"query": "query: ", "passage": "passage: "}, default_prompt_name="query").save(folder)
    return folder


def _st_scores(folder):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(folder, device="cpu").predict(PAIRS)


def _mm_scores(folder):
    from mmembed.tasks.reranker.scorer import Reranker

    return Reranker.from_pretrained(folder, device="cpu").score_pairs(PAIRS)


def test_a_cross_encoder_folder_scores_as_cross_encoder_predicts(cross_encoder):
    # predict: tanh of the logit of "query: <query>" with the document
    np.testing.assert_allclose(_mm_scores(cross_encoder), _st_scores(cross_encoder), atol=1e-5)


def test_a_full_run_keeps_the_activation_and_the_prompt(cross_encoder, rows, tmp_path):
    ck = _run(cross_encoder, rows, tmp_path / "full", "reranker", "--tuner_type", "full", "--learning_rate", "1e-3")
    st = json.load(open(os.path.join(ck, "config_sentence_transformers.json")))
    assert st["activation_fn"] == "torch.nn.modules.activation.Tanh" and st["default_prompt_name"] == "query"
    assert st["prompts"] == {"query": "query: ", "passage": "passage: "}
    assert [m["type"].rsplit(".", 1)[-1] for m in json.load(open(os.path.join(ck, "modules.json")))] == ["Transformer"]
    assert json.load(open(os.path.join(ck, "mmembed.json")))["instructions"]["query"] == "query:"  # trained with it
    theirs = _st_scores(ck)
    assert np.all(np.abs(theirs) < 1) and not np.allclose(theirs, _st_scores(cross_encoder), atol=1e-4)  # tanh, trained
    np.testing.assert_allclose(_mm_scores(ck), theirs, atol=1e-5)


def test_a_lora_run_exports_a_cross_encoder_with_its_settings(cross_encoder, rows, tmp_path):
    from mmembed.tools.export import export_checkpoint

    ck = _run(cross_encoder, rows, tmp_path / "lora", "reranker", "--tuner_type", "lora", "--lora_rank", "4",
              "--learning_rate", "1e-2", "--query_system", "Find the answer:")
    merged = export_checkpoint(ck, str(tmp_path / "merged"))
    st = json.load(open(os.path.join(merged, "config_sentence_transformers.json")))
    assert st["prompts"]["query"] == "Find the answer: " and st["activation_fn"].endswith("Tanh")  # the run's instruction
    theirs = _st_scores(merged)
    np.testing.assert_allclose(_mm_scores(ck), theirs, atol=1e-5)
    np.testing.assert_allclose(_mm_scores(merged), theirs, atol=1e-5)


def test_what_a_cross_encoder_folder_holds_beyond_mmembeds_reranker_is_refused(cross_encoder, rows, tmp_path):
    dense = tmp_path / "dense"  # a Dense scores head after the Transformer
    shutil.copytree(cross_encoder, dense)
    modules = json.load(open(dense / "modules.json"))
    (dense / "modules.json").write_text(json.dumps([*modules, {"idx": 1, "name": "1", "path": "1_Dense",
                                                               "type": "sentence_transformers.base.modules.dense.Dense"}]))
    _refused(str(dense), rows, tmp_path, "reranker", r"module '1' \(.*Dense, folder '1_Dense'\) scores after the Transformer")
    custom = tmp_path / "custom"  # an activation of the folder's own code
    shutil.copytree(cross_encoder, custom)
    st = json.load(open(custom / "config_sentence_transformers.json"))
    (custom / "config_sentence_transformers.json").write_text(json.dumps({**st, "activation_fn": "my_pkg.Act"}))
    _refused(str(custom), rows, tmp_path, "reranker", "activation_fn 'my_pkg.Act' is code outside torch")
    _refused(cross_encoder, rows, tmp_path, "generative_reranker", "a sentence-transformers CrossEncoder folder")


# ----------------------------------------------------------------------------- MultiVectorEncoder


def _mve(folder, base, *modules, prompts=None):
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Transformer

    torch.manual_seed(0)
    MultiVectorEncoder(modules=[Transformer(base), *modules], prompts=prompts, device="cpu").save(str(folder))
    return str(folder)


def _dense(**kw):
    from sentence_transformers.base.modules import Dense

    kw.setdefault("bias", False)
    kw.setdefault("activation_function", torch.nn.Identity())
    return Dense(kw.pop("in_features", 384), kw.pop("out_features", 128), module_input_name="token_embeddings", **kw)


def _normalize():
    from sentence_transformers.base.modules import Normalize

    return Normalize(module_input_name="token_embeddings")


def test_a_multivector_encoder_without_its_mask_trains_and_scores_every_token(minilm_no_dropout, rows, tmp_path):
    """No MultiVectorMask: every document token is scored (no punctuation skiplist added); the
    export loads in sentence-transformers with mmembed's MaxSim scores."""
    from sentence_transformers import MultiVectorEncoder

    from mmembed.task import get_task
    from mmembed.tools.export import export_checkpoint

    folder = _mve(tmp_path / "nomask", minilm_no_dropout, _dense(), _normalize())
    ck = _run(folder, rows, tmp_path / "run", "late_interaction", "--tuner_type", "full", "--learning_rate", "1e-4",
              "--late_interaction_query_expansion", "none")
    assert json.load(open(os.path.join(ck, "mmembed.json")))["late_interaction"]["skiplist"] == []
    st = MultiVectorEncoder(export_checkpoint(ck, str(tmp_path / "export")), device="cpu")
    queries, docs = [q for q, _ in PAIRS], [d for _, d in PAIRS]
    theirs = np.asarray(st.similarity(st.encode_query(queries), st.encode_document(docs)))
    scorer = get_task("late_interaction").load_scorer(ck, device="cpu")
    ours = np.array([[scorer.score(q, [d])[0] for d in docs] for q in queries])
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("variant, said", [
    ("bias", r"module '1' .*Dense.* has bias True"),
    ("tanh", r"module '1' .*Dense.* activation torch.nn.modules.activation.Tanh"),
    ("two_dense", r"module '2' .*Dense.* is a second one or out of order"),
    ("layer_norm", r"module '2' .*LayerNorm.* cannot be kept"),
    ("no_normalize", r"has no Normalize after the Dense"),
    ("prompts", r"prompts \{.*'\[Q\] '.*\} cannot be kept"),
])
def test_a_multivector_encoder_module_mmembed_does_not_hold_is_refused(minilm_no_dropout, rows, tmp_path, variant, said):
    from sentence_transformers.sentence_transformer.modules import LayerNorm

    modules = {"bias": [_dense(bias=True), _normalize()],
               "tanh": [_dense(activation_function=torch.nn.Tanh()), _normalize()],
               "two_dense": [_dense(out_features=256), _dense(in_features=256), _normalize()],
               "layer_norm": [_dense(), LayerNorm(128), _normalize()],
               "no_normalize": [_dense()],
               "prompts": [_dense(), _normalize()]}[variant]
    prompts = {"query": "[Q] ", "document": "[D] "} if variant == "prompts" else None
    folder = _mve(tmp_path / variant, minilm_no_dropout, *modules, prompts=prompts)
    _refused(folder, rows, tmp_path, "late_interaction", said)
