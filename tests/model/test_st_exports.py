"""Every checkpoint and export of a text template embeds outside mmembed as it does inside:
``SentenceTransformer(folder).encode`` and the plain-transformers snippet of the folder's model
card (run as written) give ``mmembed.Embedder``'s embeddings to 1e-5, under left and right
padding, with and without a system prompt (instruction); and the model card reports what the
run was. One full run and one LoRA run (then ``mmembed export``) per template, shared by the
tests of this file."""

import json
import os
import re
import shutil

import numpy as np
import pytest
from conftest import cached_embedder, stsb_pairs
from forked_cli import run_cli

from mmembed.training.arguments import parse_sft_args
from mmembed.training.sft import run_sft

TEXTS = ["A man is playing a flute.", "Two dogs run through the snow after a red ball that bounces away.", "ok",
         "The stock market fell sharply today."]
INSTRUCTION = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
OTHER = "Represent this sentence for searching relevant passages:"  # a system prompt no run is trained with
TEMPLATES = ("bert", "modernbert", "gte_qwen2", "qwen3_emb")
# the padding sides each template's embeddings hold under: BERT's absolute positions shift
# under left padding (in any library), so its folders are saved padding right, as it trains
SIDES = {"bert": ("right",), "modernbert": ("right", "left"), "gte_qwen2": ("left", "right"), "qwen3_emb": ("left", "right")}
# the system prompt each template's LoRA run is trained with (mmembed.json default_system):
# sentence-transformers' default prompt of the export
TRAIN_SYSTEM = {"bert": "query:", "modernbert": None, "gte_qwen2": None, "qwen3_emb": INSTRUCTION}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    rows = stsb_pairs(12)
    for name, part in (("train.jsonl", rows[:8]), ("val.jsonl", rows[8:])):
        (folder / name).write_text("".join(json.dumps({"query": r["query"], "response": r["response"]}) + "\n" for r in part))
    return str(folder / "train.jsonl"), str(folder / "val.jsonl")


@pytest.fixture(scope="module")
def tiny_modernbert(tmp_path_factory, minilm_path):
    """A tiny random ModernBERT with all-MiniLM's WordPiece tokenizer ([CLS] text [SEP], the
    ModernBERT convention; no ModernBERT tokenizer can be downloaded here)."""
    import torch
    from transformers import AutoTokenizer, ModernBertConfig, ModernBertModel

    out = str(tmp_path_factory.mktemp("modernbert"))
    tok = AutoTokenizer.from_pretrained(minilm_path)
    torch.manual_seed(0)
    config = ModernBertConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, max_position_embeddings=512, local_attention=16,
                              pad_token_id=tok.pad_token_id, cls_token_id=tok.cls_token_id, sep_token_id=tok.sep_token_id,
                              bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id)
    ModernBertModel(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data, tiny_model, minilm_path, tiny_modernbert):
    """``runs(template)`` -> {"full": checkpoint, "lora": checkpoint, "merged": export, "base": model}, trained once."""
    from mmembed.tools.export import export_checkpoint

    bases = {"bert": minilm_path, "modernbert": tiny_modernbert}
    done: dict[str, dict[str, str]] = {}

    def get(template: str) -> dict[str, str]:
        if template in done:
            return done[template]
        base = bases.get(template) or tiny_model({"gte_qwen2": "qwen2", "qwen3_emb": "qwen3"}[template])
        root = tmp_path_factory.mktemp(template)
        train, val = data
        common = ["--model", base, "--template", template, "--task_type", "embedding", "--dataset", train,
                  "--per_device_train_batch_size", "4", "--max_length", "48", "--max_steps", "1", "--save_steps", "1",
                  "--disable_tqdm", "true", "--dataloader_num_workers", "0", "--report_to", "none"]
        full = run_sft(parse_sft_args([*common, "--tuner_type", "full", "--learning_rate", "1e-3", "--output_dir", str(root / "full"),
                                       "--val_dataset", val, "--eval_strategy", "steps", "--eval_steps", "1"]))
        system = ["--system", TRAIN_SYSTEM[template]] if TRAIN_SYSTEM[template] else []
        lora = run_sft(parse_sft_args([*common, "--tuner_type", "lora", "--learning_rate", "1e-2", "--lora_rank", "4",
                                       "--eval_strategy", "no", "--output_dir", str(root / "lora"), *system]))
        merged = export_checkpoint(lora["last_checkpoint"])
        done[template] = {"full": full["last_checkpoint"], "lora": lora["last_checkpoint"], "merged": merged, "base": base}
        return done[template]

    return get


