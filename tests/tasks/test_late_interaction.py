"""``mmembed sft --task_type late_interaction``: the flags, the training batch against
sentence-transformers' tokenisation, the run (evaluation by MaxSim, resume to the same weights
and projection), the saved and exported folders against the libraries that load them
(sentence-transformers' ``MultiVectorEncoder``, transformers' ``ColQwen2ForRetrieval``), and
scoring with ``mmembed rerank``."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import REPO, stsb_pairs, write_jsonl

from mmembed.environment import read as read_environment
from mmembed.errors import UsageError
from mmembed.training.arguments import parse_sft_args
from mmembed.training.sft import build_trainer, run_sft

MM = os.path.join(REPO, "examples", "data", "mm")


def _rows(n, offset=0):
    """STS-B pairs as query / positive rows, with the next row's positive as a hard negative."""
    pairs = stsb_pairs(n + offset + 1)[offset:]
    return [{"query": p["query"], "response": p["response"], "rejected_response": [pairs[i + 1]["response"]]}
            for i, p in enumerate(pairs[:n])]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("li_data")
    return write_jsonl(folder / "train.jsonl", _rows(24)), write_jsonl(folder / "val.jsonl", _rows(8, offset=40))


def _args(model, data, out, *extra):
    return parse_sft_args(["--model", model, "--task_type", "late_interaction", "--dataset", data[0],
                           "--output_dir", str(out), "--per_device_train_batch_size", "4", "--max_steps", "2",
                           "--save_steps", "2", "--report_to", "none", "--disable_tqdm", "true",
                           "--dataloader_num_workers", "0", "--logging_steps", "1", *extra])


# ----------------------------------------------------------------------------- flags


def test_the_task_and_its_flags_are_checked_before_anything_loads(minilm_path, data, tmp_path):
    args = _args(minilm_path, data, tmp_path, "--task_type", "colbert")
    assert args.task_type == "late_interaction" and args.loss_type == "infonce"  # an alias, the default loss
    cases = [
        (["--task_type", "embedding", "--late_interaction_dim", "64"],
         r"--late_interaction_dim is for --task_type late_interaction; this run's --task_type is embedding"),
        (["--loss_type", "cosine_similarity"], r"--task_type late_interaction trains with a loss over MaxSim scores"),
        (["--pooling", "mean"], r"--pooling \(an embedding pooling .*\) is for embedding runs"),
        (["--task_type", "embedding", "--loss_type", "colbert_pairwise_ce"],
         r"--loss_type colbert_pairwise_ce is a late_interaction loss; add --task_type late_interaction"),
        (["--late_interaction_query_expansion", "pad"], r"--late_interaction_query_expansion must be one of mask"),
        (["--late_interaction_query_expansion", "augment", "--late_interaction_attend_expansion", "true"],
         r"--late_interaction_attend_expansion is for the mask expansion"),
        (["--late_interaction_dim", "0"], r"--late_interaction_dim must be an integer >= 1"),
        (["--eval_beir_first_stage", minilm_path], r"--eval_beir_first_stage is a reranker's \(the candidates it "
                                                   r"reorders\); a late-interaction run's --eval_beir retrieves"),
        (["--task_type", "late_interactions"], r"--task_type must be one of embedding, reranker"),
    ]
    for extra, message in cases:
        with pytest.raises(UsageError, match=message):
            _args(minilm_path, data, tmp_path, *extra)


