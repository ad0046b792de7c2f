"""Multimodal training throughput: samples/s, peak RSS and the share of step time spent on data.

A tiny random-weight Qwen2-VL (examples/tiny_models.py: hidden 64, 2 text + 2 vision layers,
the real tokenizer and processor) is trained with ``mmembed sft`` as ms-swift's GME script
does (LoRA, InfoNCE, gradient checkpointing; float32 on the CPU), on two data sets made here:

- images: caption -> 224x224 PNG picture of a coloured shape, plus one hard negative picture;
  ``MAX_PIXELS`` 112*112 brings each to 112x112 (16 merged tokens);
- video: caption -> 3 s, 10 fps, 128x128 H.264 clip of a moving shape (written with PyAV,
  read as training reads it: decord when installed, else PyAV), plus one hard negative clip;
  ``FPS`` 2 samples 6 frames of 112x112 (48 merged tokens).

A sample is one row group (caption + positive + negative). Each configuration (data x tuner x
``--dataloader_num_workers``) runs in its own process, one at a time. Inside it the Trainer's
``get_batch_samples`` (the training loop's ``next()`` on the data loader: dataset read, media
decode and resize, processor, collate; with workers, the wait for theirs) is timed, and each
optimizer step is timed from the end of the one before; the first ``--warmup`` steps (worker
start-up, first calls) are left out. data share = batch wait / step time. Peak RSS: the
trainer process's (getrusage), and summed over it and its data-loader workers (sampled every
0.1 s), with the summed PSS (every 2 s), which counts the pages forked workers share once.

The machine may be shared: before each run the benchmark waits (up to ``--quiet_wait`` s) for
other programs to leave the CPU idle, measures the cores they take during the timed steps
("others"), runs every configuration ``--repeats`` times in rounds and keeps the fastest run.

    python benchmarks/bench_multimodal.py [--steps 24] [--warmup 4] [--batch_size 8]
                                          [--workers 0,2] [--tuners lora[,full]] [--repeats 2]

Prints samples/s, step and batch-wait ms, data share and peak memory per configuration, the
ratio against ``--dataloader_num_workers 0`` (the baseline, measured in the same run), and
one batch's data time split into its parts (0 workers: it runs in the trainer's process).
Target: data share under 20% with ``--dataloader_num_workers 2``.

    python benchmarks/bench_multimodal.py --gpu [--gpu_steps 12] [--gpu_batch_size 8]

builds a Qwen2-VL-2B-sized model with random weights (bfloat16, the real 2B shapes and
tokenizer, made on the GPU) and trains LoRA on CUDA on 448x448 pictures, 2 data-loader
workers: tokens/s (media tokens included) and ``torch.cuda.max_memory_allocated`` over the
timed steps. Without CUDA it says so and stops. ``--gpu_dry_run`` builds the 2B config on
the meta device only and checks its parameter count against Qwen2-VL-2B's (CPU, no memory).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time

if not __package__:  # run as a file: the package registered from its folder (benchmarks/_bootstrap.py)
    import _bootstrap  # noqa: F401

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

IMAGE_SIZE = 224
CLIP = dict(size=128, fps=10, seconds=3)
BUDGET = {"MAX_PIXELS": str(112 * 112), "MIN_PIXELS": str(56 * 56), "VIDEO_MAX_PIXELS": str(112 * 112),
          "VIDEO_MIN_PIXELS": str(56 * 56), "FPS": "2"}
TARGET_SHARE = 0.20
QUIET_CORES = 0.3  # other programs may keep this much CPU busy before a run starts

# Qwen2-VL-2B-Instruct's config.json: the shapes the --gpu model copies (weights are random).
QWEN2_VL_2B_TEXT = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                        num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6)
QWEN2_VL_2B_VISION = dict(depth=32, embed_dim=1280, num_heads=16, mlp_ratio=4, hidden_size=1536, in_chans=3,
                          patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
QWEN2_VL_2B_PARAMS = 2_208_985_600  # Qwen2VLForConditionalGeneration, lm_head tied to the embeddings
GPU_IMAGE_SIZE = 448  # 32 x 32 patches of 14 -> 256 merged tokens per picture


# ----------------------------------------------------------------------------- data


def make_images(out_dir: str, rows: int, negatives: int, seed: int, size: int = IMAGE_SIZE) -> str:
    """``rows`` rows caption -> ``size``x``size`` picture (+ ``negatives`` pictures of other
    classes); returns the jsonl."""
    from PIL import Image

    from benchmarks.learn_multimodal import COLOURS, SHAPES, draw

    rng = random.Random(seed)
    classes = [(c, s) for c in COLOURS for s in SHAPES]
    os.makedirs(os.path.join(out_dir, "img"), exist_ok=True)
    pictures: dict[tuple[str, str], list[str]] = {k: [] for k in classes}
    for k in range(max(2, rows // len(classes) + 1)):
        for colour, shape in classes:
            name = os.path.join(out_dir, "img", f"{colour}_{shape}_{k}.png")
            draw(colour, shape, rng).resize((size, size), Image.BICUBIC).save(name)
            pictures[(colour, shape)].append(name)
    return _write_rows(os.path.join(out_dir, "images.jsonl"), "image", pictures, rows, negatives, rng)


def make_videos(out_dir: str, rows: int, negatives: int, seed: int, per_class: int = 2) -> str:
    """``rows`` rows caption -> clip (+ ``negatives`` clips of other classes); returns the jsonl.

    Clips are H.264 (PyAV), a shape crossing the frame; ``per_class`` clips per class are
    written and reused across rows (every row still decodes its clips: nothing is cached).
    """
    import av
    import numpy as np

    from benchmarks.learn_multimodal import COLOURS, SHAPES, draw

    rng = random.Random(seed)
    classes = [(c, s) for c in COLOURS for s in SHAPES]
    os.makedirs(os.path.join(out_dir, "vid"), exist_ok=True)
    clips: dict[tuple[str, str], list[str]] = {k: [] for k in classes}
    size, fps, n = CLIP["size"], CLIP["fps"], CLIP["fps"] * CLIP["seconds"]
    for k in range(per_class):
        for colour, shape in classes:
            name = os.path.join(out_dir, "vid", f"{colour}_{shape}_{k}.mp4")
            sprite = np.asarray(draw(colour, shape, rng))  # 56x56 on a light background
            with av.open(name, "w") as container:
                stream = container.add_stream("libx264", rate=fps)
                stream.width = stream.height = size
                stream.pix_fmt = "yuv420p"
                for t in range(n):
                    frame = np.full((size, size, 3), 250, np.uint8)
                    x = int((size - sprite.shape[1]) * t / (n - 1))
                    y = (size - sprite.shape[0]) // 2 + int(10 * np.sin(t / 3))
                    frame[y:y + sprite.shape[0], x:x + sprite.shape[1]] = sprite
                    for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                        container.mux(packet)
                for packet in stream.encode():
                    container.mux(packet)
            clips[(colour, shape)].append(name)
    return _write_rows(os.path.join(out_dir, "videos.jsonl"), "video", clips, rows, negatives, rng)


def _write_rows(path: str, kind: str, media: dict, rows: int, negatives: int, rng: random.Random) -> str:
    from benchmarks.learn_multimodal import caption

    classes = list(media)
    field = "images" if kind == "image" else "videos"
    with open(path, "w", encoding="utf-8") as f:
        for i in range(rows):
            cls = classes[i % len(classes)]
            others = rng.sample([c for c in classes if c != cls], negatives)
            row = {"query": caption(*cls), "response": f"<{kind}>",
                   field: [rng.choice(media[cls])] + [rng.choice(media[o]) for o in others]}
            if negatives:
                row["rejected_response"] = [f"<{kind}>"] * negatives
            f.write(json.dumps(row) + "\n")
    return path


# ----------------------------------------------------------------------------- one training run


class MemorySampler(threading.Thread):
    """Peak summed RSS (every 0.1 s) and PSS (every 2 s: the kernel walks the page tables for
    it) of this process and its children (the data-loader workers), in MB. Linux /proc."""

    def __init__(self, interval: float = 0.1, pss_every: int = 20):
        super().__init__(daemon=True)
        import psutil

        self.proc, self.interval, self.pss_every = psutil.Process(), interval, pss_every
        self.peak_rss = self.peak_pss = 0.0
        self.halt = threading.Event()

    def run(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        pids, n = [os.getpid()], 0
        while not self.halt.is_set():
            if n % 10 == 0:
                pids = [os.getpid(), *(c.pid for c in self.proc.children(recursive=True))]
            rss = pss = 0
            for pid in pids:
                try:
                    with open(f"/proc/{pid}/statm") as f:
                        rss += int(f.read().split()[1]) * page
                    if n % self.pss_every == 0:
                        with open(f"/proc/{pid}/smaps_rollup") as f:
                            pss += sum(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
                except OSError:  # a worker that just exited
                    pass
            self.peak_rss = max(self.peak_rss, rss / 2**20)
            self.peak_pss = max(self.peak_pss, pss / 2**20)
            n += 1
            self.halt.wait(self.interval)


def cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, CPU seconds of this process and its children)."""
    import psutil

    t = psutil.cpu_times()
    busy = t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)
    own = 0.0
    me = psutil.Process()
    for p in [me, *me.children(recursive=True)]:
        try:
            c = p.cpu_times()
            own += c.user + c.system
        except psutil.Error:
            pass
    return busy, own


