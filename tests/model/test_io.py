"""Which saved folders get the sentence-transformers files: one rule for training checkpoints
and exports, and where the files are written SentenceTransformer gives mmembed's embeddings
(every text template: tests/model/test_st_exports.py)."""

import json
import os

import numpy as np
import pytest
from conftest import stsb_pairs

from mmembed.training.arguments import parse_sft_args
from mmembed.training.sft import run_sft

TEXTS = ["A man is playing a flute.", "Two dogs run through the snow after a red ball.", "The stock market fell today."]
ST_FILES = ("modules.json", "sentence_bert_config.json", os.path.join("1_Pooling", "config.json"))


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    rows = stsb_pairs(8)
    path.write_text("".join(json.dumps({"query": r["query"], "response": r["response"]}) + "\n" for r in rows))
    return str(path)


def _full_checkpoint(model, data, out, *extra):
    """One step of full tuning; the checkpoint folder."""
    args = parse_sft_args([
        "--model", model, "--task_type", "embedding", "--dataset", data, "--tuner_type", "full",
        "--per_device_train_batch_size", "4", "--max_length", "32", "--max_steps", "1", "--save_steps", "1",
        "--eval_strategy", "no", "--output_dir", str(out), "--disable_tqdm", "true", "--dataloader_num_workers", "0",
        *extra,
    ])
    return run_sft(args)["last_checkpoint"]


def _has_st_files(folder):
    found = [os.path.isfile(os.path.join(folder, name)) for name in ST_FILES]
    assert all(found) or not any(found), f"{folder}: some sentence-transformers files but not all: {found}"
    return all(found)


def test_checkpoint_and_its_export_agree_on_sentence_transformers_files(tiny_model, pairs, tmp_path):
    """gte_qwen2 appends <|endoftext|>, which the Qwen tokenizer does not add itself: both the
    full checkpoint and its export get the files, with a tokenizer that appends it."""
    from mmembed.tools.export import export_checkpoint

    ckpt = _full_checkpoint(tiny_model("qwen2"), pairs, tmp_path / "run")
    merged = export_checkpoint(ckpt, str(tmp_path / "merged"))
    assert json.load(open(os.path.join(ckpt, "mmembed.json")))["template"] == "gte_qwen2"
    assert (_has_st_files(ckpt), _has_st_files(merged)) == (True, True), "checkpoint and export disagree"
    for folder in (ckpt, merged):  # the added tokens recorded in tokenizer_config.json as in tokenizer.json
        assert _added_tokens_decoder(folder) == _added_tokens_of_tokenizer_json(folder)


def _added_tokens_decoder(folder):
    return json.load(open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8")).get("added_tokens_decoder")


def _added_tokens_of_tokenizer_json(folder):
    added = json.load(open(os.path.join(folder, "tokenizer.json"), encoding="utf-8"))["added_tokens"]
    return {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added}


def test_added_tokens_written_to_the_config_load_the_same_tokenizer(tiny_model, tmp_path):
    """transformers 5 saves a Qwen tokenizer's added tokens in tokenizer.json only;
    write_added_tokens_decoder records them in tokenizer_config.json as tokenizer.json has
    them (the hub's Qwen folders do so), and the folder loads the same tokenizer."""
    from transformers import AutoTokenizer

    from mmembed.model.io import write_added_tokens_decoder

    tok = AutoTokenizer.from_pretrained(tiny_model("qwen3"))
    tok.save_pretrained(str(tmp_path))
    assert _added_tokens_decoder(tmp_path) is None
    write_added_tokens_decoder(str(tmp_path), tok)
    assert _added_tokens_decoder(tmp_path) == _added_tokens_of_tokenizer_json(tmp_path)
    again = AutoTokenizer.from_pretrained(str(tmp_path))
    assert type(again) is type(tok) and again.added_tokens_decoder == tok.added_tokens_decoder
    assert again.special_tokens_map == tok.special_tokens_map and len(again) == len(tok)
    text = "<|im_start|>user\nHello<|im_end|><|endoftext|>"
    assert again(text)["input_ids"] == tok(text)["input_ids"]


def test_sentence_transformers_files_give_mmembed_embeddings(minilm_path, pairs, tmp_path):
    """all-MiniLM-L6-v2 with the bert template: the full checkpoint and its export load in
    sentence-transformers with the Embedder's embeddings."""
    from sentence_transformers import SentenceTransformer

    from mmembed.model.embedder import Embedder
    from mmembed.tools.export import export_checkpoint

    ckpt = _full_checkpoint(minilm_path, pairs, tmp_path / "run")
    merged = export_checkpoint(ckpt, str(tmp_path / "merged"))
    for folder in (ckpt, merged):
        assert _has_st_files(folder), folder
        ours = Embedder.from_pretrained(folder, device="cpu").encode(TEXTS)
        st = SentenceTransformer(folder, device="cpu").encode(TEXTS)
        np.testing.assert_allclose(st, ours, atol=1e-5)


def test_a_system_prompt_is_the_default_prompt(minilm_path, pairs, tmp_path):
    """``--system`` puts a prefix before every text; the folder's sentence-transformers default
    prompt puts the same one."""
    from sentence_transformers import SentenceTransformer

    from mmembed.model.embedder import Embedder

    ckpt = _full_checkpoint(minilm_path, pairs, tmp_path / "run", "--system", "query:")
    assert _has_st_files(ckpt)
    ours = Embedder.from_pretrained(ckpt, device="cpu").encode(TEXTS)
    st = SentenceTransformer(ckpt, device="cpu")
    assert st.prompts[st.default_prompt_name] == "query: "
    np.testing.assert_allclose(st.encode(TEXTS), ours, atol=1e-5)
    assert np.abs(st.encode(TEXTS, prompt="") - ours).max() > 1e-3  # without it: other embeddings


@pytest.mark.parametrize("fields,expected", [
    ({"template": "bert", "tuner_type": "full", "media": []}, True),
    ({"template": "modernbert", "tuner_type": "full"}, True),
    ({"template": "bert", "tuner_type": "lora"}, False),  # an adapter: export it first
    ({"template": "bert", "tuner_type": "full", "default_system": "query:"}, True),  # the default prompt
    ({"template": "bert", "tuner_type": "full", "normalize": False}, False),
    ({"template": "gte_qwen2", "tuner_type": "full"}, True),  # the saved tokenizer appends <|endoftext|>
    ({"template": "qwen3_emb", "tuner_type": "full", "default_system": "Instruct: x\nQuery:"}, True),
    ({"template": {"name": "odd", "format": "{content} [END]", "add_special_tokens": True}, "tuner_type": "full"}, False),
    ({"template": "qwen2_gme", "tuner_type": "full", "media": ["image", "video"]}, False),
    ({"template": "qwen2_audio", "tuner_type": "full", "media": ["audio"]}, False),
    ({"tuner_type": "full"}, False),  # no template named: nothing to decide from
])
def test_rule_on_mmembed_config_fields(fields, expected):
    from mmembed.model.io import writes_sentence_transformers

    assert writes_sentence_transformers(fields) is expected
