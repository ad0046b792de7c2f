"""UEmbed (``--model_type qwen3_5_emb``) and WeMM-Embedding (``wemm_embedding``) on the tiny
random Qwen3.5 of examples/tiny_models.py (kind ``qwen3_5``: Gated DeltaNet + full attention,
the Qwen3.5 tokenizer, a vision tower).

References: ms-swift 4.6's own first losses on the same folders and rows
(tests/fixtures/swift/make_qwen3_5_fixtures.py), and the pooling written out here
(ms-swift's hook: the last valid position minus ``num_eos_tokens``; WeMM's published
``embedding``: the last position the mask covers).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
from conftest import REPO, write_jsonl

FIXTURES = os.path.join(REPO, "tests", "fixtures", "swift")
sys.path.insert(0, FIXTURES)
from first_loss import recording  # noqa: E402
from make_fixtures import weights_sha256  # noqa: E402
from make_qwen3_5_fixtures import swift_flags, wemm_folder  # noqa: E402

META = json.load(open(os.path.join(FIXTURES, "qwen3_5", "meta.json")))
SYSTEM = "Represent the user's input."


@pytest.fixture(scope="module")
def folders(tiny_model, tmp_path_factory):
    """The tiny Qwen3.5 ms-swift's fixtures were made on (checked by its weights), a WeMM-shaped
    folder of it, and a UEmbed folder with ``sparse_info.json`` (num_eos_tokens 2) and
    ``sparse_weights.pt``."""
    base = tiny_model("qwen3_5")
    assert weights_sha256(base) == META["weights_sha256"]["qwen3_5"], "not the tiny Qwen3.5 ms-swift trained"
    root = tmp_path_factory.mktemp("qwen3_5_emb")
    wemm = wemm_folder(base, str(root / "wemm"))
    sparse = str(root / "uembed")
    shutil.copytree(base, sparse)
    with open(os.path.join(sparse, "sparse_info.json"), "w") as f:
        json.dump({"num_eos_tokens": 2}, f)
    torch.save({"weights": torch.arange(4.0)}, os.path.join(sparse, "sparse_weights.pt"))
    return {"qwen3_5_emb": base, "wemm_embedding": wemm, "sparse": sparse, "root": root}


def _sft(flags: list[str]) -> dict:
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.sft import run_sft

    return run_sft(parse_sft_args([*flags, "--disable_tqdm", "true", "--overwrite_output_dir", "true"]))


@pytest.mark.parametrize("model_type", ["qwen3_5_emb", "wemm_embedding"])
@pytest.mark.parametrize("rows", ["text", "image"])
def test_first_loss_equals_ms_swift(folders, model_type, rows, tmp_path, monkeypatch):
    """ms-swift's own `swift sft` flags (full training, lr 0, batch 4) give mmembed ms-swift's
    first loss, on text rows and on picture rows (relative image paths, run from data/ as ms-swift's)."""
    swift = json.load(open(os.path.join(FIXTURES, "first_loss", f"{model_type}_{rows}.json")))
    monkeypatch.chdir(os.path.join(FIXTURES, "data"))
    for var in ("MAX_PIXELS", "MIN_PIXELS", "FPS", "FPS_MAX_FRAMES"):  # none set by the user in ms-swift's run
        monkeypatch.delenv(var, raising=False)
    flags = swift_flags(folders[model_type], model_type, "text.jsonl" if rows == "text" else "gme.jsonl",
                        str(tmp_path / "out"))
    with recording() as rec:
        _sft([*flags, "--save_strategy", "no"])
    batch = rec["first_batch"] or {}
    shapes = {k: tuple(v.shape) for k, v in batch.items() if hasattr(v, "shape")}
    grids = batch["image_grid_thw"].tolist() if "image_grid_thw" in batch else None
    assert rec["first_loss"] == pytest.approx(swift["first_loss"], abs=1e-5), (shapes, grids)


def _rendered(model_dir: str, text: str, system: str | None = SYSTEM) -> torch.Tensor:
    """The model's final states of ``text`` in UEmbed's chat shape, ``num_eos`` read by hand."""
    from transformers import AutoModel, AutoTokenizer

    n = json.load(open(os.path.join(model_dir, "sparse_info.json")))["num_eos_tokens"]
    prompt = (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{text.strip()}<|im_end|>\n"
              "<|im_start|>assistant\n<think>\n\n</think>\n\n" + "<|endoftext|>" * n)
    ids = AutoTokenizer.from_pretrained(model_dir)(prompt, add_special_tokens=False, return_tensors="pt")
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(**ids).last_hidden_state[0]
    return ids["input_ids"][0], torch.nn.functional.normalize(hidden[-1 - n], dim=-1)


def test_num_eos_tokens_suffix_and_pooling(folders):
    """sparse_info.json's num_eos_tokens N = 2: the input ends with 2 <|endoftext|> and the
    embedding is the state 2 positions before the last (ms-swift's hook), text trimmed."""
    from mmembed import Embedder

    ids, expected = _rendered(folders["sparse"], "  a flute  ")
    assert ids[-3:].tolist()[1:] == [248044, 248044] and ids[-3].item() != 248044
    got = Embedder.from_pretrained(folders["sparse"]).encode(["  a flute  "])
    assert torch.allclose(torch.from_numpy(got[0]), expected, atol=1e-5)


def test_sparse_files_carried_into_checkpoints_and_exports(folders, tmp_path):
    """sparse_info.json and sparse_weights.pt go into every checkpoint and into mmembed export's
    folder (ms-swift's additional_saved_files); both embed as the base does (lr 0)."""
    from mmembed import Embedder
    from mmembed.tools.export import export_checkpoint

    data = write_jsonl(tmp_path / "rows.jsonl", [
        {"query": f"question {i}", "response": f"answer {i}", "rejected_response": [f"other {i}"]} for i in range(4)])
    out = _sft(["--model", folders["sparse"], "--model_type", "qwen3_5_emb", "--dataset", data, "--tuner_type", "lora",
                "--lora_rank", "4", "--learning_rate", "0", "--max_steps", "1", "--save_steps", "1",
                "--per_device_train_batch_size", "2", "--split_dataset_ratio", "0", "--dataloader_num_workers", "0",
                "--report_to", "none", "--output_dir", str(tmp_path / "run")])
    checkpoint = out["last_checkpoint"]
    merged = export_checkpoint(checkpoint, str(tmp_path / "merged"))
    for folder in (checkpoint, merged):
        assert json.load(open(os.path.join(folder, "sparse_info.json"))) == {"num_eos_tokens": 2}
        assert torch.equal(torch.load(os.path.join(folder, "sparse_weights.pt"))["weights"], torch.arange(4.0))
    _, expected = _rendered(folders["sparse"], "a flute")
    for folder in (checkpoint, merged):
        got = Embedder.from_pretrained(folder).encode(["a flute"])
        assert torch.allclose(torch.from_numpy(got[0]), expected, atol=1e-5), folder


def test_packing_refused_before_the_weights_load(folders):
    """--padding_free true / --packing true: one line naming the flag and the linear attention,
    before any weight is read; by default (a GPU's flash_attn too) batches stay padded."""
    from mmembed.errors import UsageError
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.model_assembly import read_model_config, resolve_template, use_padding_free
    from mmembed.training.preflight import check_settings

    data = os.path.join(FIXTURES, "data", "text.jsonl")
    for flag in ("--padding_free", "--packing"):
        args = parse_sft_args(["--model", folders["qwen3_5_emb"], "--dataset", data, flag, "true", "--output_dir", "x"])
        with pytest.raises(UsageError) as e:
            check_settings(args)
        assert f"{flag} true" in str(e.value) and "linear-attention" in str(e.value) and "\n" not in str(e.value)
    config = read_model_config(folders["qwen3_5_emb"])
    config._attn_implementation = "flash_attention_2"
    args = parse_sft_args(["--model", folders["qwen3_5_emb"], "--dataset", data, "--output_dir", "x"])
    assert use_padding_free(args, config, resolve_template(folders["qwen3_5_emb"], None, None, None)) is False


def test_wemm_embedding_is_its_published_forward(folders, tmp_path):
    """WeMM-Embedding's embedding() (the Qwen3.5 language model's state at the mask's last
    position, normalized), computed here with transformers' Qwen3_5Model on the rendered rows,
    equals mmembed's (picked by config.json's architectures WeMMEmbedding, the folder's code not
    run); a saved folder names Qwen3_5ForConditionalGeneration and no auto_map, as ms-swift's."""
    from transformers import AutoModel, AutoTokenizer

    from mmembed import Embedder

    texts = ["a flute", "  a much longer sentence about a red square  "]
    tok = AutoTokenizer.from_pretrained(folders["wemm_embedding"])
    enc = tok([f"<|im_start|>user\n{t.strip()}<|im_end|>\n<embedding>" for t in texts], padding=True,
              add_special_tokens=False, return_tensors="pt")
    assert (enc["input_ids"][0, enc["attention_mask"][0].sum() - 1] == 248077).item()
    model = AutoModel.from_pretrained(folders["wemm_embedding"], dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
    expected = torch.nn.functional.normalize(hidden[torch.arange(2), enc["attention_mask"].sum(1) - 1], dim=-1)
    got = torch.from_numpy(Embedder.from_pretrained(folders["wemm_embedding"]).encode(texts))
    assert torch.allclose(got, expected, atol=1e-5)


def test_the_uembed_script_trains(folders, tmp_path):
    """examples/train_uembed.sh (LoRA on the language model, picture and text rows bundled with the
    examples) on the tiny UEmbed with num_eos_tokens 2, one step, no DeepSpeed: its checkpoint
    carries sparse_info.json and pools 2 positions back."""
    from conftest import run_example

    env = {"MODEL": folders["sparse"], "OUTPUT_DIR": str(tmp_path / "out"), "TORCH_DTYPE": "float32",
           "DEEPSPEED": "", "ATTN_IMPL": "sdpa"}
    r = run_example("train_uembed.sh", env, [
        "--max_steps", "1", "--save_steps", "1", "--per_device_train_batch_size", "2", "--split_dataset_ratio", "0",
        "--eval_strategy", "no", "--max_length", "512", "--dataloader_num_workers", "0", "--dataset_num_proc", "1",
        "--report_to", "none", "--dataloader_drop_last", "false", "--disable_tqdm", "true"])
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    metrics = json.loads(r.stdout[r.stdout.rindex("{\n"):])
    folder = metrics["last_checkpoint"]
    assert json.load(open(os.path.join(folder, "sparse_info.json"))) == {"num_eos_tokens": 2}
    assert json.load(open(os.path.join(folder, "mmembed.json")))["template"]["pool_skip"] == 2
