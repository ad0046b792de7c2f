"""InputBuilder and the tokenizer it shares: each builder pads and truncates on its own sides,
whatever other builders (the collator, the evaluation Embedder) do with the same tokenizer
or processor object."""

import dataclasses
import os

from conftest import DATA

from mmembed.data.sample import Item
from mmembed.encoding.inputs import InputBuilder
from mmembed.encoding.templates import get_template

LONG = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"


def test_left_truncation_survives_an_embedder_on_the_same_tokenizer(minilm_path):
    """Training with --truncation_strategy left and --eval_sts: the trainer builds an Embedder
    on the trainer's tokenizer; the collator's builder must still cut on the left."""
    from transformers import AutoTokenizer

    from mmembed.model.embedder import Embedder
    from mmembed.model.embedding import EmbeddingModel, load_backbone

    template = get_template("bert")
    shared = AutoTokenizer.from_pretrained(minilm_path)
    fresh = AutoTokenizer.from_pretrained(minilm_path)
    fresh.truncation_side = "left"
    expected = fresh([LONG, "short"], padding=True, truncation=True, max_length=8, return_tensors="pt")["input_ids"]
    assert expected[0, 1] != fresh([LONG])["input_ids"][0][1]  # the first word was cut: left truncation shows

    builder = InputBuilder(template, shared, max_length=8, truncation_side="left")
    assert builder([Item(LONG), Item("short")])["input_ids"].tolist() == expected.tolist()
    Embedder(EmbeddingModel(load_backbone(minilm_path), "mean"), shared, template, 8, device="cpu")
    got = builder([Item(LONG), Item("short")])["input_ids"]
    assert got.tolist() == expected.tolist(), "the builder truncates on the right after an Embedder was built"


def test_builders_leave_the_shared_tokenizer_as_it_was(tiny_model):
    """Two builders with opposite padding sides on one tokenizer each pad on their own side,
    and the tokenizer's own sides (what save_pretrained writes) are unchanged."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model("qwen2"))
    before = (tok.padding_side, tok.truncation_side)
    left = InputBuilder(get_template("gte_qwen2"), tok, max_length=6, truncation_side="left")
    right = InputBuilder(dataclasses.replace(get_template("gte_qwen2"), padding_side="right"), tok, max_length=6)
    items = [Item(LONG), Item("a")]
    for _ in range(2):
        a, b = left(items)["attention_mask"], right(items)["attention_mask"]
        assert a[1, -1] == 1 and a[1, 0] == 0  # left padding
        assert b[1, 0] == 1 and b[1, -1] == 0  # right padding
    ids_left, ids_right = left(items)["input_ids"][0].tolist(), right(items)["input_ids"][0].tolist()
    full = tok(get_template("gte_qwen2").render(Item(LONG)), add_special_tokens=False)["input_ids"]
    assert ids_left == full[-6:] and ids_right == full[:6]
    assert (tok.padding_side, tok.truncation_side) == before


def test_processor_builders_pad_on_their_own_side(tiny_model):
    """A multimodal builder pads through the processor, which holds the tokenizer: two
    builders on one processor keep their own padding sides."""
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(tiny_model("qwen2_vl"))
    before = proc.tokenizer.padding_side
    name = "qwen2_gme"
    left = InputBuilder(dataclasses.replace(get_template(name), padding_side="left"), proc)
    right = InputBuilder(dataclasses.replace(get_template(name), padding_side="right"), proc)
    items = [Item("<image>", images=[os.path.join(DATA, "mm", "blue_square.png")]), Item("a")]
    for _ in range(2):
        a, b = left(items)["attention_mask"], right(items)["attention_mask"]
        assert a[1, -1] == 1 and a[1, 0] == 0
        assert b[1, 0] == 1 and b[1, -1] == 0
    assert proc.tokenizer.padding_side == before
