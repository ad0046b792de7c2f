"""LateInteractionModel (mmembed.model.late_interaction): the output contract (float32 [N, L, dim],
unit vectors where kept, exactly zero elsewhere), against the backbone's own hidden states
projected and normalised by hand; length chunks give the batch's width and the same vectors;
the skiplist drops tokens on the marked rows only; Qwen2-VL / Qwen3-VL rows with images as the
transformers model computes them; under LoRA the projection trains."""

import pytest
import torch
import torch.nn.functional as F

from mmembed.errors import UsageError
from mmembed.model.late_interaction import (
    LateInteractionModel,
    skiplist_token_ids,
    token_vectors,
    tokenize_queries,
)

TEXTS = ["a flute is a woodwind, with no reed.", "hi", "Homer wrote the Odyssey (an epic poem) long ago!",
         "what?", "the capital of France is Paris", "one two three four five six seven eight nine ten eleven",
         "x", "short text here"] * 2


@pytest.fixture(scope="module")
def minilm(minilm_no_dropout):
    from transformers import AutoTokenizer

    from mmembed.model.embedding import load_backbone

    return load_backbone(minilm_no_dropout).eval(), AutoTokenizer.from_pretrained(minilm_no_dropout)


def _reference(backbone, projection, enc, keep):
    """The backbone's last hidden states -> projection -> L2 normalisation -> zero off ``keep``."""
    with torch.no_grad():
        hidden = backbone(**enc).last_hidden_state
    vectors = F.normalize(hidden @ projection.weight.T, dim=-1)
    return vectors * keep.unsqueeze(-1)