def _card_snippet(folder, library):
    """The ```python block of the model card's ``### library`` section, run as written."""
    card = open(os.path.join(folder, "README.md"), encoding="utf-8").read()
    found = re.search(rf"### {library}\n.*?```python\n(.*?)```", card, re.S)
    assert found, f"{folder}/README.md has no {library} snippet"
    namespace: dict = {}
    exec(found.group(1), namespace)
    return namespace


def _prompt_for(folder, system):
    """The prompt the card gives for a system prompt (``prompt=f'...'``), filled in."""
    card = open(os.path.join(folder, "README.md"), encoding="utf-8").read()
    fmt = re.search(r"`embed\(texts, prompt=f('.*?'|\".*?\")\)`", card, re.S).group(1)
    return eval("f" + fmt, {"system": system})


@pytest.mark.parametrize("which", ["full", "merged"])
@pytest.mark.parametrize("template", TEMPLATES)
def test_sentence_transformers_gives_mmembed_embeddings(runs, template, which):
    from sentence_transformers import SentenceTransformer

    folder = runs(template)[which]
    assert json.load(open(os.path.join(folder, "mmembed.json")))["sentence_transformers"] is True
    ours = cached_embedder(folder).encode(TEXTS)
    st = SentenceTransformer(folder, device="cpu")
    assert st.tokenizer.padding_side == SIDES[template][0]  # the template's side, saved with the tokenizer
    np.testing.assert_allclose(st.encode(TEXTS), ours, atol=1e-5, err_msg=f"{template} {which} as saved")
    for side in SIDES[template]:
        st.tokenizer.padding_side = side
        np.testing.assert_allclose(st.encode(TEXTS), ours, atol=1e-5, err_msg=f"{template} {which} padding {side}")
    # a system prompt (an instruction) on every text, as the card says to pass it
    prompted = cached_embedder(folder).encode([{"query": t, "system": OTHER} for t in TEXTS])
    assert np.abs(prompted - ours).max() > 1e-3, "the system prompt changed nothing"
    np.testing.assert_allclose(st.encode(TEXTS, prompt=_prompt_for(folder, OTHER)), prompted, atol=1e-5)


@pytest.mark.parametrize("which", ["full", "lora", "merged"])
@pytest.mark.parametrize("template", TEMPLATES)
def test_transformers_snippet_of_the_card_gives_mmembed_embeddings(runs, template, which):
    folder = runs(template)[which]
    ours = cached_embedder(folder).encode(TEXTS)
    snippet = _card_snippet(folder, "transformers")
    from mmembed.model.card import EXAMPLE_TEXTS

    np.testing.assert_allclose(snippet["embeddings"].numpy(), cached_embedder(folder).encode(EXAMPLE_TEXTS), atol=1e-5)
    for side in SIDES[template]:
        snippet["tokenizer"].padding_side = side
        np.testing.assert_allclose(snippet["embed"](TEXTS).numpy(), ours, atol=1e-5, err_msg=f"{template} {which} {side}")
    prompted = cached_embedder(folder).encode([{"query": t, "system": OTHER} for t in TEXTS])
    np.testing.assert_allclose(snippet["embed"](TEXTS, prompt=_prompt_for(folder, OTHER)).numpy(), prompted, atol=1e-5)


@pytest.mark.parametrize("template", [t for t in TEMPLATES if TRAIN_SYSTEM[t]])
def test_the_trained_system_prompt_is_the_default_prompt(runs, template):
    """Trained with ``--system S``, mmembed puts S before every text; sentence-transformers'
    default prompt does the same."""
    from sentence_transformers import SentenceTransformer

    folder = runs(template)["merged"]
    st = SentenceTransformer(folder, device="cpu")
    assert st.default_prompt_name == "default" and TRAIN_SYSTEM[template] in st.prompts["default"]
    emb = cached_embedder(folder)
    np.testing.assert_allclose(st.encode(TEXTS), emb.encode(TEXTS), atol=1e-5)
    assert np.abs(st.encode(TEXTS, prompt="") - emb.encode(TEXTS)).max() > 1e-3  # the prompt is what differs


@pytest.mark.parametrize("template", ["gte_qwen2", "qwen3_emb"])
def test_the_saved_tokenizer_appends_the_suffix_and_mmembed_embeds_as_before(runs, template, tmp_path):
    """The saved tokenizer adds ``<|endoftext|>`` itself; mmembed's own embeddings of the
    folder are those it gives with the base model's unchanged tokenizer files."""
    from transformers import AutoTokenizer

    r = runs(template)
    folder = r["merged"]
    tok = AutoTokenizer.from_pretrained(folder)
    base_tok = AutoTokenizer.from_pretrained(r["base"])
    assert tok("a b")["input_ids"] == base_tok("a b<|endoftext|>", add_special_tokens=False)["input_ids"]
    assert base_tok("a b")["input_ids"] == base_tok("a b", add_special_tokens=False)["input_ids"]  # the base adds nothing
    plain = tmp_path / "plain"
    shutil.copytree(folder, plain)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(r["base"], name), plain / name)
    np.testing.assert_allclose(cached_embedder(folder).encode(TEXTS), cached_embedder(str(plain)).encode(TEXTS), atol=0)