def test_a_classification_head_is_refused_before_it_loads(data, tmp_path, minilm_path):
    folder = tmp_path / "cls"
    folder.mkdir()
    config = json.load(open(os.path.join(minilm_path, "config.json")))
    config["architectures"] = ["BertForSequenceClassification"]
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        if os.path.exists(os.path.join(minilm_path, name)):
            shutil.copy(os.path.join(minilm_path, name), folder / name)
    with pytest.raises(UsageError, match=r"a BertForSequenceClassification gives scores, not a transformer's token states"):
        run_sft(_args(str(folder), data, tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


# ----------------------------------------------------------------------------- the run


@pytest.fixture(scope="module")
def trained(minilm_path, data, tmp_path_factory):
    """Four steps of full training with an eval set (evaluated at steps 2 and 4), checkpoints 2 and 4."""
    root = tmp_path_factory.mktemp("li_run")
    out = run_sft(_args(minilm_path, data, root / "whole", "--tuner_type", "full", "--max_steps", "4",
                        "--learning_rate", "5e-5", "--val_dataset", data[1], "--eval_strategy", "steps",
                        "--eval_steps", "2"))
    return root, out


def test_the_run_evaluates_by_maxsim_and_saves_the_projection(trained):
    root, out = trained
    for name in ("eval_loss", "eval_mean_pos", "eval_margin", "eval_ndcg_at_10", "eval_mrr_at_10", "eval_recall_at_1"):
        assert np.isfinite(out[name]), name
    assert out["eval_mean_pos"] > 1.5  # MaxSim sums (query length 32 with expansion), not cosines
    folder = out["last_checkpoint"]
    config = json.load(open(os.path.join(folder, "mmembed.json")))
    assert config["task_type"] == "late_interaction" and config["pooling"] == "tokens"
    li = config["late_interaction"]
    assert li["dim"] == 128 and li["expansion"] == "mask" and li["query_expansion"]["length"] == 32
    assert li["skiplist"][:3] == ["!", '"', "#"]  # ColBERT's punctuation skiplist for documents
    assert os.path.isfile(os.path.join(folder, "late_interaction_projection.safetensors"))
    assert not os.path.exists(os.path.join(folder, "modules.json"))  # no single-vector SentenceTransformer files
    assert {"eval_ndcg_at_10.png", "similarity_histogram.png"} <= set(os.listdir(root / "whole" / "charts"))
    from mmembed import Embedder

    with pytest.raises(UsageError, match=r"a late-interaction model \(a vector per token, scored by MaxSim\), not a "
                                         r"single-vector embedder"):
        Embedder.from_pretrained(folder)


def test_a_resumed_run_ends_with_the_same_weights_and_projection(trained, minilm_path, data):
    from safetensors.torch import load_file

    root, whole = trained
    shutil.copytree(root / "whole" / "checkpoint-2", root / "cut" / "checkpoint-2")
    resumed = run_sft(_args(minilm_path, data, root / "cut", "--tuner_type", "full", "--max_steps", "4",
                            "--learning_rate", "5e-5", "--val_dataset", data[1], "--eval_strategy", "steps",
                            "--eval_steps", "2", "--resume_from_checkpoint", str(root / "cut" / "checkpoint-2")))
    for name in ("model.safetensors", "late_interaction_projection.safetensors"):
        a = load_file(os.path.join(whole["last_checkpoint"], name))
        b = load_file(os.path.join(resumed["last_checkpoint"], name))
        start = load_file(str(root / "whole" / "checkpoint-2" / name))
        assert a.keys() == b.keys()
        assert any(not torch.equal(a[k], start[k]) for k in a), name  # steps 3-4 changed it
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=f"{name}: {k}")


def test_a_projection_width_that_disagrees_with_the_checkpoint_is_refused(trained, minilm_path, data, tmp_path):
    _, whole = trained
    with pytest.raises(UsageError, match=r"its late-interaction projection is 128-d, this run's --late_interaction_dim "
                                         r"is 64; pass --late_interaction_dim 128"):
        run_sft(_args(minilm_path, data, tmp_path / "out", "--late_interaction_dim", "64",
                      "--resume_from_checkpoint", whole["last_checkpoint"]))


def test_the_training_batch_gives_the_vectors_sentence_transformers_gives_the_export(trained, minilm_path, data, tmp_path):
    """The export loads in sentence-transformers 6.2 as a MultiVectorEncoder (no conversion) with
    the vectors of mmembed's scorer on the checkpoint (1e-5); the training collator's query rows
    (ColBERT's 32 tokens, [MASK] expansion) and document rows (punctuation left out) give those
    same vectors; MaxSim of mmembed rerank equals sentence-transformers' similarity."""
    from sentence_transformers import MultiVectorEncoder

    from mmembed.data.sample import Item, Sample
    from mmembed.task import get_task
    from mmembed.tools.export import export_checkpoint

    _, whole = trained
    folder = whole["last_checkpoint"]
    exported = export_checkpoint(folder, str(tmp_path / "export"))
    st = MultiVectorEncoder(exported, device="cpu")
    assert [type(m).__name__ for m in st] == ["Transformer", "Dense", "MultiVectorMask", "Normalize"]
    queries = ["A man is playing a flute.", "Who, exactly, plays the flute?"]
    docs = ["A man plays the flute; loudly!", "Two dogs run through the snow."]
    scorer = get_task("late_interaction").load_scorer(folder, device="cpu")
    for side, texts, theirs in (("query", queries, st.encode_query(queries)), ("document", docs, st.encode_document(docs))):
        ours = scorer.encode(texts, side)
        for a, b in zip(ours, theirs):
            b = np.asarray(b)
            assert a.shape == b.shape, side
            np.testing.assert_allclose(a, b, atol=1e-5)
    # the training collator's rows, through the trained model
    args = _args(minilm_path, data, tmp_path / "unused", "--tuner_type", "full")
    trainer = build_trainer(args)
    trainer.model.load_state_dict({**{f"backbone.{k}": v for k, v in scorer.model.backbone.state_dict().items()},
                                   "projection.weight": scorer.model.projection.weight})
    batch = trainer.data_collator([Sample(anchor=Item(q), positives=[Item(d)]) for q, d in zip(queries, docs)])
    assert batch["token_mask"][0].sum() == 32 and batch["apply_skiplist"].tolist() == [False, True, False, True]
    with torch.no_grad():
        out = trainer.model.eval()(**{k: v for k, v in batch.items() if k != "labels"})["last_hidden_state"]
    rows = [row[row.ne(0).any(-1)].numpy() for row in out]
    for got, want in zip(rows, [st.encode_query(queries)[0], st.encode_document(docs)[0],
                                st.encode_query(queries)[1], st.encode_document(docs)[1]]):
        np.testing.assert_allclose(got, np.asarray(want), atol=1e-5)
    theirs = st.similarity(st.encode_query(queries), st.encode_document(docs))
    ours = np.array([[scorer.score(q, [d])[0] for d in docs] for q in queries])
    np.testing.assert_allclose(ours, np.asarray(theirs), rtol=1e-5, atol=1e-4)
    assert os.path.isfile(os.path.join(exported, "pylate", "config_sentence_transformers.json"))


def test_mmembed_rerank_orders_by_maxsim(trained, tmp_path, capsys):
    from mmembed.tools.cli import main

    _, whole = trained
    docs = tmp_path / "docs.txt"
    docs.write_text("Two dogs run through the snow.\nA man plays the flute.\nA man is playing a flute.\n")
    assert main(["rerank", "--model", whole["last_checkpoint"], "--query", "A man is playing a flute.",
                 "--documents", str(docs), "--device", "cpu"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    scores = [r["relevance_score"] for r in line["results"]]
    assert [r["index"] for r in line["results"]][-1] == 0  # the dogs last
    assert scores == sorted(scores, reverse=True) and scores[0] > 1.5  # MaxSim sums, not probabilities


# ----------------------------------------------------------------------------- LoRA and images


def test_a_lora_run_trains_the_projection_and_exports_merged(minilm_path, data, tmp_path):
    from safetensors.torch import load_file

    from mmembed.task import get_task
    from mmembed.tools.export import export_checkpoint

    out = run_sft(_args(minilm_path, data, tmp_path / "lora", "--tuner_type", "lora", "--lora_rank", "4",
                        "--learning_rate", "1e-2", "--late_interaction_dim", "32", "--save_steps", "1"))
    folder = out["last_checkpoint"]
    assert os.path.isfile(os.path.join(folder, "adapter_model.safetensors"))
    first, last = (load_file(os.path.join(tmp_path / "lora" / f"checkpoint-{n}", "late_interaction_projection.safetensors"))
                   ["linear.weight"] for n in (1, 2))
    assert last.shape == (32, 384)
    assert not torch.allclose(first, last)  # it trains (outside the adapter, in full)
    exported = export_checkpoint(folder, str(tmp_path / "merged"))
    a = get_task("late_interaction").load_scorer(folder, device="cpu").encode(["a flute"], "document")[0]
    b = get_task("late_interaction").load_scorer(exported, device="cpu").encode(["a flute"], "document")[0]
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_a_qwen2_vl_colqwen_trains_on_image_rows_and_exports_colqwen2(tiny_model, tmp_path):
    """The tiny Qwen2-VL (GME template) as a ColQwen: queries with 10 appended pad tokens, image
    rows, LoRA, two steps; the export holds a transformers ColQwen2ForRetrieval folder that loads."""
    from transformers import ColQwen2ForRetrieval

    from mmembed.task import get_task
    from mmembed.tools.export import export_checkpoint

    out = run_sft(parse_sft_args([
        "--model", tiny_model("qwen2_vl"), "--task_type", "late_interaction", "--dataset",
        os.path.join(MM, "gme_train.jsonl"), "--output_dir", str(tmp_path / "vl"), "--per_device_train_batch_size", "4",
        "--max_steps", "2", "--save_steps", "2", "--report_to", "none", "--disable_tqdm", "true",
        "--dataloader_num_workers", "0", "--tuner_type", "lora", "--learning_rate", "1e-3", "--max_length", "512"]))
    folder = out["last_checkpoint"]
    li = json.load(open(os.path.join(folder, "mmembed.json")))["late_interaction"]
    assert li["expansion"] == "augment" and li["augmentation_tokens"] == 10 and li["expansion_token"] == "<|endoftext|>"
    assert li["skiplist"] == []
    scorer = get_task("late_interaction").load_scorer(folder, device="cpu")
    image = {"text": "<image>", "images": [os.path.join(MM, "red_circle.png")]}
    scores = scorer.score("a red circle", [image, "a blue square"])
    assert scores.shape == (2,) and np.isfinite(scores).all()
    exported = export_checkpoint(folder, str(tmp_path / "merged"))
    model = ColQwen2ForRetrieval.from_pretrained(os.path.join(exported, "colqwen2"))
    assert model.config.embedding_dim == 128


# ----------------------------------------------------------------------------- the example scripts

FEW_STEPS = ["--max_steps", "2", "--save_steps", "2", "--eval_steps", "2", "--dataloader_num_workers", "0",
             "--dataset_num_proc", "1", "--report_to", "none", "--dataloader_drop_last", "false",
             "--disable_tqdm", "true"]


def _metrics(r):
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    return json.loads(r.stdout[r.stdout.rindex("{\n"):])  # the metrics mmembed sft prints last


def test_the_colbert_script_trains_and_its_export_is_a_multivector_encoder(tmp_path):
    """examples/train_colbert.sh as written (bundled MiniLM and STS-B rows), two steps."""
    from conftest import run_example
    from sentence_transformers import MultiVectorEncoder

    from mmembed.tools.export import export_checkpoint

    metrics = _metrics(run_example("train_colbert.sh", {"OUTPUT_DIR": str(tmp_path / "out")},
                                   FEW_STEPS + ["--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4",
                                                "--split_dataset_ratio", "0.01"]))
    assert np.isfinite(metrics["train_loss"]) and np.isfinite(metrics["eval_ndcg_at_10"])
    st = MultiVectorEncoder(export_checkpoint(metrics["last_checkpoint"]), device="cpu")
    assert np.asarray(st.encode_query(["a flute"])[0]).shape == (32, 128)


def test_the_colqwen_script_trains_under_zero3_across_two_processes(tiny_model, tmp_path):
    """examples/train_colqwen.sh (LoRA, ZeRO-3 by default) on the tiny Qwen2-VL and the bundled
    image rows, two processes, two steps: the checkpoint holds the adapter and the whole projection."""
    from conftest import run_example
    from safetensors.torch import load_file

    env = {"MODEL": tiny_model("qwen2_vl"), "OUTPUT_DIR": str(tmp_path / "out"), "NPROC_PER_NODE": "2",
           "TORCH_DTYPE": "float32"}
    metrics = _metrics(run_example("train_colqwen.sh", env, FEW_STEPS + [
        "--gradient_accumulation_steps", "1", "--learning_rate", "1e-3", "--split_dataset_ratio", "0",
        "--eval_strategy", "no", "--max_length", "512"]))
    assert np.isfinite(metrics["train_loss"])
    folder = metrics["last_checkpoint"]
    projection = load_file(os.path.join(folder, "late_interaction_projection.safetensors"))["linear.weight"]
    hidden = json.load(open(os.path.join(tiny_model("qwen2_vl"), "config.json")))
    hidden = (hidden.get("text_config") or hidden).get("hidden_size") or hidden["hidden_size"]
    assert projection.shape == (128, hidden) and torch.isfinite(projection).all()  # gathered whole under ZeRO-3


def test_a_multivector_encoder_folder_trains_on_from_its_own_projection_and_settings(trained, minilm_path, data, tmp_path):
    """--model a sentence-transformers MultiVectorEncoder folder (mmembed's export without its
    mmembed files): the run starts from the folder's Dense weight (not a new random projection)
    and its query expansion; a --late_interaction_dim that disagrees is refused before it loads."""
    from safetensors.torch import load_file

    from mmembed.tools.export import export_checkpoint

    _, whole = trained
    folder = export_checkpoint(whole["last_checkpoint"], str(tmp_path / "st"))
    for name in ("mmembed.json", "late_interaction_projection.safetensors"):
        os.remove(os.path.join(folder, name))
    config = json.load(open(os.path.join(folder, "sentence_bert_config.json")))
    config["query_expansion"]["length"] = 24  # the folder's own setting, taken when the flag is not given
    (tmp_path / "st" / "sentence_bert_config.json").write_text(json.dumps(config))
    out = run_sft(_args(folder, data, tmp_path / "again", "--tuner_type", "full", "--learning_rate", "0",
                        "--max_steps", "1", "--save_steps", "1", "--weight_decay", "0"))
    saved = load_file(os.path.join(out["last_checkpoint"], "late_interaction_projection.safetensors"))["linear.weight"]
    dense = load_file(os.path.join(folder, "1_Dense", "model.safetensors"))["linear.weight"]
    torch.testing.assert_close(saved, dense, rtol=0, atol=0)
    li = json.load(open(os.path.join(out["last_checkpoint"], "mmembed.json")))["late_interaction"]
    assert li["query_expansion"]["length"] == 24 and li["skiplist"][:1] == ["!"]
    with pytest.raises(UsageError, match=r"its late-interaction projection is 128-d, this run's --late_interaction_dim "
                                         r"is 64; leave it unset"):
        run_sft(_args(folder, data, tmp_path / "wrong", "--late_interaction_dim", "64"))


def test_a_tiny_qwen2_vl_learns_image_text_retrieval_as_a_multi_vector_model(tmp_path):
    """benchmarks/learn_multimodal.py --task_type late_interaction (ColQwen-style, MaxSim), 10
    epochs: held-out recall@1 below 2x chance before (a seeded random projection on the start
    weights) and at least 3x after (measured 0.042 -> 0.278, chance 0.056)."""
    import sys

    from conftest import launch

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import learn_multimodal

    environ = read_environment().variables
    result = learn_multimodal.main(["--work_dir", str(tmp_path), "--epochs", "10", "--task_type", "late_interaction"],
                                   run=lambda args, env: launch(args, env=env, timeout=900))
    assert read_environment().variables == environ  # its MAX_PIXELS / MIN_PIXELS stay its own
    assert result["before"]["recall@1"] < 2 * result["before"]["chance"]
    assert result["after"]["recall@1"] >= 3 * result["after"]["chance"], result


def test_post_v1_rerank_serves_maxsim(trained):
    """mmembed serve with a late-interaction checkpoint: POST /v1/rerank (and TEI's /rerank)
    rank by MaxSim, relevance_score the scorer's MaxSim (raw_scores changes nothing)."""
    import sys

    sys.path.insert(0, os.path.join(REPO, "tests", "tools"))
    from test_serve import ThreadServer, httpx  # the HTTP client the openai package is built on

    from mmembed.task import task_of_folder
    from mmembed.tools.serve import ServeConfig
    from mmembed.tools.serve_rerank import create_rerank_app

    _, whole = trained
    folder = whole["last_checkpoint"]
    task = task_of_folder(folder)
    assert task.name == "late_interaction" and task.scores_pairs
    scorer = task.load_scorer(folder, device="cpu")
    query, docs = "A man is playing a flute.", ["Two dogs run in the snow.", "A man plays the flute."]
    want = scorer.score(query, docs)
    with ThreadServer(create_rerank_app(scorer, ServeConfig(model=folder, served_model_name="li"))) as s:
        body = httpx.post(s.url + "/v1/rerank", json={"query": query, "documents": docs}, timeout=60).json()
        raw = httpx.post(s.url + "/v1/rerank", json={"query": query, "documents": docs, "raw_scores": True},
                         timeout=60).json()
        tei = httpx.post(s.url + "/rerank", json={"query": query, "texts": docs}, timeout=60).json()
    assert [r["index"] for r in body["results"]] == [1, 0]
    np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], want[[1, 0]], rtol=1e-5)
    assert body["results"] == raw["results"] and [r["index"] for r in tei] == [1, 0]


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_qwen2_5_vl_and_qwen3_vl_train_as_multi_vector_models_on_image_rows(tiny_model, tmp_path, kind):
    """The tiny Qwen2.5-VL (gme-like) and Qwen3-VL (qwen3_vl_emb) on the bundled image rows, LoRA,
    two steps, from two datasets with a query instruction: the checkpoint scores an image document.
    Qwen3-VL under --attn_impl varlen, where the one-vector tasks pack by default: the per-token
    task keeps its padded rows (the tower still takes its pictures in one call)."""
    from mmembed.task import get_task

    rows = os.path.join(MM, "gme_train.jsonl" if kind == "qwen2_5_vl" else "qwen3_vl_train.jsonl")
    out = run_sft(parse_sft_args([
        "--model", tiny_model(kind), "--task_type", "late_interaction", "--dataset", rows, f"{rows}#4",
        "--query_system", "Find the picture.", "--output_dir", str(tmp_path / kind),
        "--per_device_train_batch_size", "4", "--max_steps", "2", "--save_steps", "2", "--report_to", "none",
        "--disable_tqdm", "true", "--dataloader_num_workers", "0", "--tuner_type", "lora", "--learning_rate", "1e-3",
        "--max_length", "512", *(["--attn_impl", "varlen"] if kind == "qwen3_vl" else [])]))
    assert np.isfinite(out["train_loss"])
    scorer = get_task("late_interaction").load_scorer(out["last_checkpoint"], device="cpu")
    assert scorer.template.query_system == "Find the picture."
    image = {"text": "<image>", "images": [os.path.join(MM, "red_circle.png")]}
    assert np.isfinite(scorer.score("a red circle", [image, "a blue square"])).all()


def _beir(folder, n=12, offset=60):
    rows = _rows(n, offset)
    os.makedirs(folder / "qrels", exist_ok=True)
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"_id": f"d{i}", "text": r["response"]}) + "\n"
                                                 for i, r in enumerate(rows)))
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": f"q{i}", "text": r["query"]}) + "\n"
                                                  for i, r in enumerate(rows)))
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
        f"q{i}\td{i}\t1\n" for i in range(n)))
    return str(folder), rows