def test_output_contract(minilm):
    backbone, tokenizer = minilm
    torch.manual_seed(0)
    model = LateInteractionModel(backbone, 128, length_chunks=1).eval()
    enc = tokenizer(TEXTS[:4], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model(**enc)["last_hidden_state"]
    assert out.dtype == torch.float32 and out.shape == (4, enc["input_ids"].shape[1], 128)
    present = out.ne(0).any(-1)
    assert torch.equal(present, enc["attention_mask"].bool())
    assert torch.equal(out[~present], torch.zeros_like(out[~present]))  # exactly zero, every component
    torch.testing.assert_close(out[present].norm(dim=-1), torch.ones(int(present.sum())))
    torch.testing.assert_close(out, _reference(backbone, model.projection, enc, enc["attention_mask"]), atol=1e-5,
                               rtol=0)


@pytest.mark.parametrize("kind", ["minilm", "qwen3"])
@pytest.mark.parametrize("bucket", [False, True])
def test_length_chunks_keep_the_width_and_vectors(minilm, tiny_model, kind, bucket):
    """16 rows in 2 length chunks: the same [N, L, dim] as one padded call, for documents and for
    expanded queries (whose scored expansion positions lie beyond the attended tokens): BERT
    right-padded, Qwen3 left-padded (cut from the left; rotary positions make the shift
    harmless, whereas BERT's absolute positions would not be, in the parent class alike)."""
    if kind == "minilm":
        backbone, tokenizer = minilm
    else:
        from transformers import AutoTokenizer

        from mmembed.model.embedding import load_backbone

        folder = tiny_model("qwen3")
        backbone, tokenizer = load_backbone(folder).eval(), AutoTokenizer.from_pretrained(folder, padding_side="left")
        assert tokenizer.padding_side == "left"
    torch.manual_seed(0)
    one = LateInteractionModel(backbone, 32, length_chunks=1).eval()
    chunked = LateInteractionModel(backbone, 32, length_chunks=4, bucket=bucket, projection=one.projection).eval()
    docs = tokenizer(TEXTS, return_tensors="pt", padding=True)
    queries = tokenize_queries(tokenizer, TEXTS, {"strategy": "min", "attend": False, "length": 12})
    for batch in (docs, queries):
        with torch.no_grad():
            a, b = one(**batch)["last_hidden_state"], chunked(**batch)["last_hidden_state"]
        assert a.shape == b.shape == (16, batch["input_ids"].shape[1], 32)
        assert torch.equal(a.ne(0).any(-1), b.ne(0).any(-1))
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # the expansion positions are scored though not attended
    assert torch.equal(b.ne(0).any(-1), queries["token_mask"])
    assert (queries["token_mask"].sum(1) > queries["attention_mask"].sum(1)).any()


def test_skiplist_on_marked_rows_only(minilm):
    backbone, tokenizer = minilm
    torch.manual_seed(0)
    skip = skiplist_token_ids(tokenizer)
    model = LateInteractionModel(backbone, 16, skiplist_ids=skip, length_chunks=1).eval()
    texts = ["hello, world!", "hello, world!"]
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model(**enc, apply_skiplist=torch.tensor([False, True]))["last_hidden_state"]
    punct = torch.isin(enc["input_ids"], torch.tensor(skip))
    assert int(punct[1].sum()) == 2  # "," and "!"
    assert torch.equal(out[0].ne(0).any(-1), enc["attention_mask"][0].bool())  # query row: all tokens
    assert torch.equal(out[1].ne(0).any(-1), enc["attention_mask"][1].bool() & ~punct[1])  # document row
    q, d = token_vectors(out)
    torch.testing.assert_close(d, q[~punct[0][enc["attention_mask"][0].bool()]])


def test_padding_free_refused(minilm):
    with pytest.raises(UsageError, match="padding_free"):
        LateInteractionModel(minilm[0], 16, padding_free=True)


def test_lora_trains_the_projection(minilm_no_dropout):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer

    from mmembed.model.embedding import load_backbone

    tokenizer = AutoTokenizer.from_pretrained(minilm_no_dropout)
    backbone = get_peft_model(load_backbone(minilm_no_dropout), LoraConfig(r=4, target_modules=["query", "value"],
                                                                           init_lora_weights=False))
    torch.manual_seed(0)
    model = LateInteractionModel(backbone, 16).train()
    enc = tokenizer(TEXTS[:4], return_tensors="pt", padding=True)
    out = model(**enc)["last_hidden_state"]
    q, d = out[:2], out[2:]
    scores = torch.einsum("qid,pjd->qpij", q, d).amax(-1).sum(-1)  # MaxSim
    F.cross_entropy(scores, torch.arange(2)).backward()
    assert model.projection.weight.requires_grad and model.projection.weight.grad.abs().sum() > 0
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    assert lora and all(p.grad is not None for p in lora)
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n and n != "projection.weight")


def _image(seed: int, size: int):
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8))


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen3_vl"])
def test_vision_rows(tiny_model, kind):
    """Rows with an image and a text-only row, through the model's one vision-tower call, equal the
    transformers model run on the same inputs (which encodes the images itself); a text-only batch
    (the dummy tower input) equals it too."""
    from transformers import AutoProcessor

    from mmembed.model.embedding import load_backbone

    folder = tiny_model(kind)
    processor = AutoProcessor.from_pretrained(folder)
    backbone = load_backbone(folder).eval()
    torch.manual_seed(0)
    model = LateInteractionModel(backbone, 24, tower="vision").eval()
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    batch = processor(text=[f"{image}a picture", f"two{image}", "no image at all, only words"],
                      images=[_image(0, 56), _image(1, 84)], return_tensors="pt", padding=True)
    batch = dict(batch)
    with torch.no_grad():
        ours = model(**batch)["last_hidden_state"]
    torch.testing.assert_close(ours, _reference(backbone, model.projection, batch, batch["attention_mask"]),
                               atol=1e-5, rtol=0)
    assert torch.equal(ours.ne(0).any(-1), batch["attention_mask"].bool())
    text = dict(processor.tokenizer(["only words", "more words here"], return_tensors="pt", padding=True))
    with torch.no_grad():
        ours = model(**text)["last_hidden_state"]
    torch.testing.assert_close(ours, _reference(backbone, model.projection, text, text["attention_mask"]),
                               atol=1e-5, rtol=0)
