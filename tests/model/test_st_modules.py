"""A sentence-transformers folder as ``--model`` is trained, saved and exported whole: its
modules after the Transformer (Dense, LayerNorm, Dropout, token weights, weighted layer
pooling...) run in the training forward, a full fine-tune trains them, LoRA keeps them unless
``--modules_to_save`` names them, every checkpoint and export is a sentence-transformers
folder of the same layout whose ``SentenceTransformer(folder).encode`` equals ``mmembed``'s
embeddings (1e-5), and a resumed run ends where the uninterrupted one does. The reference is
sentence-transformers 6.2 itself."""

import json
import os

import numpy as np
import pytest
import torch
from conftest import stsb_pairs, write_jsonl
from safetensors.torch import load_file

from mmembed import Embedder
from mmembed.errors import UsageError
from mmembed.model.st_modules import check_modules, modules_of_folder
from mmembed.training.arguments import parse_sft_args
from mmembed.training.sft import run_sft

TEXTS = ["A man is playing a flute.", "Two dogs run through the snow after a red ball that bounces away.", "ok"]


def st_folder(out: str, base: str, modules: list, prompts: dict | None = None) -> str:
    """Save a SentenceTransformer of ``Transformer(base)`` followed by ``modules`` into ``out``."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Transformer

    torch.manual_seed(0)
    SentenceTransformer(modules=[Transformer(base, max_seq_length=64), *modules], prompts=prompts,
                        device="cpu").save(out)
    return out


def st_encode(folder: str, texts=TEXTS, **kw) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(folder, device="cpu").encode(texts, convert_to_numpy=True, **kw)


def mm_encode(folder: str, texts=TEXTS, **kw) -> np.ndarray:
    return Embedder.from_pretrained(folder, device="cpu").encode(texts, **kw)


def dense_weights(folder: str, path: str = "2_Dense") -> dict:
    return load_file(os.path.join(folder, path, "model.safetensors"))


@pytest.fixture(scope="module")
def minilm_dense(tmp_path_factory, minilm_no_dropout):
    """all-MiniLM-L6-v2 -> mean Pooling -> Dense 384->128 (tanh) -> Normalize (the issue's folder)."""
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling

    return st_folder(str(tmp_path_factory.mktemp("minilm_dense")), minilm_no_dropout,
                     [Pooling(384, "mean"), Dense(384, 128, activation_function=torch.nn.Tanh()), Normalize()])


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    pairs = stsb_pairs(16)
    return write_jsonl(tmp_path_factory.mktemp("rows") / "train.jsonl",
                       [{"query": r["query"], "response": r["response"]} for r in pairs])


def train(model: str, rows: str, out: str, *flags: str) -> str:
    """``mmembed sft`` in this process; returns the output folder."""
    run_sft(parse_sft_args(["--model", model, "--dataset", rows, "--per_device_train_batch_size", "4",
                            "--gradient_accumulation_steps", "1", "--max_length", "32", "--max_steps", "2",
                            "--save_steps", "2", "--learning_rate", "1e-3", "--disable_tqdm", "true",
                            "--dataloader_num_workers", "0", "--report_to", "none", "--output_dir", out, *flags]))
    return out


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, minilm_dense, rows):
    return train(minilm_dense, rows, str(tmp_path_factory.mktemp("full")), "--tuner_type", "full")


def test_plain_folders_need_no_modules(minilm_path):
    # Transformer -> mean Pooling -> Normalize is mmembed's own pooling and normalization
    assert check_modules(minilm_path) is not None and modules_of_folder(minilm_path) is None