def test_model_card_reports_the_run(runs, data):
    folder = runs("qwen3_emb")["full"]
    card = open(os.path.join(folder, "README.md"), encoding="utf-8").read()
    cfg = json.load(open(os.path.join(folder, "mmembed.json")))
    train, val = data
    for fact in (runs("qwen3_emb")["base"], "`qwen3_emb`", "last token", "| max length | 48 |", f"`{train}` | 8 |",
                 f"`{val}` | 4 |", "temperature=0.1", "| steps | 1 |", "training time", "training loss", "eval_margin",
                 "### mmembed", "### sentence-transformers", "### transformers"):
        assert fact in card, f"card lacks {fact!r}"
    assert cfg["training"]["global_step"] == 1 and cfg["training"]["seconds"] > 0
    assert cfg["data"]["train_rows"] == 8 and cfg["data"]["val_rows"] == 4
    assert "eval_margin" in cfg["training"]["eval"]
    # the LoRA checkpoint: an adapter, so no sentence-transformers files; its card says how to export it
    lora = runs("qwen3_emb")["lora"]
    lora_card = open(os.path.join(lora, "README.md"), encoding="utf-8").read()
    assert not os.path.exists(os.path.join(lora, "modules.json")) and "### sentence-transformers" not in lora_card
    assert f"mmembed export --adapters {lora} --merge_lora true" in lora_card
    merged_card = open(os.path.join(runs("qwen3_emb")["merged"], "README.md"), encoding="utf-8").read()
    assert f"| exported from | `{lora}` |" in merged_card and runs("qwen3_emb")["base"] in merged_card


def test_export_command_writes_sentence_transformers_files(runs, tmp_path):
    """`mmembed export` from the command line: the folder it writes loads in sentence-transformers."""
    from sentence_transformers import SentenceTransformer

    lora = runs("gte_qwen2")["lora"]
    out = str(tmp_path / "exported")
    r = run_cli(["export", "--adapters", lora, "--merge_lora", "true", "--output_dir", out])
    assert r.returncode == 0, r.stderr[-2000:]
    np.testing.assert_allclose(SentenceTransformer(out, device="cpu").encode(TEXTS), cached_embedder(lora).encode(TEXTS), atol=1e-5)


def test_the_card_counts_the_steps_trained_not_the_steps_logged():
    """With --logging_steps 5 a 4-step run logs step 1 only; its card and mmembed.json say 4 steps."""
    from mmembed.model.card import training_record

    history = [{"step": 1, "loss": 2.5, "learning_rate": 1e-4}]
    record = training_record({}, history, global_step=4)
    assert record["global_step"] == 4 and record["train_loss"] == 2.5 and record["train_loss_step"] == 1
    assert training_record({}, history)["global_step"] == 1  # without the Trainer's count: the last logged step


def _tensors(folder):
    from safetensors import safe_open

    names = {}
    for file in sorted(os.listdir(folder)):
        if file.endswith(".safetensors") and not file.startswith("adapter"):
            with safe_open(os.path.join(folder, file), "pt") as f:
                names.update({k: f.get_tensor(k) for k in f.keys()})
    return names


@pytest.mark.parametrize("which", ["full", "merged"])
@pytest.mark.parametrize("template", TEMPLATES)
def test_checkpoints_and_exports_keep_every_tensor_of_the_base_model(runs, template, which):
    """Nothing the base model had is dropped or re-initialised: every tensor of its weights
    file is in the trained folder's (BERT's pooler too, which no embedding pooling reads: it
    stays as it was), except the buffers transformers 5 no longer writes (BERT's
    ``embeddings.position_ids``, recomputed at load), and transformers loads the folder with
    no missing and no unexpected key."""
    import torch
    from transformers import AutoModel

    run = runs(template)
    base, trained = _tensors(run["base"]), _tensors(run[which])
    model, info = AutoModel.from_pretrained(run[which], output_loading_info=True)
    persistent = set(model.state_dict(keep_vars=False))
    assert info["missing_keys"] in ([], set()) and info["unexpected_keys"] in ([], set()), info
    kept = {k for k in base if k in persistent}
    assert kept == set(base) - {"embeddings.position_ids"}
    assert kept <= set(trained), sorted(kept - set(trained))
    for name in kept:
        if "pooler" in name.split("."):
            assert torch.equal(trained[name], base[name]), name