def test_beir_retrieval_ranks_by_maxsim_in_training_and_in_mmembed_eval(trained, minilm_path, data, tmp_path, capsys):
    """--eval_beir during a late-interaction run and `mmembed eval --beir` rank the corpus by
    MaxSim; nDCG@10 equals the one written out from sentence-transformers' MultiVectorEncoder
    similarity on the export (one relevant document each: 1 / log2(rank + 2))."""
    from sentence_transformers import MultiVectorEncoder

    from mmembed.tools.cli import main
    from mmembed.tools.export import export_checkpoint

    folder, rows = _beir(tmp_path / "beir")
    out = run_sft(_args(minilm_path, data, tmp_path / "run", "--tuner_type", "full", "--eval_beir", folder,
                        "--eval_strategy", "steps", "--eval_steps", "2"))
    assert 0 < out["eval_beir_ndcg_at_10"] <= 1
    assert main(["eval", "--model", out["last_checkpoint"], "--beir", folder, "--json", str(tmp_path / "m.json")]) == 0
    ours = json.load(open(tmp_path / "m.json"))
    assert ours["ndcg@10"] == pytest.approx(out["eval_beir_ndcg_at_10"], abs=1e-6)  # the same model, the same task
    st = MultiVectorEncoder(export_checkpoint(out["last_checkpoint"], str(tmp_path / "st")), device="cpu")
    sim = np.asarray(st.similarity(st.encode_query([r["query"] for r in rows]),
                                   st.encode_document([r["response"] for r in rows])))
    ranks = [int((sim[i] > sim[i, i]).sum()) for i in range(len(rows))]
    ndcg = np.mean([1 / np.log2(r + 2) if r < 10 else 0.0 for r in ranks])
    assert ours["ndcg@10"] == pytest.approx(ndcg, abs=1e-5)
    capsys.readouterr()
    assert main(["eval", "--model", out["last_checkpoint"], "--sts", data[1]]) == 2  # a usage error, one line
    assert "--sts scores pairs by the cosine of one vector each" in capsys.readouterr().err