def test_a_full_fine_tune_trains_and_saves_the_dense_layer(full_run, minilm_dense):
    ck = os.path.join(full_run, "checkpoint-2")
    with open(os.path.join(ck, "modules.json"), encoding="utf-8") as f:
        kinds = [m["type"].rsplit(".", 1)[-1] for m in json.load(f)]
    assert kinds == ["Transformer", "Pooling", "Dense", "Normalize"]
    before, after = dense_weights(minilm_dense), dense_weights(ck)
    assert (before["linear.weight"] - after["linear.weight"]).abs().max() > 1e-4  # trained
    st, mm = st_encode(ck), mm_encode(ck)
    assert st.shape == mm.shape == (3, 128)
    np.testing.assert_allclose(mm, st, atol=1e-5)


def test_the_base_folder_embeds_as_sentence_transformers_does(minilm_dense):
    np.testing.assert_allclose(mm_encode(minilm_dense), st_encode(minilm_dense), atol=1e-5)


def test_lora_keeps_the_dense_layer_unless_modules_to_save_names_it(tmp_path, minilm_dense, rows):
    from mmembed.tools.export import export_checkpoint

    kept = train(minilm_dense, rows, str(tmp_path / "lora"), "--tuner_type", "lora")
    named = train(minilm_dense, rows, str(tmp_path / "named"), "--tuner_type", "lora", "--modules_to_save", "2")
    before = dense_weights(minilm_dense)["linear.weight"]
    assert torch.equal(dense_weights(os.path.join(kept, "checkpoint-2"))["linear.weight"], before)
    assert (dense_weights(os.path.join(named, "checkpoint-2"))["linear.weight"] - before).abs().max() > 1e-4
    merged = export_checkpoint(os.path.join(named, "checkpoint-2"), str(tmp_path / "merged"))
    np.testing.assert_allclose(dense_weights(merged)["linear.weight"],
                               dense_weights(os.path.join(named, "checkpoint-2"))["linear.weight"])
    np.testing.assert_allclose(mm_encode(os.path.join(named, "checkpoint-2")), st_encode(merged), atol=1e-5)
    np.testing.assert_allclose(mm_encode(merged), st_encode(merged), atol=1e-5)


def test_a_resumed_run_ends_with_the_uninterrupted_runs_weights(tmp_path, minilm_dense, rows):
    flags = ["--tuner_type", "full", "--max_steps", "4"]
    straight = train(minilm_dense, rows, str(tmp_path / "straight"), *flags)
    resumed = train(minilm_dense, rows, str(tmp_path / "resumed"), *flags,
                    "--resume_from_checkpoint", os.path.join(straight, "checkpoint-2"))
    a, b = os.path.join(straight, "checkpoint-4"), os.path.join(resumed, "checkpoint-4")
    for name in ("model.safetensors", "2_Dense/model.safetensors"):
        wa, wb = load_file(os.path.join(a, name)), load_file(os.path.join(b, name))
        assert wa.keys() == wb.keys()
        for k in wa:
            torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6)


def test_token_modules_and_modules_over_the_pooled_vector(tmp_path, minilm_no_dropout, rows):
    """WordWeights + a weighted-mean Pooling (sentence-transformers pools: token weights), then
    LayerNorm, Dropout; and WeightedLayerPooling: the base folder and a trained checkpoint embed
    as sentence-transformers does."""
    from sentence_transformers.sentence_transformer.modules import (
        Dropout,
        LayerNorm,
        Pooling,
        WeightedLayerPooling,
        WordWeights,
    )
    from transformers import AutoTokenizer

    vocab = [t for t, _ in sorted(AutoTokenizer.from_pretrained(minilm_no_dropout).get_vocab().items(), key=lambda x: x[1])]
    weights = {"man": 3.0, "flute": 0.5, "dogs": 2.0, "the": 0.1}
    words = st_folder(str(tmp_path / "words"), minilm_no_dropout,
                      [WordWeights(vocab, weights, 1.0), Pooling(384, "mean"), LayerNorm(384), Dropout(0.1)])
    layers = st_folder(str(tmp_path / "layers"), minilm_no_dropout,
                       [WeightedLayerPooling(384, num_hidden_layers=6, layer_start=3), Pooling(384, "cls")])
    with open(os.path.join(layers, "config.json")) as f:
        cfg = json.load(f)
    cfg["output_hidden_states"] = True  # sentence-transformers hands the layers to WeightedLayerPooling only so
    with open(os.path.join(layers, "config.json"), "w") as f:
        json.dump(cfg, f)
    for folder in (words, layers):  # no Normalize in these folders: mmembed's vectors are L2-normalized
        assert modules_of_folder(folder) is not None
        np.testing.assert_allclose(mm_encode(folder), st_encode(folder, normalize_embeddings=True), atol=1e-5)
    out = train(words, rows, str(tmp_path / "words_run"), "--tuner_type", "full")
    ck = os.path.join(out, "checkpoint-2")
    with open(os.path.join(ck, "modules.json"), encoding="utf-8") as f:  # the same layout, a Normalize appended
        kinds = [m["type"].rsplit(".", 1)[-1] for m in json.load(f)]
    assert kinds == ["Transformer", "WordWeights", "Pooling", "LayerNorm", "Dropout", "Normalize"]
    np.testing.assert_allclose(mm_encode(ck), st_encode(ck), atol=1e-5)


