"""Instructions on each side (``--query_system``, ``--document_system``) and the same
instruction after training: the rendered strings follow the documented precedence (a row's
own system > its dataset's > the side's flag > ``--system`` > the template's default); the
collator puts the query side's on anchors and the document side's on positives and
negatives; an export of a Qwen3-Embedding-like model keeps the base model's
sentence-transformers prompts and writes ``query`` / ``document``; and sentence-transformers'
``encode_query`` / ``encode_document`` give what ``mmembed embed --input_type``,
``Embedder.encode(..., input_type=...)`` and ``mmembed serve``'s ``input_type`` give."""

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
from conftest import stsb_pairs

from mmembed.data.sample import Item, Sample
from mmembed.encoding.templates import get_template

TEXTS = ["how do flutes work", "A man is playing a flute.", "The stock market fell sharply today.", "ok"]
# Qwen3-Embedding's own sentence-transformers prompts (config_sentence_transformers.json of
# Qwen/Qwen3-Embedding-0.6B: the query instruction, ending in "Query:", and an empty document
# prompt), plus one more named prompt a base model may carry
BASE_PROMPTS = {
    "query": "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:",
    "document": "",
    "nq_query": "Instruct: Given a question, retrieve Wikipedia passages that answer the question\nQuery:",
}
QUERY = "Instruct: Given a claim, find documents that refute the claim\nQuery:"


# ----------------------------------------------------------------------------- rendering
def test_precedence_one_rendered_string_per_level():
    gme = get_template("qwen2_gme")

    def chat(system, text="hi"):
        return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n"
                "<|im_start|>assistant\n<|endoftext|>")

    plain = Item(text="hi")
    # the template's default, on both sides and without one
    for side in ("query", "document", None):
        assert gme.render(plain, side) == chat("You are a helpful assistant.")
    # --system over the template's default
    t = dataclasses.replace(gme, default_system="SYS")
    assert gme.render(plain, "query") != t.render(plain, "query") == chat("SYS")
    # --query_system over --system, on the query side only; --document_system on the document side
    t = dataclasses.replace(t, query_system="Q")
    assert (t.render(plain, "query"), t.render(plain, "document"), t.render(plain)) == (chat("Q"), chat("SYS"), chat("SYS"))
    t = dataclasses.replace(t, document_system="D")
    assert (t.render(plain, "query"), t.render(plain, "document"), t.render(plain)) == (chat("Q"), chat("D"), chat("SYS"))
    # a dataset's instruction (set on Item.system at load time) and a row's own system: over the flags
    assert t.render(Item(text="hi", system="DATASET"), "query") == chat("DATASET")
    assert t.render(Item(text="hi", system="ROW"), "document") == chat("ROW")
    # an empty instruction is an instruction: no system at all, over --system
    t = dataclasses.replace(t, query_system="")
    assert t.render(plain, "query") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<|endoftext|>"
    # with_side gives the item that renders so without a side (what the collator feeds the builder)
    for side in ("query", "document"):
        assert t.render(t.with_side(plain, side)) == t.render(plain, side)
    with pytest.raises(ValueError, match="unknown side"):
        t.render(plain, "passage")

    # Qwen3-Embedding: "{system} {text}<|endoftext|>" as ms-swift renders it; no system: the text alone
    q3 = dataclasses.replace(get_template("qwen3_emb"), query_system=QUERY)
    assert q3.render(plain, "query") == QUERY + " hi<|endoftext|>"
    assert q3.render(plain, "document") == q3.render(plain) == "hi<|endoftext|>"


def _sample(anchor_system=None, negative_system=None, label=None):
    return Sample(anchor=Item(text="the question", system=anchor_system), positives=[Item(text="the answer")],
                  negatives=[Item(text="a wrong answer", system=negative_system)], label=label)