def machine_busy(seconds: float = 1.0) -> float:
    """Cores kept busy by the whole machine over ``seconds`` (0 .. cpu count)."""
    import psutil

    t0 = psutil.cpu_times()
    time.sleep(seconds)
    t1 = psutil.cpu_times()
    busy = sum(getattr(t1, k) - getattr(t0, k) for k in ("user", "nice", "system", "irq", "softirq"))
    return busy / seconds


def wait_for_quiet(limit_s: float, cores: float = QUIET_CORES) -> float:
    """Wait (up to ``limit_s``) until other programs keep fewer than ``cores`` cores busy; the
    machine is shared, and a timing taken beside another job says little. Returns the last reading."""
    deadline = time.time() + limit_s
    busy = machine_busy()
    while busy > cores and time.time() < deadline:
        busy = machine_busy(2.0)
    return busy


class PartTimer:
    """Seconds and calls accumulated per named function, for the data-time breakdown."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, owner, attr: str, name: str) -> None:
        inner = getattr(owner, attr)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
                self.calls[name] = self.calls.get(name, 0) + 1

        setattr(owner, attr, timed)

    def snapshot(self) -> tuple[dict, dict]:
        return dict(self.seconds), dict(self.calls)


def child(spec: dict) -> dict:
    """Train once as ``spec`` says, timing each step and each wait for a batch."""
    import torch
    from transformers import TrainerCallback

    import mmembed.training.sft as sft
    from mmembed.data.dataset import EmbeddingDataset
    from mmembed.encoding.collator import EmbeddingCollator
    from mmembed.encoding.inputs import InputBuilder
    from mmembed.training.arguments import parse_sft_args
    from mmembed.training.trainer import EmbeddingTrainer

    parts = PartTimer()
    parts.wrap(EmbeddingDataset, "__getitem__", "dataset read")
    parts.wrap(InputBuilder, "_load_media", "media decode+resize")
    parts.wrap(InputBuilder, "_process", "processor")
    parts.wrap(EmbeddingCollator, "__call__", "collate")
    from transformers import Qwen2Tokenizer, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    parts.wrap(Qwen2VLImageProcessor, "__call__", "image processor")
    parts.wrap(Qwen2VLVideoProcessor, "__call__", "video processor")
    parts.wrap(Qwen2Tokenizer, "__call__", "tokenizer")
    warmup = spec["warmup"]
    rec = {"wait": [], "step_end": [], "tokens": [], "parts_at_warmup": None, "cpu": []}

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            rec["step_end"].append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            if spec.get("cuda"):
                torch.cuda.synchronize()
            rec["step_end"].append(time.perf_counter())
            if state.global_step == warmup:
                rec["parts_at_warmup"] = parts.snapshot()
            if state.global_step in (warmup, state.max_steps):  # the workers are still alive at the last step
                rec["cpu"].append((time.perf_counter(), *cpu_seconds()))

    class TimedTrainer(EmbeddingTrainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.add_callback(Clock())

        def get_batch_samples(self, epoch_iterator, num_batches, device):
            t0 = time.perf_counter()
            batches, n = super().get_batch_samples(epoch_iterator, num_batches, device)
            rec["wait"].append(time.perf_counter() - t0)
            rec["tokens"].append(sum(int(b["attention_mask"].sum()) for b in batches))
            return batches, n

    sft.EmbeddingTrainer = TimedTrainer  # run_sft builds its trainer from this name
    args = parse_sft_args([
        "--model", spec["model"], "--dataset", spec["dataset"], "--tuner_type", spec["tuner"],
        "--loss_type", "infonce", "--per_device_train_batch_size", str(spec["batch"]),
        "--gradient_accumulation_steps", "1", "--max_steps", str(spec["steps"]),
        "--dataloader_num_workers", str(spec["workers"]), "--dataloader_drop_last", "true",
        "--learning_rate", "1e-4", "--save_strategy", "no", "--logging_steps", "1000",
        "--report_to", "none", "--disable_tqdm", "true", "--seed", "42", "--output_dir", spec["out"],
        "--overwrite_output_dir", "true",  # every configuration trains into the same folder
        *spec.get("extra", []),
    ])
    memory = MemorySampler()
    memory.start()
    metrics = sft.run_sft(args)
    memory.halt.set()
    memory.join()
    steps = [b - a for a, b in zip(rec["step_end"], rec["step_end"][1:])]
    timed = slice(warmup, len(steps))
    before_s, before_n = rec["parts_at_warmup"] or ({}, {})
    (t0, busy0, own0), (t1, busy1, own1) = rec["cpu"][0], rec["cpu"][-1]
    after_s, after_n = parts.snapshot()
    result = {
        "steps": len(steps[timed]), "step_s": sum(steps[timed]), "wait_s": sum(rec["wait"][timed]),
        "tokens": sum(rec["tokens"][timed]), "train_runtime": metrics["train_runtime"],
        "own_cores": (own1 - own0) / (t1 - t0), "other_cores": max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0),
        "peak_rss_main_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "peak_rss_mb": max(memory.peak_rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0),
        "peak_pss_mb": memory.peak_pss,
        "parts": {k: (after_s[k] - before_s.get(k, 0.0), after_n[k] - before_n.get(k, 0)) for k in after_s},
    }
    if spec.get("cuda"):
        result.update(cuda_max_allocated_mb=torch.cuda.max_memory_allocated() / 2**20,
                      cuda_max_reserved_mb=torch.cuda.max_memory_reserved() / 2**20,
                      device_name=torch.cuda.get_device_name())
    return result


def run_child(spec: dict, env: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                          capture_output=True, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
        raise SystemExit(f"run failed: {spec}")
    return json.loads(lines[-1][len("RESULT "):])


# ----------------------------------------------------------------------------- CPU benchmark


def cpu_benchmark(a: argparse.Namespace) -> None:
    import torch
    import transformers

    from benchmarks.checkout import tiny_models

    work = a.work_dir
    rows = a.steps * a.batch_size + a.batch_size  # one epoch covers the run: no worker restarts
    t0 = time.time()
    model = tiny_models().build("qwen2_vl", os.path.join(work, "model"), seed=0)
    data = {"image": make_images(os.path.join(work, "data"), rows, a.negatives, 0),
            "video": make_videos(os.path.join(work, "data"), rows, a.negatives, 1)}
    print(f"built the model and {rows} rows of each data set in {time.time() - t0:.0f} s", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", **BUDGET)
    workers = [int(w) for w in a.workers.split(",")]
    configs = [(tuner, media, w) for tuner in a.tuners.split(",") for media in ("image", "video") for w in workers]
    best: dict[tuple, dict] = {}
    quiet_wait = a.quiet_wait
    for rep in range(a.repeats):  # rounds over all configurations, so that a burst of load hits one run, not one config
        for tuner, media, w in configs:
            quiet = wait_for_quiet(quiet_wait)
            if quiet > QUIET_CORES and quiet_wait:
                print(f"  the machine stays busy (other programs: {quiet:.1f} cores); running anyway, without "
                      "waiting again: expect slower, noisier timings", flush=True)
                quiet_wait = 0.0
            spec = dict(model=model, dataset=data[media], tuner=tuner, batch=a.batch_size, steps=a.steps,
                        warmup=a.warmup, workers=w, out=os.path.join(work, "out"))
            r = dict(run_child(spec, env), media=media, tuner=tuner, workers=w)
            r["samples_s"] = r["steps"] * a.batch_size / r["step_s"]
            print(f"  round {rep + 1}: {media} {tuner} workers={w}: {r['samples_s']:.2f} samples/s, data share "
                  f"{r['wait_s'] / r['step_s']:.1%}, other programs {r['other_cores']:.2f} cores", flush=True)
            key = (tuner, media, w)
            if key not in best or r["samples_s"] > best[key]["samples_s"]:
                best[key] = r
    results = [best[k] for k in configs]

    from mmembed.encoding.media import MediaBudget, video_reader

    per_sample = 2 + a.negatives
    print(f"\ntiny Qwen2-VL (random weights, hidden 64, 2 text + 2 vision layers), InfoNCE, batch {a.batch_size} "
          f"samples = {a.batch_size * per_sample} rows (caption, positive, {a.negatives} negative), "
          f"{a.steps} steps of which the first {a.warmup} are not timed; best of {a.repeats} runs")
    print(f"images {IMAGE_SIZE}x{IMAGE_SIZE} PNG -> 112x112; video {CLIP['seconds']} s {CLIP['size']}x{CLIP['size']} "
          f"H.264 at {CLIP['fps']} fps -> 6 frames of 112x112 (read with {video_reader(MediaBudget.from_env(env))}); "
          f"CPU threads={env['OMP_NUM_THREADS']}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}, transformers {transformers.__version__}")
    head = (f"{'data':<6}{'tuner':<6}{'workers':>8}{'samples/s':>11}{'vs 0 workers':>14}{'step ms':>9}{'data ms':>9}"
            f"{'data share':>12}{'RSS MB':>8}{'+workers':>10}{'PSS MB':>8}{'cores':>7}{'others':>8}")
    print(head)
    print("-" * len(head))
    base = {}
    for r in results:
        key = (r["media"], r["tuner"])
        if r["workers"] == 0:
            base[key] = r["samples_s"]
        ratio = f"{r['samples_s'] / base[key]:.2f}x" if key in base else "-"
        print(f"{r['media']:<6}{r['tuner']:<6}{r['workers']:>8}{r['samples_s']:>11.2f}{ratio:>14}"
              f"{r['step_s'] / r['steps'] * 1000:>9.0f}{r['wait_s'] / r['steps'] * 1000:>9.1f}"
              f"{r['wait_s'] / r['step_s']:>12.1%}{r['peak_rss_main_mb']:>8.0f}{r['peak_rss_mb']:>10.0f}"
              f"{r['peak_pss_mb']:>8.0f}{r['own_cores']:>7.2f}{r['other_cores']:>8.2f}")
    print("(data ms: the training loop's wait for the next batch; RSS MB: peak of the trainer process; +workers: "
          "summed with its data-loader workers; PSS: the same, pages the workers share with it counted once; "
          "cores: CPU used by the run, others: by other programs, over the timed steps)")
    reader = video_reader(MediaBudget.from_env(env))
    cols = [r for r in results if r["workers"] == 0 and "collate" in r["parts"]]
    if cols:
        print(f"\ndata time of one batch ({a.batch_size * per_sample} rows) in the trainer's process (0 workers), ms")
        print(f"{'':<52}" + "".join(f"{r['media'] + ' ' + r['tuner']:>12}" for r in cols))
        ms = []
        for r in cols:
            batches = r["parts"]["collate"][1] or 1
            m = {k: sec / batches * 1000 for k, (sec, _) in r["parts"].items()}
            proc = m.get("image processor", 0.0) + m.get("video processor", 0.0)
            m["processor rest"] = m.get("processor", 0.0) - proc - m.get("tokenizer", 0.0)
            m["media processor"] = proc
            m["collate rest"] = m["collate"] - m.get("media decode+resize", 0.0) - m.get("processor", 0.0)
            m["total"] = m["collate"] + m.get("dataset read", 0.0)
            ms.append(m)
        for key, label in (("dataset read", "dataset read (Arrow row -> Sample)"),
                           ("media decode+resize", f"media decode + resize (PIL / {reader}, qwen-vl-utils)"),
                           ("media processor", "image / video processor (normalize, patches)"),
                           ("tokenizer", "tokenizer"),
                           ("processor rest", "rest of the processor call"),
                           ("collate rest", "rest of collate (render rows, labels)"),
                           ("total", "total")):
            print(f"  {label:<50}" + "".join(f"{m.get(key, 0.0):>12.1f}" for m in ms))
    checked = [r for r in results if r["workers"] == 2]
    if checked:
        ok = all(r["wait_s"] / r["step_s"] < TARGET_SHARE for r in checked)
        print(f"target (data share < {TARGET_SHARE:.0%} with --dataloader_num_workers 2):", "met" if ok else "NOT met")


# ----------------------------------------------------------------------------- GPU benchmark


def qwen2_vl_2b_config():
    """Qwen2-VL-2B's config (the real shapes and token ids), for random weights."""
    from transformers import Qwen2VLConfig

    from benchmarks.checkout import tiny_models

    ids = tiny_models().TOKENIZER_SPECS["qwen2_vl"].added_ids()
    text = dict(QWEN2_VL_2B_TEXT, vocab_size=tiny_models().VOCAB_SIZE, bos_token_id=None, eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]})
    return Qwen2VLConfig(text_config=text, vision_config=dict(QWEN2_VL_2B_VISION), image_token_id=ids["<|image_pad|>"],
                         video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                         vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True)