@pytest.mark.parametrize("entry, said", [
    ({"idx": 1, "name": "1", "path": "1_Custom", "type": "my_package.Custom"}, "code of the folder's own"),
    ({"idx": 1, "name": "1", "path": "1_CNN", "type": "sentence_transformers.models.CNN"}, "cannot be trained"),
])
def test_a_module_mmembed_cannot_run_is_refused_before_the_weights_load(tmp_path, minilm_dense, rows, entry, said):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(minilm_dense, folder)
    with open(folder / "modules.json") as f:
        modules = json.load(f)
    modules.insert(1, entry)
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UsageError, match=f"modules.json module '1' .*{said}"):
        check_modules(str(folder))
    from mmembed.training.preflight import check_settings

    with pytest.raises(UsageError, match=said):  # the run's checks say it before anything loads
        check_settings(parse_sft_args(["--model", str(folder), "--dataset", rows, "--output_dir", str(tmp_path / "o")]))


def _global_batch_run(model: str, rows: str, out: str, nproc: int, *extra: str) -> str:
    """One step of plain SGD (lr 1: differences show) on the 8 rows' global batch, in ``nproc``
    processes of 8 / ``nproc`` rows each; returns checkpoint-1."""
    from conftest import launch

    args = ["-m", "mmembed.tools.cli", "sft", "--model", model, "--dataset", rows, "--tuner_type", "full",
            "--per_device_train_batch_size", str(8 // nproc), "--gradient_accumulation_steps", "1", "--max_steps", "1",
            "--save_steps", "1", "--optim", "sgd", "--learning_rate", "1.0", "--weight_decay", "0", "--max_grad_norm", "0",
            "--lr_scheduler_type", "constant", "--gradient_checkpointing", "false", "--max_length", "32", "--seed", "3",
            "--output_dir", out, "--disable_tqdm", "true", "--dataloader_num_workers", "0", "--report_to", "none", *extra]
    launch(args, nproc=nproc)
    return os.path.join(out, "checkpoint-1")


def test_zero3_on_two_processes_trains_the_dense_layer_as_one_process(tmp_path, minilm_dense):
    """The Dense layer's gradient reaches it from both processes' rows, and its gathered weights
    are what the checkpoint saves under ZeRO-3 (partitioned in the run)."""
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"query": r["query"], "response": r["response"]} for r in stsb_pairs(8)])
    one = _global_batch_run(minilm_dense, rows, str(tmp_path / "one"), 1)
    two = _global_batch_run(minilm_dense, rows, str(tmp_path / "two"), 2, "--deepspeed", "zero3")
    before = dense_weights(minilm_dense)["linear.weight"]
    a, b = dense_weights(one), dense_weights(two)
    assert (a["linear.weight"] - before).abs().max() > 1e-3
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5)
    np.testing.assert_allclose(st_encode(two), mm_encode(two), atol=1e-5)