def test_collator_puts_each_sides_instruction_on_its_rows(tiny_model):
    """Anchors are the query side, positives and negatives the document side (a pair row's
    sentence1 and sentence2 too); a row's own system wins; token_lengths measures the
    instructions too."""
    from transformers import AutoTokenizer

    from mmembed.encoding.collator import EmbeddingCollator, token_lengths
    from mmembed.encoding.layout import Layout

    tok = AutoTokenizer.from_pretrained(tiny_model("qwen3"))
    template = dataclasses.replace(get_template("qwen3_emb"), query_system=QUERY, document_system="Passage:")
    collator = EmbeddingCollator(template, tok, Layout.GROUP, max_length=128)

    def decoded(batch):
        return [tok.decode([i for i, m in zip(ids, mask) if m]) for ids, mask in
                zip(batch["input_ids"].tolist(), batch["attention_mask"].tolist())]

    assert decoded(collator([_sample(), _sample(anchor_system="Row says:", negative_system="Row doc:")])) == [
        QUERY + " the question<|endoftext|>", "Passage: the answer<|endoftext|>", "Passage: a wrong answer<|endoftext|>",
        "Row says: the question<|endoftext|>", "Passage: the answer<|endoftext|>", "Row doc: a wrong answer<|endoftext|>",
    ]
    pairs = EmbeddingCollator(template, tok, Layout.PAIR, max_length=128)
    assert decoded(pairs([_sample(label=1.0)])) == [QUERY + " the question<|endoftext|>", "Passage: the answer<|endoftext|>"]
    # the longest row of the sample is the anchor with its instruction
    want = len(tok(QUERY + " the question<|endoftext|>", add_special_tokens=False)["input_ids"])
    assert token_lengths([_sample()], collator.builder, Layout.GROUP) == [want]


def test_flags_reach_the_run_template(tiny_model, tmp_path):
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.model_assembly import Encoding

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"query": "a", "response": "b"}) + "\n")
    common = ["--model", tiny_model("qwen3"), "--dataset", str(data), "--output_dir", str(tmp_path / "o")]
    enc = Encoding.resolve(parse_sft_args([*common, "--system", "S", "--query_system", "Q"]))
    assert (enc.template.render(Item(text="x"), "query"), enc.template.render(Item(text="x"), "document")) == (
        "Q x<|endoftext|>", "S x<|endoftext|>")


# ----------------------------------------------------------------------------- runs and exports
@pytest.fixture(scope="module")
def qwen3_base(tiny_model, tmp_path_factory):
    """A tiny Qwen3 with the real Qwen tokenizer and Qwen3-Embedding's sentence-transformers prompts."""
    folder = tmp_path_factory.mktemp("base") / "qwen3-embedding"
    shutil.copytree(tiny_model("qwen3"), folder)
    (folder / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": BASE_PROMPTS, "default_prompt_name": None, "similarity_fn_name": "cosine"}))
    return str(folder)


@pytest.fixture(scope="module")
def runs(qwen3_base, tmp_path_factory):
    """{"lora": checkpoint, "merged": its export} of a LoRA run with --query_system, and
    {"full": checkpoint} of a full run with no instruction."""
    from mmembed.tools.export import export_checkpoint
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.sft import run_sft

    root = tmp_path_factory.mktemp("runs")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"query": r["query"], "response": r["response"]}) + "\n" for r in stsb_pairs(8)))
    common = ["--model", qwen3_base, "--template", "qwen3_emb", "--dataset", str(data), "--per_device_train_batch_size", "4",
              "--max_length", "48", "--max_steps", "1", "--save_steps", "1", "--eval_strategy", "no", "--disable_tqdm", "true",
              "--dataloader_num_workers", "0", "--report_to", "none"]
    lora = run_sft(parse_sft_args([*common, "--tuner_type", "lora", "--lora_rank", "4", "--learning_rate", "1e-2",
                                   "--query_system", QUERY, "--output_dir", str(root / "lora")]))["last_checkpoint"]
    full = run_sft(parse_sft_args([*common, "--tuner_type", "full", "--learning_rate", "1e-3",
                                   "--output_dir", str(root / "full")]))["last_checkpoint"]
    return {"lora": lora, "merged": export_checkpoint(lora), "full": full}


def _st_config(folder):
    with open(os.path.join(folder, "config_sentence_transformers.json"), encoding="utf-8") as f:
        return json.load(f)


