"""EmbeddingGemma (``--model_type gemma_emb``) on the tiny EmbeddingGemma-shaped
sentence-transformers folder of examples/tiny_models.py (kind ``gemma_emb``: Gemma3TextModel with bidirectional
attention -> mean Pooling -> Dense 64->256 -> Dense 256->64 -> Normalize, EmbeddingGemma's prompts).

References: ms-swift 4.6's own first losses on the same folder and rows
(tests/fixtures/swift/make_gemma_fixtures.py) and sentence-transformers 6.2 itself.
ms-swift's SentenceTransformersLoader leaves the Transformer's attention implementation unset, so
transformers builds no attention mask and every row attends to the batch's padding; with
``--attn_impl sdpa`` ms-swift runs the model's own attention. mmembed's first loss equals the
latter, and the former is shown to be the unmasked forward's.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, run_example

FIXTURES = os.path.join(REPO, "tests", "fixtures", "swift")
sys.path.insert(0, FIXTURES)
from first_loss import recording  # noqa: E402
from make_fixtures import weights_sha256  # noqa: E402
from make_gemma_fixtures import FLAGS, ROWS  # noqa: E402

SWIFT = {name: json.load(open(os.path.join(FIXTURES, "first_loss", f"{name}.json")))
         for name in ("gemma_emb", "gemma_emb_sdpa")}
TEXTS = ["A man is playing a flute.", "Two dogs run through the snow after a red ball that bounces away.", "ok"]


@pytest.fixture(scope="module")
def gemma(tiny_model) -> str:
    """The folder ms-swift's fixtures were made on (examples/tiny_models.py's kind gemma_emb,
    checked by its weights)."""
    folder = tiny_model("gemma_emb")
    sha = SWIFT["gemma_emb_sdpa"]["base_sha256"]
    assert weights_sha256(folder) == sha["transformer"], "not the tiny EmbeddingGemma ms-swift trained"
    assert weights_sha256(os.path.join(folder, "2_Dense")) == sha["2_Dense"]
    return folder


def _sft(flags: list[str]) -> None:
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.sft import run_sft

    run_sft(parse_sft_args([*flags, "--disable_tqdm", "true"]))


@pytest.fixture(scope="module")
def first_step(gemma, tmp_path_factory) -> dict:
    """mmembed's first step on ms-swift's flags (full training, lr 0, batch 8): loss and batch."""
    with recording() as rec:
        _sft(["--model", gemma, "--dataset", ROWS, *FLAGS, "--output_dir", str(tmp_path_factory.mktemp("run"))])
    return rec


def test_first_loss_equals_ms_swifts_with_the_models_attention(first_step):
    assert first_step["first_loss"] == pytest.approx(SWIFT["gemma_emb_sdpa"]["first_loss"], abs=1e-6)


def _reference_loss(folder: str, batch: dict, attn: str | None) -> float:
    """The first step's loss written out: sentence-transformers' own pipeline on the batch's rows
    (anchor, positive, negative per group), in-batch InfoNCE at temperature 0.1 over every
    positive and negative, halved as the step's loss is (two micro-batches make the global batch of 16)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(folder, device="cpu")
    model[0].auto_model.config._attn_implementation = attn
    with torch.no_grad():
        e = model({"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]})["sentence_embedding"]
    a, docs = e[0::3], torch.stack([e[1::3], e[2::3]], 1).reshape(-1, e.shape[1])
    return F.cross_entropy(a @ docs.T / 0.1, torch.arange(len(a)) * 2).item() / 2


def test_ms_swifts_default_loss_is_the_forward_without_an_attention_mask(gemma, first_step):
    batch = first_step["first_batch"]
    assert (batch["attention_mask"] == 0).any()  # padded rows: where the two differ
    assert _reference_loss(gemma, batch, "sdpa") == pytest.approx(first_step["first_loss"], abs=1e-6)
    unmasked = _reference_loss(gemma, batch, None)  # ms-swift's: no mask built, padding attended
    assert unmasked == pytest.approx(SWIFT["gemma_emb"]["first_loss"], abs=1e-6)
    assert abs(unmasked - first_step["first_loss"]) > 0.1


def test_embeds_and_prompts_as_sentence_transformers(gemma):
    """Plain texts, and each side with EmbeddingGemma's prompt (encode_query / encode_document)."""
    from sentence_transformers import SentenceTransformer

    from mmembed import Embedder

    st, mm = SentenceTransformer(gemma, device="cpu"), Embedder.from_pretrained(gemma, device="cpu")
    np.testing.assert_allclose(mm.encode(TEXTS), st.encode(TEXTS), atol=1e-5)
    np.testing.assert_allclose(mm.encode(TEXTS, input_type="query"), st.encode_query(TEXTS), atol=1e-5)
    np.testing.assert_allclose(mm.encode(TEXTS, input_type="document"), st.encode_document(TEXTS), atol=1e-5)


def test_the_example_script_trains_and_its_export_loads_in_sentence_transformers(gemma, tmp_path):
    """examples/train_embeddinggemma.sh on the tiny folder: LoRA with the Dense layers trained
    (--modules_to_save), EmbeddingGemma's prompts as the sides' instructions; the export keeps
    the five modules, and s-t's encode_query / encode_document give mmembed's vectors."""
    from sentence_transformers import SentenceTransformer

    from mmembed import Embedder
    from mmembed.tools.export import export_checkpoint

    out = tmp_path / "out"
    run_example("train_embeddinggemma.sh", {"MODEL": gemma, "DATA": ROWS, "OUTPUT_DIR": str(out)},
                ["--max_steps", "2", "--save_steps", "2", "--per_device_train_batch_size", "4",
                 "--dataloader_num_workers", "0", "--learning_rate", "1e-3"])
    ck = str(out / "checkpoint-2")
    merged = export_checkpoint(ck, str(tmp_path / "merged"))
    with open(os.path.join(merged, "modules.json"), encoding="utf-8") as f:
        kinds = [m["type"].rsplit(".", 1)[-1] for m in json.load(f)]
    assert kinds == ["Transformer", "Pooling", "Dense", "Dense", "Normalize"]
    from safetensors.torch import load_file

    for dense in ("2_Dense", "3_Dense"):  # trained through --modules_to_save
        before, after = load_file(os.path.join(gemma, dense, "model.safetensors")), load_file(
            os.path.join(merged, dense, "model.safetensors"))
        assert (before["linear.weight"] - after["linear.weight"]).abs().max() > 1e-5
    st, mm = SentenceTransformer(merged, device="cpu"), Embedder.from_pretrained(ck, device="cpu")
    with open(os.path.join(merged, "config_sentence_transformers.json"), encoding="utf-8") as f:
        prompts = json.load(f)["prompts"]
    assert prompts["query"] == "task: search result | query: " and prompts["Clustering"] == "task: clustering | query: "
    np.testing.assert_allclose(mm.encode(TEXTS, input_type="query"), st.encode_query(TEXTS), atol=1e-5)
    np.testing.assert_allclose(mm.encode(TEXTS, input_type="document"), st.encode_document(TEXTS), atol=1e-5)