def count_params_meta() -> int:
    """Parameters of the 2B-sized Qwen2VLForConditionalGeneration, built on the meta device (no memory)."""
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    with torch.device("meta"):
        model = Qwen2VLForConditionalGeneration(qwen2_vl_2b_config())
    return sum(p.numel() for p in model.parameters())  # tied lm_head is counted once


def save_qwen2_vl_processor(out_dir: str) -> None:
    """The real Qwen tokenizer and a Qwen2-VL processor with Qwen2-VL's own pixel defaults."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    from benchmarks.checkout import tiny_models

    tok = tiny_models().build_qwen_tokenizer(out_dir, "qwen2_vl")
    image = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 1280, patch_size=14, temporal_patch_size=2,
                                  merge_size=2)
    video = Qwen2VLVideoProcessor(min_pixels=128 * 28 * 28, max_pixels=768 * 28 * 28, patch_size=14,
                                  temporal_patch_size=2, merge_size=2, cap_pixels_per_frame=False)
    Qwen2VLProcessor(image_processor=image, tokenizer=tok, video_processor=video).save_pretrained(out_dir)


def build_qwen2_vl_2b(out_dir: str, seed: int = 0) -> str:
    """Save a Qwen2-VL-2B-sized model with random bfloat16 weights (made on the GPU: seconds,
    where the CPU takes minutes) and its tokenizer and processor; returns ``out_dir``."""
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = Qwen2VLForConditionalGeneration(qwen2_vl_2b_config())
    finally:
        torch.set_default_dtype(dtype)
    model.save_pretrained(out_dir)
    del model
    torch.cuda.empty_cache()
    save_qwen2_vl_processor(out_dir)
    return out_dir


def gpu_benchmark(a: argparse.Namespace) -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("--gpu needs CUDA, and torch sees no GPU here; run it where one is lent "
                         "(or --gpu_dry_run for the CPU-only config check)")
    work = a.work_dir
    t0 = time.time()
    model = build_qwen2_vl_2b(os.path.join(work, "model"))
    rows = (a.gpu_steps + 1) * a.gpu_batch_size
    data = make_images(os.path.join(work, "data"), rows, a.negatives, 0, GPU_IMAGE_SIZE)
    print(f"built the 2B-sized model and {rows} rows in {time.time() - t0:.0f} s", flush=True)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               MAX_PIXELS=str(GPU_IMAGE_SIZE ** 2), MIN_PIXELS=str(56 * 56))
    spec = dict(model=model, dataset=data, tuner="lora", batch=a.gpu_batch_size, steps=a.gpu_steps,
                warmup=min(a.warmup, a.gpu_steps // 3), workers=2, out=os.path.join(work, "out"), cuda=True,
                extra=["--torch_dtype", "bfloat16", "--attn_impl", "sdpa"])
    r = run_child(spec, env)
    print(f"\nQwen2-VL-2B-sized model, random bfloat16 weights, LoRA (rank 8, the language model), InfoNCE, "
          f"gradient checkpointing, batch {a.gpu_batch_size} samples = {a.gpu_batch_size * (2 + a.negatives)} rows, "
          f"{GPU_IMAGE_SIZE}x{GPU_IMAGE_SIZE} pictures (256 tokens each), 2 data-loader workers; {r['device_name']}, "
          f"torch {torch.__version__}; {r['steps']} timed steps after {spec['warmup']}")
    print(f"{'tokens/s':>12}{'samples/s':>11}{'step ms':>9}{'data share':>12}{'max allocated MB':>18}{'max reserved MB':>17}"
          f"{'host RSS MB':>13}")
    print(f"{r['tokens'] / r['step_s']:>12.0f}{r['steps'] * a.gpu_batch_size / r['step_s']:>11.2f}"
          f"{r['step_s'] / r['steps'] * 1000:>9.0f}{r['wait_s'] / r['step_s']:>12.1%}{r['cuda_max_allocated_mb']:>18.0f}"
          f"{r['cuda_max_reserved_mb']:>17.0f}{r['peak_rss_main_mb']:>13.0f}")


def gpu_dry_run() -> None:
    """What ``--gpu`` builds, checked without a GPU: the 2B config's parameter count (meta device)
    and the processor, saved and loaded back."""
    from transformers import AutoConfig, AutoProcessor

    t0 = time.time()
    n = count_params_meta()
    print(f"Qwen2-VL-2B-sized config on the meta device: {n:,} parameters (Qwen2-VL-2B: {QWEN2_VL_2B_PARAMS:,}), "
          f"{n * 2 / 2**30:.2f} GiB in bfloat16")
    with tempfile.TemporaryDirectory() as out:
        qwen2_vl_2b_config().save_pretrained(out)
        save_qwen2_vl_processor(out)
        proc = AutoProcessor.from_pretrained(out)
        cfg = AutoConfig.from_pretrained(out)
        ids = proc.tokenizer("<|vision_start|><|image_pad|><|vision_end|>")["input_ids"]
    print(f"processor {type(proc).__name__}, vision tokens {ids} (config: image_token_id {cfg.image_token_id}); "
          f"{time.time() - t0:.1f} s")
    if n != QWEN2_VL_2B_PARAMS or ids[1] != cfg.image_token_id:
        raise SystemExit("the 2B-sized model does not match Qwen2-VL-2B")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--negatives", type=int, default=1)
    p.add_argument("--workers", default="0,2", help="--dataloader_num_workers values; 0 is the baseline")
    p.add_argument("--tuners", default="lora", help="lora,full")
    p.add_argument("--repeats", type=int, default=2, help="runs per configuration; the fastest is reported")
    p.add_argument("--quiet_wait", type=float, default=20.0,
                   help="seconds to wait, before each run, for other programs to leave the CPU idle")
    p.add_argument("--work_dir", default=None, help="keep the model, data and output here (default: a temporary folder)")
    p.add_argument("--gpu", action="store_true", help="the Qwen2-VL-2B-sized LoRA run on CUDA")
    p.add_argument("--gpu_steps", type=int, default=12)
    p.add_argument("--gpu_batch_size", type=int, default=8)
    p.add_argument("--gpu_dry_run", action="store_true", help="check the 2B config on the meta device only")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(json.loads(a.child))))
    elif a.gpu_dry_run:
        gpu_dry_run()
    else:
        with tempfile.TemporaryDirectory(prefix="mmembed-bench-mm-") as tmp:
            a.work_dir = a.work_dir or tmp  # model, data and output; removed afterwards unless given
            (gpu_benchmark if a.gpu else cpu_benchmark)(a)


if __name__ == "__main__":
    main()