def test_export_keeps_the_base_prompts_and_writes_each_side(runs):
    merged = _st_config(runs["merged"])
    # query: the instruction the run was trained with, as the template renders it before the text;
    # document: the run gave none, the base model's is kept; the base model's other prompts are kept
    assert merged["prompts"] == {**BASE_PROMPTS, "query": QUERY + " "}
    assert merged["default_prompt_name"] is None  # the sides differ: no default
    with open(os.path.join(runs["merged"], "mmembed.json"), encoding="utf-8") as f:
        assert json.load(f)["instructions"] == {"query": QUERY, "document": None, "datasets": {}}
    card = open(os.path.join(runs["merged"], "README.md"), encoding="utf-8").read()
    assert "| query instruction | `" + QUERY.replace("\n", "\\n") + "` |" in card and "encode_query" in card
    # a run with no instruction on either side keeps all of the base model's prompts as they are
    full = _st_config(runs["full"])
    assert full["prompts"] == BASE_PROMPTS and full["default_prompt_name"] is None


@pytest.mark.parametrize("which", ["merged", "full"])
def test_encode_query_and_document_equal_mmembed(runs, which, tmp_path):
    """sentence-transformers' encode_query / encode_document on the folder, mmembed embed
    --input_type and Embedder.encode(input_type=...) give the same embeddings; the query's
    tokens are the same token for token."""
    from sentence_transformers import SentenceTransformer

    from mmembed.model.embedder import Embedder
    from mmembed.tools.cli import cmd_embed

    folder = runs[which]
    st = SentenceTransformer(folder, device="cpu")
    ours = Embedder.from_pretrained(folder, device="cpu")
    inputs = tmp_path / "in.txt"
    inputs.write_text("\n".join(TEXTS) + "\n")
    by_side = {}
    for side, st_encode in (("query", st.encode_query), ("document", st.encode_document)):
        want = st_encode(TEXTS)
        got = ours.encode(TEXTS, input_type=side)
        np.testing.assert_allclose(got, want, atol=1e-6)
        if which == "merged":  # the command loads the folder as the Embedder does (once per side: once is enough)
            out = tmp_path / f"{side}.npy"
            assert cmd_embed(["--model", folder, "--input", str(inputs), "--output", str(out), "--input_type", side]) == 0
            np.testing.assert_allclose(np.load(out), want, atol=1e-6)
        by_side[side] = got
    # the query's instruction changes the embeddings (it is the trained one, or the base model's kept one)
    assert np.abs(by_side["query"] - by_side["document"]).max() > 1e-3
    prompt = QUERY + " " if which == "merged" else BASE_PROMPTS["query"]
    assert st.prompts["query"] == prompt
    st_ids = st.tokenize([prompt + TEXTS[0]])["input_ids"][0].tolist()
    ours_ids = ours.builder([ours.as_input(TEXTS[0], "query")])["input_ids"][0].tolist()
    assert st_ids == ours_ids
    assert ours.tokenizer.decode(ours_ids) == prompt + TEXTS[0] + "<|endoftext|>"


def test_lora_checkpoint_embeds_as_its_export(runs):
    from mmembed.model.embedder import Embedder

    lora = Embedder.from_pretrained(runs["lora"], device="cpu")
    merged = Embedder.from_pretrained(runs["merged"], device="cpu")
    for side in ("query", "document", None):
        np.testing.assert_allclose(lora.encode(TEXTS, input_type=side), merged.encode(TEXTS, input_type=side), atol=1e-5)


def test_a_base_model_embeds_a_side_with_its_own_prompt(qwen3_base):
    """A base model folder (no mmembed.json) with sentence-transformers prompts: a query is its
    ``query`` prompt followed by the text, as sentence-transformers' encode_query builds it."""
    from mmembed.model.embedder import Embedder

    base = Embedder.from_pretrained(qwen3_base, device="cpu")
    np.testing.assert_allclose(base.encode(TEXTS, input_type="query"), base.encode([BASE_PROMPTS["query"] + t for t in TEXTS]),
                               atol=1e-6)
    np.testing.assert_allclose(base.encode(TEXTS, input_type="document"), base.encode(TEXTS), atol=1e-6)
    assert np.abs(base.encode(TEXTS, input_type="query") - base.encode(TEXTS)).max() > 1e-3
    # a text with a system of its own keeps it
    row = {"query": TEXTS[0], "system": "Own:"}
    np.testing.assert_allclose(base.encode([row], input_type="query"), base.encode([row]), atol=1e-6)


def test_serve_takes_input_type(runs):
    import importlib.util

    import openai

    from mmembed.model.embedder import Embedder
    from mmembed.tools.serve import ServeConfig, create_app

    spec = importlib.util.spec_from_file_location("serve_tests", os.path.join(os.path.dirname(__file__), "..", "tools",
                                                                             "test_serve.py"))
    serve_tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve_tests)  # its loopback server and the HTTP client the openai package is built on
    ThreadServer, httpx = serve_tests.ThreadServer, serve_tests.httpx
    embedder = Embedder.from_pretrained(runs["merged"], device="cpu")
    config = ServeConfig(model=runs["merged"], served_model_name="m", max_inputs=8, max_wait_ms=5)
    with ThreadServer(create_app(embedder, config)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        for side in ("query", "document", None):
            extra = {"extra_body": {"input_type": side}} if side else {}
            got = client.embeddings.create(model="m", input=TEXTS, **extra)
            np.testing.assert_allclose(np.array([d.embedding for d in got.data]), embedder.encode(TEXTS, input_type=side),
                                       atol=1e-5)
        r = httpx.post(server.url + "/v1/embeddings", json={"model": "m", "input": "a", "input_type": "passage"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_type"


def test_multimodal_folder_records_the_instructions(tmp_path):
    """A GME folder gets no sentence-transformers files: its mmembed.json and model card hold
    the instructions, and the card's rendering of each side is the template's."""
    from mmembed.model.folder import write_saved_folder

    config = {"base_model": "/models/gme", "template": "qwen2_gme", "default_system": "You are a helpful assistant.",
              "pooling": "last", "media": ["image", "video"], "normalize": True, "max_length": 64, "tuner_type": "full",
              "instructions": {"query": "Find an image that matches the caption.", "document": None,
                               "datasets": {"vqa": {"query": "Answer the question.", "document": None}}}}
    written = write_saved_folder(str(tmp_path), config, dim=32)
    assert written["sentence_transformers"] is False
    with open(tmp_path / "mmembed.json", encoding="utf-8") as f:
        assert json.load(f)["instructions"] == config["instructions"]
    card = (tmp_path / "README.md").read_text(encoding="utf-8")
    assert "| query instruction | `Find an image that matches the caption.` |" in card
    assert "| query instruction of dataset `vqa` | `Answer the question.` |" in card
    query = "'<|im_start|>system\\nFind an image that matches the caption.<|im_end|>\\n<|im_start|>user\\n'"
    document = "'<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n<|im_start|>user\\n'"
    assert f"- query: `{query}` + input" in card and f"- document: `{document}` + input" in card


def test_dataset_prompts_and_default_prompt(tmp_path):
    """``<dataset>_query`` / ``<dataset>_document`` per dataset instruction; the default prompt
    only where both sides and a text without a side agree."""
    from mmembed.model.io import sentence_transformers_prompts

    base = {"template": "qwen3_emb", "tuner_type": "full"}
    prompts, default = sentence_transformers_prompts(
        {**base, "instructions": {"query": "Q:", "datasets": {"nq": {"query": "NQ:", "document": "Doc:"},
                                                              "sts": {"query": None, "document": None}}}}, {"keep": "x"})
    assert prompts == {"keep": "x", "query": "Q: ", "document": "", "nq_query": "NQ: ", "nq_document": "Doc: "}
    assert default is None
    prompts, default = sentence_transformers_prompts({**base, "default_system": "S"}, BASE_PROMPTS)
    assert prompts == {**BASE_PROMPTS, "query": "S ", "document": "S ", "default": "S "} and default == "default"
    # both sides' flags equal but no --system: a text without a side has no prompt, so no default
    prompts, default = sentence_transformers_prompts({**base, "instructions": {"query": "S", "document": "S"}}, {})
    assert prompts == {"query": "S ", "document": "S "} and default is None
    # a side with no instruction keeps the base model's prompt of that name
    prompts, default = sentence_transformers_prompts(base, BASE_PROMPTS)
    assert prompts == BASE_PROMPTS and default is None
    prompts, _ = sentence_transformers_prompts({**base, "instructions": {"query": "Q:"}}, {"document": "passage: "})
    assert prompts == {"query": "Q: ", "document": "passage: "}
    # an empty instruction replaces the base model's prompt of that side
    prompts, _ = sentence_transformers_prompts({**base, "instructions": {"query": ""}}, BASE_PROMPTS)
    assert prompts["query"] == ""
